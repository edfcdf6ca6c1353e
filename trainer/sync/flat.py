"""Gradients in flat buffers, allocated once, each parameter's .grad a view into its bucket's buffer;
shared by the strategies that average buckets themselves (manual, bucketed, zero).

A collective then runs on a bucket's buffer directly: nothing is copied into a flat buffer before it
or back out after it (two copies of every gradient per step). Autograd keeps accumulating into the
views as long as nobody drops them, so a strategy zeroes the buffers between steps instead of
setting the gradients to None.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from trainer.footprint import Footprint, Held, Plan, replicated, whole, wire

Collective = Literal[
    "all_reduce", "rs_ag"
]  # sync.collective (manual, bucketed): all_reduce = reduce_scatter + all_gather


def names_of(model: nn.Module, params: Sequence[nn.Parameter]) -> list[str]:
    """Each parameter's name in the model (the first, for a tied one): for the messages."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    return [names.get(id(p), "?") for p in params]


def padded(numel: int, world_size: int) -> int:
    """numel rounded up to a multiple of the world size: a buffer reduce_scatter splits evenly."""
    return -(-numel // world_size) * world_size


def group_by_size(params: Iterable[nn.Parameter], cap_bytes: int) -> Iterator[list[nn.Parameter]]:
    """Consecutive groups of at most cap_bytes (a larger parameter goes alone; 0: one parameter each).

    A group never mixes dtypes or devices: its gradients share one buffer.
    """
    group: list[nn.Parameter] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        same_kind = not group or (param.dtype, param.device) == (group[0].dtype, group[0].device)
        if group and (size + nbytes > cap_bytes or not same_kind):
            yield group
            group, size = [], 0
        group.append(param)
        size += nbytes
    if group:
        yield group


@dataclass
class Bucket:
    """Some parameters' gradients side by side in one buffer, padded to a multiple of the world size
    (reduce_scatter splits it evenly)."""

    params: list[nn.Parameter]
    views: list[torch.Tensor]  # each parameter's .grad, a view into `buffer`
    buffer: torch.Tensor  # numel gradient elements, then zeros up to a multiple of the world size
    numel: int
    shard: torch.Tensor  # this rank's 1/world_size of the buffer, for reduce_scatter + all_gather

    @property
    def nbytes(self) -> int:
        """The gradients' bytes (what all_reduce sends, without the padding)."""
        return self.numel * self.buffer.element_size()

    @property
    def padded_nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def grads(self) -> torch.Tensor:
        """The gradients without the padding."""
        return self.buffer[: self.numel]


class FlatGrads:
    """A bucket per group of parameters, in order, each parameter's .grad bound to its bucket's view."""

    def __init__(self, groups: Sequence[list[nn.Parameter]], world_size: int, shards: bool = True) -> None:
        """`shards`: each bucket gets a shard of its own (reduce_scatter + all_gather); without, an empty one."""
        self.buckets = [self._allocate(group, world_size, shards) for group in groups]
        self.bind()

    @staticmethod
    def _allocate(params: list[nn.Parameter], world_size: int, shards: bool) -> Bucket:
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(padded(numel, world_size), dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for param in params:
            views.append(buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        shard = torch.empty(buffer.numel() // world_size if shards else 0, dtype=buffer.dtype, device=buffer.device)
        return Bucket(params, views, buffer, numel, shard)

    @staticmethod
    def footprint(groups: Sequence[list[nn.Parameter]], world_size: int, shards: bool = True) -> tuple[Held, Held]:
        """What buckets of these groups keep (for the memory predictor): each gradient buffer, padded,
        and each one's shard (if it has them)."""
        sizes = [padded(sum(p.numel() for p in g), world_size) * g[0].element_size() for g in groups]
        return Held("gradients", tuple(sizes)), Held("comm_buffers", tuple(n // world_size * shards for n in sizes))

    @staticmethod
    def replica(
        plan: Plan,
        groups: Sequence[list[nn.Parameter]],
        world_size: int,
        shards: bool = True,
        alone: Sequence[nn.Parameter] = (),
        at_once: int = 0,
    ) -> Footprint:
        """A replica whose gradients live in buckets of these groups (and `alone`, each reduced where
        autograd put it), `at_once` of them reduced together (0: all): for the memory predictor. A
        reduction sends the gradients (all_reduce), or the padded buffer into its shard
        (reduce_scatter), copied where trainer.reduce_dtype is wider (footprint.wire)."""
        sent = [p.numel() * p.element_size() for p in alone]
        for group in groups:
            numel, size = sum(p.numel() for p in group), group[0].element_size()
            sent.append(padded(numel, world_size) * (world_size + 1) // world_size * size if shards else numel * size)
        held = (*FlatGrads.footprint(groups, world_size, shards), whole("gradients", alone))
        return replicated(plan, *held, *wire(plan, sent, at_once))

    def held(self) -> dict[str, int]:
        """The shards, for the memory probe: the buffers hold the parameters' .grad, which it sees."""
        return {"comm_buffers": sum(b.shard.numel() * b.shard.element_size() for b in self.buckets)}

    def bind(self) -> None:
        """Make every parameter's .grad its view again, keeping any gradient it already holds."""
        for index in range(len(self.buckets)):
            self.bind_bucket(index)

    def bind_bucket(self, index: int) -> None:
        """bind(), for one bucket."""
        bucket = self.buckets[index]
        for param, view in zip(bucket.params, bucket.views, strict=True):
            if param.grad is view:
                continue
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(param.grad)
            param.grad = view

    def zero(self) -> None:
        """Clear every gradient: one fill per bucket, and the views stay bound."""
        for bucket in self.buckets:
            bucket.buffer.zero_()

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)

    def sizes(self) -> list[int]:
        """Each bucket's gradient bytes, in order."""
        return [bucket.nbytes for bucket in self.buckets]
