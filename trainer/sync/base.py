"""The interface every gradient-sync strategy implements; the trainer calls nothing else.

A step, as the trainer runs it (k = grad_accum_steps):

    for each of the first k-1 micro-batches:  with sync.no_sync(model): forward; backward
    last micro-batch:                          forward; backward
    sync.after_backward(model)                 # gradients are now equal on every rank
    optimizer.step()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn
from torch.optim import Optimizer

from trainer.sync.comm import CommCounters


class SyncStrategy(ABC):
    """How the replicas' gradients become one averaged gradient.

    Besides the four methods, a strategy counts what it sends in `self.comm`, which the trainer
    reads at logged steps through take_comm(). `comm_in_sync_phase` says that all its communication happens inside
    after_backward, so the trainer's timing of that phase is its communication time.
    `keeps_replicas_equal` says every rank holds the same parameters after each step.
    """

    comm_in_sync_phase: bool = False
    keeps_replicas_equal: bool = True  # the trainer's replica check applies

    def __init__(self) -> None:
        self.comm = CommCounters()

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Return the module the forward pass runs; every replica must start equal after this."""

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Context for micro-batches whose gradients must only accumulate locally."""
        return nullcontext()

    def after_backward(self, model: nn.Module) -> None:
        """Runs after the last micro-batch's backward, before optimizer.step()."""

    def zero_grad(self, optimizer: Optimizer) -> None:
        """After optimizer.step(): clear the gradients for the next step.

        Strategies whose gradients are views into persistent flat buffers zero the buffers instead,
        so that autograd keeps accumulating into them (set_to_none would drop the views).
        """
        optimizer.zero_grad(set_to_none=True)

    def take_comm(self) -> CommCounters:
        """What was sent (and, if measured, how long it took) since the last call: at logged rows."""
        return self.comm.take()

    def row_metrics(self) -> dict[str, float]:
        """Extra fields the strategy reports in every logged row (e.g. DDP's bucket cap in use); read at rows only."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What the strategy does, for logs and summaries."""
        return {}
