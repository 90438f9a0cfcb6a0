"""Multi-token prediction (adapter/multi_token_prediction.py): megatron-core 0.16's GPT model computes the MTP
loss from ``labels`` even when there are none, so a forward for logits alone fails (0.17 skips the loss then),
and its checkpoint on a pipeline stage of MTP without the embedding needs a ``metadata`` callers need not pass
(0.17 ties that embedding elsewhere). Later releases need nothing: no entry."""

from packaging.version import Version

from adapter import multi_token_prediction
from adapter.registry import installed_megatron_core_version

_VERSIONS = ">=0.16.1,<0.17"  # 0.17.0: process_mtp_loss returns without labels; GPTModel ties no MTP embedding
_GPT_MODEL = "megatron.core.models.gpt.gpt_model:GPTModel"


def register(registry, versions: str) -> None:
    if Version(installed_megatron_core_version()) >= Version("0.17"):
        return
    registry.wrap(f"{_GPT_MODEL}._postprocess", multi_token_prediction.main_logits_without_labels, versions=_VERSIONS,
                  reason="0.16 clones labels=None for the MTP loss in a logits-only forward: no labels, "
                         "no MTP loss, the main model's logits (as 0.17)")
    registry.wrap(f"{_GPT_MODEL}.sharded_state_dict", multi_token_prediction.metadata_with_dp_cp_group,
                  versions=_VERSIONS,
                  reason="0.16 ties a later stage's MTP embedding copy with metadata['dp_cp_group'] even when no "
                         "metadata is given: megatron's default group, as its modules fill it")
