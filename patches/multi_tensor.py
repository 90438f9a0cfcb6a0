"""megatron's stand-ins for apex's multi-tensor kernels, as torch ``_foreach`` ops.

Without apex or Transformer Engine (every CPU run; NPU and CUDA runs without them) megatron's gradient
clipping falls back to ``megatron.core.utils``' local versions: a Python loop that allocates a scaled
copy of every gradient, and an l2 norm that turns every per-tensor norm into a Python float (a device
sync each) before summing. These do the same arithmetic in a few foreach calls, in place. Replacing the
functions in ``megatron.core.utils`` also rebinds the by-value copies ``clip_grads`` and ``optimizer``
took at import, and only those: apex's kernels, where installed, are different objects and stay.
"""

import torch

_UTILS = "megatron.core.utils"


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``dst = src * scale`` for each pair of ``tensor_lists = [srcs, dsts]``."""
    srcs, dsts = tensor_lists
    if all(s is d for s, d in zip(srcs, dsts)):
        torch._foreach_mul_(dsts, scale)
    else:
        torch._foreach_copy_(dsts, torch._foreach_mul(srcs, scale))


def multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The l2 norm over every tensor of ``tensor_lists`` as a float32 tensor of shape [1] on their device
    (megatron's local version returns no per-tensor norms either)."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack(norms).float()) if norms else torch.zeros(())
    return total.reshape(1), None


def register(registry, versions: str) -> None:
    registry.replace(f"{_UTILS}:local_multi_tensor_scale", multi_tensor_scale, versions=versions,
                     reason="gradient clipping scales grads in place with one foreach op, not a copy each")
    registry.replace(f"{_UTILS}:local_multi_tensor_l2_norm", multi_tensor_l2_norm, versions=versions,
                     reason="the grad norm is one foreach norm, not a device sync per gradient")
