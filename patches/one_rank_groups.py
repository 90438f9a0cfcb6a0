"""Process groups of one rank answered on the calling thread, the registry entry (the mechanism:
``adapter/one_rank_groups.py``)."""

from adapter import one_rank_groups

_STATE = "megatron.core.parallel_state"


def register(registry, versions: str) -> None:
    one_rank_groups.libraries()  # an unknown ADAPTER_ONE_RANK_GROUPS fails at `import adapter`, not in megatron
    registry.wrap(f"{_STATE}:create_group", one_rank_groups.one_rank_groups_answered_here, versions=versions,
                  reason="a one-rank gloo group's collectives change nothing or copy: gloo's worker-thread hand-over "
                         "costs 50 us a call, and its copies there leave libgomp throttling the training thread")
