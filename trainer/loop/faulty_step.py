"""Optimizer steps with trainer.fault's switch (trainer/reliability/fault.py) attached around them.

The trainer runs these only when a fault is configured: the plain step path (step.py) carries no
fault code, and costs nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from trainer.loop.step import StepRunner
from trainer.reliability import fault as faults


class FaultyStepRunner(StepRunner):
    """StepRunner, with one rank failing on purpose at trainer.fault.at_step."""

    _poisoned = False  # kind=nan_loss at this step: this rank's loss becomes NaN

    def run(self, batches: Iterator[Any], step: int) -> None:
        fault, ctx = self.settings.fault, self.ctx
        if fault.kind == "perturb" and fault.due(ctx.rank, step, ctx.attempt):
            self.sync.wait_for_parameters()  # it nudges a parameter: after the last step's writes
        faults.maybe_fire(fault, ctx.rank, step, ctx.attempt, self.model)
        self._poisoned = fault.poisons_loss(ctx.rank, step, ctx.attempt)
        super().run(batches, step)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits = super().forward(inputs, targets, step)
        return (loss * float("nan") if self._poisoned else loss), logits
