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


class Window:
    """What the steps between two logged rows produced, kept on the device so unlogged steps never sync.

    add() only keeps references (the detached loss, and on the sampled step its logits' predicted
    classes and the targets): no kernel on an unsampled step. The sums, the sampled step's accuracy,
    the steps whose gradients were not finite (fp16's overflows, on_nonfinite=skip's skips) and the
    first non-finite loss are computed from them once per row, where the host synchronises anyway.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._loss_steps: list[int] = []  # the optimizer step (1-based) each loss belongs to
        self._predictions: list[torch.Tensor] = []  # the sampled step's
        self._targets: list[torch.Tensor] = []
        self._grad_norms: list[
            torch.Tensor
        ] = []  # every step's with max_grad_norm (or fp16, skip), else the sampled one
        self._norm_steps: list[int] = []
        self._sampled_norm: torch.Tensor | None = None
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
            self._sampled_norm = norm

    def add_found_inf(self, found_inf: torch.Tensor, step: int) -> None:
        """A step's agreed flag: 1.0 where its gradients were not finite (the step was skipped)."""
        self._found_inf.append(found_inf)
        self._found_steps.append(step)

    def totals(self, **extra: torch.Tensor | None) -> tuple[float, int, int]:
        """(sum of the micro-batches' losses, the sampled step's correct predictions, first step whose
        loss or gradient norm was not finite or -1): the row's one host read, a handful of kernels.
        It also reads the row's other tensors, `extra` (fp16's loss scale, the ranks' previous
        non-finite answers), whose values land in self.extra by name, the sampled step's gradient norm
        (self.grad_norm) and the skipped steps (self.not_finite_steps)."""
        given = {name: tensor.flatten() for name, tensor in extra.items() if tensor is not None}
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        losses = torch.stack(self._losses).float() if self._losses else None
        norms = torch.stack(self._grad_norms).double() if self._grad_norms else None
        found = torch.stack(self._found_inf).double() if self._found_inf else zero.new_zeros(0)
        correct = (torch.cat(self._predictions) == torch.cat(self._targets)).sum() if self._predictions else zero
        parts = [
            losses.sum().double() if losses is not None else zero,
            correct.double(),
            norms.sum() if norms is not None else zero,
            self._sampled_norm.double() if self._sampled_norm is not None else zero,
            found,
            *(t.to(device=self.device, dtype=torch.float64) for t in given.values()),
        ]
        loss_sum, count, norm_sum, sampled_norm, *rest = torch.cat([p.flatten() for p in parts]).tolist()
        flags, rest = rest[: found.numel()], rest[found.numel() :]
        self.not_finite_steps = [step for step, flag in zip(self._found_steps, flags, strict=True) if flag]
        self.extra = {}
        for name, tensor in given.items():
            self.extra[name], rest = rest[: tensor.numel()], rest[tensor.numel() :]
        # An overflowed step's norm (fp16, on_nonfinite=skip) is not a gradient's: not reported.
        self.grad_norm = sampled_norm if self._sampled_norm is not None and math.isfinite(sampled_norm) else None
        bad = []  # rare: only now look for the step (a finite sum can't hide one)
        if losses is not None and not math.isfinite(loss_sum):
            bad.append(first_nonfinite(losses, self._loss_steps))
        if norms is not None and not math.isfinite(norm_sum) and not self._found_inf:  # fp16, skip: expected
            bad.append(first_nonfinite(norms, self._norm_steps))
        return loss_sum, int(count), min(bad) if bad else -1


def first_nonfinite(values: torch.Tensor, steps: list[int]) -> int:
    """The step of the first value that is not finite (-1: none)."""
    finite = torch.isfinite(values).tolist()
    return next((step for step, ok in zip(steps, finite, strict=True) if not ok), -1)


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
