"""Optimizer steps with trainer.fault's switch (trainer/reliability/fault.py) attached around them.

The trainer runs these only when a fault is configured: the plain step path (step.py) carries no
fault code, and costs nothing for it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from trainer.errors import check
from trainer.loop.step import StepRunner
from trainer.reliability import fault as faults

log = logging.getLogger(__name__)


class FaultyStepRunner(StepRunner):
    """StepRunner, with one rank failing on purpose at trainer.fault.at_step."""

    _poisoned = False  # kind=nan_loss at this step: this rank's loss becomes NaN

    def __init__(self, **parts: Any) -> None:
        super().__init__(**parts)
        kind = self.settings.fault.kind
        if kind in faults.LAUNCHES:  # they act on the communication object's launches: DDP's are torch's own
            check(
                not self.sync.comm.observer.watch_group,
                "trainer.fault.kind",
                kind,
                "a fault on a collective the lab launches, and this strategy's are launched by torch itself "
                "(DDP's reducer); accepted here: crash, hang, kill, sigterm, perturb, nan_loss, kill_in_save, slow",
            )

    def run(self, batches: Iterator[Any], step: int) -> None:
        fault, ctx = self.settings.fault, self.ctx
        if fault.kind == "perturb" and fault.due(ctx.rank, step, ctx.attempt):
            self.sync.wait_for_parameters()  # it nudges a parameter: after the last step's writes
        faults.maybe_fire(fault, ctx.rank, step, ctx.attempt, self.model)
        faults.wrong_launch(fault, ctx.rank, step, ctx.attempt, self.sync.comm)
        self._poisoned = fault.poisons_loss(ctx.rank, step, ctx.attempt)
        super().run(batches, step)
        if "_launch" in vars(self.sync.comm):  # desync/size found nothing to act on (sync=none sends nothing)
            del self.sync.comm._launch
            log.warning("trainer.fault: %s at step %d found no collective of the lab's to act on", fault.kind, step)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits = super().forward(inputs, targets, step)
        faults.kill(self.settings.fault, self.ctx.rank, step, self.ctx.attempt)
        return (loss * float("nan") if self._poisoned else loss), logits
