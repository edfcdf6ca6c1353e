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

import torch
from torch import nn

Kind = Literal["parameters", "gradients", "comm_buffers"]  # the predictor sizes optimizer state and activations


@dataclass(frozen=True)
class Held:
    """Buffers of one kind: each piece's bytes, at most `at_once` consecutive pieces alive together
    (0: all of them), alive in the moments `during` (none named: the whole step). `beyond`:
    gradients the ZeRO paper's model states do not count: the fp32 copy of a 16-bit gradient that
    the optimizer reads (torch's optimizers step an fp32 parameter with a gradient of its dtype), a
    unit's full gradients before they are reduced to this rank's shard."""

    kind: Kind
    sizes: tuple[int, ...]
    at_once: int = 0
    during: tuple[str, ...] = ()
    beyond: bool = False


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
    param_dtype: torch.dtype = torch.float32  # trainer.param_dtype (the model's parameters are in it)
    reduce_dtype: torch.dtype = torch.float32  # trainer.reduce_dtype

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
    that (by default each trainable parameter's .grad); 16-bit parameters: their fp32 copies, stepped,
    and from the sync to the optimizer step's end the copies' fp32 gradients (trainer/sync/master.py)."""
    held = held or (whole("gradients", plan.trainable),)
    copies: tuple[Held, ...] = ()
    if plan.param_dtype != torch.float32:
        fp32 = tuple(p.numel() * torch.float32.itemsize for p in plan.trainable)
        copies = (Held("parameters", fp32), Held("gradients", fp32, 0, ("after",), beyond=True))
    parameters = whole("parameters", plan.model.parameters())
    return Footprint((parameters, *held, *copies), tuple(p.numel() for p in plan.trainable))


def wire(plan: Plan, sizes: Iterable[int], at_once: int = 0, during: tuple[str, ...] = ()) -> tuple[Held, ...]:
    """The copies the communication object sends 16-bit gradient buckets of these sizes in, where
    trainer.reduce_dtype is wider (trainer/sync/comm.py): communication buffers while in flight."""
    if plan.param_dtype == torch.float32 or plan.reduce_dtype == plan.param_dtype:
        return ()
    scale = plan.reduce_dtype.itemsize // plan.param_dtype.itemsize
    return (Held("comm_buffers", tuple(n * scale for n in sizes), at_once, during),)
