"""One sampled step of a strategy built alone, read back as the row keys the observer would log."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.optim import Optimizer

from trainer.measures import KINDS, MemoryProbe, wire_bytes
from trainer.sync.base import SyncStrategy


@contextmanager
def sampled(
    sync: SyncStrategy, model: nn.Module | None = None, optimizer: Optimizer | None = None
) -> Iterator[dict[str, Any]]:
    """Everything inside runs as one sampled step (trainer/observer.py); the dict it yields holds
    that step's time/*, comm/* and (given the model and optimizer) memory/* keys afterwards (its
    collectives must all be waited for; `observer.mark("sync")` inside notes the gradients held)."""
    observer = sync.comm.observer
    if model is not None and optimizer is not None:
        observer.probe = MemoryProbe(model, optimizer, sync.comm.held, sync.gathers_parameters)
    observer.every = 1  # this step and every other one is sampled while the block runs
    observer.begin_step(1)
    row: dict[str, Any] = {}
    try:
        yield row
    finally:
        observer.end_step()
        observer.every = 0
    row.update(observer.take())


def sent(row: dict[str, Any]) -> dict[str, list[float]]:
    """A row's data collectives: {kind: [bytes on the wire, calls]} (trainer/measures.py's definition)."""
    return {
        k: [row[f"comm/{k}_bytes_per_step"], row[f"comm/{k}_per_step"]] for k in KINDS if f"comm/{k}_per_step" in row
    }


def on_the_wire(buffers: dict[str, list[int]], ranks: int) -> dict[str, list[float]]:
    """What collectives moving these buffers ({kind: [buffer bytes, calls]}) put on the wire per rank."""
    return {k: [wire_bytes(k, nbytes, ranks), calls] for k, (nbytes, calls) in buffers.items() if calls}


def watch_every_step(sync: SyncStrategy) -> SyncStrategy:
    """The strategy with its observer sampling from now on (one sample that never closes): the
    path a sampled step takes, on every step of a test that runs steps by hand."""
    sync.comm.observer.every = 1
    sync.comm.observer.begin_step(1)
    return sync
