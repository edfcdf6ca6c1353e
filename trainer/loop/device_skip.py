"""A non-finite step skipped on the device, for an optimizer that cannot skip one itself.

fp16 and trainer.on_nonfinite=skip know on the device whether a step's gradients were finite (the
global norm's flag, alike on every rank: trainer/loop/loss_scale.py). torch's fused Adam, AdamW and
Adagrad take that flag and change nothing; any other optimizer (SGD with momentum, the default, and
every non-fused one) would have the host read it before the step, a wait on the device every step.
Here the step runs anyway, and where the flag is set what it changed is put back with torch.where,
reading nothing:

- just before optimizer.step() (a step pre-hook: inside the strategy's optimizer_step, so after zero's
  and fsdp's preparation), a copy of each tensor the step can change: every parameter that has a
  gradient, as the optimizer holds it (a zero shard's piece, an fsdp DTensor's local shard, a 16-bit
  parameter's fp32 copy), and every tensor of its state (momentum buffers, Adam's moments and count);
- just after it (a post-hook: before zero's gathers and the 16-bit parameters' refresh from their fp32
  copies, which so carry the restored values), each one restored where the flag is set, and the
  state the step created on a parameter's first step set to zero there.

torch leaves no state after a skipped first step. Zero state is the same thing for optimizers whose
state starts at zero (Adam's kind, count included) and for SGD without dampening (its buffer starts
as the gradient, which is what 0 * momentum + gradient gives): the next step is a first step, bit
for bit. Where the device cannot undo a step, `undoable()` says so and the caller reads the flag on
the host, as torch's GradScaler does: state the optimizer keeps on the host (a Python number; a CPU
tensor in a CUDA run, such as non-fused Adam's count unless capturable), or state created by an
optimizer whose first step is not a step from zero (SGD with dampening, NAdam), which is only until
that optimizer's first step that is not skipped.

The price, paid only where a step may be skipped (never in the default fp32 run): a copy of each
stepped tensor and its state and a where on each (docs/metrics.md gives the µs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

# Their state starts at zero (torch.zeros_like, a count of 0): zero state steps as no state does.
ZERO_STARTED = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)


def starts_from_zero(optimizer: Optimizer) -> bool:
    """Whether a parameter's state, created by a step and then set to zero, makes its next step the
    same as its first. SGD's buffer starts as the gradient: a zero buffer gives the same only without
    dampening (0 * momentum + (1 - dampening) * gradient); without momentum SGD keeps no state."""
    if isinstance(optimizer, torch.optim.SGD):
        return all(group["momentum"] == 0 or group["dampening"] == 0 for group in optimizer.param_groups)
    return isinstance(optimizer, ZERO_STARTED)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What the optimizer's arithmetic writes: a DTensor's local shard (fsdp), else the tensor itself."""
    kind = type(tensor)
    return tensor if kind is torch.Tensor or kind is nn.Parameter else getattr(tensor, "_local_tensor", tensor)


def _counts_on_host(group: dict[str, Any]) -> bool:
    """Whether this group's step counts are CPU tensors (Adam's kind, unless capturable or fused)."""
    return "capturable" in group and not (group["capturable"] or group.get("fused"))


class DeviceSkip:
    """Puts back, on the device, what an optimizer step changed where a 0-dim bool flag is set."""

    def __init__(self, optimizer: Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.on_host = device.type == "cpu"  # else a CPU tensor in the state is one only the host can change
        self.zero_started = starts_from_zero(optimizer)
        self._flag: torch.Tensor | None = None  # set only inside skipping(): the hooks act then only
        self._kept: list[torch.Tensor] = []  # what the step can change, with state it already had
        self._fresh: list[torch.Tensor] = []  # parameters without state before the step
        self._copies: list[torch.Tensor] = []
        # On the host the copies are kept from step to step: CPU memory has no caching allocator, and a
        # fresh copy of a large tensor pays its page faults every step (the 25 M mlp: several times the copy)
        self._keeps_copies = self.on_host
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def undoable(self) -> bool:
        """Whether the coming step can be undone on the device; looks at which state there is, not at
        any value. False: the caller must read the flag on the host (module docstring)."""
        kept: list[torch.Tensor] = []
        fresh: list[torch.Tensor] = []
        state, on_host = self.optimizer.state, self.on_host
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:  # the optimizer leaves it alone
                    continue
                kept.append(_local(param))
                values = state.get(param)
                if not values:  # the step creates its state: zero is no state for some optimizers only
                    if not self.zero_started or (not on_host and _counts_on_host(group)):
                        return False
                    fresh.append(param)
                    continue
                for value in values.values():
                    if isinstance(value, torch.Tensor) and (on_host or not value.is_cpu):
                        kept.append(_local(value))
                    elif value is not None:  # kept on the host: only a read can decide it
                        return False
        self._kept, self._fresh = kept, fresh
        return True

    @contextmanager
    def skipping(self, nonfinite: torch.Tensor) -> Iterator[None]:
        """The optimizer step inside changes nothing where `nonfinite` (0-dim bool) is set; undoable()
        must have said True just before."""
        self._flag = nonfinite
        try:
            yield
        finally:
            self._flag, self._kept, self._fresh = None, [], []
            if not self._keeps_copies:
                self._copies = []

    def _before(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._flag is None:
            return
        kept, copies = self._kept, self._copies
        with torch.no_grad():
            if not self._keeps_copies:
                self._copies = list(torch._foreach_clone(kept))
                return
            alike = len(copies) == len(kept) and all(
                c.shape == t.shape and c.dtype == t.dtype for c, t in zip(copies, kept, strict=True)
            )
            if not alike:  # the first step, or the state changed (a first step of a parameter, a load)
                self._copies = copies = [torch.empty_like(t) for t in kept]
            torch._foreach_copy_(copies, kept)

    def _after(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        flag = self._flag
        if flag is None:
            return
        with torch.no_grad():
            for tensor, copy in zip(self._kept, self._copies, strict=True):
                torch.where(flag, copy, tensor, out=tensor)  # NaN-safe, unlike a lerp by the flag
            for param in self._fresh:  # what the step created: zero where skipped (as if absent)
                for value in optimizer.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor):
                        _local(value).masked_fill_(flag, 0)
