"""The interface every gradient-sync strategy implements; the trainer calls nothing else.

A step, as the trainer runs it (k = grad_accum_steps):

    for each of the first k-1 micro-batches:  with sync.no_sync(model): forward; backward
    last micro-batch:                          forward; backward
    sync.after_backward(model)                 # gradients are now equal on every rank
    sync.optimizer_step(optimizer)             # optimizer.step(), plus what sharding needs after it
    sync.zero_grad(optimizer)

The optimizer comes from build_optimizer (a sharded strategy's optimizer holds only its shard),
and checkpoints go through state_dicts / load_state_dicts, which always speak in the full,
unsharded model's terms: a checkpoint looks the same whichever strategy wrote it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainer.sync.collectives import Collectives, CommCounters

OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


class SyncStrategy(ABC):
    """How the replicas' gradients become one averaged gradient.

    A strategy sends through `self.net` (trainer/sync/collectives.py), which counts every collective;
    the trainer reads the counts at logged rows through pop_comm_counts(). `comm_in_sync_phase`
    says that all its communication happens inside after_backward, so the trainer's timing of
    that phase is its communication time.
    `keeps_replicas_equal` says every rank holds the same full parameters after each step (the
    trainer's replica check compares them; a strategy whose ranks hold shards sets it False).
    """

    comm_in_sync_phase: bool = False
    keeps_replicas_equal: bool = True  # the trainer's replica check applies

    def __init__(self) -> None:
        self.net = Collectives()

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Return the module the forward pass runs; every replica must start equal after this."""

    def check_device(self, device: torch.device) -> None:
        """Refuse (ConfigError) options this device cannot run; called before any process group exists."""

    def build_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> Optimizer:
        """The optimizer over what this rank updates, after wrap(): by default every parameter."""
        return factory(model.parameters())

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Context for micro-batches whose gradients must only accumulate locally."""
        return nullcontext()

    def after_backward(self, model: nn.Module) -> None:
        """Runs after the last micro-batch's backward, before optimizer.step()."""

    def optimizer_step(self, optimizer: Optimizer) -> None:
        """The optimizer step on the averaged gradients (ZeRO then gathers the updated shards)."""
        optimizer.step()

    def wait_for_parameters(self) -> None:
        """Wait for whatever this strategy still writes into the parameters (zero's gathers after
        the optimizer step, which it waits for only before the next forward): the trainer calls it
        before it reads the parameters outside a forward (the replica check, a fault that nudges
        them, the end of train()). Cheap when nothing is in flight."""

    def grads_finite(self, model: nn.Module, optimizer: Optimizer) -> bool:
        """Whether the gradients the optimizer is about to use are finite: the same answer on every
        rank (trainer.on_nonfinite=skip skips the step everywhere or nowhere).

        After after_backward the full gradients are equal on every rank, so each rank answers
        alone; a strategy whose ranks hold different gradient shards must agree through a collective.
        """
        flags = [torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None]
        return bool(torch.stack(flags).all()) if flags else True

    def state_dicts(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model state, optimizer state) of the full unsharded model, for a checkpoint.

        Every rank calls it (a sharded strategy gathers); only global rank 0's result is written,
        so other ranks may return empty dicts.
        """
        return model.state_dict(), optimizer.state_dict()

    def load_state_dicts(
        self, model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        """Load what state_dicts returned (every rank holds the full dicts, read from the file)."""
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def zero_grad(self, optimizer: Optimizer) -> None:
        """After optimizer.step(): clear the gradients for the next step.

        Strategies whose gradients are views into persistent flat buffers zero the buffers instead,
        so that autograd keeps accumulating into them (set_to_none would drop the views).
        """
        optimizer.zero_grad(set_to_none=True)

    def pop_comm_counts(self) -> CommCounters:
        """What was sent (and, if measured, how long it took) since the last call: at logged rows."""
        return self.net.counts.pop()

    def row_metrics(self) -> dict[str, float]:
        """Extra fields the strategy reports in every logged row (e.g. DDP's bucket cap in use); read at rows only."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What the strategy does, for logs and summaries."""
        return {}
