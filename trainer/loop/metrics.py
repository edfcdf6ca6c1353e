"""Training metrics kept on the device between logged steps, and exact evaluation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer

from trainer.sync.grads import NormLater


class Window:
    """What the steps between two logged rows produced, kept on the device so unlogged steps never sync.

    add() only keeps references (the detached loss, and on the sampled step its logits' predicted
    classes and the targets): no kernel on an unsampled step. The sums, the sampled step's accuracy,
    the steps whose gradients were not finite (fp16's overflows, on_nonfinite=skip's skips) and the
    first non-finite loss are computed from them once per row, where the host synchronises anyway.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Stacked with the row's values: torch.stack promotes them all to float64 (a count or a step stays exact).
        self._float64 = torch.zeros((), dtype=torch.float64, device=device)
        self.reset()

    def reset(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._loss_steps: list[int] = []  # the optimizer step (1-based) each loss belongs to
        self._predictions: list[torch.Tensor] = []  # the sampled step's
        self._targets: list[torch.Tensor] = []
        self._grad_norms: list[torch.Tensor] = []  # every step's with max_grad_norm (or fp16, skip)
        self._norm_steps: list[int] = []
        self._sampled_norm: NormLater | None = None  # the sampled step's, for the row to finish
        self._found_inf: list[torch.Tensor] = []  # fp16 or on_nonfinite=skip: per step, 1.0 where not finite
        self._found_steps: list[int] = []
        self.grad_norm: float | None = None  # the sampled step's, before clipping: set by totals()
        self.not_finite_steps: list[int] = []  # steps whose gradients were not finite: set by totals()
        self.extra: dict[str, list[float]] = {}  # the other tensors totals() read, by name
        self.samples = 0
        self.tokens = 0
        self.predicted = 0  # the samples (tokens) the sampled step's accuracy is over
        self.micro_batches = 0  # with data: a rank that ran out of data (data.drop_last=false) has fewer
        self.num_steps = 0  # optimizer steps in the window
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, step: int, targets: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        """A micro-batch's loss; with the sampled step's logits, what its accuracy is read from."""
        self._losses.append(loss.detach())
        self._loss_steps.append(step)
        if logits is not None:
            self._predictions.append(logits.detach().argmax(dim=-1))
            self._targets.append(targets)
            self.predicted += targets.numel()  # one prediction per sample, or per token of a window
        self.samples += targets.shape[0]
        self.tokens += targets.numel()
        self.micro_batches += 1

    def add_grad_norm(self, norm: torch.Tensor, step: int, sampled: bool, every_step: bool) -> None:
        """A step's gradient norm (a 0-dim tensor, not read until the row). `every_step`: computed on
        every step (the clip uses it), so the row also looks for the first non-finite one."""
        if every_step:
            self._grad_norms.append(norm)
            self._norm_steps.append(step)
        if sampled:
            self.add_norm_later(NormLater([norm]))

    def add_norm_later(self, norm: NormLater) -> None:
        """The sampled step's gradient norm, for the row to finish on the host (trainer/sync/base.py)."""
        if self._sampled_norm is not None and self._sampled_norm.pending is not None:
            self._sampled_norm.pending.wait()  # an earlier sampled step's (sampling more often than rows)
        self._sampled_norm = norm

    def add_found_inf(self, found_inf: torch.Tensor, step: int) -> None:
        """A step's agreed flag: 1.0 where its gradients were not finite (the step was skipped)."""
        self._found_inf.append(found_inf)
        self._found_steps.append(step)

    def totals(self, **extra: torch.Tensor | None) -> tuple[float, int, int]:
        """(sum of the micro-batches' losses, the sampled step's correct predictions, first step whose
        loss or gradient norm was not finite or -1): the row's one host read, of one stack of the
        window's scalars (a kernel or two: each costs µs on a sub-millisecond step, so the losses and
        norms go to the host as they are and are summed there). It also reads the row's other
        tensors, `extra` (fp16's loss scale, the ranks' previous non-finite answers), whose values
        land in self.extra by name, the sampled step's gradient norm (self.grad_norm) and the skipped
        steps (self.not_finite_steps)."""
        given = {name: tensor.flatten() for name, tensor in extra.items() if tensor is not None}
        sampled = self._sampled_norm if self._sampled_norm is not None else NormLater([])
        if sampled.pending is not None:
            sampled.pending.wait()  # the agreement of the sampled step's norm, launched there
        pieces = [*sampled.norms, *sampled.squares]
        scalars = [*self._losses, *self._grad_norms, *pieces, *self._found_inf, self._float64]
        if self._predictions:
            predicted, targets = _joined(self._predictions), _joined(self._targets)
            scalars.append((predicted == targets).sum())
        stacked = torch.stack(scalars)
        values = (torch.cat([stacked, *given.values()]) if given else stacked).tolist()
        losses, values = _split(values, len(self._losses))
        norms, values = _split(values, len(self._grad_norms))
        norm_values, values = _split(values, len(sampled.norms))
        square_values, values = _split(values, len(sampled.squares))
        flags, values = _split(values, len(self._found_inf))
        count, values = _split(values, 2 if self._predictions else 1)  # the float64 zero, then the count
        self.not_finite_steps = [step for step, flag in zip(self._found_steps, flags, strict=True) if flag]
        self.extra = {}
        for name, tensor in given.items():
            self.extra[name], values = _split(values, tensor.numel())
        # An overflowed step's norm (fp16, on_nonfinite=skip) is not a gradient's: not reported.
        norm = sampled.finish(norm_values, square_values) if self._sampled_norm is not None else None
        self.grad_norm = norm if norm is not None and math.isfinite(norm) else None
        bad = [first_nonfinite(losses, self._loss_steps)]
        if not self._found_inf:  # fp16, skip: a non-finite norm is expected, and the step was skipped
            bad.append(first_nonfinite(norms, self._norm_steps))
        bad = [step for step in bad if step >= 0]
        return sum(losses), int(count[-1]), min(bad) if bad else -1


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)  # no copy for one micro-batch


def _split(values: list[float], n: int) -> tuple[list[float], list[float]]:
    """The first n values, and the rest."""
    return values[:n], values[n:]


def first_nonfinite(values: list[float], steps: list[int]) -> int:
    """The step of the first value that is not finite (-1: none)."""
    return next((step for step, value in zip(steps, values, strict=True) if not math.isfinite(value)), -1)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[Any]],
    forwards: int,
    empty_inputs: torch.Tensor,
) -> dict[str, float]:
    """eval/loss and eval/accuracy (per token for a language model, with eval/perplexity) over every
    rank's shard, summed across ranks: the same on all.

    Takes the unwrapped model: DDP's forward would broadcast buffers. Ranks' shards may differ in
    length by one batch, so every rank runs `forwards` forwards (the most any rank has), padding
    with forwards on 0 samples: a model whose forward communicates (FSDP's all-gathers) pairs up.
    """
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    ran = 0
    per_token = False
    for inputs, targets in loader:
        ran += 1
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with autocast():
            logits = model(inputs)
        sums[0] += F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")
        sums[1] += (logits.argmax(dim=-1) == targets).sum()
        sums[2] += targets.numel()  # a language model's loss is per token
        per_token = targets.dim() > 1
    for _ in range(forwards - ran):
        with autocast():
            model(empty_inputs)
    dist.all_reduce(sums)  # every rank reaches this exactly once per evaluation
    model.train()
    loss_sum, correct, count = sums.tolist()
    if count == 0:
        return {}
    metrics = {"eval/loss": loss_sum / count, "eval/accuracy": correct / count}
    if per_token:  # nats per token: its exponential is the perplexity
        metrics["eval/perplexity"] = math.exp(min(metrics["eval/loss"], 700.0))
    return metrics


def optimizer_state_mb(optimizer: Optimizer) -> float:
    """MiB of optimizer state this rank holds (momentum, Adam's moments, ...): what ZeRO and FSDP shard.

    A sharded tensor (FSDP's DTensor) counts only its local shard; read at logged rows only.
    """
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total / 2**20
