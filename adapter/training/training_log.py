"""Megatron-LM's iteration log line, TensorBoard scalars, and the model-FLOPs count behind TFLOP/s.

Printed by the last rank (it holds the loss, as in Megatron-LM). Model FLOPs follow the PaLM appendix B
convention: per token, 6 x the matmul parameters (forward 2, backward 4) plus 6 x 2 x layers x seq x
hidden for the attention score and value products; recomputation is not counted (it is hardware
work, not model work), so TFLOP/s here is model-FLOPs utilisation's numerator.
"""

from __future__ import annotations

import time

import torch

from adapter import device


def model_flops_per_token(model, seq_length: int) -> float:
    """Training FLOPs per token of ``model`` (a ModelConfig) at ``seq_length``."""
    h, f, layers = model.hidden_size, model.ffn_hidden_size, model.num_layers
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * model.head_dim * h
    mlp = (3 if model.activation == "swiglu" else 2) * h * f
    matmul_params = layers * (qkv + h * h + mlp) + model.vocab_size * h  # the output layer
    return 6 * matmul_params + 6 * 2 * layers * seq_length * h


def memory_summary() -> str:
    if device.has_accelerator():
        gib = 2**30
        return (f"mem allocated (GiB): {device.memory_allocated() / gib:.2f} | "
                f"max allocated (GiB): {device.max_memory_allocated() / gib:.2f}")
    import psutil

    return f"host RSS (GiB): {psutil.Process().memory_info().rss / 2**30:.2f}"


class TrainingLog:
    """Accumulates losses between log lines and writes the line and the TensorBoard scalars."""

    def __init__(self, args):
        self.args = args
        self.writer = None
        self.is_last_rank = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        if args.tensorboard_dir and self.is_last_rank:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise SystemExit(f"--tensorboard-dir needs the tensorboard package: pip install tensorboard "
                                 f"({exc})") from exc
            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.log_interval)
        self._since = time.perf_counter()
        self._losses: dict[str, list[float]] = {}
        self._skipped = 0
        self._nan = 0
        self.flops_per_iteration = (model_flops_per_token(args.model_config, args.seq_length)
                                    * args.global_batch_size * args.seq_length)

    def excluded(self):
        """A context whose time (evaluation, checkpointing) the next log line's per-iteration time leaves
        out, as Megatron-LM's does."""
        import contextlib

        @contextlib.contextmanager
        def pause():
            start = time.perf_counter()
            try:
                yield
            finally:
                self._since += time.perf_counter() - start

        return pause()

    def add(self, losses: dict, skipped: bool) -> None:
        for name, value in losses.items():
            self._losses.setdefault(name, []).append(value)
            self._nan += int(value != value)
        self._skipped += int(skipped)

    def step(self, iteration: int, consumed: int, lr: float, loss_scale: float, grad_norm) -> dict | None:
        """After each iteration: writes scalars, and every --log-interval the log line."""
        args = self.args
        if self.writer is not None:
            for name, values in self._losses.items():
                self.writer.add_scalar(name, values[-1], iteration)
            self.writer.add_scalar("learning-rate", lr, iteration)
            self.writer.add_scalar("loss-scale", loss_scale, iteration)
            if grad_norm is not None:
                self.writer.add_scalar("grad-norm", grad_norm, iteration)
        if iteration % args.log_interval:
            return None
        elapsed = (time.perf_counter() - self._since) / args.log_interval
        self._since = time.perf_counter()
        tokens_per_s = args.global_batch_size * args.seq_length / elapsed
        tflops = self.flops_per_iteration / elapsed / args.world_size / 1e12
        means = {name: sum(v) / len(v) for name, v in self._losses.items()}
        if self.writer is not None:
            self.writer.add_scalar("throughput-tflops-per-device", tflops, iteration)
            self.writer.add_scalar("tokens-per-second", tokens_per_s, iteration)
        if self.is_last_rank:
            fields = [f"iteration {iteration:8d}/{args.train_iters:8d}", f"consumed samples: {consumed:12d}",
                      f"elapsed time per iteration (ms): {elapsed * 1000:.1f}",
                      f"throughput per device (TFLOP/s): {tflops:.4g}", f"tokens per second: {tokens_per_s:.1f}",
                      f"learning rate: {lr:.6E}", f"global batch size: {args.global_batch_size:5d}"]
            fields += [f"{name}: {value:.6E}" for name, value in means.items()]
            fields += [f"loss scale: {loss_scale:.1f}"]
            if grad_norm is not None:
                fields.append(f"grad norm: {grad_norm:.3f}")
            fields += [f"number of skipped iterations: {self._skipped:3d}",
                       f"number of nan iterations: {self._nan:3d}", memory_summary()]
            print(" " + " | ".join(fields) + " |", flush=True)
        self._losses, self._skipped, self._nan = {}, 0, 0
        return {"iteration": iteration, **means, "tflops": tflops, "tokens_per_second": tokens_per_s}

    def validation(self, iteration: int, losses: dict, label: str = "validation") -> None:
        if self.writer is not None:
            for name, value in losses.items():
                self.writer.add_scalar(f"{name} {label}", value, iteration)
        if self.is_last_rank:
            text = " | ".join(f"{name} value: {value:.6E} | {name} PPL: {_ppl(value):.6E}"
                              for name, value in losses.items())
            line = f" {label} loss at iteration {iteration} | {text} |"
            print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _ppl(loss: float) -> float:
    import math

    return math.exp(min(20.0, loss))
