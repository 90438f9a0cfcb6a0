"""Multi-latent attention (DeepSeek-V3) on every kernel provider: the core attention takes megatron's separate
key and value head sizes (``k_channels`` / ``v_channels``), checked against plain softmax(q k^T * scale) v in
torch, and megatron's own MLASelfAttention builds and trains through the adapter's layer spec."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from adapter import kernels
from tests.kernel_reference import (
    assert_all_close,
    attention_config,
    called,
    forward_backward,
    leaves,
    one_rank_model_parallel,
    randn,
)

SEQ, BATCH, HEADS = 12, 2, 4


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    with one_rank_model_parallel():
        yield


def _reference(q, k, v, scale):
    """softmax(q k^T * scale) v, causal, in float32: q/k [s, b, n, dk], v [s, b, nkv, dv] -> [s, b, n * dv]."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.float().permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), -torch.inf)
    out = torch.softmax(scores, -1) @ v
    return out.permute(2, 0, 1, 3).flatten(2)


def _core_attention(provider, config, k_channels, v_channels, softmax_scale=None):
    return kernels.core_attention_module(provider)(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        softmax_scale=softmax_scale, k_channels=k_channels, v_channels=v_channels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa2"])
@pytest.mark.parametrize("dk, dv", [(24, 16), (8, 16)], ids=["dk>dv", "dk<dv"])
def test_separate_key_and_value_head_sizes_match_plain_attention(provider, dk, dv, groups, dtype):
    config = attention_config(heads=HEADS, groups=groups, head_dim=16, dtype=dtype)
    q, k = randn(SEQ, BATCH, HEADS, dk, dtype=dtype, seed=1), randn(SEQ, BATCH, groups, dk, dtype=dtype, seed=2)
    v = randn(SEQ, BATCH, groups, dv, dtype=dtype, seed=3)
    scale = 0.37  # MLA hands its own scale (YaRN's mscale squared over sqrt(q head size))
    got = forward_backward(lambda *x: _core_attention(provider, config, dk, dv, scale)(*x, None), leaves(q, k, v))
    want = forward_backward(lambda *x: _reference(*x, scale).to(dtype), leaves(q, k, v))
    assert got[0].shape == (SEQ, BATCH, HEADS * dv)
    assert_all_close(got, want, dtype)
    called(provider, "npu_fusion_attention")


def test_default_scale_is_one_over_the_square_root_of_the_key_head_size(provider):
    """As Transformer Engine's DotProductAttention with kv_channels=(k_channels, v_channels)."""
    config = attention_config(heads=HEADS, groups=HEADS, head_dim=16)
    assert _core_attention(provider, config, 24, 16).softmax_scale == pytest.approx(1 / math.sqrt(24))


def test_packed_sequences_with_separate_value_head_size(provider):
    bounds = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=7, max_seqlen_kv=7)
    config = attention_config(heads=HEADS, groups=2, head_dim=16)
    q, k, v = randn(SEQ, HEADS, 24, seed=1), randn(SEQ, 2, 24, seed=2), randn(SEQ, 2, 16, seed=3)
    got = forward_backward(
        lambda *x: _core_attention(provider, config, 24, 16, 0.3)(*x, None, packed_seq_params=packed),
        leaves(q, k, v))

    def per_sequence(q, k, v):
        return torch.cat([_reference(*(t[s:e].unsqueeze(1) for t in (q, k, v)), 0.3).squeeze(1)
                          for s, e in ((0, 5), (5, 12))])

    assert_all_close(got, forward_backward(per_sequence, leaves(q, k, v)), torch.float32)


def test_ring_attention_with_separate_head_sizes_is_refused_and_ulysses_takes_them(provider):
    """Ulysses with MLA's head sizes is held to whole-sequence attention in tests/test_context_parallel.py."""
    ring = attention_config(heads=HEADS, groups=HEADS, head_dim=16, context_parallel_size=2, cp_comm_type="p2p")
    with pytest.raises(kernels.UnsupportedKernelSetting, match="cp_comm_type='p2p' with query/key head size 24 != "
                                                               "value head size 16.*use cp_comm_type='a2a'"):
        _core_attention(provider, ring, 24, 16)
    ulysses = attention_config(heads=HEADS, groups=HEADS, head_dim=16, context_parallel_size=2, cp_comm_type="a2a")
    assert _core_attention(provider, ulysses, 24, 16).cp_kind == "a2a"


# Megatron-LM's arguments for MLA over context parallelism (query/key head 16 + 8, value head 16)
MLA_CP_ARGS = dict(multi_latent_attention=True, context_parallel_size=2, qk_head_dim=16, qk_pos_emb_head_dim=8,
                   v_head_dim=16)


@pytest.mark.parametrize("comm_types", [["p2p"], ["a2a", "p2p"]])
def test_megatron_lms_validate_args_refuses_mla_over_ring_attention_in_one_line(comm_types):
    from types import SimpleNamespace

    from adapter.cuda_only_features import RefusedSetting
    from patches.kernels import _mla_ring_attention_refused

    ran = []
    with pytest.raises(RefusedSetting) as refused:
        _mla_ring_attention_refused(ran.append)(SimpleNamespace(**MLA_CP_ARGS, cp_comm_type=comm_types))
    line = str(refused.value)
    assert "\n" not in line and ran == [], line  # before megatron's own checks, so before any model
    assert line.startswith("--multi-latent-attention (query/key head size 24") and "value head size 16" in line
    assert f"--cp-comm-type {' '.join(comm_types)}:" in line and line.endswith("use --cp-comm-type a2a"), line


@pytest.mark.parametrize("args", [dict(cp_comm_type=["a2a"]), dict(cp_comm_type=["p2p"], v_head_dim=24),
                                  dict(cp_comm_type=["p2p"], context_parallel_size=1),
                                  dict(cp_comm_type=["p2p"], multi_latent_attention=False)],
                         ids=["ulysses", "equal_sizes", "no_cp", "no_mla"])
def test_what_the_adapters_attention_runs_passes_validate_args(args):
    from types import SimpleNamespace

    from patches.kernels import _mla_ring_attention_refused

    assert _mla_ring_attention_refused(lambda a: "megatron's")(SimpleNamespace(**{**MLA_CP_ARGS, **args})) == \
        "megatron's"


# Megatron-LM's argument parsing and validate_args (the wheel's megatron.training), as pretrain_gpt.py starts
_VALIDATE = """
from megatron.training.arguments import parse_args, validate_args
validate_args(parse_args())
print("validated")
"""
MLA_FLAGS = ["--multi-latent-attention", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
             "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "1", "--context-parallel-size", "2"]


@pytest.mark.slow
def test_under_adapter_run_mla_over_ring_attention_is_one_line_and_status_2(tmp_path):
    """Through the wheel's megatron.training (no checkout needed); the ulysses spelling trains in
    tests/test_megatron_lm_deepseek.py."""
    import importlib.util
    import subprocess
    import sys

    from tests.distributed import _base_env

    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron-core 0.16's wheel ships no megatron.training")
    (tmp_path / "start.py").write_text(_VALIDATE)
    env = _base_env({"ADAPTER_BACKEND": "cpu", "RANK": "0", "WORLD_SIZE": "2"})
    ring = subprocess.run([sys.executable, "-m", "adapter.run", "start.py", *MLA_FLAGS, "--cp-comm-type", "p2p"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ring.returncode == 2 and "Traceback" not in ring.stderr and "validated" not in ring.stdout, ring.stderr
    assert ring.stderr.strip().splitlines()[-1].startswith("error: --multi-latent-attention (query/key head size 24")


def _mla_config(dtype=torch.float32, **rope):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, multi_latent_attention=True, q_lora_rank=32,
        kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=8, **(rope or dict(rope_type="rope")),
        normalization="RMSNorm", add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16)


def _mla_layer(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    return build_module(spec.submodules.self_attention, config=config, layer_number=1)


# YaRN as DeepSeek-V3 (scaling factor 40, mscale_all_dim 1): scale = (0.1 ln 40 + 1)^2 / sqrt(q head size);
# apply_rope_fusion calls megatron's fused MLA RoPE entry points, off CUDA the adapter's torch version of its
# Triton kernels (adapter/kernels/mla_rope.py, through patches/kernels.py).
ROPES = {"rope": ({}, 1.0),
         "yarn_fused": (dict(rope_type="yarn", rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                             apply_rope_fusion=True), (0.1 * math.log(40.0) + 1.0) ** 2)}


@pytest.mark.parametrize("rope", list(ROPES))
def test_megatron_mla_self_attention_trains_through_the_adapter_spec(provider, monkeypatch, rope):
    """megatron's MLASelfAttention, built from its local spec (whose core attention is the provider's), runs
    forward and backward, and the core attention's output on the layer's own q/k/v (192/128-like: 24-wide
    query/key heads, 8-wide value heads) equals the plain formula at megatron's MLA scale."""
    monkeypatch.setattr(kernels, "current", lambda: provider)
    kernels.core_attention_module.cache_clear()
    try:
        layer = _mla_layer(_mla_config(**ROPES[rope][0]))
    finally:
        kernels.core_attention_module.cache_clear()
    assert type(layer.core_attention).__name__ == f"{provider.NAME.capitalize()}CoreAttention"
    torch.manual_seed(0)
    hidden = torch.randn(SEQ, BATCH, 64, requires_grad=True)
    seen = {}

    def plain(q, k, v, *args, **kwargs):
        seen["want"] = _reference(q, k, v, layer.softmax_scale)
        seen["got"] = original(q, k, v, *args, **kwargs)
        return seen["got"]

    original = layer.core_attention.forward
    layer.core_attention.forward = plain
    out, _ = layer(hidden, attention_mask=None)
    out.float().sum().backward()
    assert out.shape == (SEQ, BATCH, 64) and torch.isfinite(hidden.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters() if p.requires_grad)
    torch.testing.assert_close(seen["got"], seen["want"], atol=1e-5, rtol=1e-5)
    assert layer.softmax_scale == pytest.approx(ROPES[rope][1] / math.sqrt(16 + 8))
    called(provider, "npu_fusion_attention")


# ------------------------------------------------------------------- MLA's fused YaRN RoPE off the GPU
class _CPGroup:
    """What megatron's thd RoPE asks of a context-parallel group: its size and this rank."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _yarn(emb_dim):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    return YarnRotaryEmbedding(emb_dim, use_cpu_initialization=True, scaling_factor=40.0,
                               original_max_position_embeddings=4, mscale=1.0, mscale_all_dim=0.0)


def _unfused(t, freqs, mscale, cu_seqlens, cp):
    """megatron's unfused MLA RoPE (MLASelfAttention with apply_rope_fusion=False): apply_rotary_pos_emb with
    MLA's interleaved read, YaRN's mscale, and for thd the CP rank's chunks of each sequence. megatron-core 0.16
    reads MLA's pairs interleaved for ``config.multi_latent_attention``; later releases ask MLASelfAttention's
    ``mla_rotary_interleaved``."""
    import inspect
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=True)
    mla_read = ({"mla_rotary_interleaved": True}
                if "mla_rotary_interleaved" in inspect.signature(apply_rotary_pos_emb).parameters else {})
    return apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=_CPGroup(*cp),
                                **mla_read)


QK, EMB, V, MAX_SEQ = 16, 8, 12, 12
# sbhd [12, 2, ...]; thd: sequences of 8 and 12 tokens whole, and CP ranks 0 and 1 of 2 (chunks r, 3 - r)
LAYOUTS = {"sbhd": (None, (1, 0)), "thd": ([0, 8, 20], (1, 0)), "thd_cp2_rank0": ([0, 8, 20], (2, 0)),
           "thd_cp2_rank1": ([0, 8, 20], (2, 1))}


def _rope_inputs(layout):
    """(cu_seqlens, (cp size, rank), leading dims of this rank's tokens, megatron's freqs and mscale, cos, sin)."""
    bounds, cp = LAYOUTS[layout]
    yarn = _yarn(EMB)
    freqs, mscale = yarn(MAX_SEQ, packed_seq=bounds is not None)
    cos, sin = yarn.get_cached_cos_sin(MAX_SEQ, dtype=torch.float32, packed_seq=bounds is not None)
    if bounds is None:
        return None, cp, (SEQ, BATCH), freqs, mscale, cos, sin
    return torch.tensor(bounds, dtype=torch.int32), cp, (bounds[-1] // cp[0],), freqs, mscale, cos, sin


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_mla_rope_for_q_is_megatrons_unfused_rope(layout):
    """megatron's entry point (the Triton kernel's on CUDA), forward and backward, against its unfused RoPE."""
    from megatron.core.fusions import fused_mla_yarn_rope_apply as fused

    cu_seqlens, cp, rows, freqs, mscale, cos, sin = _rope_inputs(layout)
    q = randn(*rows, HEADS, QK + EMB, seed=1)
    got = forward_backward(lambda t: fused.fused_apply_mla_rope_for_q(t, cos, sin, QK, EMB, cu_seqlens, cp[1], cp[0]),
                           leaves(q))

    def unfused(t):
        nope, pe = torch.split(t, [QK, EMB], dim=-1)
        return torch.cat([nope, _unfused(pe, freqs, mscale, cu_seqlens, cp)], dim=-1)

    assert_all_close(got, forward_backward(unfused, leaves(q)), torch.float32)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_mla_rope_for_kv_is_megatrons_unfused_rope(layout):
    """Key: the heads' own part, then the rotated shared k_pos_emb; value: the rest. Gradients to kv and
    k_pos_emb (summed over the heads sharing it)."""
    from megatron.core.fusions import fused_mla_yarn_rope_apply as fused

    cu_seqlens, cp, rows, freqs, mscale, cos, sin = _rope_inputs(layout)
    kv, k_pos_emb = randn(*rows, HEADS, QK + V, seed=2), randn(*rows, 1, EMB, seed=3)

    def fused_kv(kv, k_pos_emb):
        key, value = fused.fused_apply_mla_rope_for_kv(kv, k_pos_emb, cos, sin, EMB, QK, V, cu_seqlens, cp[1], cp[0])
        return torch.cat([key.flatten(), value.flatten()])

    def unfused(kv, k_pos_emb):
        k_nope, value = torch.split(kv, [QK, V], dim=-1)
        rotated = _unfused(k_pos_emb, freqs, mscale, cu_seqlens, cp).expand(*rows, HEADS, EMB)
        return torch.cat([torch.cat([k_nope, rotated], dim=-1).flatten(), value.flatten()])

    assert_all_close(forward_backward(fused_kv, leaves(kv, k_pos_emb)),
                     forward_backward(unfused, leaves(kv, k_pos_emb)), torch.float32)


def test_mla_layer_with_rope_fusion_is_the_layer_without(provider, monkeypatch):
    """megatron's MLASelfAttention with apply_rope_fusion (its fused entry points, answered off CUDA by the
    adapter) and without (megatron's unfused RoPE), same weights and input: output and every gradient."""
    monkeypatch.setattr(kernels, "current", lambda: provider)
    kernels.core_attention_module.cache_clear()
    yarn = dict(rope_type="yarn", rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    runs = []
    try:
        for fusion in (True, False):
            torch.manual_seed(0)
            layer = _mla_layer(_mla_config(**yarn, apply_rope_fusion=fusion))
            hidden = randn(SEQ, BATCH, 64, seed=4).requires_grad_(True)
            runs.append(forward_backward(lambda x, layer=layer: layer(x, attention_mask=None)[0], [hidden])
                        + [p.grad for p in layer.parameters()])
    finally:
        kernels.core_attention_module.cache_clear()
    assert_all_close(runs[0], runs[1], torch.float32)
