"""What a sync strategy's step sends, in the words the scaling model reads.

A strategy knows its algorithm (what it sends, in which pieces, when, among which ranks) and says it
in `SyncStrategy.schedule()`; trainer/scaling/predict.py knows the arithmetic (what a collective
costs on a topology, what hides under compute) and never looks at a strategy's name. A leaf, as
trainer/footprint.py is: the strategies (trainer/sync/) write these records and the scaling model
(trainer/scaling/) reads them, and neither package imports the other.

A step sends one of three things:
- `Nothing`: no collective at all.
- `Buckets`: the gradients in consecutive buckets, each bucket's `hops` one after the other, either
  during backward as soon as the bucket's last gradient is ready (`overlap`) or all after backward;
  then each bucket's `after` hops, which nothing hides.
- `ShardedUnits`: FSDP's pipeline. Each unit's parameters are gathered before its forward, and again
  before its backward when they were freed after the forward; its gradients are reduced once its
  backward is done.

Each collective is a `Hop`: its kind, the group it runs on (trainer/links.py's Span: `world` every
rank, `node` the ranks of one node, `nodes` one rank per node) and what it carries: the whole bucket
or unit, or (`share="node"`) its 1/G where G ranks share a node, which is what each rank holds after a
reduce_scatter inside its node. The hierarchical all-reduce of a bucket is three hops:
`Hop("reduce_scatter", "node")`, `Hop("all_reduce", "nodes", "node")`, `Hop("all_gather", "node")`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from trainer.links import Span

Kind = Literal["all_reduce", "reduce_scatter", "all_gather"]
Share = Literal["whole", "node"]  # node: the piece's 1/G, G ranks per node


@dataclass(frozen=True)
class Hop:
    """One collective on each bucket or unit: its kind, where its group lies, how much it carries."""

    kind: Kind
    span: Span = "world"
    share: Share = "whole"


@dataclass(frozen=True)
class Nothing:
    """A step that sends nothing."""


@dataclass(frozen=True)
class Buckets:
    """The gradients in consecutive buckets of about cap_mb MiB, in `order`: the model's
    (registration) or backward's (reverse: the last layer's first, as their gradients become
    ready). `rule` flat: a bucket closes before a gradient would overflow the cap, a larger one goes
    alone (ddplab's flat buffers); ddp: a gradient is added, then the bucket closes once it reaches
    the cap (torch's DDP), the first bucket at first_cap_mb if given. `overlap`: each bucket's hops
    start once its last gradient is ready, while backward goes on; else all of them after
    backward. `after`: each bucket's hops once backward and every bucket's `hops` are done
    (bucketed's rs_ag all_gathers before the optimizer step, zero's after it): nothing hides them."""

    cap_mb: float
    rule: Literal["flat", "ddp"] = "flat"
    order: Literal["registration", "reverse"] = "reverse"
    first_cap_mb: float | None = None
    overlap: bool = True
    hops: tuple[Hop, ...] = (Hop("all_reduce"),)
    after: tuple[Hop, ...] = ()


@dataclass(frozen=True)
class ShardedUnits:
    """FSDP's units as sync.wrap makes them (auto, block or module: trainer/sync/fsdp_units.py), in
    forward's order. Each unit's `gather` before its forward (the next unit's issued as it starts),
    again before its backward if reshard_after_forward freed it; its `scatter` hops once its
    backward is done."""

    wrap: str
    gather: Hop = Hop("all_gather")
    scatter: tuple[Hop, ...] = (Hop("reduce_scatter"),)
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class Schedule:
    """What one step sends, and which ranks split the optimizer step: `optimizer_shard` names the
    group whose ranks each update 1/n of the parameters (world: 1/N; node: 1/G), None every rank
    updates them all."""

    sends: Nothing | Buckets | ShardedUnits
    optimizer_shard: Span | None = None

    def with_cap(self, cap_mb: float) -> Schedule:
        """The same step with buckets of this cap (a step without buckets as it is)."""
        return replace(self, sends=replace(self.sends, cap_mb=cap_mb)) if isinstance(self.sends, Buckets) else self

    def with_wrap(self, wrap: str) -> Schedule:
        """The same step with these units (a step without units as it is)."""
        return replace(self, sends=replace(self.sends, wrap=wrap)) if isinstance(self.sends, ShardedUnits) else self
