"""HCCL options per megatron process group (what the registry installs as get_nccl_options on NPU).

Runs here against the torch_npu double (tests/doubles), on gloo: the HCCL options are built and checked,
then dropped before the group is created, since gloo cannot take them.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from adapter.parallel import ParallelConfigError, hccl_group_options
from adapter.registry import installed_megatron_core_version
from tests.distributed import run_ranks

DEFAULT_MB = 200


@pytest.fixture
def npu(torch_npu_double, monkeypatch):
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    return torch_npu_double


# ---------------------------------------------------------------- the double itself
def test_double_hccl_config_is_a_copy(npu):
    opts = npu._C._distributed_c10d.ProcessGroupHCCL.Options()
    opts.hccl_config = {"hccl_buffer_size": 200, "group_name": "tp"}
    opts.hccl_config["hccl_buffer_size"] = 999  # lost, as on real torch_npu
    assert opts.hccl_config == {"hccl_buffer_size": 200, "group_name": "tp"}
    config = opts.hccl_config
    config["hccl_buffer_size"] = 999
    opts.hccl_config = config  # copy, modify, reassign
    assert opts.hccl_config["hccl_buffer_size"] == 999


@pytest.mark.parametrize("config, error", [
    ({"hccl_buffer_sz": 1}, "hccl_buffer_sz"),
    ({"group_name": "g" * 33}, "longer than 32"),
    ({"hccl_op_expansion_mode": 4}, "0-3"),
    ({"hccl_buffer_size": "200"}, "non-negative int"),
])
def test_double_validates_assigned_config(npu, config, error):
    opts = npu._C._distributed_c10d.ProcessGroupHCCL.Options()
    with pytest.raises((TypeError, ValueError), match=error):
        opts.hccl_config = config
    assert opts.hccl_config == {}


def test_double_stays_off_the_path_without_the_fixture():
    import importlib.util
    import sys

    assert "torch_npu" not in sys.modules
    assert importlib.util.find_spec("torch_npu") is None


# ---------------------------------------------------------------- hccl_group_options
def test_defaults(npu):
    opts = hccl_group_options("tp", {})
    assert isinstance(opts, npu._C._distributed_c10d.ProcessGroupHCCL.Options)
    assert opts.hccl_config == {"hccl_buffer_size": DEFAULT_MB, "group_name": "tp"}


def test_buffer_size_from_env(npu, monkeypatch):
    monkeypatch.setenv("HCCL_BUFFSIZE", "300")
    assert hccl_group_options("dp", {}).hccl_config == {"hccl_buffer_size": 300, "group_name": "dp"}


@pytest.mark.parametrize("raw", ["abc", "0", "-5", ""])
def test_bad_buffer_size_env(npu, monkeypatch, raw):
    monkeypatch.setenv("HCCL_BUFFSIZE", raw)
    with pytest.raises(ParallelConfigError, match=rf"HCCL_BUFFSIZE={raw!r}: give the buffer size in MB"):
        hccl_group_options("tp", {})


def test_per_group_config(npu, monkeypatch):
    cfgs = {"tp": {"hccl_buffer_size": 400}}
    assert hccl_group_options("tp", cfgs).hccl_config == {"hccl_buffer_size": 400, "group_name": "tp"}
    assert hccl_group_options("dp", cfgs).hccl_config == {"hccl_buffer_size": DEFAULT_MB, "group_name": "dp"}
    monkeypatch.setenv("HCCL_BUFFSIZE", "300")  # the per-group value beats the environment
    assert hccl_group_options("tp", cfgs).hccl_config["hccl_buffer_size"] == 400
    assert hccl_group_options("dp", cfgs).hccl_config["hccl_buffer_size"] == 300


def test_other_hccl_keys_pass_and_nccl_only_keys_are_dropped(npu):
    cfgs = {"ep": {"qos_service_level": 2, "qos_traffic_class": 3, "hccl_op_expansion_mode": 1,
                   "is_high_priority_stream": True, "max_ctas": 8},
            "pp": None}  # an empty YAML entry
    assert hccl_group_options("ep", cfgs).hccl_config == {
        "qos_service_level": 2, "qos_traffic_class": 3, "hccl_op_expansion_mode": 1,
        "hccl_buffer_size": DEFAULT_MB, "group_name": "ep"}
    assert hccl_group_options("pp", cfgs).hccl_config == {"hccl_buffer_size": DEFAULT_MB,
                                                          "group_name": "pp"}


def test_unknown_key_is_named(npu):
    with pytest.raises(ParallelConfigError,
                       match=r"communicator config for group 'tp' has unknown keys \['hccl_bufer_size'\]; "
                             r"HCCL understands \['hccl_buffer_size'"):
        hccl_group_options("tp", {"tp": {"hccl_bufer_size": 400}})


def test_long_names_are_truncated_to_32(npu):
    name = "intra_distributed_optimizer_instance_group"
    assert len(name) > 32
    assert hccl_group_options(name, {}).hccl_config["group_name"] == name[:32]
    assert hccl_group_options("x" * 32, {}).hccl_config["group_name"] == "x" * 32


# ---------------------------------------------------------------- inside megatron's initialize_model_parallel
# megatron's group_desc -> the name it passes to get_nccl_options (megatron-core 0.16.1 parallel_state)
MEGATRON_GROUP_NAMES = {
    "DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "DATA_PARALLEL_GROUP": "dp",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "MODEL_PARALLEL_GROUP": "mp",
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "EMBEDDING_GROUP": "embd",
    "POSITION_EMBEDDING_GROUP": "pos_embd",
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "EXPERT_TENSOR_PARALLEL_GROUP": "ep_tp",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep_mp",
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "EXPERT_DATA_PARALLEL_GROUP": "ep_dp",
    "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt_instance",
}
if Version(installed_megatron_core_version()) >= Version("0.19"):  # weight rematerialisation's groups
    MEGATRON_GROUP_NAMES.update({"GTP_WEIGHT_REMAT_GROUP": "gtp_remat",
                                 "EXPERT_GTP_WEIGHT_REMAT_GROUP": "expt_gtp_remat",
                                 "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "tp_ep_gtp_remat_pp"})


def groups_with_hccl_options(config: dict, tp: int, pp: int) -> dict:
    """Rank fn: megatron builds its groups with the adapter's HCCL options (as on NPU), on gloo."""
    import os
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "doubles"))
    import torch
    import yaml

    import adapter
    from adapter import one_rank_groups
    from megatron.core import parallel_state as ps

    adapter.init_distributed()
    assert adapter.current_backend().name == "cpu"
    ps.get_nccl_options = adapter.parallel.hccl_group_options  # what the registry does on npu
    # on npu these groups are HCCL's, which stay theirs at one rank too; gloo's stand-in here would make its
    # one-rank groups (data parallel at this layout) the adapter's (adapter/one_rank_groups.py)
    one_rank_groups.answers_here = lambda ranks, backend: False
    calls = []
    real_new_group = torch.distributed.new_group

    def spy(*args, **kwargs):
        options = kwargs.pop("pg_options", None)  # gloo cannot take HCCL options
        calls.append({"ranks": list(kwargs.get("ranks") or args[0]), "backend": kwargs.get("backend"),
                      "desc": kwargs.get("group_desc"), "options": type(options).__qualname__,
                      "hccl_config": getattr(options, "hccl_config", None)})
        return real_new_group(*args, **kwargs)

    torch.distributed.new_group = spy
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"comm-rank{os.environ['RANK']}.yaml"
        path.write_text(yaml.safe_dump(config))
        ps.initialize_model_parallel(tp, pp, nccl_communicator_config_path=str(path),
                                     high_priority_stream_groups=["dp"])  # an NCCL-only key for dp
    torch.distributed.new_group = real_new_group
    out = {"calls": calls, "tp": torch.distributed.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
           "torch_npu": sys.modules["torch_npu"].__file__}
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.multiproc
@pytest.mark.slow
def test_megatron_groups_get_hccl_options_by_name():
    config = {"tp": {"hccl_buffer_size": 400}, "dp": {"hccl_buffer_size": 100},
              "pp": {"hccl_buffer_size": 300, "hccl_op_expansion_mode": 2}}
    results = run_ranks(4, groups_with_hccl_options, config, 2, 2, env={"HCCL_BUFFSIZE": "250"})
    expected_tp = [[0, 1], [2, 3]]
    for rank, out in enumerate(results):
        assert "tests/doubles/torch_npu" in out["torch_npu"]
        assert out["tp"] == expected_tp[rank // 2]
        calls = out["calls"]
        gloo = [c for c in calls if c["backend"] == "gloo"]
        hccl = [c for c in calls if c["backend"] != "gloo"]
        assert gloo and all(c["desc"].endswith("_GLOO") and c["hccl_config"] is None for c in gloo)
        # every group megatron asked options for is here, under megatron's name for it
        assert {c["desc"] for c in hccl} == set(MEGATRON_GROUP_NAMES)
        for c in hccl:
            name = MEGATRON_GROUP_NAMES[c["desc"]]
            assert c["options"] == "ProcessGroupHCCL.Options", c
            hccl_config = c["hccl_config"]
            assert hccl_config["group_name"] == name, c
            assert hccl_config["hccl_buffer_size"] == {"tp": 400, "dp": 100, "pp": 300}.get(name, 250), c
            if name == "pp":
                assert hccl_config == {"hccl_buffer_size": 300, "hccl_op_expansion_mode": 2,
                                       "group_name": "pp"}
            else:  # dp's is_high_priority_stream (an NCCL-only key megatron added) is not passed on
                assert set(hccl_config) == {"hccl_buffer_size", "group_name"}, c
        tp_calls = sorted(c["ranks"] for c in hccl if c["desc"] == "TENSOR_MODEL_PARALLEL_GROUP")
        assert tp_calls == expected_tp
        pp_calls = sorted(c["ranks"] for c in hccl if c["desc"] == "PIPELINE_MODEL_PARALLEL_GROUP")
        assert pp_calls == [[0, 2], [1, 3]]
