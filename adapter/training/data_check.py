"""The corpora of ``--data-path`` checked before the first step, on the own flow: ``adapter.corpus_check`` for
each prefix, once, on rank 0 for every rank (the ranks meet in a shared outcome, ``shared_outcome``)."""

from __future__ import annotations

import datetime

import torch

from adapter.corpus_check import check_corpus
from adapter.shared_outcome import shared_outcome


def check_corpora(prefixes: list[str], vocab_size: int, scan_tokens: bool, timeout: datetime.timedelta) -> None:
    """``check_corpus`` for each prefix once, on rank 0 (the first to build the datasets; megatron's builder
    then has the other data-reading ranks open the same files). A refusal reaches every rank out of band
    (``shared_outcome``): each prints the one error line and stops, none is left waiting for rank 0 in a
    collective; rank 0 waits up to ``timeout`` for them to have read it. The others wait in a barrier
    meanwhile, so the process group's timeout (--distributed-timeout-minutes) must cover rank 0's pass over
    the data. Without a process group (the provider called on its own) this process checks."""
    def check_each():
        for prefix in dict.fromkeys(prefixes):
            check_corpus(prefix, vocab_size, scan_tokens)

    if not torch.distributed.is_initialized():
        check_each()
        return
    with shared_outcome("checking --data-path", timeout):
        if torch.distributed.get_rank() == 0:
            check_each()
