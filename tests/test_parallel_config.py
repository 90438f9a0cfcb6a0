"""Impossible parallel layouts are refused up front, with the bad value and the fix in the message."""

from __future__ import annotations

import pytest

import adapter
from adapter import parallel
from adapter.parallel import ModelShape, ParallelConfigError, check_sizes
from tests.distributed import run_ranks


# ---------------------------------------------------------------- check_sizes
def test_valid_layouts_return_the_data_parallel_size():
    assert check_sizes(8, tp=2, pp=2) == 2
    assert check_sizes(16, tp=2, pp=4) == 2
    assert check_sizes(8, tp=2, cp=2, ep=2) == 2
    assert check_sizes(8, tp=2, pp=2, vpp=2, model=ModelShape(num_attention_heads=8, num_query_groups=2,
                                                              num_layers=8)) == 2
    assert check_sizes(None, tp=2, model=ModelShape(num_attention_heads=8)) is None  # the model alone
    assert check_sizes(1) == 1


def test_world_not_divisible_by_tp_pp_cp():
    with pytest.raises(ParallelConfigError,
                       match=r"world size 6 is not divisible by tensor \(2\) x pipeline \(2\) x context "
                             r"\(1\) parallel = 4\. Launch a multiple of 4 processes"):
        check_sizes(6, tp=2, pp=2)
    with pytest.raises(ParallelConfigError, match=r"context \(3\) parallel = 6\. Launch a multiple of 6"):
        check_sizes(8, tp=2, cp=3)


def test_expert_sizes_not_dividing():
    with pytest.raises(ParallelConfigError,
                       match=r"world size 8 is not divisible by expert tensor \(2\) x expert \(3\) x "
                             r"pipeline \(1\) parallel = 6\. Change expert_model_parallel_size"):
        check_sizes(8, tp=2, ep=3)
    with pytest.raises(ParallelConfigError, match=r"expert tensor \(4\) x expert \(4\) x pipeline \(1\) "
                                                  r"parallel = 16.*expert_tensor_parallel_size"):
        check_sizes(8, tp=1, ep=4, etp=4)


def test_gtp_remat_axes_take_ranks_of_their_own():
    """megatron-core 0.19's gtp_remat_size counts toward the model size (world = TP*GTP*CP*PP*DP) and
    expert_gtp_remat_size toward the expert grid, as its parallel_state.initialize_model_parallel says."""
    assert check_sizes(8, tp=2, gtp=2) == 2
    with pytest.raises(ParallelConfigError, match=r"world size 8 is not divisible by tensor \(2\) x pipeline "
                                                  r"\(1\) x context \(1\) x gtp_remat \(3\) parallel = 6"):
        check_sizes(8, tp=2, gtp=3)
    with pytest.raises(ParallelConfigError, match=r"expert gtp_remat \(3\) parallel = 6\. .*"
                                                  r"expert_gtp_remat_size"):
        check_sizes(8, ep=2, egtp=3)
    with pytest.raises(ParallelConfigError, match=r"gtp_remat_size=0: parallel sizes are whole numbers"):
        check_sizes(8, gtp=0)


def test_the_wrapper_reads_every_size_however_it_is_passed(monkeypatch):
    """Sizes passed positionally, by keyword, or only as 0.19's new arguments all reach the check, over
    the wrapped release's own signature; nothing reaches megatron when one is wrong."""
    import torch

    calls = []

    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, use_sharp=False,
                                  context_parallel_size=1, expert_model_parallel_size=1,
                                  gtp_remat_size=1, expert_gtp_remat_size=1,
                                  expert_tensor_parallel_size=None, local_world_size=None):
        calls.append(context_parallel_size)

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 8)
    checked = parallel.checked_initialize_model_parallel(initialize_model_parallel)
    checked(2, 1, None, False, 4)  # context parallel 4, positionally: 2 x 4 divides 8
    with pytest.raises(ParallelConfigError, match=r"context \(3\) parallel = 6"):
        checked(2, 1, None, False, 3)
    with pytest.raises(ParallelConfigError, match=r"gtp_remat \(4\) parallel = 8\. Launch a multiple of 8"):
        checked(tensor_model_parallel_size=2, gtp_remat_size=4, local_world_size=4)
    with pytest.raises(ParallelConfigError, match=r"expert gtp_remat \(3\)"):
        checked(expert_gtp_remat_size=3)
    assert calls == [4]


@pytest.mark.parametrize("world, sizes, message", [
    (4, dict(tp=2, vpp=2), r"virtual pipeline size 2 needs pipeline_model_parallel_size > 1 \(got 1\)\. "
                           r"Drop the virtual pipeline size or use a pipeline"),
    (8, dict(tp=8, model=ModelShape(num_attention_heads=4)),
     r"tensor parallel size 8 does not divide num_attention_heads=4: use a tensor parallel size that divides 4"),
    (8, dict(tp=4, model=ModelShape(num_attention_heads=6)),
     r"tensor parallel size 4 does not divide num_attention_heads=6: use a tensor parallel size that divides 6"),
    (8, dict(tp=4, model=ModelShape(num_attention_heads=8, num_query_groups=2)),
     r"tensor parallel size 4 does not divide num_query_groups=2: use a tensor parallel size that divides 2"),
    (8, dict(tp=4, model=ModelShape(ffn_hidden_size=6)),  # the user's setting, by its name
     r"tensor parallel size 4 does not divide ffn_hidden_size=6: use a tensor parallel size that divides 6"),
    (8, dict(ep=4, model=ModelShape(num_experts=6)),
     r"expert parallel size 4 does not divide num_experts=6: use an expert parallel size that divides 6"),
    (8, dict(tp=2, etp=4, model=ModelShape(num_experts=8, expert_ffn_hidden_size=6)),
     r"expert tensor parallel size 4 does not divide expert_ffn_hidden_size=6"),
    (8, dict(ep=2, model=ModelShape(num_attention_heads=8)),
     r"expert parallel size 2 for a dense model: set num_experts, or use 1"),
    (8, dict(tp=4, cp=2, sequence_parallel=True, model=ModelShape(seq_length=36)),
     r"sequence parallelism splits each CP rank's 18 tokens over TP 4, which does not divide them"),
    (8, dict(cp=4, model=ModelShape(seq_length=36)),
     r"seq_length=36 is not divisible by 2 x context parallel size 4 = 8 \(megatron's load-balanced split"),
], ids=["vpp-without-pipeline", "tp-above-heads", "tp-not-dividing-heads", "tp-not-dividing-groups",
        "tp-not-dividing-ffn", "ep-not-dividing-experts", "etp-not-dividing-expert-ffn", "ep-for-a-dense-model",
        "sp-not-dividing-a-cp-ranks-tokens", "cp-not-dividing-seq"])
def test_refused_layouts_name_the_value_and_the_fix(world, sizes, message):
    with pytest.raises(ParallelConfigError, match=message):
        check_sizes(world, **sizes)


def test_layers_not_divisible_by_pipeline_stages():
    with pytest.raises(ParallelConfigError,
                       match=r"10 layers cannot be split evenly over pipeline \(2\) x virtual pipeline "
                             r"\(2\) = 4 stages: choose sizes whose product divides 10"):
        check_sizes(4, pp=2, vpp=2, model=ModelShape(num_layers=10))
    with pytest.raises(ParallelConfigError, match=r"7 layers .* pipeline \(2\) x virtual pipeline \(1\) = 2"):
        check_sizes(4, pp=2, model=ModelShape(num_layers=7))


@pytest.mark.parametrize("kwargs, name, shown", [
    (dict(tp=0), "tensor_model_parallel_size", "0"),
    (dict(pp=-2), "pipeline_model_parallel_size", "-2"),
    (dict(cp=1.5), "context_parallel_size", "1.5"),
    (dict(ep="2"), "expert_model_parallel_size", "'2'"),
    (dict(tp=True), "tensor_model_parallel_size", "True"),
    (dict(etp=0), "expert_tensor_parallel_size", "0"),
    (dict(pp=2, vpp=0), "virtual_pipeline_model_parallel_size", "0"),
    (dict(tp=2.0), "tensor_model_parallel_size", "2.0"),
])
def test_non_positive_or_non_int_sizes(kwargs, name, shown):
    with pytest.raises(ParallelConfigError,
                       match=rf"^{name}={shown}: parallel sizes are whole numbers >= 1$".replace(".", r"\.")):
        check_sizes(8, **kwargs)


def test_non_positive_world_size():
    with pytest.raises(ParallelConfigError, match=r"^world_size=0: parallel sizes are whole numbers >= 1"):
        check_sizes(0)


def test_parallel_config_error_is_a_value_error():
    assert issubclass(ParallelConfigError, ValueError)
    assert adapter.ParallelConfigError is ParallelConfigError


# ---------------------------------------------------------------- initialize_model_parallel wrapper
def refuse_then_build() -> dict:
    """Rank fn: an impossible layout is refused with no group created; a possible one then works."""
    import torch

    import adapter
    from megatron.core import parallel_state as ps

    adapter.init_distributed()
    created = []
    real_new_group = torch.distributed.new_group

    def spy(*args, **kwargs):
        created.append(kwargs.get("group_desc"))
        return real_new_group(*args, **kwargs)

    torch.distributed.new_group = spy
    out = {}
    for label, kwargs in (("tp4", dict(tensor_model_parallel_size=4)),
                          ("ep4", dict(expert_model_parallel_size=4))):
        try:
            ps.initialize_model_parallel(**kwargs)
        except Exception as exc:  # noqa: BLE001 - the type is the point
            out[label] = (type(exc).__name__, str(exc))
        else:
            out[label] = None
        out[label + "_initialized"] = ps.model_parallel_is_initialized()
        out[label + "_groups"] = list(created)
    # nothing half-built is left behind: the possible layout goes through on the same processes
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out["after"] = (ps.model_parallel_is_initialized(),
                    torch.distributed.get_process_group_ranks(ps.get_tensor_model_parallel_group()))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.multiproc
@pytest.mark.slow
def test_initialize_model_parallel_refuses_before_creating_groups():
    for out in run_ranks(2, refuse_then_build):
        name, message = out["tp4"]
        assert name == "ParallelConfigError"
        assert "world size 2 is not divisible by tensor (4)" in message
        assert "Launch a multiple of 4 processes" in message
        assert out["tp4_initialized"] is False
        assert out["tp4_groups"] == []
        name, message = out["ep4"]
        assert name == "ParallelConfigError"
        assert "expert (4)" in message and "expert_model_parallel_size" in message
        assert out["ep4_initialized"] is False
        assert out["ep4_groups"] == []
        assert out["after"] == (True, [0, 1])


def test_initialize_model_parallel_without_torch_distributed():
    import torch

    from megatron.core import parallel_state as ps

    assert not torch.distributed.is_initialized(), "this test needs a process without a default group"
    assert adapter.registry.applied("megatron.core.parallel_state:initialize_model_parallel")
    with pytest.raises(ParallelConfigError,
                       match=r"initialize_model_parallel needs torch\.distributed first: call "
                             r"adapter\.init_distributed\(\)"):
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    assert not ps.model_parallel_is_initialized()


# ---------------------------------------------------------------- timeout
def test_timeout_default(monkeypatch):
    monkeypatch.delenv(parallel.TIMEOUT_ENV, raising=False)
    assert parallel.timeout_minutes() == 30.0


@pytest.mark.parametrize("raw, minutes", [("5", 5.0), ("0.5", 0.5), (" 90 ", 90.0)])
def test_timeout_from_env(monkeypatch, raw, minutes):
    monkeypatch.setenv("ADAPTER_DIST_TIMEOUT_MINUTES", raw)
    assert parallel.timeout_minutes() == minutes
    assert parallel.timeout_minutes(12) == 12.0  # an explicit value wins over the environment


@pytest.mark.parametrize("raw", ["abc", "", "0", "-3", "nan", "inf"])
def test_timeout_env_refused(monkeypatch, raw):
    monkeypatch.setenv("ADAPTER_DIST_TIMEOUT_MINUTES", raw)
    with pytest.raises(ParallelConfigError,
                       match=rf"^ADAPTER_DIST_TIMEOUT_MINUTES={raw!r}: give the timeout as a positive "
                             r"number of minutes, e\.g\. 30$"):
        parallel.timeout_minutes()


@pytest.mark.parametrize("requested", [0, -1, float("nan"), float("inf")])
def test_timeout_argument_refused(requested):
    with pytest.raises(ParallelConfigError, match=r"^timeout=.*positive number of minutes"):
        parallel.timeout_minutes(requested)


def test_timeout_is_refused_before_the_process_group_starts(monkeypatch):
    import torch

    monkeypatch.setenv("ADAPTER_DIST_TIMEOUT_MINUTES", "abc")
    with pytest.raises(ParallelConfigError, match="ADAPTER_DIST_TIMEOUT_MINUTES='abc'"):
        adapter.init_distributed()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("name", ["cpu", "cuda", "npu"])
def test_only_nccl_groups_are_bound_to_their_device_at_init(monkeypatch, name):
    """On cuda, init_process_group gets the rank's device (NCCL connects at init and megatron's groups
    are split from it); gloo has no device to bind, torch_npu's HCCL no eager connect to take one."""
    import torch

    from adapter import backend, device

    started = {}
    monkeypatch.setattr(backend, "current", lambda: backend.Backend(name))
    monkeypatch.setattr(device, "device_count", lambda: 2)
    monkeypatch.setattr(device, "set_device", lambda index: started.setdefault("set_device", index))
    monkeypatch.setattr(device, "torch_device", lambda: torch.device(name, 1))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: started.update(kwargs))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    adapter.init_distributed()
    assert started["backend"] == {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[name]
    assert started.get("device_id") == (torch.device("cuda", 1) if name == "cuda" else None)
    assert started.get("set_device") == (None if name == "cpu" else 1)
