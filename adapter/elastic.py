"""Restarts under torchrun (``--max-restarts``): a store of this generation's own.

torchrun's elastic agent hosts the store the ranks meet in (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's
default since 2.4) and keeps it, with every key in it, across restarts: the rendezvous round changes, the
workers' store does not. Process groups publish their members' addresses there under names that are the same
in every generation (``default_pg``'s, then one per ``new_group`` in creation order), so the ranks of a restart
read the addresses the dead generation left, and gloo's ``connectFullMesh`` (NCCL's unique-id exchange alike)
connects to processes that are gone: ``Connection refused``, every restart, until the restarts run out.

So each generation works under a prefix of its own, agreed through the store without trusting anything a
past generation left in it: rank 0 draws the next generation number (an atomic add, never reused); every
other rank posts a fresh random nonce and waits for rank 0 to answer that nonce with the prefix. An answer
can only come from the rank 0 that read this process's nonce, and the only rank 0 alive is this generation's
(torchrun stops every worker of a generation before the next one starts). TORCHELASTIC_RESTART_COUNT is no
substitute: an agent whose own workers stayed healthy restarts them without counting a restart, so on several
nodes the counts differ.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import torch

_GENERATIONS = "adapter/generations"
_POLL = 0.02  # seconds between rank 0's looks at the ranks still to answer


def shares_agent_store() -> bool:
    """Whether this process was started by torchrun's agent with the agent's store, which outlives it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def generation_store(timeout: datetime.timedelta):
    """(store, rank, world size) from torchrun's environment, the store prefixed for this generation alone."""
    store, rank, world_size = next(torch.distributed.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    prefix = _lead(store, world_size, deadline) if rank == 0 else _follow(store, rank, timeout)
    return torch.distributed.PrefixStore(prefix, store), rank, world_size


def _follow(store, rank: int, timeout: datetime.timedelta) -> str:
    nonce = uuid.uuid4().hex
    store.set(f"adapter/join/{rank}", nonce)
    answer = f"adapter/welcome/{rank}/{nonce}"
    store.wait([answer], timeout)
    prefix = store.get(answer).decode()
    store.set(f"{prefix}joined/{rank}", "1")
    return prefix


def _lead(store, world_size: int, deadline: float) -> str:
    """Rank 0: draw the generation's prefix and answer each rank's current nonce until every rank has
    taken it (a nonce read before its rank posted a fresh one is a dead rank's, answered in vain)."""
    prefix = f"adapter/generation{store.add(_GENERATIONS, 1)}/"
    waiting = set(range(1, world_size))
    while waiting:
        for rank in sorted(waiting):
            if store.check([f"{prefix}joined/{rank}"]):
                waiting.discard(rank)
            elif store.check([f"adapter/join/{rank}"]):
                store.set(f"adapter/welcome/{rank}/{store.get(f'adapter/join/{rank}').decode()}", prefix)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(waiting)} did not join this generation's process group within "
                               f"the timeout ({prefix.rstrip('/')} of the torchrun store at "
                               f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')})")
        if waiting:
            time.sleep(_POLL)
    return prefix
