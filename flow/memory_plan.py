"""Each device's memory for a megatron-core training layout, worked out before 32 devices are booked for it.

``plan(model, tp=8, pp=4, vpp=5, dp=1, ...)`` returns one ``StagePlan`` per pipeline rank, because the ranks
differ: the first holds the embedding and the most micro-batches in flight, the last holds the output layer
and the logits. ``python -m flow.memory_plan --world-size N <the scripts/pretrain_gpt.py arguments>`` prints the
table, from the arguments as megatron.training's own parser reads them (``--model NAME`` expanded first, as
``scripts/pretrain_gpt.py`` does), so a plan refuses, in one line, what the run would refuse.

What megatron-core 0.16.1 keeps on a device (P = this device's parameters, D = data-parallel x context-parallel
ranks, over which the distributed optimizer shards):

- weights: P in the params dtype (2 bytes for bf16/fp16). Tensor-parallel layers hold 1/t of their weight;
  norms (and row-parallel biases) are whole on every TP rank. A tied embedding is held by the first stage and,
  as the output layer, again by the last. A layer's attention, with a heads of size d (``kv_channels``) in g
  query groups: QKV of (a + 2g)d x h, the output projection of ad back to h (ad is h unless the head size
  is set apart from it, as Qwen3's 128 is), and with QK-norm (``qk_layernorm``) two norms of d, whole.
- grads: DDP's contiguous ``main_grad`` buffer covers all P, fp32 when ``grad_reduce_in_fp32`` (Megatron-LM
  forces it for bf16), else the params dtype; the distributed optimizer reduce-scatters into it, it does not
  shrink it.
- optimizer: with 16-bit params, an fp32 master copy (4 bytes) and Adam's ``exp_avg`` and ``exp_avg_sq``
  (4 + 4), 12 bytes per parameter, over D with the distributed optimizer (``DistributedOptimizer`` keeps the
  master copy of its shard only), over 1 without; fp32 params have no master copy (8 bytes). With 16-bit grads
  ``step()`` also makes an fp32 copy of the grad shard (4 bytes / D); it lives while the activations are
  freed, so it is not added to the peak. Bucket padding (at most lcm(D, 128) values per bucket and 64 per
  parameter) is left out.
- activations: below; ``logits``: the last stage's output layer and loss, below.

A Mixture-of-Experts model's MoE layers split differently: their routed experts over EP x expert TP (each
device holds E/EP experts, each 1/ETP of its FC1 and FC2), replicated over expert DP = TP x DP x CP / (ETP x
EP) devices of a stage; the router (E x h) and a shared expert's gate are whole on every device, the shared
expert is split over TP like an MLP. Weights and grads count the experts like any parameter (the grad buffer
has a separate part for them); the distributed optimizer shards the dense part over D and the experts over
expert DP. ``of which experts`` in the table is the routed experts' share of P.

Not counted: the runtime's own memory (CUDA/CANN context, kernels' workspaces), communicator buffers
(``HCCL_BUFFSIZE`` per group on Ascend), allocator fragmentation, and the backward pass's transient tensors
(the gradient of one layer, a layer being recomputed).

Activations per layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4): with s tokens, micro-batch b, hidden h, a heads, t = TP and sequence
parallelism, a GPT layer keeps sbh(34 + 5as/h)/t bytes: 2-byte activations, 1-byte dropout masks. Their
terms, per token, re-derived for what megatron-core's layers save (e = bytes per activation value, d = head
dim, g = query groups, f = FFN size):

- sequence-parallel region, divided by t only with sequence parallelism: the input of each norm (2 x eh),
  the input of QKV and of FC1 (2 x eh; with sequence parallelism the linear layer saves its sharded input
  and all-gathers it again in the backward pass), and the dropout masks after the attention projection and
  FC2 (2 x h bytes, only when hidden dropout > 0): 4eh + 2h. The paper's 10sbh.
- attention, divided by t, over the attention width ad (= h unless the head size is set apart): queries
  e*a*d; keys and values 2e*g*d, so GQA keeps 2e*ad*g/a where the paper (g = a, ad = h) keeps 2eh; the
  attention output, which is also the projection's input, e*ad. Flash attention (``--use-flash-attn``) keeps
  only its fp32 log-sum-exp, 4a bytes, instead of scores. Megatron's unfused attention repeats keys and
  values to all a heads first (3e*ad for Q, K, V), then keeps the softmax output (e*as) and, with attention
  dropout, its mask and result (as + e*as): the paper's 5as^2b; its context output is a fresh tensor (e*ad).
  MHA unfused: 4eh + 5as = 8h + 5as, the paper's attention block 11sbh + 5as^2b less its QKV input and
  dropout mask, counted above. QK-norm, before RoPE and outside core attention, keeps its inputs (the
  un-normed Q and K, e(a + g)d) and each head's fp32 reciprocal RMS (4(a + g)); RoPE saves nothing of its
  input.
- MLP, divided by t: GeLU keeps FC1's output (ef) and FC2's input (ef), 8h + 8h for f = 4h as in the paper;
  fused SwiGLU keeps its input, FC1's output of 2f (2ef), and FC2's input (ef): 3ef.
- MoE layer, in place of the MLP, with k experts per token, expert FFN f_e, E experts: the router's fp32
  logits and scores, 8E, in the sequence-parallel region; the token dispatcher's permuted tokens, each token
  copied to its k experts: the all-gather (or all-to-all) brings the routed tokens of the expert-TP x EP
  group to the devices holding their experts, which with balanced routing is k x the micro-batch's tokens
  x ETP/t per device, keh x ETP / t; each expert keeps what an MLP of f_e keeps per routed token over ETP,
  so k x 3ef_e / t with SwiGLU; a shared expert of f_s keeps what an MLP of f_s does, 3ef_s / t. Layers of
  a stage differ (``moe_layer_freq``): a pass holds the stage's mean layer that many times.

Hybrid models (Qwen3.5, Qwen3-Next: ``layer_types``) have, in place of attention in three layers of four, a
Gated DeltaNet mixer, with k_d = key heads x key head dim, v_d = value heads x value head dim and n_v value
heads. Its parameters: the input projection (2k_d + 2v_d + 2n_v) x h, the convolution (2k_d + v_d) x its
width, A_log and dt_bias (n_v each), all split over TP by head, the output projection v_d x h, split, and
the output norm over one value head, whole. What it keeps per token, over t: the input projection's output
e(2k_d + 2v_d + 2n_v), the convolution's output after silu e(2k_d + v_d), q and k after their L2 norm
e*2k_d, the decay g and beta in fp32 (8n_v), the gated delta rule's output and the gated norm's output (the
output projection's input), 2e*v_d. This is what flash-linear-attention's chunked kernel keeps (it recomputes
its per-chunk states in the backward pass); the torch implementation the cpu and npu providers run keeps its
per-chunk products too and is not counted. The gated attention layers keep the output gate's projection and
the gated output besides (2e*ad). megatron's hybrid stack counts two layers per model layer (the mixer, then
the MLP or MoE block), so full recompute with N layers per group keeps ceil(2l/N) inputs for l model layers.

Summed for GeLU, MHA, unfused attention with dropout and f = 4h: 10h + 8h + 5as + 16h = 34h + 5as, the
paper's formula. For Qwen2.5 with flash attention and no dropout: (4eh)/t + (eh(2 + 2g/a) + 4a + 3ef)/t;
Qwen3 adds QK-norm and its attention width is ad: (4eh)/t + (e*ad(2 + 2g/a) + (ed + 4)(a + g) + 4a + 3ef)/t.
Selective recompute (megatron-core's default ``core_attn``) checkpoints core attention: its inputs (Q and the
unrepeated K, V) and output stay, the scores or the log-sum-exp go. Its other modules
(``--recompute-modules``, megatron's TransformerConfig.recompute_modules) drop what they recompute and keep
their inputs, which other terms count: ``layernorm`` the two norms' outputs (2eh of the 4eh), ``moe_act``
each routed token's FC2 input (ef_e of 3ef_e), ``mlp`` a dense MLP's, ``moe`` a whole MoE block's (router,
experts, shared expert), ``shared_experts`` the shared expert's, ``mla_up_proj`` MLA's up-projected q, k, v
(below). Full recompute keeps each checkpointed group's input, eh (over t with sequence parallelism):
``uniform`` with N layers per group keeps ceil(l/N) inputs for a chunk of l layers, ``block`` keeps the
first N layers' inputs and the rest whole.

Multi-latent attention (DeepSeek-V3, Kimi-K2), as megatron-core's ``MLASelfAttention`` of the local spec
builds it. Parameters: the down projections h x q_lora (the query latent) and h x (kv_lora + r) (the key/value
latent and the shared RoPE key of r = ``qk_pos_emb_head_dim``), the up projections q_lora x a(d_qk + r) and
kv_lora x a(d_qk + d_v), the output projection a*d_v x h, all split over TP (the down projections are
column-parallel, their outputs gathered); the two latents' norms whole. Without a query LoRA one h x a(d_qk + r)
projection. What it keeps per token (checked against torch's saved-tensor hooks in tests/test_memory_plan_mla.py):
in the sequence-parallel region the latents' norm inputs and outputs (the up projections' inputs,
2e*q_lora + 2e*kv_lora) and their fp32 reciprocal RMS (4 each); without sequence parallelism the key latent's
norm input is a view of the gathered down projection's output, so its storage holds the RoPE key too (+ e*r).
Split over TP: the up-projected query and key per head, d_qk + r each, the value, d_v (e*a(2(d_qk + r) + d_v)),
core attention's output (e*a*d_v) and its log-sum-exp (4a) or, unfused, its softmax (e*a*s). Recomputing
``mla_up_proj`` releases q, k and v after core attention and keeps the up projection's inputs, which with
sequence parallelism include the gathered down projection's output under the RoPE key: e*(kv_lora + r) of
every token on each TP rank. The release reaches what a flash kernel saved (q, k, v as given); the unfused
path (the torch provider's attention) saves head-major copies of them, which stay (measured in the test).
RoPE's cos / sin tables (4 x e x r per position, not per token) are left out.

Multi-token prediction (DeepSeek-V3's MTP layer, megatron's MTP block) lives on the last stage, which then
also builds the word embedding (the MTP layer embeds the next tokens; a V x h copy over TP beside the output
layer). Its parameters: a decoder layer like the last, the projection 2h -> h (split over TP) and three norms
(``ModelConfig.mtp_layer_parameters``). Per micro-batch, held once like the logits: the next tokens'
embedding, the projection's input (2eh), its decoder layer and its final norm's input (4eh over t with
sequence parallelism, plus the layer), or under full uniform recompute (megatron checkpoints each MTP layer
whole) the embedding only; and its own logits, counted in ``logits``: the output layer's input (eh), the
logits and the cross entropy's fp32 copy ((e + 4)V/t).

Uneven pipeline splits (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``, or
the embedding / loss counted as a layer): each stage holds its own layer count, and a pass holds that many
layers; the plan takes them without virtual stages.

Micro-batches in flight (megatron-core 0.16.1, ``pipeline_parallel/schedules.py``,
``get_pp_rank_microbatches``): pipeline rank r runs ``w`` warmup forward passes, then one more forward before
its first backward frees anything, so w + 1 passes are held (at most all of them). 1F1B: w = p - r - 1, each
pass one stage of L/p layers, so rank 0 holds p micro-batches, L layers' worth. Interleaved 1F1B with v model
chunks (micro-batch groups of p, Megatron-LM's default): w = 2(p - r - 1) + (v - 1)p, each pass one chunk of
L/(pv) layers, so rank 0 holds L(1 + (p - 1)/(pv)) layers' worth, Korthikanti et al.'s section 4.2.3. The last
stage runs its last chunk's backward right after that chunk's forward, so it holds one micro-batch's logits:
the final norm's and output layer's inputs (2eh, over t with sequence parallelism), the vocab-parallel logits
(e*V/t) and the fp32 copy the cross entropy turns into its saved softmax (4V/t).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import os
import sys
import warnings

from adapter.cuda_only_features import RefusedSetting
from adapter.parallel import ParallelConfigError, PipelineSplit, check_sizes
from flow import model_flags
from models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, ModelConfigError
from models.megatron_lm_args import described


GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RECOMPUTE = (None, "selective", "full")
# megatron-core's selective recompute modules (TransformerConfig.recompute_modules); gdn_norm_out is not
# planned (its activations stay counted)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "gdn_norm_out")


class PlanError(ValueError):
    """A layout or batch megatron would refuse: names the values and what to change."""


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One device of pipeline rank ``stage``; every memory figure is in bytes."""

    stage: int
    layers: int
    parameters: int  # on this device
    expert_parameters: int  # of them, a MoE model's routed experts (this device's EP x expert-TP share)
    passes_in_flight: int  # forward passes (micro-batch x model chunk) whose activations are held at the peak
    layers_per_pass: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    mtp_parameters: int = 0  # of them, the multi-token prediction layers' (and their word embedding's)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits

    def gib(self) -> dict[str, float]:
        return {name: getattr(self, name) / GIB
                for name in ("weights", "grads", "optimizer", "activations", "logits", "total")}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    model: ModelConfig
    tp: int
    pp: int
    vpp: int | None
    dp: int
    cp: int
    ep: int
    etp: int
    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    num_microbatches: int
    params_dtype: str
    grads_dtype: str
    distributed_optimizer: bool
    sequence_parallel: bool
    flash_attention: bool
    recompute: str | None
    stages: tuple[StagePlan, ...]
    recompute_modules: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def peak(self) -> StagePlan:
        return max(self.stages, key=lambda stage: stage.total)

    def table(self, model_name: str | None = None) -> str:
        layout = (f"TP {self.tp} x PP {self.pp} x DP {self.dp}" + (f" x CP {self.cp}" if self.cp > 1 else "")
                  + f" = {self.world_size} devices")
        if self.vpp:
            layout += f", {self.vpp} virtual stages of {self.model.num_layers // (self.pp * self.vpp)} layers"
        moe = self.model.num_experts is not None
        expert_dp = self.tp * self.dp * self.cp // (self.etp * self.ep)
        if moe:
            layout += (f"; experts: EP {self.ep} x expert TP {self.etp} x expert DP {expert_dp}, "
                       f"{self.model.num_experts // self.ep} of {self.model.num_experts} per device")
        shards = self.dp * self.cp
        settings = [f"{self.params_dtype} weights", f"{self.grads_dtype} grads",
                    f"distributed optimizer over {shards} rank{'s' if shards > 1 else ''}"
                    + (f" (experts over {expert_dp})" if moe else "")
                    if self.distributed_optimizer else "optimizer not sharded",
                    "sequence parallel" if self.sequence_parallel else "no sequence parallel",
                    "flash attention" if self.flash_attention else "unfused attention",
                    f"{self.recompute} recompute" if self.recompute else "no recompute"]
        if self.recompute == "selective":
            settings[-1] += f" of {' '.join(self.recompute_modules)}"
        lines = [f"memory plan per device: {model_name or 'model'}, {layout}",
                 f"micro-batch {self.micro_batch_size} x seq {self.seq_length}, global batch "
                 f"{self.global_batch_size} = {self.num_microbatches} micro-batches per step",
                 ", ".join(settings), ""]
        rows = [("", [f"stage {s.stage}" for s in self.stages]),
                ("layers", [str(s.layers) for s in self.stages]),
                ("parameters (M)", [f"{s.parameters / 1e6:.1f}" for s in self.stages])]
        if moe:
            rows.append(("of which experts (M)", [f"{s.expert_parameters / 1e6:.1f}" for s in self.stages]))
        if self.model.mtp_num_layers:
            rows.append(("of which MTP (M)", [f"{s.mtp_parameters / 1e6:.1f}" for s in self.stages]))
        rows.append(("in flight (passes x layers)",
                     [f"{s.passes_in_flight} x {s.layers_per_pass}" for s in self.stages]))
        rows += [(f"{name} (GiB)", [f"{s.gib()[name]:.2f}" for s in self.stages])
                 for name in ("weights", "grads", "optimizer", "activations", "logits", "total")]
        width = max(len(label) for label, _ in rows) + 2
        cell = max(len(value) for _, values in rows for value in values) + 2
        lines += [label.ljust(width) + "".join(value.rjust(cell) for value in values) for label, values in rows]
        peak = self.peak
        lines += ["", f"needs {peak.total / GIB:.1f} GiB per device (stage {peak.stage}), plus the runtime's own "
                      f"memory, communicator buffers and fragmentation"]
        return "\n".join(lines)


def _mixer_parameters(model: ModelConfig, mixer: str) -> tuple[int, int]:
    """(split over TP, whole on every TP rank) parameters of a layer's token mixer: attention, or Gated
    DeltaNet (its projections, convolution, A_log and dt_bias split by head; its output norm over one value
    head, whole)."""
    if mixer == LINEAR_ATTENTION:
        return model.gated_delta_net_parameters() - model.linear_value_head_dim, model.linear_value_head_dim
    if model.multi_latent_attention:
        return _latent_attention_parameters(model)
    h, d, qkv = model.hidden_size, model.head_dim, model.qkv_rows
    qk_norms = 2 * (2 * d if model.normalization == "LayerNorm" else d) if model.qk_layernorm else 0
    # QKV: h -> (a + 2g)d rows; the output projection: the attention width ad -> h (ad = h unless kv_channels)
    return qkv * h + model.num_attention_heads * d * h + (qkv if model.add_qkv_bias else 0), qk_norms


def _latent_attention_parameters(model: ModelConfig) -> tuple[int, int]:
    """(split over TP, whole) parameters of multi-latent attention as megatron's local spec builds it
    (``ModelConfig.latent_attention_parameters``): every projection column- or row-parallel (the down projections
    too, their outputs gathered), the latents' norms whole; the output projection's bias, if any, is counted with
    the layer's row-parallel biases."""
    norm = (2 if model.normalization == "LayerNorm" else 1) if model.qk_layernorm else 0
    whole = norm * ((model.q_lora_rank or 0) + model.kv_lora_rank)
    bias = model.hidden_size if model.add_bias_linear else 0
    return model.latent_attention_parameters() - whole - bias, whole


def _layer_parameters(model: ModelConfig, moe: bool, mixer: str = FULL_ATTENTION) -> tuple[int, int, int]:
    """(split over TP, whole on every TP rank, experts) parameters of one transformer layer (a hybrid model's
    token mixer and MLP or MoE block), a MoE layer's routed experts (split over EP x expert TP) apart."""
    h = model.hidden_size
    norm = 2 * h if model.normalization == "LayerNorm" else h
    row_bias = h if model.add_bias_linear else 0  # a row-parallel layer's bias (projection, FC2) is whole
    split, mixer_whole = _mixer_parameters(model, mixer)
    whole = 2 * norm + mixer_whole + row_bias
    if not moe:
        return split + model.mlp_parameters(model.ffn_hidden_size) - row_bias, whole + row_bias, 0
    shared = model.moe_shared_expert_intermediate_size  # megatron's shared experts have no biases
    split += model.mlp_parameters(shared) if shared else 0
    whole += model.num_experts * (h + (1 if model.add_bias_linear else 0)) + (h if model.moe_shared_expert_gate else 0)
    return split, whole, model.num_experts * model.mlp_parameters(model.expert_ffn_hidden_size)


def stage_sizes(model: ModelConfig, pp: int, split: PipelineSplit = PipelineSplit()) -> list[int]:
    """Each pipeline rank's decoder layers: L/p, or megatron's uneven split (the first / last stage's given
    sizes and the rest evenly; or the embedding and the loss counted as a layer of the first / last stage)."""
    if split.first is None and split.last is None:
        counted = model.num_layers + split.embedding + split.loss
        sizes = [counted // pp] * pp
        sizes[0] -= split.embedding
        sizes[-1] -= split.loss
        return sizes
    middle = pp - (split.first is not None) - (split.last is not None)
    rest = model.num_layers - (split.first or 0) - (split.last or 0)
    sizes = [rest // middle if middle else 0] * pp
    sizes[0] = sizes[0] if split.first is None else split.first
    sizes[-1] = sizes[-1] if split.last is None else split.last
    return sizes


def stage_layers(model: ModelConfig, stage: int, pp: int, vpp: int | None = None,
                 split: PipelineSplit = PipelineSplit()) -> list[int]:
    """The layers pipeline rank ``stage`` holds: one block of its stage size, or with v virtual stages the
    model chunks stage, stage + p, stage + 2p, ... of L/(pv) layers each (the plan takes virtual stages only
    with the even split)."""
    if vpp is None:
        sizes = stage_sizes(model, pp, split)
        return list(range(sum(sizes[:stage]), sum(sizes[:stage + 1])))
    per_chunk = model.num_layers // (pp * vpp)
    return [layer for chunk in range(vpp) for layer in range((chunk * pp + stage) * per_chunk,
                                                               (chunk * pp + stage + 1) * per_chunk)]


def _mtp_parameters(model: ModelConfig) -> tuple[int, int, int]:
    """(split over TP, whole, experts) parameters of the MTP layers: each a decoder layer like the last one,
    the projection of the embedding and hidden state (2h -> h, column-parallel) and three norms (of the
    embedding, the hidden state, the output)."""
    h, count = model.hidden_size, model.mtp_num_layers or 0
    norm = 2 * h if model.normalization == "LayerNorm" else h
    split, whole, experts = _layer_parameters(model, model.moe_layer_pattern()[-1], model.mixers()[-1])
    return count * (split + 2 * h * h), count * (whole + 3 * norm), count * experts


def _stage_parameters(model: ModelConfig, stage: int, pp: int, vpp: int | None, tp: int, experts_split: int,
                      split: PipelineSplit = PipelineSplit()) -> tuple[int, int, int]:
    """(all, routed experts', MTP layers') parameters on one device of pipeline rank ``stage``. The MTP
    layers live on the last stage, which then builds the word embedding too (megatron's GPTModel: the MTP
    layer embeds the next tokens) beside the output layer."""
    h, pattern, mixers = model.hidden_size, model.moe_layer_pattern(), model.mixers()
    split_params = whole = experts = mtp = 0
    for layer in stage_layers(model, stage, pp, vpp, split):
        layer_split, layer_whole, layer_experts = _layer_parameters(model, pattern[layer], mixers[layer])
        split_params, whole, experts = split_params + layer_split, whole + layer_whole, experts + layer_experts
    if stage == 0:
        split_params += model.vocab_size * h
        whole += model.max_position_embeddings * h if model.position_embedding == "learned_absolute" else 0
    if stage == pp - 1:
        whole += 2 * h if model.normalization == "LayerNorm" else h
        # a tied output layer reuses the embedding on a single stage, and holds a copy of it on the last one
        if not model.tie_embeddings or pp > 1:
            split_params += model.vocab_size * h
        if model.mtp_num_layers:
            mtp_split, mtp_whole, mtp_experts = _mtp_parameters(model)
            mtp_split += model.vocab_size * h if pp > 1 else 0  # the MTP stage's own word embedding
            mtp = mtp_split // tp + mtp_whole + mtp_experts // experts_split
            split_params, whole, experts = split_params + mtp_split, whole + mtp_whole, experts + mtp_experts
    experts //= experts_split
    return split_params // tp + whole + experts, experts, mtp


def _mlp_activations(model: ModelConfig, e: int, ffn: int | None, act_recomputed: bool = False) -> int:
    """What an MLP of FFN size ``ffn`` keeps per token it processes: fused SwiGLU its input (FC1's output, 2f)
    and FC2's input (f), GeLU FC1's output and FC2's input; with the activation recomputed (``moe_act``) only
    FC1's output."""
    width = 2 if model.activation == "swiglu" else 1
    return (width + (0 if act_recomputed else 1)) * e * ffn if ffn else 0


def _core_attention_scores(model: ModelConfig, e: int, seq_per_rank: int, flash_attention: bool,
                           attention_dropout: bool) -> float:
    """What core attention keeps beside its inputs and output: flash attention's fp32 log-sum-exp, or the
    unfused softmax output (and its dropout mask and result); recomputing ``core_attn`` drops it."""
    a = model.num_attention_heads
    if flash_attention:
        return 4 * a
    return e * a * seq_per_rank + ((1 + e) * a * seq_per_rank if attention_dropout else 0)


def _attention_activations(model: ModelConfig, e: int, seq_per_rank: int, flash_attention: bool,
                           recomputed: frozenset, attention_dropout: bool) -> float:
    """What an attention mixer keeps per token, all of it split over TP (module docstring)."""
    d, a, g = model.head_dim, model.num_attention_heads, model.num_query_groups
    # the QK-norms' inputs (un-normed Q and K) and their fp32 reciprocal RMS per head, outside core attention
    qk_norms = (e * d + 4) * (a + g) if model.qk_layernorm else 0
    # the output gate's projection and the gated output (the projection's input) beside the attention output
    gate = 2 * e * a * d if model.attention_output_gate else 0
    if "core_attn" in recomputed:
        return e * (a * d + 2 * g * d) + e * a * d + qk_norms + gate
    # unfused attention repeats keys and values to every head before it saves them
    inputs = e * (a * d + 2 * g * d) if flash_attention else 3 * e * a * d
    scores = _core_attention_scores(model, e, seq_per_rank, flash_attention, attention_dropout)
    return inputs + e * a * d + scores + qk_norms + gate


def _latent_attention_activations(model: ModelConfig, e: int, seq_per_rank: int, tp: int, sequence_parallel: bool,
                                  flash_attention: bool, recomputed: frozenset, attention_dropout: bool) -> float:
    """What multi-latent attention keeps per token (module docstring), each term divided as it is split."""
    a, rope, kv_rank = model.num_attention_heads, model.qk_pos_emb_head_dim, model.kv_lora_rank
    q_rank = model.q_lora_rank or 0
    # the latents' norm inputs (the key latent's is a view of the down projection's output with the RoPE key
    # unless sequence parallelism scatters it apart), fp32 reciprocal RMS, and outputs (the up projections' inputs)
    latents = e * (2 * q_rank + 2 * kv_rank + (0 if sequence_parallel else rope)) + (8 if q_rank else 4)
    per_head = e * a * (2 * (model.qk_head_dim + rope) + model.v_head_dim)  # the up-projected q, k and v
    if "mla_up_proj" in recomputed and flash_attention:
        # the recomputed up projection releases q, k and v (which a flash kernel saved as given) and keeps its
        # inputs: with sequence parallelism the RoPE key holds the gathered down projection's output, all its
        # tokens on every TP rank
        per_head, gathered = 0, e * (kv_rank + rope) if sequence_parallel else 0
    else:
        gathered = 0
    core = 0 if "core_attn" in recomputed else _core_attention_scores(model, e, seq_per_rank, flash_attention,
                                                                      attention_dropout)
    output = e * a * model.v_head_dim  # core attention's output, the output projection's input
    return latents / (tp if sequence_parallel else 1) + gathered + (per_head + output + core) / tp


def _gated_delta_net_activations(model: ModelConfig, e: int) -> float:
    """What a Gated DeltaNet mixer keeps per token, all of it split over TP (module docstring)."""
    qk = model.linear_num_key_heads * model.linear_key_head_dim
    v, heads = model.linear_num_value_heads * model.linear_value_head_dim, model.linear_num_value_heads
    projected = e * (2 * qk + 2 * v + 2 * heads)  # in_proj's output: q, k, v, z, beta and the decay's input
    convolved = e * (2 * qk + v)  # the convolution's output after silu
    normalised = e * 2 * qk  # q and k after their L2 norm
    return projected + convolved + normalised + 8 * heads + 2 * e * v  # g, beta in fp32; the core and gated outputs


def _activation_bytes_per_token(model: ModelConfig, *, moe: bool, mixer: str, act_bytes: int, seq_per_rank: int,
                                tp: int, etp: int, sequence_parallel: bool, flash_attention: bool,
                                recomputed: frozenset, hidden_dropout: bool, attention_dropout: bool) -> float:
    """One layer's saved activations per token of a micro-batch, when the layer is not fully recomputed;
    ``recomputed``: megatron's selective recompute modules."""
    e, h = act_bytes, model.hidden_size
    # each norm's input, and its output (the input of QKV or FC1) unless "layernorm" recomputes it
    sequence_region = (2 if "layernorm" in recomputed else 4) * e * h + (2 * h if hidden_dropout else 0)
    latent = 0.0
    if mixer == LINEAR_ATTENTION:
        mixing = _gated_delta_net_activations(model, e)
    elif model.multi_latent_attention:
        mixing, latent = 0, _latent_attention_activations(model, e, seq_per_rank, tp, sequence_parallel,
                                                          flash_attention, recomputed, attention_dropout)
    else:
        mixing = _attention_activations(model, e, seq_per_rank, flash_attention, recomputed, attention_dropout)
    if moe and "moe" not in recomputed:
        sequence_region += 8 * model.num_experts  # the router's fp32 logits and scores
        expert = _mlp_activations(model, e, model.expert_ffn_hidden_size, "moe_act" in recomputed)
        mlp = model.moe_router_topk * (e * h * etp + expert)
        if "shared_experts" not in recomputed:
            mlp += _mlp_activations(model, e, model.moe_shared_expert_intermediate_size)
    elif moe or "mlp" in recomputed:
        mlp = 0  # recomputed whole from its input, the pre-MLP norm's output
    else:
        mlp = _mlp_activations(model, e, model.ffn_hidden_size)
    return sequence_region / (tp if sequence_parallel else 1) + latent + (mixing + mlp) / tp


def passes_in_flight(pp: int, vpp: int | None, rank: int, num_microbatches: int) -> int:
    """Forward passes (micro-batch x model chunk) whose activations rank ``rank`` holds at its peak."""
    if vpp is None:
        warmup = pp - rank - 1
    else:
        warmup = 2 * (pp - rank - 1) + (vpp - 1) * pp
    return min(warmup + 1, num_microbatches * (vpp or 1))


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise PlanError(message)


def _check_layout(world: int, *, model: ModelConfig, seq_length: int | None = None, **sizes) -> int:
    """``adapter.parallel.check_sizes``, the layout rules the flow and megatron's groups use; the model's
    rules first (a TP or EP the model cannot take is the first thing to fix), then the world's. The plan's
    ``seq_length`` is the one the context-parallel split cuts, where it differs from the model's."""
    shape = model.shape() if seq_length is None else dataclasses.replace(model.shape(), seq_length=seq_length)
    try:
        return check_sizes(world, **sizes, model=shape)
    except ParallelConfigError as exc:
        raise PlanError(str(exc)) from None


def _check_plan(model: ModelConfig, *, tp: int, pp: int, vpp: int | None, dp: int, cp: int, ep: int, etp: int,
                micro_batch_size: int, global_batch_size: int, seq_length: int, params_dtype: str,
                sequence_parallel: bool, recompute: str | None, recompute_method: str,
                recompute_num_layers: int, recompute_modules: tuple[str, ...],
                split: PipelineSplit) -> int:
    """Refuse what megatron would; returns the number of micro-batches per step."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp), ("ep", ep), ("etp", etp),
                        ("micro_batch_size", micro_batch_size), ("global_batch_size", global_batch_size),
                        ("seq_length", seq_length), ("recompute_num_layers", recompute_num_layers)):
        _check(isinstance(value, int) and value >= 1, f"{name}={value!r}: must be a positive integer")
    _check(params_dtype in DTYPE_BYTES, f"params_dtype={params_dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    _check(recompute in RECOMPUTE, f"recompute={recompute!r}: use selective, full or None")
    _check(recompute_method in ("uniform", "block"), f"recompute_method={recompute_method!r}: use uniform or block")
    unknown = sorted(set(recompute_modules) - set(RECOMPUTE_MODULES))
    _check(not unknown, f"recompute modules {', '.join(unknown)}: megatron-core recomputes "
                        f"{', '.join(RECOMPUTE_MODULES)}")
    _check(vpp is None or split == PipelineSplit(), "virtual pipeline stages with an uneven pipeline split: the "
                                                    "plan takes one of them; drop the virtual stages")
    _check(not (model.mtp_num_layers and recompute == "full" and recompute_method == "uniform"
                and recompute_num_layers != 1),
           f"full uniform recompute of {recompute_num_layers} layers a group with MTP layers: megatron recomputes "
           "MTP layers one at a time only; use --recompute-num-layers 1")
    _check_layout(tp * pp * cp * dp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, model=model, seq_length=seq_length,
                  sequence_parallel=sequence_parallel, split=split)
    per_step = micro_batch_size * dp
    _check(global_batch_size % per_step == 0,
           f"global batch {global_batch_size} is not divisible by micro batch {micro_batch_size} x DP {dp} = "
           f"{per_step}: change the global or the micro batch size")
    num_microbatches = global_batch_size // per_step
    _check(vpp is None or num_microbatches % pp == 0,
           f"the interleaved schedule runs micro-batches in groups of PP {pp}, which does not divide the "
           f"{num_microbatches} micro-batches: change the global batch size")
    return num_microbatches


def _pass_bytes(layer_bytes: float, input_bytes: float, layers_per_pass: int, recompute: str | None,
                recompute_method: str, recompute_num_layers: int) -> float:
    """What one forward pass of ``layers_per_pass`` layers leaves saved, ``layer_bytes`` each when whole."""
    if recompute != "full":
        return layers_per_pass * layer_bytes
    if recompute_method == "uniform":
        return math.ceil(layers_per_pass / recompute_num_layers) * input_bytes
    checkpointed = min(recompute_num_layers, layers_per_pass)
    return checkpointed * input_bytes + (layers_per_pass - checkpointed) * layer_bytes


def plan(model: ModelConfig, *, tp: int, pp: int, vpp: int | None = None, dp: int, cp: int = 1, ep: int = 1,
         etp: int | None = None, micro_batch_size: int, global_batch_size: int, seq_length: int,
         params_dtype: str = "bf16", distributed_optimizer: bool = True, sequence_parallel: bool = True,
         recompute: str | None = None, recompute_method: str = "uniform", recompute_num_layers: int = 1,
         recompute_modules: tuple[str, ...] | None = None, split: PipelineSplit = PipelineSplit(),
         grad_reduce_in_fp32: bool = True, flash_attention: bool = True, hidden_dropout: float = 0.0,
         attention_dropout: float = 0.0) -> MemoryPlan:
    """The memory of one device per pipeline rank (see the module docstring for every term). ``ep`` and
    ``etp`` (default: ``tp``) are a MoE model's expert parallel sizes; ``recompute_modules`` megatron's
    selective recompute modules (default core_attn); ``split`` an uneven pipeline split.

    Raises ``ModelConfigError`` for a TP/PP/VPP/EP the model cannot be split into and ``PlanError`` for sizes or
    batches megatron would refuse."""
    etp, vpp = tp if etp is None else etp, None if vpp == 1 else vpp
    sequence_parallel = sequence_parallel and tp > 1
    modules = tuple(recompute_modules or ("core_attn",)) if recompute == "selective" else ()
    num_microbatches = _check_plan(
        model, tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, etp=etp, micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size, seq_length=seq_length, params_dtype=params_dtype,
        sequence_parallel=sequence_parallel, recompute=recompute, recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers, recompute_modules=modules, split=split)
    e = DTYPE_BYTES[params_dtype]
    grads_dtype = "fp32" if grad_reduce_in_fp32 or params_dtype == "fp32" else params_dtype
    optimizer_bytes = 8 if params_dtype == "fp32" else 12
    # the distributed optimizer shards the dense part over DP x CP, the experts over expert DP
    shards, expert_shards = (dp * cp, tp * dp * cp // (etp * ep)) if distributed_optimizer else (1, 1)
    tokens = seq_length // cp * micro_batch_size
    sequence_split = tp if sequence_parallel else 1
    kinds = list(zip(model.mixers(), model.moe_layer_pattern()))  # each layer's (token mixer, MoE?)
    layer_bytes = {(mixer, moe): tokens * _activation_bytes_per_token(
        model, moe=moe, mixer=mixer, act_bytes=e, seq_per_rank=seq_length // cp, tp=tp, etp=etp,
        sequence_parallel=sequence_parallel, flash_attention=flash_attention, recomputed=frozenset(modules),
        hidden_dropout=hidden_dropout > 0, attention_dropout=attention_dropout > 0) for mixer, moe in set(kinds)}
    # megatron's hybrid stack has two layers per model layer (mixer, MLP/MoE): recompute counts those
    stack_layers = 2 if model.layer_types else 1
    hidden = tokens * e * model.hidden_size / sequence_split  # one hidden state of the micro-batch
    logits = 2 * hidden + tokens * (e + 4) * model.vocab_size / tp
    mtp_activations, mtp_logits = _mtp_activations(model, hidden, layer_bytes[kinds[-1]], logits,
                                                    recompute == "full" and recompute_method == "uniform")
    stages = []
    for stage, size in enumerate(stage_sizes(model, pp, split) if vpp is None else [model.num_layers // pp] * pp):
        parameters, experts, mtp = _stage_parameters(model, stage, pp, vpp, tp, ep * etp, split)
        pattern = [kinds[layer] for layer in stage_layers(model, stage, pp, vpp, split)]
        mean_layer = sum(layer_bytes[kind] for kind in pattern) / len(pattern)
        in_flight, layers_per_pass = passes_in_flight(pp, vpp, stage, num_microbatches), size // (vpp or 1)
        pass_bytes = _pass_bytes(mean_layer / stack_layers, hidden, layers_per_pass * stack_layers, recompute,
                                 recompute_method, recompute_num_layers)
        last = stage == pp - 1
        stages.append(StagePlan(
            stage=stage, layers=size, parameters=parameters, expert_parameters=experts,
            passes_in_flight=in_flight, layers_per_pass=layers_per_pass, weights=parameters * e,
            grads=parameters * DTYPE_BYTES[grads_dtype],
            optimizer=(parameters - experts) * optimizer_bytes // shards + experts * optimizer_bytes // expert_shards,
            activations=round(in_flight * pass_bytes + (mtp_activations if last else 0)),
            logits=round(logits + mtp_logits) if last else 0, mtp_parameters=mtp))
    return MemoryPlan(model=model, tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, etp=etp,
                      micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                      seq_length=seq_length, num_microbatches=num_microbatches, params_dtype=params_dtype,
                      grads_dtype=grads_dtype, distributed_optimizer=distributed_optimizer,
                      sequence_parallel=sequence_parallel, flash_attention=flash_attention, recompute=recompute,
                      stages=tuple(stages), recompute_modules=modules)


def _mtp_activations(model: ModelConfig, hidden: float, layer: float, logits: float,
                     recomputed: bool) -> tuple[float, float]:
    """(activations, logits) of the MTP layers for one micro-batch, held on the last stage beside its own
    logits: each layer keeps the next tokens' embedding, the concatenated input of its projection (two hidden
    states), its decoder layer and its final norm's input, or, recomputed (full, uniform), only the
    embedding (the decoder's output it also reads is the output layer's input already); and its own logits:
    the output layer's input, the logits and the cross entropy's fp32 copy."""
    count = model.mtp_num_layers or 0
    kept = hidden if recomputed else 4 * hidden + layer
    return count * kept, count * (logits - hidden)


def _world_size(argv: list[str]) -> tuple[int, list[str]]:
    """(devices in all, ``argv`` without ``--world-size N``): the plan's own flag, else NNODES x NPROC_PER_NODE
    from the environment, as the launchers set them."""
    words, world = list(argv), None
    if "--world-size" in words:
        at = words.index("--world-size")
        value = words[at + 1] if at + 1 < len(words) else ""
        _check(value.isdigit() and int(value) > 0, f"--world-size {value!r}: must be a positive integer")
        world, words = int(value), words[:at] + words[at + 2:]
    if world is None:
        _check("NPROC_PER_NODE" in os.environ, "no world size: pass --world-size N or set NPROC_PER_NODE (and NNODES)")
        try:
            world = int(os.environ.get("NNODES", "1")) * int(os.environ["NPROC_PER_NODE"])
        except ValueError as exc:
            raise PlanError(f"NNODES and NPROC_PER_NODE must be integers ({exc})") from exc
    return world, words


def megatron_args(argv: list[str], world: int) -> argparse.Namespace:
    """``argv`` as ``scripts/pretrain_gpt.py`` reads it (``flow.pretrain.run``): ``--model NAME`` expanded into
    Megatron-LM's flags, parsed and validated by megatron.training's own parser for ``world`` ranks, without
    a process group. megatron's prints and warnings go nowhere (the table is the output; the run says them)
    and its environment settings (CUDA_DEVICE_MAX_CONNECTIONS) are undone."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _parsed(argv, world)


def _parsed(argv: list[str], world: int) -> argparse.Namespace:
    from megatron.training.arguments import parse_args, validate_args

    from flow.releases import ARGS_DEFAULTS

    words, saved_argv, saved_env = model_flags.expand(argv, describe=described), sys.argv, dict(os.environ)
    sys.argv, said = [sys.argv[0], *words], io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parse_args()
        args.world_size, args.rank = world, 0
        with contextlib.redirect_stdout(io.StringIO()):
            validate_args(args, ARGS_DEFAULTS)
    except SystemExit:  # argparse's usage and error: its error line
        raise PlanError(said.getvalue().strip().splitlines()[-1].split("error: ", 1)[-1]) from None
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    return args


def _vocabulary(args: argparse.Namespace) -> int:
    """The embedding's rows: ``--padded-vocab-size`` (a named model's own), else the tokenizer's vocabulary
    padded as megatron pads it, from the tokenizer megatron builds."""
    if args.padded_vocab_size is None:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

        try:
            with contextlib.redirect_stdout(io.StringIO()):
                build_tokenizer(args)
        except Exception as exc:  # noqa: BLE001 - whatever stops the tokenizer's build, the plan says it in a line
            raise PlanError(f"--tokenizer-type {args.tokenizer_type} does not build here "
                            f"({type(exc).__name__}: {' '.join(str(exc).split())}): pass --padded-vocab-size N, "
                            "the embedding's rows") from None
    return args.padded_vocab_size


def _model(argv: list[str], args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig of megatron's arguments: the named model's (its hybrid layers and YaRN settings, which no
    Megatron-LM flag says, included) with every architecture argument megatron parsed over it."""
    from models.provider import config_from_args

    values = vars(args) | {"model": model_flags.name(argv), "padded_vocab_size": _vocabulary(args),
                           "vocab_size": None}
    if isinstance(args.moe_layer_freq, list):
        values["moe_layer_freq"] = tuple(args.moe_layer_freq)
    return config_from_args(argparse.Namespace(**values))


def plan_from_args(argv: list[str]) -> tuple[MemoryPlan, str]:
    """The plan for ``scripts/pretrain_gpt.py``'s argument list (and ``--world-size N``), and the model's name for
    the table. The layout is checked against the model and the world before megatron's checks, which would
    refuse the same layouts with less to go on."""
    world, argv = _world_size(argv)
    args = megatron_args(argv, world)
    model = _model(argv, args)
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    split = PipelineSplit(first=args.decoder_first_pipeline_num_layers, last=args.decoder_last_pipeline_num_layers,
                          embedding=args.account_for_embedding_in_pipeline_split,
                          loss=args.account_for_loss_in_pipeline_split)
    vpp = args.virtual_pipeline_model_parallel_size
    dp = _check_layout(world, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, model=model, split=split)
    params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    result = plan(model, tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, etp=etp, micro_batch_size=args.micro_batch_size,
                  global_batch_size=args.global_batch_size, seq_length=args.seq_length, params_dtype=params_dtype,
                  distributed_optimizer=args.use_distributed_optimizer, sequence_parallel=args.sequence_parallel,
                  recompute=args.recompute_granularity, recompute_method=args.recompute_method or "uniform",
                  recompute_num_layers=args.recompute_num_layers or 1,
                  recompute_modules=tuple(args.recompute_modules or ()), split=split,
                  grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32, flash_attention=args.use_flash_attn,
                  hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout)
    return result, model_flags.name(argv) or "model"


def main(argv: list[str] | None = None) -> int:
    """``python -m flow.memory_plan [--world-size N] ARGS``: the table, or one line and exit 2 for a layout or
    argument megatron would refuse."""
    try:
        result, name = plan_from_args(sys.argv[1:] if argv is None else argv)
    except (PlanError, ModelConfigError, RefusedSetting) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.table(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
