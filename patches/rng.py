"""The model-parallel RNG tracker on devices other than CUDA."""

import contextlib

from adapter import device as _device

_RANDOM = "megatron.core.tensor_parallel.random"


class GraphSafeRngUnavailable(RuntimeError):
    pass


def _refuse_graph_safe(graph_safe: bool) -> None:
    if graph_safe:
        raise GraphSafeRngUnavailable(
            "CUDA-graph-safe RNG states exist only on CUDA: set use_cudagraphable_rng=False "
            "(and cuda_graph_impl='none') on this backend.")


def get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    """megatron's _get_cuda_rng_state, answered by this backend's generator (``device`` is the one
    this process runs on, as everywhere in megatron)."""
    _refuse_graph_safe(graph_safe)
    state = _device.get_rng_state()
    return state.clone() if clone else state


def set_rng_state(new_state, device: int = -1, graph_safe: bool = False) -> None:
    """megatron's _set_cuda_rng_state, applied to this backend's generator at once."""
    _refuse_graph_safe(graph_safe)
    _device.set_rng_state(new_state)


@contextlib.contextmanager
def fork_on_cpu(self, name="model-parallel-rng"):
    """CudaRNGStatesTracker.fork for CPU, where the tracked generator is the CPU generator itself.

    Megatron's fork warns when the CPU RNG state changes inside the fork, which on CPU is every fork
    that draws a random number. This version keeps the tracker's contract (switch to the named state,
    save it back on exit, restore the outer state, keep ``_current_state_name``) without that check."""
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    outer_name = self._current_state_name
    outer_state = _device.get_rng_state()
    if outer_name != "default-rng":
        self.states_[outer_name] = outer_state
    _device.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(f"current state name {self._current_state_name} is not the same as the "
                            f"desired state name {name}.")
        self.states_[name] = _device.get_rng_state()
        _device.set_rng_state(outer_state if outer_name == "default-rng" else self.states_[outer_name])
        self._current_state_name = outer_name


def register(registry, versions: str) -> None:
    registry.replace(f"{_RANDOM}:_get_cuda_rng_state", get_rng_state, versions=versions,
                     backends=("cpu", "npu"),
                     reason="reads torch.cuda.default_generators, which exist only on CUDA")
    registry.replace(f"{_RANDOM}:_set_cuda_rng_state", set_rng_state, versions=versions,
                     backends=("cpu", "npu"),
                     reason="defers to CUDA lazy init (never runs off CUDA) and CUDA generators")
    registry.replace(f"{_RANDOM}:CudaRNGStatesTracker.fork", fork_on_cpu, versions=versions,
                     backends=("cpu",),
                     reason="on CPU the tracked RNG is the CPU RNG, so the CPU-state check fires always")
