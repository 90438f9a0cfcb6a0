"""Megatron-LM's iteration log line, TensorBoard scalars, and the model-FLOPs count behind TFLOP/s.

Printed by the last rank (it holds the loss, as in Megatron-LM). Model FLOPs follow the PaLM appendix B
convention: per token, 6 x the matmul parameters (forward 2, backward 4) plus 6 x 2 x layers x seq x
heads x head size for the attention score and value products (PaLM's 12LHQT). Heads x head size, the
attention width, is the hidden size unless the head size is set apart (Qwen3's 128): then the score and
value products and the output projection's input are that width, not the hidden size. Recomputation is not
counted (it is hardware work, not model work), so TFLOP/s here is model-FLOPs utilisation's numerator. A
MoE layer's matmul parameters are those a token passes through: its top-k routed experts and the shared
expert (the router's small GEMM left out, as Megatron-LM's count leaves it).

A MoE model's line and TensorBoard also carry its router losses and each MoE layer's expert load
(``ExpertMetrics``).
"""

from __future__ import annotations

import time

import torch
from megatron.core.transformer.moe.moe_utils import track_moe_metrics
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from adapter import device, startup_clock
from adapter.expert_load import ExpertLoad
from models.config import FULL_ATTENTION


def model_flops_per_token(model, seq_length: int) -> float:
    """Training FLOPs per token of ``model`` (a ModelConfig) at ``seq_length``: 6 x the matmul parameters a
    token passes through, plus each attention layer's scores and weighted sum over the whole sequence
    (12 x seq x width, s x s not halved for causality), plus each Gated DeltaNet layer's state work (per value
    head the decay-and-correct update, the error and the readout, 2 dk dv FLOPs each, x 3 for training).
    Multi-latent attention: its projections, and scores over the query/key head, the weighted sum over the value
    head; each MTP layer: one more layer like the last, its 2h -> h projection and its own logits (as
    Megatron-LM counts them)."""
    h, width = model.hidden_size, model.num_attention_heads * model.head_dim
    attention, scores = model.qkv_rows * h + width * h, 2 * width
    if model.multi_latent_attention:
        attention = model.latent_attention_parameters()
        scores = model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim)
    gdn_proj = model.gated_delta_net_parameters() - model.linear_value_head_dim  # no norm weight
    gdn_state = 3 * 3 * 2 * model.linear_key_head_dim * model.linear_value_head_dim * model.linear_num_value_heads

    def mlp(ffn: int | None) -> int:
        return (3 if model.activation == "swiglu" else 2) * h * ffn if ffn else 0

    moe = model.moe_router_topk * mlp(model.expert_ffn_hidden_size) + mlp(model.moe_shared_expert_intermediate_size)
    mlps = sum(moe if is_moe else mlp(model.ffn_hidden_size) for is_moe in model.moe_layer_pattern())
    full = sum(mixer == FULL_ATTENTION for mixer in model.mixers())
    linear = model.num_layers - full
    matmul_params = full * attention + linear * gdn_proj + mlps + model.vocab_size * h  # with the output layer
    mtp = model.mtp_num_layers or 0
    last_mlp = moe if model.moe_layer_pattern()[-1] else mlp(model.ffn_hidden_size)
    matmul_params += mtp * (attention + last_mlp + 2 * h * h + model.vocab_size * h)
    return 6 * matmul_params + 6 * (full + mtp) * seq_length * scores + linear * gdn_state


def aux_loss_names(args) -> list[str]:
    """The router losses megatron's tracker holds for these arguments, under Megatron-LM's names."""
    types = args.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    names = [{"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}[t] for t in types if t != "none"]
    return names + (["z_loss"] if args.moe_z_loss_coeff is not None else [])


class ExpertMetrics:
    """A MoE model's router losses and expert load, for the iteration line and TensorBoard.

    Router losses as Megatron-LM's ``training_log`` has them: megatron's routers record each layer's
    load-balancing and z losses in moe_utils' tracker during training forwards; every iteration, on every
    rank (it reduces over the pipeline and data-parallel groups), ``track_moe_metrics`` writes the mean over
    the MoE layers to TensorBoard (each layer too with --moe-per-layer-logging) and adds it to the totals the
    line averages over its iterations.

    Expert load, which megatron-core does not log: adapter/expert_load.py's count, summed over all ranks at
    each log line and shown on the line."""

    def __init__(self, args, model: list):
        config = args.model_config
        self.args = args
        self.names = aux_loss_names(args)
        # megatron's index of each MoE layer (a hybrid model's MoE blocks are layers of their own) -> the model's
        self.moe_layers = config.megatron_moe_layers()
        # megatron's aux-loss tracker reads the MoE layers as one 0/1 per megatron layer
        self.moe_layer_freq = [int(i in self.moe_layers) for i in range(config.megatron_num_layers)]
        self.totals: dict[str, torch.Tensor] = {}
        self.iterations = 0
        # megatron's tracker holds the MTP layers' router losses after the decoder's (MoE layers like the last)
        self.mtp = {"mtp_num_layers": config.mtp_num_layers} if config.mtp_num_layers else {}
        self.load = ExpertLoad(config.megatron_num_layers, config.num_experts, model)

    def track(self, iteration: int, writer) -> None:
        """After each training iteration, on every rank."""
        self.iterations += 1
        track_moe_metrics(
            loss_scale=1 / self.args.num_micro_batches, iteration=iteration, writer=writer,
            total_loss_dict=self.totals, per_layer_logging=self.args.moe_per_layer_logging, force_initialize=True,
            track_names=self.names, num_layers=len(self.moe_layer_freq), moe_layer_freq=self.moe_layer_freq,
            **self.mtp)

    def log(self, iteration: int, writer) -> tuple[list[str], dict]:
        """At a log line, on every rank (the load is summed over all): the line's fields and the logged
        values (router losses averaged over the iterations since the last line, each MoE layer's load)."""
        load = self.load.summary(self.moe_layers)  # the model's layer numbers, as the log shows them
        logged = {name: (total / self.iterations).item() for name, total in self.totals.items()}
        self.totals, self.iterations = {}, 0
        if writer is not None:
            load.write(writer, iteration, self.args.moe_per_layer_logging)
        fields = [f"{name}: {value:.6E}" for name, value in logged.items()] + [load.field()]
        return fields, {**logged, "expert load": dict(zip(load.layers, load.load))}


class StartupClock:
    """Where a launch's time goes before training runs: from the process's start (what the OS recorded, so
    the interpreter's and the imports' time counts) through each named phase to the end of the first
    iteration, printed once as one line by the rank that prints the log.

    The time a launcher takes before it starts this process (torchrun's own imports) is not counted."""

    def __init__(self):
        self._last = startup_clock.process_start()
        self._phases = {"imports": time.time() - self._last}
        self._last += self._phases["imports"]

    def mark(self, phase: str) -> None:
        """The phase that ends now."""
        now = time.time()
        self._phases[phase] = self._phases.get(phase, 0.0) + now - self._last
        self._last = now

    def phases(self) -> dict[str, float]:
        return {**self._phases, "total": sum(self._phases.values())}

    def line(self) -> str:
        return f" {startup_clock.line(self._phases)}"


def memory_summary() -> str:
    if device.has_accelerator():
        gib = 2**30
        return (f"mem allocated (GiB): {device.memory_allocated() / gib:.2f} | "
                f"max allocated (GiB): {device.max_memory_allocated() / gib:.2f}")
    import psutil

    return f"host RSS (GiB): {psutil.Process().memory_info().rss / 2**30:.2f}"


class TrainingLog:
    """Accumulates losses between log lines and writes the line and the TensorBoard scalars."""

    def __init__(self, args, model: list | None = None):
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
        self._losses: dict[str, list[torch.Tensor]] = {}
        self._pending: list[tuple[int, dict]] = []  # TensorBoard scalars not yet written
        self._skipped = 0
        self._nan = 0
        self.flops_per_iteration = (model_flops_per_token(args.model_config, args.seq_length)
                                    * args.global_batch_size * args.seq_length)
        self.experts = (ExpertMetrics(args, model) if model is not None and args.model_config.num_experts is not None
                        else None)
        # megatron's MTP losses ("mtp_1 loss", ...) summed over the iterations since the last line, as
        # Megatron-LM's training_log has them; None without MTP layers
        self._mtp: dict[str, torch.Tensor] | None = {} if args.model_config.mtp_num_layers else None
        self._mtp_iterations = 0

    def started(self, clock: StartupClock) -> dict[str, float]:
        """After the first iteration: the launch's phases, printed by the rank that prints the log."""
        if self.is_last_rank:
            print(clock.line(), flush=True)
        return clock.phases()

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
        """An iteration's losses, as device tensors: read on the host at log lines only, so iterations
        between them queue on the device without waiting for it."""
        for name, value in losses.items():
            self._losses.setdefault(name, []).append(value)
        self._skipped += int(skipped)

    def _scalars(self, iteration: int, lr: float, loss_scale, grad_norm) -> None:
        """This iteration's TensorBoard scalars, kept until the log line writes them (with their
        iterations): writing a device tensor would wait for the device every iteration."""
        if self.writer is None:
            return
        scalars = {name: values[-1] for name, values in self._losses.items()}
        scalars.update({"learning-rate": lr, "loss-scale": loss_scale})
        if grad_norm is not None:
            scalars["grad-norm"] = grad_norm
        self._pending.append((iteration, scalars))

    def _write_pending(self) -> None:
        for iteration, scalars in self._pending:
            for name, value in scalars.items():
                self.writer.add_scalar(name, float(value), iteration)
        self._pending = []

    def _loss_means(self) -> dict[str, float]:
        """Each loss's mean over the iterations since the last line (one host read), counting the NaN ones."""
        if not self._losses:
            return {}
        names = list(self._losses)
        values = torch.stack([torch.stack(self._losses[name]).float() for name in names]).cpu()
        self._nan += int(values.isnan().any(dim=0).sum())
        return dict(zip(names, values.mean(dim=1).tolist()))

    def _mtp_means(self) -> dict[str, float]:
        """Each MTP layer's loss, the mean over the iterations since the last line (last stage only)."""
        if not self._mtp:
            return {}
        means = {name: total.item() / self._mtp_iterations for name, total in self._mtp.items()}
        self._mtp, self._mtp_iterations = {}, 0
        return means

    def step(self, iteration: int, consumed: int, lr: float, loss_scale, grad_norm) -> dict | None:
        """After each iteration: keeps the scalars, and every --log-interval writes them and the log line."""
        args = self.args
        self._scalars(iteration, lr, loss_scale, grad_norm)
        if self.experts is not None:
            self.experts.track(iteration, self.writer)
        if self._mtp is not None:  # on every rank: it reduces over the data-parallel ranks of the last stage
            MTPLossLoggingHelper.track_mtp_metrics(1 / args.num_micro_batches, iteration, self.writer, None, self._mtp)
            self._mtp_iterations += 1
        if iteration % args.log_interval:
            return None
        if self.writer is not None:
            self._write_pending()
        loss_scale = float(loss_scale)
        expert_fields, expert_values = (self.experts.log(iteration, self.writer)
                                        if self.experts is not None else ([], {}))
        means = {**self._loss_means(), **self._mtp_means()}
        device.synchronize()  # the iterations' work may still be queued: time it done
        elapsed = (time.perf_counter() - self._since) / args.log_interval
        self._since = time.perf_counter()
        tokens_per_s = args.global_batch_size * args.seq_length / elapsed
        tflops = self.flops_per_iteration / elapsed / args.world_size / 1e12
        if self.writer is not None:
            self.writer.add_scalar("throughput-tflops-per-device", tflops, iteration)
            self.writer.add_scalar("tokens-per-second", tokens_per_s, iteration)
        if self.is_last_rank:
            fields = [f"iteration {iteration:8d}/{args.train_iters:8d}", f"consumed samples: {consumed:12d}",
                      f"elapsed time per iteration (ms): {elapsed * 1000:.1f}",
                      f"throughput per device (TFLOP/s): {tflops:.4g}", f"tokens per second: {tokens_per_s:.1f}",
                      f"learning rate: {lr:.6E}", f"global batch size: {args.global_batch_size:5d}"]
            fields += [f"{name}: {value:.6E}" for name, value in means.items()]
            fields += expert_fields + [f"loss scale: {loss_scale:.1f}"]
            if grad_norm is not None:
                fields.append(f"grad norm: {grad_norm:.3f}")
            fields += [f"number of skipped iterations: {self._skipped:3d}",
                       f"number of nan iterations: {self._nan:3d}", memory_summary()]
            print(" " + " | ".join(fields) + " |", flush=True)
        self._losses, self._skipped, self._nan = {}, 0, 0
        return {"iteration": iteration, **means, **expert_values, "tflops": tflops,
                "tokens_per_second": tokens_per_s}

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
