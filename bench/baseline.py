"""An earlier revision of this repository, checked out beside it, for benchmarks that compare the working
tree with it side by side in one run (``--baseline REV``): the children of both take turns, so drift on
the machine hits both alike."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def worktree(rev: str):
    """A detached git worktree of ``rev`` in a temporary folder, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="bench-baseline-")) / "tree"
    done = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), rev],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--baseline {rev}: git worktree add failed: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)],
                       capture_output=True)


def pythonpath(root: Path, env: dict) -> str:
    """PYTHONPATH for a run of the tree at ``root``: its packages first, then ``env``'s own (a Megatron-LM
    checkout, which megatron-core 0.16.1 needs)."""
    return os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
