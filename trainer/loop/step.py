"""One optimizer step: k micro-batches forward and backward, the sync, the optimizer; each phase timed.

Kept apart from the loop (trainer.py) because this is the hot path: everything here runs every
step, so everything here is counted in µs (docs/performance.md). What is due between steps (rows,
checks, evaluation, checkpoints) belongs to the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from trainer.core import DistContext, TrainSettings
from trainer.loop.metrics import Window
from trainer.loop.timing import StepTimer
from trainer.sync.base import SyncStrategy

log = logging.getLogger(__name__)


def autocast_for(precision: str, device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    """The context each forward runs in: bf16 or fp16 autocast, or for fp32 nothing at all.

    fp32 skips autocast entirely: a disabled autocast still saves and restores torch's autocast
    state on every entry, work that buys nothing in fp32 and is paid every micro-batch.
    """
    if precision == "fp32":
        return nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler_for(precision: str, device: torch.device, sharded: bool) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (None otherwise). Its scale must stay the same on every rank, so the
    overflow it finds must be every rank's: with replicated gradients each rank finds the same;
    with sharded ones (zero, fsdp) each rank sees only its shard, and torch's ShardedGradScaler
    all-reduces what unscale_ found before the scale is updated."""
    if precision != "fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # fp16 only: not on every run

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type)


class StepRunner:
    """Runs optimizer steps on the objects the Trainer owns, noting the loss and timing each phase."""

    def __init__(
        self,
        *,
        settings: TrainSettings,
        ctx: DistContext,
        model: nn.Module,
        train_model: nn.Module,
        empty_inputs: torch.Tensor,
        sync: SyncStrategy,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        timer: StepTimer,
        window: Window,
    ) -> None:
        self.settings, self.ctx, self.model, self.train_model, self.sync = settings, ctx, model, train_model, sync
        self.empty_inputs = empty_inputs  # a batch of 0 samples, for backward_without_data()
        self.optimizer, self.scheduler, self.timer, self.window = optimizer, scheduler, timer, window
        self.autocast = autocast_for(settings.precision, ctx.device)
        self.scaler = grad_scaler_for(settings.precision, ctx.device, sync.grads_sharded)
        self.overflow_steps = 0  # fp16: steps skipped because the scaled gradients overflowed
        self.lr = optimizer.param_groups[0]["lr"]  # the rate the last step used
        self.skipped_steps = 0  # on_nonfinite=skip

    def run(self, batches: Iterator[Any], step: int, logged: bool = False) -> None:
        """Optimizer step number `step` (1-based) on the next grad_accum_steps batches: the
        tutorial's step (forward, backward, the sync, the clip, the optimizer), each phase timed.
        `logged`: a row follows this step and reports its gradient norm (computed only then,
        unless trainer.max_grad_norm clips every step)."""
        k, timer, window = self.settings.grad_accum_steps, self.timer, self.window
        timer.start()
        for i in range(k):
            # Only the last micro-batch may communicate; the others accumulate gradients locally.
            with self.sync.no_sync(self.train_model) if i < k - 1 else nullcontext():
                batch = next(batches)
                if batch is None:  # this rank's share of the epoch is used up (data.drop_last=false)
                    timer.mark("data")
                    self.backward_without_data()
                    timer.mark("backward")
                    continue
                inputs = batch[0].to(self.ctx.device, non_blocking=True)
                targets = batch[1].to(self.ctx.device, non_blocking=True)
                timer.mark("data")
                loss, logits = self.forward(inputs, targets, step)
                window.add(loss, logits, targets, step)
                timer.mark("forward")
                (loss if self.scaler is None else self.scaler.scale(loss)).backward()
                timer.mark("backward")
        self.sync.after_backward(self.train_model)
        timer.mark("sync")
        self.lr = self.optimizer.param_groups[0]["lr"]
        max_norm, scaler = self.settings.max_grad_norm, self.scaler
        if scaler is not None:  # fp16: the true gradients first, and every step's norm says whether they overflowed
            scaler.unscale_(self.optimizer)
        norm = self.sync.grad_norm(self.optimizer) if max_norm is not None or logged or scaler else None
        checked = scaler is not None or self.settings.on_nonfinite == "skip"
        finite = self._finite(norm) if checked else True  # one host read, the same answer on every rank
        if norm is not None and (finite or scaler is None):
            window.add_grad_norm(norm, step)
        if not finite and scaler is not None:  # an overflow: the scaler lowers its scale below
            self.overflow_steps += 1
        elif not finite:  # trainer.on_nonfinite=skip
            # Gradients are averaged by now (and a norm is global), so every rank skips this same
            # step: the replicas stay equal.
            self.skipped_steps += 1
            log.warning("step %d: non-finite gradients, optimizer step skipped (trainer.on_nonfinite=skip)", step)
        else:
            if max_norm is not None:  # clip the averaged gradient by its global norm, as one process would
                assert norm is not None
                self.sync.scale_grads(self.optimizer, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
            self.sync.optimizer_step(self.optimizer)
        if scaler is not None:
            scaler.update()  # from what unscale_ found: the same on every rank
        self.scheduler.step()
        self.sync.zero_grad(self.optimizer)
        timer.mark("optimizer")
        window.num_steps += 1
        timer.stop()

    def scale(self) -> torch.Tensor | None:
        """fp16: the loss scale in use, as a tensor (a row reads it with its other tensors, in one go);
        else None. GradScaler's own get_scale() reads it on the host by itself."""
        return None if self.scaler is None else self.scaler._get_scale_async()  # torch's GradScaler.update keeps it

    def _finite(self, norm: torch.Tensor | None) -> bool:
        """on_nonfinite=skip: whether this step's gradients are finite, the same answer on every rank.
        A norm computed this step already is that answer (one host read); else the strategy checks."""
        if norm is not None:
            return bool(torch.isfinite(norm))
        return self.sync.grads_finite(self.model, self.optimizer)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, logits) of a micro-batch: its loss divided by grad_accum_steps (the step's is their sum)."""
        k = self.settings.grad_accum_steps
        with self.autocast():
            logits = self.train_model(inputs)
            if targets.dim() > 1:  # a language model: every token is a sample of the loss
                loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
            else:
                loss = F.cross_entropy(logits, targets)
            if k > 1:  # the mean over the whole step's samples (no extra kernel when k == 1)
                loss = loss / k
        return loss, logits

    def backward_without_data(self) -> None:
        """A micro-batch for a rank with no samples left while others still have some.

        A forward and backward on a batch of 0 samples: every collective the others run in this
        micro-batch (DDP's bucket all-reduces, FSDP's all-gathers, the hooks of bucketed) gets
        its partner, and this rank's contribution to the gradient sum is exactly zero, as a rank
        that joined does under torch's Join. Unlike Join, the rank then takes the optimizer step
        with the averaged gradient, so the replicas and their optimizer state stay identical.
        """
        with self.autocast():
            logits = self.train_model(self.empty_inputs)
        (logits.float().sum() * 0.0).backward()
