"""Vocab-parallel cross entropy in one autograd function, on any device and process-group backend.

Stands in for megatron's ``fused_vocab_parallel_cross_entropy`` (``cross_entropy_loss_fusion``), whose
torch.compile'd kernels need a working compiler tool chain on the host. Each tensor-parallel rank holds the
logits of its vocabulary slice; the loss needs the global max, the global sum of exponentials and the
target's logit, which one MAX and one SUM all-reduce provide. Backward is softmax minus one-hot, scaled by
the incoming gradient, computed from the saved softmax in float32. On one tensor-parallel rank torch's own
cross entropy does the same, faster.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group):
        vocab_local = logits.shape[-1]
        distributed = tp_group is not None and tp_group.size() > 1
        rank = tp_group.rank() if distributed else 0

        logits32 = logits.float()
        row_max = logits32.amax(dim=-1)  # max(dim) would find the indices too
        if distributed:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        if logits32 is logits:  # float32 input: never write into the caller's logits
            shifted = logits32 - row_max.unsqueeze(-1)
        else:  # the float32 copy is ours: one [s, b, vocab] buffer serves every step below
            shifted = logits32.sub_(row_max.unsqueeze(-1))

        local_target = target - rank * vocab_local
        elsewhere = (local_target < 0) | (local_target >= vocab_local)
        local_target = local_target.masked_fill(elsewhere, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)

        exp = shifted.exp_()
        sums = torch.stack((exp.sum(dim=-1), target_logit))
        if distributed:
            dist.all_reduce(sums, group=tp_group)
        sum_exp, target_logit = sums
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, elsewhere)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, elsewhere = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (elsewhere.float() - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
    """Per-token loss [s, b] (float32) from this rank's logits [s, b, vocab / tp] and global targets. On one
    tensor-parallel rank, torch's own cross entropy over the float32 logits: the same loss, and on the CPU
    0.7 of the time of the function above (whose softmax and loss are separate passes) forward and backward."""
    if tp_group is None or tp_group.size() == 1:
        return F.cross_entropy(vocab_parallel_logits.float().flatten(0, -2), target.flatten(),
                               reduction="none").view_as(target)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group)
