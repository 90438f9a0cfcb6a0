"""Multi-token prediction on megatron-core 0.16: logits without labels, and the checkpoint of an MTP layer on a
later pipeline stage than the embedding.

``GPTModel._postprocess`` of 0.16 runs the MTP layers, then clones ``labels`` for their loss whether or not
there are labels: a forward for logits alone (``models.verify``, a conversion check, generation) raises
``AttributeError: 'NoneType' object has no attribute 'clone'``. 0.17's ``process_mtp_loss`` answers that case:
no labels, no MTP loss; the main model's hidden states (the first of the chunks the MTP block concatenates) go
on to the output layer. This wrapper gives 0.16 that answer, running the MTP layers as 0.17 does (forward hooks
on them still see their outputs).

``GPTModel.sharded_state_dict`` of 0.16, on a pipeline stage that holds the MTP layers but not the embedding
(PP > 1), ties that stage's embedding copy with ``metadata['dp_cp_group']``; megatron's ``MegatronModule`` fills
a missing ``metadata`` for itself only, so a call without it (dist_checkpointing's usual ``sharded_state_dict()``)
raises ``TypeError: 'NoneType' object is not subscriptable``. 0.17 ties it elsewhere. The wrapper fills
``metadata`` the way megatron's own ``ensure_metadata_has_dp_cp_group`` does.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch


def main_logits_without_labels(postprocess):
    """``GPTModel._postprocess`` that, without labels, skips the MTP loss and returns the main model's logits."""
    signature = inspect.signature(postprocess)

    @functools.wraps(postprocess)
    def _postprocess(self, *args, **kwargs):
        config = self.config
        if (config.mtp_num_layers is None or not self.post_process or not getattr(self, "mtp_process", False)
                or signature.bind(self, *args, **kwargs).arguments.get("labels") is not None):
            return postprocess(self, *args, **kwargs)
        chunks = 1 + config.mtp_num_layers
        handle = self.mtp.register_forward_hook(
            lambda module, inputs, hidden_states: torch.chunk(hidden_states, chunks, dim=0)[0])
        self.config = copy.copy(config)  # this model's view only: the MTP block keeps its own config
        self.config.mtp_num_layers = None  # no MTP loss to compute
        try:
            return postprocess(self, *args, **kwargs)
        finally:
            self.config = config
            handle.remove()

    return _postprocess


def metadata_with_dp_cp_group(sharded_state_dict):
    """``GPTModel.sharded_state_dict`` with its ``metadata`` holding ``dp_cp_group`` (megatron's default group)
    when the caller gave none."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    @functools.wraps(sharded_state_dict)
    def _sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return sharded_state_dict(self, prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))

    return _sharded_state_dict
