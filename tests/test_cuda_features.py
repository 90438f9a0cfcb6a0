"""megatron-core features that spell CUDA on their way and died off CUDA with "Torch not compiled with CUDA
enabled", run at data parallel 2 on CPU/gloo (real ranks): fp16 training with megatron's dynamic loss
scaler and the distributed optimizer, the parameter-hash check across data-parallel replicas, and the fully
parallel save and load of a dist checkpoint with each of megatron's exchange algorithms.

fp16 on CPU: torch 2.x computes every op the tiny GPT uses in float16 on CPU, so the fp16 run is megatron's
own (Float16Module: fp16 weights and activations; fp32 master weights in the optimizer), nothing cast back
to fp32 for the CPU. It is slower than fp32 there (a CPU without fp16 arithmetic converts: about 6x per
small matmul, 2x per tiny-GPT step, 75 ms against 37 ms), which at this size costs under a second.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from scripts.train_tiny_gpt import Run, finish, train_step
from tests.checkpointing import _clone_tensors, _sharded_state, _tensors_equal
from tests.distributed import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

RUN = Run(distributed_optimizer=True, steps=7, lr=3e-3)
INITIAL_SCALE = 2.0 ** 10
GROWTH_INTERVAL = 2
HYSTERESIS = 2
# rank 1 fills its gradient buffer with this (after the data-parallel reduce-scatter) before these steps
INJECTED = {1: float("inf"), 2: float("nan"), 5: float("inf")}
ALGORITHMS = ("broadcast", "gather_rounds", "gather_object", None)  # None: the wrapper's default
SHARDINGS = ("dp_reshardable", "fully_reshardable")  # the distributed optimizer's checkpoint formats
PATCHES = ("megatron.core.dist_checkpointing.mapping:ShardedTensor.init_data",
           "megatron.core.dist_checkpointing.exchange_utils:exchange_loaded_tensors_gather_rounds")


def _build(run: Run, fp16: bool):
    """The tiny GPT as Megatron-LM builds it for --fp16 (Float16Module inside DDP) or in fp32, with the
    distributed optimizer and, for fp16, megatron's dynamic loss scaler."""
    import models
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from models.provider import build_model, transformer_config

    torch.manual_seed(run.seed)
    model_parallel_cuda_manual_seed(run.seed)
    flavor = models.get(run.flavor)
    dtype = torch.float16 if fp16 else torch.float32
    config = transformer_config(flavor, fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype)
    model = build_model(flavor, config)
    if fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True, bucket_size=run.bucket_size)
    chunk = DistributedDataParallel(config, ddp_config, model)
    config.no_sync_func = chunk.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0,
                        use_distributed_optimizer=True, fp16=fp16, loss_scale=None,
                        initial_loss_scale=INITIAL_SCALE, min_loss_scale=1.0,
                        loss_scale_window=GROWTH_INTERVAL, hysteresis=HYSTERESIS),
        [chunk])
    config.grad_scale_func = optimizer.scale_loss
    return flavor, chunk, optimizer


def _start(run: Run, fp16: bool = True):
    import adapter
    from megatron.core import parallel_state

    adapter.init_distributed()
    parallel_state.initialize_model_parallel(1, 1)
    return _build(run, fp16)


def _gpt(chunk):
    """The GPTModel inside DDP (and Float16Module)."""
    module = chunk.module
    return module.module if hasattr(module, "float16_convertor") else module


def _inner(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


# ---------------------------------------------------------------------------------- fp16 training
class _Stepping:
    """The optimizer as train_step sees it. With ``inject``, before a step of INJECTED rank 1 fills its
    whole gradient buffer with the value, so rank 0's shard stays finite and only megatron's all-reduce of
    found_inf can tell rank 0; without, those steps are left out (the fp32 reference). Records what each
    step returned and every sub-optimizer's loss scale after it."""

    def __init__(self, optimizer, chunk, inject: bool):
        self.optimizer, self.chunk, self.inject = optimizer, chunk, inject
        self.step_index, self.updated, self.scales = 0, [], []

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        value = INJECTED.get(self.step_index)
        self.step_index += 1
        if value is not None and not self.inject:
            return False, None, None
        if value is not None and torch.distributed.get_rank() == 1:
            for param in self.chunk.parameters():
                param.main_grad.fill_(value)
        result = self.optimizer.step()
        self.updated.append(result[0])
        self.scales.append([inner.get_loss_scale().item() for inner in _inner(self.optimizer)])
        return result


def fp16_training(run: Run) -> dict:
    """In a rank: the fp16 run with INJECTED; megatron's parameter-hash check on its replicas, before and
    after one element of rank 1's copy changed; and the fp32 reference: the same initial weights (the fp16
    ones), the same data, the steps the fp16 run skips left out."""
    from megatron.core.utils import check_param_hashes_across_dp_replicas

    flavor, chunk, optimizer = _start(run)
    computed = []
    _gpt(chunk).output_layer.register_forward_hook(lambda module, args, out: computed.append(out[0].dtype))
    initial = {name: p.detach().clone() for name, p in _gpt(chunk).named_parameters()}
    stepping = _Stepping(optimizer, chunk, inject=True)
    losses, unchanged = [], []
    for step in range(run.steps):
        before = [p.detach().clone() for p in chunk.parameters()]
        losses.append(train_step(run, flavor, [chunk], stepping, step)[0])
        unchanged.append(all(torch.equal(a, p) for a, p in zip(before, chunk.parameters())))
    params = {name: p.detach().clone() for name, p in _gpt(chunk).named_parameters()}
    # each fp32 master shard with the same range of its fp16 parameter
    masters = [(main.detach().clone(), model.detach().clone()) for inner in _inner(optimizer)
               for mains, fp16s in zip(inner.shard_fp32_from_float16_groups, inner.shard_float16_groups)
               for main, model in zip(mains, fp16s)]

    hashes = {"equal": check_param_hashes_across_dp_replicas([chunk]),
              "equal, cross_check": check_param_hashes_across_dp_replicas([chunk], cross_check=True)}
    if torch.distributed.get_rank() == 1:
        with torch.no_grad():
            next(chunk.parameters()).view(-1)[0] += 1.0
    hashes["rank 1 changed"] = check_param_hashes_across_dp_replicas([chunk])
    hashes["rank 1 changed, cross_check"] = check_param_hashes_across_dp_replicas([chunk], cross_check=True)

    _, reference_chunk, reference_optimizer = _build(run, fp16=False)
    with torch.no_grad():
        for name, p in _gpt(reference_chunk).named_parameters():
            p.copy_(initial[name])
    reference = _Stepping(reference_optimizer, reference_chunk, inject=False)
    reference_losses = [train_step(run, flavor, [reference_chunk], reference, step)[0]
                        for step in range(run.steps)]
    reference_params = {name: p.detach().clone() for name, p in _gpt(reference_chunk).named_parameters()}
    finish()
    return {"losses": losses, "updated": stepping.updated, "scales": stepping.scales, "unchanged": unchanged,
            "computed_in": sorted(set(map(str, computed))), "initial": initial, "params": params,
            "masters": masters, "hashes": hashes, "reference_losses": reference_losses,
            "reference_params": reference_params}


@pytest.fixture(scope="module")
def fp16():
    return run_ranks(2, fp16_training, RUN)


def test_fp16_dynamic_loss_scale_skips_overflowing_steps_backs_off_and_grows(fp16):
    """megatron's DynamicGradScaler as its docstring specifies it: a step whose gradients hold an inf or nan
    on any rank is skipped on every rank, weights untouched; after ``hysteresis`` such steps the scale
    halves; after ``growth_interval`` good steps in a row it doubles (and the hysteresis count restarts)."""
    s = INITIAL_SCALE
    # 0 good; 1 inf (hysteresis 2 -> 1); 2 nan (-> 0: halve); 3 good; 4 good (2 in a row: double,
    # hysteresis back to 2); 5 inf (2 -> 1: kept); 6 good
    want = [s, s, s / 2, s / 2, s, s, s]
    skipped = [step in INJECTED for step in range(RUN.steps)]
    for rank in fp16:
        assert rank["computed_in"] == ["torch.float16"]  # the logits: fp16 compute on CPU
        assert rank["updated"] == [not skip for skip in skipped]
        assert rank["unchanged"] == skipped
        assert rank["scales"] == [[scale] * len(rank["scales"][0]) for scale in want]


def test_fp16_replicas_agree_and_follow_the_fp32_run(fp16):
    """Both replicas hold the same fp16 weights, each the fp32 master weight rounded; the loss falls and
    stays within 2e-3 of the fp32 run's (seen: 4e-4), and each weight's change over the run is the fp32
    run's within 10% (seen: at most 4%; Adam amplifies fp16 rounding of near-zero gradients)."""
    first, second = fp16
    for name, param in first["params"].items():
        assert param.dtype == torch.float16 and torch.equal(param, second["params"][name]), name
    for rank in fp16:
        assert rank["masters"] and all(torch.equal(main.half(), model) for main, model in rank["masters"])
    losses = first["losses"]
    assert losses[-1] < losses[0] - 0.3
    assert losses == pytest.approx(first["reference_losses"], abs=2e-3)
    for name, param in first["params"].items():
        start = first["initial"][name].float()
        change, reference_change = param.float() - start, first["reference_params"][name] - start
        assert (change - reference_change).norm() < 0.1 * reference_change.norm(), name


def test_param_hashes_across_dp_replicas(fp16):
    """check_param_hashes_across_dp_replicas compares each rank's hashes with DP rank 0's (with
    cross_check: with every rank's). Trained replicas agree; once rank 1's copy differs in one element,
    rank 1 says False, and with cross_check every rank does."""
    assert [r["hashes"]["equal"] for r in fp16] == [True, True]
    assert [r["hashes"]["equal, cross_check"] for r in fp16] == [True, True]
    assert [r["hashes"]["rank 1 changed"] for r in fp16] == [True, False]
    assert [r["hashes"]["rank 1 changed, cross_check"] for r in fp16] == [False, False]


# ------------------------------------------------------------------- fully parallel dist checkpoint
def _optimizer_tensors(optimizer) -> dict:
    """What the distributed optimizer holds: Adam's states, the fp32 master shards, the loss scale."""
    return {"adam": _clone_tensors([inner.optimizer.state_dict()["state"] for inner in _inner(optimizer)]),
            "masters": [main.detach().clone() for inner in _inner(optimizer)
                        for group in inner.shard_fp32_from_float16_groups for main in group],
            "scale": [inner.get_loss_scale().item() for inner in _inner(optimizer)]}


def _model_tensors(chunk) -> list:
    """(checkpoint key, offset, where in the whole tensor, this rank's tensor) for the model's sharded state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = chunk.module.sharded_state_dict()
    apply_factories(sharded)
    return [(t.key, t.global_offset, t.global_slice(), t.data.detach().clone()) for t in nested_values(sharded)
            if isinstance(t, ShardedTensor)]


def _fully_parallel_load(directory: str, algorithm, reads: list):
    """FullyParallelLoadStrategyWrapper over the checkpoint's torch_dist strategy, on the DP group, noting
    into ``reads`` (key, offset) of each shard this rank reads from storage itself."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(directory), parallel_state.get_data_parallel_group(),
        **({} if algorithm is None else {"exchange_algo": algorithm}))
    base_load = strategy.base_strategy.load

    def noting_load(sharded_state_dict, checkpoint_dir, *rest):  # rest: 0.19's async_strategy
        reads.extend((t.key, t.global_offset) for t in nested_values(sharded_state_dict)
                     if isinstance(t, ShardedTensor))
        return base_load(sharded_state_dict, checkpoint_dir, *rest)

    strategy.base_strategy.load = noting_load
    return strategy


def fully_parallel_round_trip(run: Run, directories: dict) -> dict:
    """In a rank: fp16 training for ``run.steps``; the model's and the distributed optimizer's sharded state
    saved through FullyParallelSaveStrategyWrapper over torch_dist, once per optimizer format
    (``directories``: format -> directory), and loaded into a model and optimizer of another seed through
    FullyParallelLoadStrategyWrapper with each exchange algorithm. Then megatron's load_plain_tensors
    (ShardedTensors with no data, as load_tensors_metadata gives them), fully parallel: the rank that does
    not read a tensor allocates the one it receives with ShardedTensor.init_data("cuda")."""
    import adapter
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    flavor, chunk, optimizer = _start(run)
    for step in range(run.steps):
        train_step(run, flavor, [chunk], optimizer, step)
    saved_params = {name: p.detach().clone() for name, p in chunk.named_parameters()}
    saved_optimizer = _optimizer_tensors(optimizer)
    model_tensors = _model_tensors(chunk)
    model_keys = {key for key, _, _, _ in model_tensors}

    def model_shards(shards) -> list:
        return sorted(shard for shard in shards if shard[0] in model_keys)

    loads = {}
    for sharding, directory in directories.items():
        strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                    parallel_state.get_data_parallel_group())
        dist_checkpointing.save(_sharded_state([chunk], optimizer, sharding), directory, sharded_strategy=strategy)
        torch.distributed.barrier()
        for algorithm in ALGORITHMS:
            _, fresh, fresh_optimizer = _build(dataclasses.replace(run, seed=run.seed + 1), fp16=True)
            reads = []
            strategy = _fully_parallel_load(directory, algorithm, reads)
            state = dist_checkpointing.load(_sharded_state([fresh], fresh_optimizer, sharding, is_loading=True),
                                            directory, sharded_strategy=strategy)
            fresh.module.load_state_dict(state["model"])
            with torch.no_grad():
                fresh_optimizer.load_state_dict(state["optimizer"])
            loads[sharding, algorithm] = {
                "algorithm": strategy.exchange_algo, "read": model_shards(reads),
                "params": all(torch.equal(p, saved_params[name]) for name, p in fresh.named_parameters()),
                "optimizer": _tensors_equal(_optimizer_tensors(fresh_optimizer), saved_optimizer)}

    plain, directory = {}, directories["fully_reshardable"]
    for algorithm in ALGORITHMS:
        reads = []
        metadata = dist_checkpointing.load_tensors_metadata(directory)
        wanted = model_shards((t.key, t.global_offset) for t in metadata.values())
        tensors = dist_checkpointing.load(metadata, directory, validate_access_integrity=False,
                                          sharded_strategy=_fully_parallel_load(directory, algorithm, reads))
        tensors = {key: t for key, t in tensors.items() if torch.is_tensor(t)}
        plain[algorithm] = {
            "read": model_shards(reads), "wanted": wanted,
            "devices": sorted({t.device.type for t in tensors.values()}),
            "model": all(torch.equal(tensors[key][index], t) for key, _, index, t in model_tensors),
            # the fp32 master weights, as saved in the optimizer's state, round to the fp16 weights
            "masters": all(torch.equal(tensors[f"optimizer.state.param.{key}"][index].half(), t)
                           for key, _, index, t in model_tensors)}
    finish()
    return {"loads": loads, "plain": plain, "model_keys": sorted(model_keys),
            "model_shards": model_shards((key, offset) for key, offset, _, _ in model_tensors),
            "patches": {target: adapter.registry.status(target) for target in PATCHES}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directories = {sharding: str(tmp_path_factory.mktemp(sharding)) for sharding in SHARDINGS}
    return directories, run_ranks(2, fully_parallel_round_trip, dataclasses.replace(RUN, steps=2), directories)


def _split_between_the_ranks(reads: list, shards: list) -> bool:
    """Each rank read part of ``shards`` from storage, together all of them, none twice."""
    first, second = map(set, reads)
    return bool(first) and bool(second) and not first & second and first | second == set(shards)


def test_fully_parallel_save_spreads_the_replicated_weights_over_the_ranks(checkpoints):
    """With the wrapper each DP rank writes part of the weights both hold (plain torch_dist writes all of
    them from DP rank 0): torch_dist's own metadata names the file that holds each shard."""
    from torch.distributed.checkpoint import FileSystemReader

    directories, ranks = checkpoints
    model_keys = set(ranks[0]["model_keys"])
    for directory in directories.values():
        storage = FileSystemReader(directory).read_metadata().storage_data
        written = [[], []]  # per rank, the model's shards in its files, named __<rank>_<writer thread>.distcp
        for index, info in storage.items():
            if index.fqn in model_keys:
                rank = int(re.fullmatch(r"__(\d+)_\d+\.distcp", info.relative_path)[1])
                written[rank].append((index.fqn, tuple(index.offset)))
        assert _split_between_the_ranks(written, ranks[0]["model_shards"]), written


@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fully_parallel_load_restores_model_and_distributed_optimizer(checkpoints, sharding, algorithm):
    """Each rank reads part of the weights and the exchange gives every rank all of them: parameters, Adam's
    states, the fp32 master weights and the loss scale come back bit-exact, on both ranks. ``gather_rounds``
    all-gathers shards of different sizes (patched on gloo); None is the wrapper's default, 'broadcast'."""
    _, ranks = checkpoints
    results = [rank["loads"][sharding, algorithm] for rank in ranks]
    assert all(r["algorithm"] == (algorithm or "broadcast") for r in results)
    assert all(r["params"] and r["optimizer"] for r in results), results
    assert _split_between_the_ranks([r["read"] for r in results], ranks[0]["model_shards"])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fully_parallel_load_of_plain_tensors_allocates_received_tensors_here(checkpoints, algorithm):
    """megatron's load_plain_tensors, fully parallel: the tensors a rank receives have no buffer yet, and
    megatron makes it with ShardedTensor.init_data("cuda") (patched: this backend's device). Every rank
    ends with the whole weights as the model held them, and the fp32 master weights rounding to them."""
    _, ranks = checkpoints
    results = [rank["plain"][algorithm] for rank in ranks]
    for r in results:
        assert r["devices"] == ["cpu"] and r["model"] and r["masters"], r
    assert _split_between_the_ranks([r["read"] for r in results], results[0]["wanted"])
    assert ranks[0]["patches"] == {target: "applied" for target in PATCHES}
