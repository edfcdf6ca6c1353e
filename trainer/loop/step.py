"""One optimizer step: k micro-batches forward and backward, the sync, the optimizer.

Kept apart from the loop (trainer.py) because this is the hot path: everything here runs every
step, so everything here is counted in µs (docs/performance.md). What is due between steps (rows,
checks, evaluation, checkpoints) belongs to the loop. The step reports its phases to the observer
(trainer/observer.py), which only acts on the sampled step; on any other step nothing here reads
a clock, records a CUDA event, launches a kernel of the lab's own or reads a tensor on the host.
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
from trainer.loop.device_skip import DeviceSkip
from trainer.loop.loss_scale import AgreedScaler
from trainer.loop.metrics import Window
from trainer.observer import Observer
from trainer.sync.base import SyncStrategy
from trainer.sync.grads import grad_norm, grad_norm_later, optimizer_grads, scale_grads

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


def grad_scaler_for(precision: str, device: torch.device) -> AgreedScaler | None:
    """fp16's loss scaler (None otherwise); its overflows are agreed through the global gradient norm."""
    return AgreedScaler(device.type) if precision == "fp16" else None


def skips_on_device(optimizer: Optimizer) -> bool:
    """Whether the optimizer skips a step itself when handed a non-finite flag (torch's fused Adam,
    AdamW, Adagrad: `found_inf`, no host read). Fused SGD is left out: on torch 2.14 a first step
    skipped that way leaves its momentum buffer uninitialised. Any other is undone by DeviceSkip."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and not isinstance(optimizer, torch.optim.SGD)


_NOTHING = nullcontext()  # reusable: entered on every step that is not sampled


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
        observer: Observer,
        window: Window,
    ) -> None:
        self.settings, self.ctx, self.model, self.train_model, self.sync = settings, ctx, model, train_model, sync
        self.empty_inputs = empty_inputs  # a batch of 0 samples, for backward_without_data()
        self.optimizer, self.scheduler, self.observer, self.window = optimizer, scheduler, observer, window
        self.autocast = autocast_for(settings.precision, ctx.device)
        self.scaler = grad_scaler_for(settings.precision, ctx.device)
        # fp16 and on_nonfinite=skip: whether a step's gradients were finite is a device flag, agreed by the norm
        self.checks_finite = self.scaler is not None or settings.on_nonfinite == "skip"
        self.skips_on_device = skips_on_device(optimizer)
        # An optimizer that cannot skip a step itself: its step undone on the device where the flag is set
        self.device_skip = (
            DeviceSkip(optimizer, ctx.device) if self.checks_finite and not self.skips_on_device else None
        )
        self.lr = optimizer.param_groups[0]["lr"]  # the rate the last step used

    def run(self, batches: Iterator[Any], step: int) -> None:
        """Optimizer step number `step` (1-based) on the next grad_accum_steps batches: the
        tutorial's step (forward, backward, the sync, the clip, the optimizer)."""
        k, observer, window, sync = self.settings.grad_accum_steps, self.observer, self.window, self.sync
        observer.begin_step(step)
        sampled = observer.sampling
        for i in range(k):
            # Only the last micro-batch may communicate; the others accumulate gradients locally.
            with sync.no_sync(self.train_model) if i < k - 1 else nullcontext():
                batch = next(batches)
                if batch is None:  # this rank's share of the epoch is used up (data.drop_last=false)
                    observer.mark("data")
                    self.backward_without_data()
                    observer.mark("backward")
                    continue
                inputs = batch[0].to(self.ctx.device, non_blocking=True)
                targets = batch[1].to(self.ctx.device, non_blocking=True)
                observer.mark("data")
                with observer.saved if sampled else _NOTHING:  # what the forward saves for backward
                    loss, logits = self.forward(inputs, targets, step)
                window.add(loss, step, targets, logits if sampled else None)  # accuracy: on the sampled step
                observer.mark("forward")
                (loss if self.scaler is None else self.scaler.scale(loss)).backward()
                observer.mark("backward")
        sync.after_backward(self.train_model)
        sync.masters.take_grads()  # 16-bit parameters: the optimizer's fp32 copies take the averages
        observer.mark("sync")
        self.optimize(step, sampled)
        observer.mark("optimizer")
        window.num_steps += 1
        observer.end_step()
        sync.after_step()  # bucket_cap_mb=auto's trials

    def optimize(self, step: int, sampled: bool) -> None:
        """Unscale (fp16), the global norm where something needs it, the clip, the optimizer step
        (skipped on every rank alike when the gradients are not finite), the LR schedule."""
        self.lr = self.optimizer.param_groups[0]["lr"]
        max_norm, scaler, optimizer = self.settings.max_grad_norm, self.scaler, self.optimizer
        if scaler is not None:  # fp16: the true gradients first
            scaler.unscale(optimizer_grads(optimizer))
        norm = None
        if max_norm is not None or self.checks_finite:
            norm = grad_norm(self.sync, optimizer)  # the same on every rank: also the agreement on an overflow
            self.window.add_grad_norm(norm, step, sampled, every_step=max_norm is not None)
        elif sampled:  # for the row only: finished there, on the host
            self.window.add_norm_later(grad_norm_later(self.sync, optimizer))
        found_inf = nonfinite = None
        if self.checks_finite:
            assert norm is not None
            nonfinite = ~torch.isfinite(norm)
            found_inf = nonfinite.to(torch.float32)
            self.window.add_found_inf(found_inf, step)
        if max_norm is not None:  # clip the averaged gradient by its global norm, as one process would
            assert norm is not None
            scale_grads(optimizer, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        if nonfinite is None:
            self.sync.optimizer_step(optimizer)
        elif self.skips_on_device:  # the optimizer leaves every parameter and its state as they were
            optimizer.found_inf, optimizer.grad_scale = found_inf, None  # type: ignore[attr-defined]
            self.sync.optimizer_step(optimizer)
            optimizer.found_inf = None  # type: ignore[attr-defined]
        elif self.device_skip is not None and self.device_skip.undoable():
            with self.device_skip.skipping(nonfinite):  # the step runs; where not finite, it is put back
                self.sync.optimizer_step(optimizer)
        elif not bool(found_inf):  # state only the host can undo (device_skip.py): read, as GradScaler does
            self.sync.optimizer_step(optimizer)
        if scaler is not None:
            assert found_inf is not None
            scaler.update_from(found_inf)
        self.scheduler.step()
        self.sync.zero_grad(optimizer)

    def scale(self) -> torch.Tensor | None:
        """fp16: the loss scale in use, as a tensor (a row reads it with its other tensors, in one go);
        else None. GradScaler's own get_scale() reads it on the host by itself."""
        return None if self.scaler is None else self.scaler._get_scale_async()  # torch's GradScaler keeps it

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
