"""The cost of reading a checkpoint's pickles through the allow-list (adapter/checkpoint_unpickling.py) on a
normal load, against Python's full pickle, side by side in one process.

A torch DCP checkpoint of a synthetic state is written once (no_dist): ``--tensors`` tensors split into
``--chunks`` chunks each, which is what makes ``.metadata`` large (one entry per chunk, as a big model saved
on many ranks has), and ``--items`` non-tensor items shaped like megatron's (an RNG state with a numpy array,
a dict of arguments, optimizer step counts). Two kinds of read, interleaved round by round (the order
alternating, so drift on the machine hits both):

- ``allow-list``: as every load runs with the adapter, ``.metadata`` through ``MetadataUnpickler`` and each item
  through ``torch.load(weights_only=True)``;
- ``full pickle``: the same calls with the checkpoint's directory in ``ADAPTER_TRUSTED_CHECKPOINTS``, which
  takes torch's own readers (``pickle.load``, ``torch.load(weights_only=False)``).

Each kind times reading ``.metadata`` alone and a whole ``torch.distributed.checkpoint.load`` of the state
(tensors and items). Prints the median of each and the ratios (allow-list / full pickle).

Usage: python bench/checkpoint_unpickling.py [--tensors 2000] [--chunks 8] [--items 200] [--rounds 5]
Exits 0 whatever the ratio (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("ADAPTER_BACKEND", "cpu")
import adapter  # noqa: E402,F401 - the patch table
import megatron.core  # noqa: E402,F401 - the globals it registers for its state, as in every load
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

from adapter.checkpoint_unpickling import TRUSTED_ENV  # noqa: E402


def _state(tensors: int, chunks: int, items: int) -> dict:
    """Tensors as ``chunks`` separate entries each (DCP keeps one metadata entry per saved chunk), and
    megatron-like non-tensor items."""
    state = {f"model.layer{i}.weight.chunk{c}": torch.randn(16, 16) for i in range(tensors) for c in range(chunks)}
    rng = np.random.RandomState(0).get_state()
    for i in range(items):
        state[f"item{i}"] = {"rng": {"random": (3, tuple(range(625)), None), "np": rng, "torch": torch.get_rng_state()},
                             "args": {"lr": 1e-3, "seq_length": 4096, "name": f"run{i}"}, "step": i}
    return state


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args) -> dict[str, dict[str, list[float]]]:
    times = {kind: {"metadata": [], "load": []} for kind in ("allow-list", "full pickle")}
    with tempfile.TemporaryDirectory(prefix="unpickling-") as tmp:
        state = _state(args.tensors, args.chunks, args.items)
        dcp.save(state, checkpoint_id=tmp, no_dist=True)
        print(f".metadata {Path(tmp, '.metadata').stat().st_size / 2**20:.1f} MiB, {len(state)} entries", flush=True)
        for round_ in range(args.rounds):
            kinds = ["allow-list", "full pickle"][:: 1 if round_ % 2 == 0 else -1]
            for kind in kinds:
                if kind == "full pickle":
                    os.environ[TRUSTED_ENV] = tmp
                else:
                    os.environ.pop(TRUSTED_ENV, None)
                times[kind]["metadata"].append(_timed(lambda: FileSystemReader(tmp).read_metadata()))
                target = copy.deepcopy(state)  # DCP reads into it: the items' values are replaced, nested as saved
                times[kind]["load"].append(_timed(lambda: dcp.load(target, checkpoint_id=tmp, no_dist=True)))
        os.environ.pop(TRUSTED_ENV, None)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    times = measure(args)
    print(f"load average {os.getloadavg()[0]:.1f}")
    for what in ("metadata", "load"):
        allowed, full = (statistics.median(times[kind][what]) for kind in ("allow-list", "full pickle"))
        print(f"{what:8s}  allow-list {allowed * 1e3:8.1f} ms   full pickle {full * 1e3:8.1f} ms   "
              f"ratio {allowed / full:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
