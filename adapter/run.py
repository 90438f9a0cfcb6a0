"""``python -m adapter.run SCRIPT.py [ARGS]``: run a script, such as Megatron-LM's own pretrain_gpt.py
unchanged, with the adapter imported first in its process and in every Python process it starts.

    PYTHONPATH=/path/to/Megatron-LM torchrun --nproc-per-node 4 -m adapter.run \\
        /path/to/Megatron-LM/pretrain_gpt.py <Megatron-LM arguments>

In order:
1. megatron.training must be importable: megatron-core 0.17+ wheels ship it; with 0.16.1 it comes from a
   Megatron-LM checkout at tag core_v0.16.1 on PYTHONPATH.
2. ``megatron.core`` comes from the installed megatron-core distribution when there is one (see
   adapter.core_source for why). megatron.training and megatron.legacy come from a checkout on PYTHONPATH
   when there is one, whose megatron/core must then be the same version: it is what its megatron.training
   was written against; without one, from the wheel (0.17+: megatron.training, no megatron.legacy).
   Without the distribution, the checkout's megatron.core is used.
3. ``adapter/_spawn_hook`` goes first on PYTHONPATH: its sitecustomize.py does the above in every Python
   process started from here on, before that process's main module runs. multiprocessing 'spawn' children
   (megatron's persistent async checkpoint worker) re-import the entry script, which imports megatron.
4. The script runs as ``__main__``, its directory first on sys.path, as ``python SCRIPT.py`` would, with its
   own CUDA spellings routed as megatron's are (``run_routed``).

Problems found before the script starts are one line on stderr: exit status 2 for a missing script, 1
for the environment (no megatron.training, a checkout whose megatron-core is not the installed one).

A feature the script turns on that needs a CUDA library this backend lacks (``--fp8-format``,
``--tp-comm-overlap``, ``--moe-token-dispatcher-type flex``, ``--cuda-graph-impl``, ``--use-nccl-ub``,
``--symmetric-ar-type``: adapter.cuda_only_features) is refused where megatron is given it, in Megatron-LM's
``validate_args``, before any group or model exists. Every rank raises the same ``CudaOnlyFeatureError``;
``run_refusing`` turns it into one line for the job (rank 0's) and exit status 2 on every rank, as a refused
argument is. The exception is caught here, at the top of the script's run, rather than printed and exited
inside the patch: megatron's code between the patch and here (its own ``try`` blocks) is left as it is, and a
refusal raised later (a config or a constructor of a refused feature) ends the same way, as does bad input
to megatron.training (a failed check of its ``validate_args``, a missing or out-of-vocabulary corpus:
``adapter.input_refusals``).
"""

from __future__ import annotations

import ast
import builtins
import importlib.metadata
import importlib.util
import os
import site
import types
import sys
import time
from pathlib import Path

import adapter  # the backend and the patch table, before anything imports megatron
from adapter.core_source import (CHECKOUT, installed_megatron_core, megatron_lm_checkout, megatron_training,
                                 prefer_installed_megatron_core)
from adapter import checkpoint_unpickling
from adapter.cuda_only_features import RefusedSetting
from adapter.shared_outcome import StepFailed

HOOK_DIR = Path(__file__).resolve().parent / "_spawn_hook"
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # where ``import adapter`` finds the adapter
# only megatron-core 0.16's wheel lacks megatron.training (0.17+ ships it)
NO_MEGATRON_TRAINING = ("megatron.training is not importable: put a Megatron-LM checkout at tag core_v0.16.1 "
                        "on PYTHONPATH (git clone --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM), "
                        "or install a megatron-core 0.17+ wheel, which ships it")


class LaunchError(Exception):
    """Why the script cannot be started; ``status`` is the exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def _package_version(package_info: Path) -> str:
    spec = importlib.util.spec_from_file_location("_megatron_lm_package_info", package_info)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.__version__


def check_megatron_lm() -> None:
    """megatron.training importable; a checkout's megatron/core the installed megatron-core's version (the
    wheel's megatron.training, 0.17+, is its own release's)."""
    training = megatron_training()
    if training is None:
        raise LaunchError(NO_MEGATRON_TRAINING)
    if training.origin != CHECKOUT:
        return
    checkout = megatron_lm_checkout()
    package_info = checkout / "megatron" / "core" / "package_info.py"
    core = installed_megatron_core()
    if core is None or not package_info.is_file() or package_info.parent == core:
        return
    installed, checked_out = importlib.metadata.version("megatron-core"), _package_version(package_info)
    if installed != checked_out:
        raise LaunchError(
            f"megatron-core {installed} is installed, but the Megatron-LM checkout at {checkout} is "
            f"megatron-core {checked_out} ({package_info}): check out the Megatron-LM tag core_v{installed} "
            f"(git -C {checkout} checkout core_v{installed})")


def hook_children() -> None:
    """PYTHONPATH for every process started from here: the hook first; the adapter's own directory last
    when it is not a site directory (a source checkout, where only the cwd made it importable)."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(HOOK_DIR)]
    parts.insert(0, str(HOOK_DIR))
    site_dirs = {*site.getsitepackages(), site.getusersitepackages()}
    if str(_PACKAGE_ROOT) not in parts and str(_PACKAGE_ROOT) not in site_dirs:
        parts.append(str(_PACKAGE_ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not argv or argv[0].startswith("-"):
            raise LaunchError("usage: python -m adapter.run SCRIPT.py [script arguments]", status=2)
        script = Path(argv[0]).resolve()
        if not script.is_file():
            raise LaunchError(f"no such script: {argv[0]}", status=2)
        check_megatron_lm()
    except LaunchError as exc:
        print(f"adapter.run: error: {exc}", file=sys.stderr)
        return exc.status
    prefer_installed_megatron_core()
    hook_children()
    sys.argv = [str(script), *argv[1:]]
    sys.path[0] = str(script.parent)
    return run_refusing(script)


REFUSED = 2  # a refused argument's exit status (argparse's)


def run_refusing(script: Path) -> int:
    """``run_routed(script)``, its refusals and failed saves as ``run_guarded`` ends them."""
    return run_guarded(run_routed, script)


def run_guarded(train, *args) -> int:
    """``train(*args)``'s exit status: a refusal (module doc) is one line, from rank 0, and ``REFUSED`` on
    every rank; a failed save is its one line and 1. The project's own entry point ends the same way."""
    try:
        train(*args)
    except StepFailed as exc:  # a save that failed on this rank; the others stop with its line (shared_outcome)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except BaseException as caught:  # noqa: BLE001 - torch DCP gathers a rank's refusal into a BaseException
        exc = caught if isinstance(caught, RefusedSetting) else checkpoint_unpickling.untrusted_in(caught)
        if exc is None:
            raise
        rank_0 = os.environ.get("RANK", "0") == "0"
        if rank_0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        _leave_groups()
        if not rank_0 and _left_standing_by_rank_0():
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return REFUSED
    return 0


RANK_0_GRACE_S = 60.0


def _left_standing_by_rank_0() -> bool:
    """Whether a refused rank other than 0 says the job's line. Under torchrun the first worker to exit
    non-zero has the others SIGTERMed, so a rank that left before rank 0 printed could end the job without
    its line (seen on a loaded machine: exit status 2, no line). Such a rank waits for the SIGTERM that rank
    0's exit brings, up to ``RANK_0_GRACE_S``, and says the line itself if still here (rank 0 was not
    refused, or waits on this rank). Without torchrun no one ends the others: rank 0 says it."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    time.sleep(RANK_0_GRACE_S)
    return True


def _leave_groups() -> None:
    """Destroy the process groups where a refusal came after they were made (local to this rank): an
    interpreter that exits holding gloo groups can die in their threads' destructors."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either order of the comparison)."""
    test = getattr(node, "test", None)
    if not isinstance(node, ast.If) or not isinstance(test, ast.Compare) or len(test.comparators) != 1:
        return False
    sides = [test.left, test.comparators[0]]
    return isinstance(test.ops[0], ast.Eq) and {ast.unparse(side) for side in sides} == {"__name__", "'__main__'"}


def run_routed(script: Path) -> None:
    """Run ``script`` as ``__main__`` with its own CUDA spellings routed as megatron's are: its definitions
    first (the body without its ``if __name__ == "__main__":`` blocks), then the script routed like a
    module of a package given to ``adapter.route_cuda`` (torch, torch.cuda, ``.cuda()`` in its functions),
    then those blocks. Megatron-LM 0.19's pretrain_gpt.py moves its batch with ``.cuda()`` in its own
    ``get_batch``; routing after the whole script had run would be too late (its main block trains)."""
    tree = ast.parse(script.read_text(), str(script))
    guards = [node for node in tree.body if _is_main_guard(node)]
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=str(script), __builtins__=builtins, __spec__=None, __loader__=None)
    sys.modules["__main__"] = module
    definitions = ast.Module([node for node in tree.body if node not in guards], type_ignores=[])
    exec(compile(definitions, str(script), "exec"), module.__dict__)  # noqa: S102 - the user's script
    adapter.route_cuda("__main__")
    exec(compile(ast.Module(guards, type_ignores=[]), str(script), "exec"), module.__dict__)  # noqa: S102


if __name__ == "__main__":
    sys.exit(main())
