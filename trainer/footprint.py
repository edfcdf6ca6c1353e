"""What a sync strategy keeps on each rank, in the words the memory predictor reads.

A strategy knows its layout (its buckets, its units, its padding) and says it in
`SyncStrategy.footprint(plan)`; trainer/scaling/memory.py knows the arithmetic (which holdings are
alive together, the optimizer's state, the activations) and never looks at a strategy's name. A
leaf: the strategies (trainer/sync/) write these records and the predictor (trainer/scaling/)
reads them, and neither package may import the other.

Each buffer a strategy keeps is a `Held`: its kind (a `memory/<kind>_*` key of docs/metrics.md),
the bytes of each of its pieces (a bucket, a unit) in the order they come and go, how many
consecutive pieces are alive at once (a unit gathered in its turn with the next `prefetch`, a
unit's gradients until reduced), and the moments of the step it is alive in, named by the
strategy ("forward", "backward", ...; none: the whole step). A kind's peak is the most that one
moment holds (docs/memory.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from torch import nn

Kind = Literal["parameters", "gradients", "comm_buffers"]  # the predictor sizes optimizer state and activations


@dataclass(frozen=True)
class Held:
    """Buffers of one kind: each piece's bytes, at most `at_once` consecutive pieces alive together
    (0: all of them), alive in the moments `during` (none named: the whole step)."""

    kind: Kind
    sizes: tuple[int, ...]
    at_once: int = 0
    during: tuple[str, ...] = ()


@dataclass(frozen=True)
class Footprint:
    """Everything a rank keeps for a strategy: its buffers, and the numel of each tensor its
    optimizer steps (the optimizer's state is sized by them)."""

    held: tuple[Held, ...]
    stepped: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """What a strategy lays out for the predictor: the model (on the meta device: shapes, no memory),
    the world size, the optimizer's groups (optim.weight_decay_on, DecayGroups.groups) and whether
    gradients accumulate over micro-batches (trainer.grad_accum_steps > 1)."""

    model: nn.Module
    world_size: int
    groups: list[tuple[list[nn.Parameter], bool]]
    accumulating: bool

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def frozen(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if not p.requires_grad]


def nbytes(tensors: Iterable[nn.Parameter]) -> tuple[int, ...]:
    """Each tensor's bytes."""
    return tuple(t.numel() * t.element_size() for t in tensors)


def whole(kind: Kind, tensors: Iterable[nn.Parameter], *during: str) -> Held:
    """These tensors, each at its own size, all alive together."""
    return Held(kind, nbytes(tensors), 0, during)


def replicated(plan: Plan, *held: Held) -> Footprint:
    """A replica: every parameter whole, the optimizer over every trainable one, and `held` beyond
    that (by default each trainable parameter's .grad)."""
    held = held or (whole("gradients", plan.trainable),)
    return Footprint((whole("parameters", plan.model.parameters()), *held), tuple(p.numel() for p in plan.trainable))
