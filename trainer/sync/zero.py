"""ZeRO by hand, stages 1 and 2: every rank keeps the full parameters, but only 1/N of the optimizer
state and (stage 2) of the gradient. Stage 3, which shards the parameters too, is zero3.py;
`zero_sync` at the bottom (sync=zero's _target_) builds either.

build_optimizer() groups the trainable parameters into buckets of about `bucket_cap_mb` (bucketed's
rule, reverse registration order; a bucket never mixes optim.weight_decay_on's groups) and lays
them into one flat buffer, each bucket padded to a multiple of the world size (zero_state.Layout;
each parameter a view of it). This rank's shard is its 1/N slice of every bucket, side by side in
a tensor of its own; the optimizer gets one piece of it per group. A step, in the order it happens:

1. backward: a hook per parameter puts its gradient into its bucket (zero_buckets.py: stage 1 a
   flat view, stage 2 a staging buffer, the .grad dropped). Once a bucket is complete and every
   bucket before it has started (buckets.py), `_reduce` starts its collective: stage 1 all_reduces
   the gradients, stage 2 reduce_scatters the bucket into this rank's shard. Stage 2 keeps at most
   `num_buckets_staged` buckets alive: before another is staged, while that many are in flight the
   oldest lands (`_land`: waited for, `_average` leaves this rank's slice of the sum, divided by N,
   in its shard of the gradient, and the bucket is freed), so backward never holds the whole
   gradient; a bucket staged out of turn waits for its turn, uncounted.
   A bucket is complete once each of its parameters has had its gradients for the backward (more
   than one for a layer reused under reentrant checkpointing). Stage 2's step 1 counts one each and
   learns the real counts after backward; a gradient that comes after its bucket has left goes to
   the bucket's late buffer. Stage 1's gradients are views autograd adds into, where a late one
   would land in a bucket on its way: its step 1 starts every bucket after backward, as `bucketed`'s.
2. after_backward(): the buckets not started yet start now, in order (a gradient that never came
   counts as zero), before any control collective: a rank where some gradient never came holds
   that bucket back, where the others may have started it in backward. Then the ranks agree
   (unused.py's rule; step 1: the counts, and every rank reduces the late buffer of each bucket
   holding a parameter some rank got more than one gradient for, zeros where it has none, into
   the shard), and every reduction still in flight lands.
3. optimizer_step(): the optimizer updates this rank's shard; `_gather` starts each bucket's
   all_gather of the updated shards into every rank's parameter buffer (the first layers' bucket
   first). They are waited for just before the next forward (a pre-hook on the model), or in
   wait_for_parameters() where the trainer reads the parameters otherwise.

gloo's reduce_scatter and all_gather are slow paths (docs/sync.md measures them), so on gloo a
bucket is all-reduced and this rank's slice read from the sum, and the shards are gathered by one
broadcast per rank from its owner (as ZeroRedundancyOptimizer broadcasts): the same bytes and the
same bits, and comm/* counts the collectives really issued. An emulated link takes the native ones:
it charges each collective its own kind's time, and the lesson is what a cluster sends.

Parameters without a gradient follow trainer/sync/unused.py's rule; one no rank used
(find_unused_parameters=true) gets no update although the optimizer steps on the whole shard, so its
slice of the shard and of the optimizer state is kept as it was (zero_state.unchanged). With
find_unused_parameters=true no bucket starts during backward (one could wait for a gradient that
never comes), so stage 2 stages every bucket until after backward. Forward, backward and
evaluation stay local. Checkpoints speak in the full model's terms (zero_state.py), a sharded
checkpoint in per-parameter ranges (zero_checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn
from torch.optim import Optimizer

from trainer.comm_schedule import Buckets, Hop, Schedule
from trainer.footprint import Footprint, Held, Plan, nbytes, whole, wire
from trainer.sync.base import DecayGroups, OptimizerFactory, SyncStrategy
from trainer.sync.buckets import InOrder
from trainer.sync.flat import group_by_size, names_of
from trainer.sync.fsdp_units import Wrap
from trainer.sync.master import master_dtype
from trainer.sync.unused import Arrivals, fewest_and_most
from trainer.sync.zero3 import Zero3Sync
from trainer.sync.zero_buckets import GradientBuckets
from trainer.sync.zero_checkpoint import ZeroCheckpointing
from trainer.sync.zero_state import (
    ELEMENTWISE,
    Layout,
    Skipped,
    check_one_kind,
    check_optimizer,
    unchanged,
)

__all__ = ["ELEMENTWISE", "Stage", "ZeroSync", "zero_sync"]

Stage = Literal[1, 2, 3]  # sync.stage


class ZeroSync(SyncStrategy):
    """Sharded optimizer state (stage 1) and gradient (stage 2), reduced bucket by bucket during backward."""

    name = "zero"

    keeps_replicas_equal = True  # the all_gather leaves every rank the same full parameters
    grads_sharded = True  # the optimizer reads this rank's shard of the averaged gradient

    def __init__(
        self, stage: Literal[1, 2], bucket_cap_mb: float, num_buckets_staged: int, find_unused_parameters: bool
    ) -> None:
        super().__init__()
        self.checkpointing = ZeroCheckpointing(self)
        self.stage, self.bucket_cap_mb = stage, float(bucket_cap_mb)
        self.num_buckets_staged = num_buckets_staged
        self.find_unused_parameters = find_unused_parameters
        self.layout: Layout | None = None
        self.flat: torch.Tensor | None = None  # the flat parameter buffer: every parameter a view of it
        self.param_shard: torch.Tensor | None = None  # this rank's shard of it (its own memory)
        self.spans: list[tuple[int, int]] = []  # each optimizer piece's [lo, hi) in the shard
        self.full_groups: list[list[int]] = []  # each group's positions in model.parameters(), for checkpoints
        self._pieces: list[nn.Parameter] = []  # the optimizer's parameters: one piece of the shard per group
        self._rank, self._native = 0, True
        self._grads: GradientBuckets | None = None
        self._arrivals: Arrivals | None = None
        self._names: list[str] = []
        self._calls: list[int] = []  # per parameter, the gradients it received in this backward
        self._expected: list[int] | None = None  # learned in step 1
        self._order = InOrder([])  # which buckets may start (laid out in build_optimizer)
        self._works: list[dist.Work] = []  # this step's bucket reductions, in order
        self._landed = 0  # how many of them are in the shard (stage 2: and freed)
        self._unused: list[tuple[int, int]] = []  # this step: shard slices of parameters no rank used
        self._unused_names: list[str] = []
        self._skipped = Skipped(stage)
        self._gathers: list[list[dist.Work]] = []  # per bucket, in flight from the optimizer step to the next forward
        self._accumulating = False
        self._grads_cleared = False  # after the optimizer step (a skipped step leaves them to zero_grad)

    def wrap(self, model: nn.Module) -> nn.Module:
        check_one_kind([p for p in model.parameters() if p.requires_grad])  # before any collective: on every rank
        self.comm.broadcast_parameters(model)
        self._rank = dist.get_rank()
        self._native = dist.get_backend() != "gloo" or self.comm.link is not None
        # Every forward (training, evaluation) reads the parameters: the gathers land first.
        model.register_forward_pre_hook(lambda *_: self.wait_for_parameters())
        return model  # the buffer is laid out in build_optimizer(), by the optimizer's groups

    def build_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> Optimizer:
        """The optimizer over this rank's shard of the parameter buffer, one piece per group of
        optim.weight_decay_on (a piece's .grad: this rank's shard of the averaged gradient)."""
        rule = factory if isinstance(factory, DecayGroups) else DecayGroups(factory)
        groups = rule.groups(model.parameters())
        if self.layout is None:
            self._lay_out(model, groups)
        assert self.param_shard is not None and self._grads is not None
        self._pieces = [nn.Parameter(self.param_shard[lo:hi]) for lo, hi in self.spans]  # views: no copy
        self._bind_grads()
        optimizer = rule.build_groups(
            [([piece], decays) for piece, (_, decays) in zip(self._pieces, groups, strict=True)]
        )
        check_optimizer(optimizer, self._pieces)
        return optimizer

    def _lay_out(self, model: nn.Module, groups: list[tuple[list[nn.Parameter], bool]]) -> None:
        """The flat buffer, bucket after bucket, each group's buckets together (so this rank's shard
        holds each group's elements side by side: one optimizer piece each), and a hook per parameter."""
        per_group = self._buckets(groups)
        buckets = [bucket for group in per_group for bucket in group]
        self.layout = layout = Layout.of(model, buckets, dist.get_world_size())
        params = [p for p in model.parameters() if p.requires_grad]  # in layout order
        self.flat = torch.zeros(layout.padded_numel, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for param, view in zip(params, layout.split(self.flat), strict=True):
                view.copy_(param)
                param.data = view  # the parameter now lives in the buffer: the all_gather updates it
        # Its own memory, in fp32 where the parameters are 16-bit: the copy the optimizer steps
        self.param_shard = layout.shard_of(self.flat, self._rank).to(master_dtype(self.flat.dtype))
        self.spans = layout.group_spans([len(group) for group in per_group])
        position = {id(p): i for i, p in enumerate(model.parameters())}
        self.full_groups = [[position[id(p)] for p in group] for group, _ in groups]
        # Stage 2 stages each bucket in the dtype it is reduced in (trainer.reduce_dtype)
        self._grads = GradientBuckets(self.stage, buckets, layout, self._rank, self._make_room, self.comm.reduce_dtype)
        self.comm.holds(lambda: {"comm_buffers": self._grads.staged_bytes() if self._grads is not None else 0})
        self._names = names_of(model, params)
        self._calls = [0] * len(params)
        self._arrivals = Arrivals(params, self._names, self.comm, "zero", self.find_unused_parameters)
        # Step 1 takes one gradient per parameter (stage 2: a later one is late, kept apart). Where every
        # bucket starts after backward no bucket is ever complete: find_unused_parameters (one might wait
        # for a gradient that never comes) and stage 1's step 1 (the module's docstring).
        after_backward = self.find_unused_parameters or self.stage == 1
        self._order = InOrder([-1 if after_backward else len(bucket) for bucket in buckets])
        at = {id(p): i for i, p in enumerate(params)}
        for index, bucket in enumerate(buckets):  # autograd calls each once the gradient is accumulated
            for j, param in enumerate(bucket):
                param.register_post_accumulate_grad_hook(partial(self._gradient_ready, index, j, at[id(param)]))

    def _buckets(self, groups: list[tuple[list[nn.Parameter], bool]]) -> list[list[list[nn.Parameter]]]:
        """Each group's buckets of about bucket_cap_mb, in reverse registration order: the last layers'
        gradients are ready first in backward."""
        cap = int(self.bucket_cap_mb * 2**20)
        return [list(group_by_size(reversed([p for p in group if p.requires_grad]), cap)) for group, _ in groups]

    def _gradient_ready(self, index: int, j: int, position: int, param: nn.Parameter) -> None:
        """Autograd's hook: `param`'s gradient is in. Into its bucket (room made first); maybe start buckets."""
        if self._accumulating:  # no_sync: it stays in .grad, summed with the next micro-batch's
            return
        assert self._grads is not None
        self._calls[position] += 1
        calls, expected = self._calls[position], self._expected
        if expected is not None and calls > expected[position]:
            raise RuntimeError(
                f"sync=zero: parameter {self._names[position]!r} got gradient number {calls} in one "
                f"backward, but {expected[position]} in the first step: its bucket may already be on its way"
            )
        if expected is None and calls > 1 and index < self._order.next:  # step 1, reused: its bucket has left
            self._grads.hold_late(index, j, param)
            return
        self._grads.hold(index, j, param, first=calls == 1)  # stage 2: _make_room() before it stages the bucket
        if expected is not None or calls == 1:  # step 1 counts a parameter's first gradient only
            for ready in self._order.arrived(index):
                self._works.append(self._reduce(ready))

    def _make_room(self) -> None:
        """Stage 2, before a bucket is staged (zero_buckets calls it): while num_buckets_staged
        reductions are in flight, the oldest lands, so that with this one at most num_buckets_staged
        buckets are alive. A bucket staged out of turn (a gradient came before an earlier bucket was
        complete: optim.weight_decay_on=matrices' second group, whose buckets start after the first
        group's) cannot be waited for, so it is not counted: it stays staged until its turn."""
        while len(self._works) - self._landed >= self.num_buckets_staged:
            self._land()

    def _land(self) -> None:
        """The oldest reduction in flight is waited for and averaged into this rank's shard."""
        self._works[self._landed].wait()
        self._average(self._landed)
        self._landed += 1

    def _reduce(self, index: int) -> dist.Work:
        """Bucket `index` is complete: start reducing it to this rank's shard of the sum."""
        assert self._grads is not None
        full = self._grads.to_reduce(index)
        if self.stage == 2 and self._native:  # each rank receives only its 1/N slice of the sum
            return self.comm.reduce_scatter(self._grads.shards[index], full, index)
        # Stage 1 keeps the full gradient anyway; gloo's fast path: the whole sum, then a slice
        return self.comm.all_reduce(full, index)

    def _average(self, index: int) -> None:
        """After the bucket's reduction: this rank's slice of the sum, divided by N, in its shard."""
        assert self._grads is not None
        shard = self._grads.shards[index]
        world_size = dist.get_world_size()
        if self.stage == 2 and self._native:  # the reduce_scatter left this rank's slice in the shard
            shard.div_(world_size)
        else:  # read and divided in one pass where it lies in the summed bucket
            mine = self._grads.summed(index)[self._rank * shard.numel() : (self._rank + 1) * shard.numel()]
            torch.div(mine, world_size, out=shard)
        self._grads.release(index)  # stage 2: only the shard is kept

    def after_backward(self, model: nn.Module) -> None:
        assert self._grads is not None and self._arrivals is not None and self.layout is not None, (
            "build_optimizer() first"
        )
        # Every rank, the same buckets in the same order, before any control collective below: the
        # others may have started in backward a bucket this rank held back.
        for index in self._order.rest():
            self._grads.fill_missing(index)  # a gradient that never came counts as zero
            self._works.append(self._reduce(index))
        unused = self._arrivals.unused_everywhere()  # the rule (a control collective where the ranks agree)
        self._unused = self.layout.shard_slices(unused, self._rank)
        self._unused_names = [self._arrivals.names[i] for i in unused]
        late = self._learn() if self._expected is None and not self.find_unused_parameters else []
        reducing = [self._reduce_late(index) for index in late]  # every rank, the same ones
        while self._landed < len(self._works):
            self._land()
        for index, work, mine in reducing:  # step 1, after the bucket's own sum: the late gradients' share
            work.wait()
            self._grads.shards[index].add_(mine.div_(dist.get_world_size()))
            self._grads.release_late(index)
        self._works, self._landed, self._calls, self._grads_cleared = [], 0, [0] * len(self._calls), False
        self._order.reset()
        self._bind_grads()  # clipping reads them next

    def _learn(self) -> list[int]:
        """Step 1: each parameter's gradients per backward, the most any rank saw (every rank must
        reach this); a bucket is complete once its parameters' arrivals add up to that. Stage 2: the
        buckets that held a parameter with more than one, which may have left before the rest came."""
        assert self._grads is not None and self._arrivals is not None
        _, self._expected = fewest_and_most(self.comm, self._calls, self._grads.shard.device)
        position = {id(p): i for i, p in enumerate(self._arrivals.params)}
        per_bucket = [[self._expected[position[id(p)]] for p in group] for group in self._grads.groups]
        self._order = InOrder([sum(bucket) for bucket in per_bucket])
        return [index for index, bucket in enumerate(per_bucket) if max(bucket) > 1] if self.stage == 2 else []

    def _reduce_late(self, index: int) -> tuple[int, dist.Work, torch.Tensor]:
        """Step 1: bucket `index`'s late buffer reduced as the bucket was (zeros where this rank has
        none); where this rank's slice of the sum lands."""
        assert self._grads is not None
        late, size = self._grads.late_of(index), self._grads.shards[index].numel()
        if self._native:
            mine = late.new_empty(size)
            return index, self.comm.reduce_scatter(mine, late, index), mine
        return index, self.comm.all_reduce(late, index), late[self._rank * size : (self._rank + 1) * size]

    def optimizer_step(self, optimizer: Optimizer) -> None:
        assert self.flat is not None and self.param_shard is not None and self.layout is not None and self._grads
        self.wait_for_parameters()  # a step whose forward did not wait for the last gathers (none in the trainer)
        assert self._arrivals is not None
        self._skipped.check(optimizer, self._unused_names, self._arrivals.checked)  # agreed: alike on every rank
        with unchanged(self.param_shard, optimizer, self._unused, self.spans):  # one process skips them
            optimizer.step()  # updates this rank's shard only
        # Every rank must reach these, in this order (a skipped step skips them on every rank alike).
        # The last bucket holds the first layers, which the next forward needs first.
        for index in reversed(range(len(self.layout.buckets))):
            self._gathers.append(self._gather(index))
        # Cleared now (the gathers write the parameters, not the gradients): a caller that clears with a
        # plain optimizer.zero_grad() cannot reach the model's gradient views.
        self._grads.zero()
        self._grads_cleared = True

    def _gather(self, index: int) -> list[dist.Work]:
        """Start filling bucket `index` of every rank's parameter buffer with every rank's updated slice."""
        assert self.flat is not None and self.param_shard is not None and self.layout is not None
        (start, padded), (_, at, size) = self.layout.buckets[index], self.layout.pieces(self._rank)[index]
        full, mine = self.flat[start : start + padded], self.param_shard[at : at + size]
        own = full[self._rank * size : (self._rank + 1) * size]
        if mine.dtype != full.dtype:  # 16-bit parameters: the fp32 copy rounded into its slot, sent from there
            mine = own.copy_(mine)
        if self._native:
            return [self.comm.all_gather(full, mine, index)]
        # gloo: every rank broadcasts its own slice; every rank issues the same broadcasts in the same order
        owners = range(padded // size)
        slices = [mine if owner == self._rank else full[owner * size : (owner + 1) * size] for owner in owners]
        works = [self.comm.broadcast(tensor, owner, index) for owner, tensor in enumerate(slices)]
        if mine is not own:
            own.copy_(mine)
        return works

    def gather_parameters(self) -> None:
        """Every rank's shard into the full buffer now (a collective): after a sharded checkpoint's load."""
        assert self.layout is not None
        self.wait_for_parameters()
        self._gathers = [self._gather(index) for index in reversed(range(len(self.layout.buckets)))]
        self.wait_for_parameters()

    def wait_for_parameters(self) -> None:
        """Wait for the last step's gathers: the parameters are whole again."""
        for works in self._gathers:
            for work in works:
                work.wait()
        self._gathers = []

    def _bind_grads(self) -> None:
        """Each piece's .grad: its slice of the gradient shard (again, if a plain optimizer.zero_grad() dropped it)."""
        assert self._grads is not None
        for piece, (lo, hi) in zip(self._pieces, self.spans, strict=True):
            if piece.grad is None or piece.grad.data_ptr() != self._grads.shard[lo:hi].data_ptr():
                piece.grad = self._grads.shard[lo:hi]

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def zero_grad(self, optimizer: Optimizer) -> None:
        # The buckets, never set_to_none (that would drop the views autograd accumulates into); the
        # shard's .grad needs no zeroing, the reduction overwrites it.
        assert self._grads is not None, "build_optimizer() first"
        if not self._grads_cleared:  # a skipped step (on_nonfinite=skip)
            self._grads.zero()

    def footprint(self, plan: Plan) -> Footprint:
        """The full parameter buffer and this rank's shard of it; stage 1 the full gradient buckets and
        a shard, stage 2 a shard (and the full .grad while micro-batches accumulate), with
        num_buckets_staged consecutive buckets staged at once (find_unused_parameters: every bucket,
        until after backward) and a later group's buckets; the optimizer steps a piece of the shard
        per group."""
        per_group = self._buckets(plan.groups)
        groups = [bucket for group in per_group for bucket in group]
        layout = Layout.of(plan.model, groups, plan.world_size)
        size = plan.trainable[0].element_size()  # one dtype for every trainable parameter (check_one_kind)
        # The shard the optimizer steps and its gradient: fp32 where the parameters are 16-bit (stage 1:
        # the gradient's a copy of the full 16-bit one's slice)
        sixteen = size < master_dtype(plan.param_dtype).itemsize
        full, shard = layout.padded_numel * size, layout.shard_numel * master_dtype(plan.param_dtype).itemsize
        sent = [sum(nbytes(bucket)) for bucket in groups]  # stage 1: each bucket all-reduced, all in flight
        grads = [Held("gradients", (full,)), Held("gradients", (shard,), beyond=sixteen), *wire(plan, sent)]
        if self.stage == 2:
            # The first group's buckets, num_buckets_staged at once; a later group's gradients arrive
            # among them, but its buckets start after the first group's: each staged until then. Each
            # is staged in the dtype it is reduced in.
            staged = plan.reduce_dtype.itemsize if sixteen else size
            buckets, first = [padded * staged for _, padded in layout.buckets], len(per_group[0])
            at_once = 0 if self.find_unused_parameters else self.num_buckets_staged
            grads = [Held("gradients", (shard,)), Held("comm_buffers", tuple(buckets[:first]), at_once)]
            grads += [Held("comm_buffers", tuple(buckets[first:]))]
            grads += [whole("gradients", plan.trainable)] if plan.accumulating else []
        held = (Held("parameters", (full, shard, *nbytes(plan.frozen))), *grads)
        return Footprint(held, tuple(hi - lo for lo, hi in layout.group_spans([len(g) for g in per_group])))

    def facts(self) -> dict[str, Any]:
        if self.layout is None or self._grads is None:
            return {}
        reduce = "all_reduce" if self.stage == 1 or not self._native else "reduce_scatter"
        sizes = [n * self._grads.element_size for n in self._grads.numels]  # gradient bytes, as bucketed lists them
        shape = {k: getattr(self.layout, k) for k in ("world_size", "numel", "padded_numel", "shard_numel")}
        return {"collectives": f"{reduce} + {'all_gather' if self._native else 'broadcast'}", **shape} | {
            "num_params": len(self.layout.indices),
            "num_buckets": len(sizes),
            "bucket_sizes_bytes": sizes,
        }

    def schedule(self) -> Schedule:
        """Buckets in gradient-ready order, each reduced as soon as backward has filled it (stage 1
        all_reduce, stage 2 reduce_scatter; find_unused_parameters: all after backward); after the
        sharded optimizer step, each bucket's all_gather of the updated shards (NCCL's form)."""
        reduce = Hop("all_reduce" if self.stage == 1 else "reduce_scatter")
        overlap = not self.find_unused_parameters
        sends = Buckets(self.bucket_cap_mb, overlap=overlap, hops=(reduce,), after=(Hop("all_gather"),))
        return Schedule(sends, optimizer_shard="world")


def zero_sync(
    stage: Annotated[
        Stage,
        Field(
            description="1: optimizer state sharded; 2: gradients too; 3: parameters too; stage 0 (nothing "
            "sharded) is sync=ddp or sync=bucketed"
        ),
    ] = 2,
    bucket_cap_mb: Annotated[float, Field(gt=0, description="stages 1, 2: MiB of gradients per bucket")] = 25.0,
    num_buckets_staged: Annotated[
        int,
        Field(
            ge=1,
            description="stage 2: gradient buckets alive at once in backward (the one filling and those "
            "being reduced); the oldest reduction is waited for before another is staged",
        ),
    ] = 2,
    find_unused_parameters: bool = False,
    wrap: Annotated[Wrap, Field(description="stage 3: the units, as sync=fsdp's")] = "auto",
    prefetch: Annotated[int, Field(ge=0, description="stage 3: units gathered ahead of the one computing")] = 1,
    reshard_after_forward: Annotated[
        bool, Field(description="stage 3: free a unit's parameters after its forward")
    ] = True,
) -> SyncStrategy:
    """sync=zero's builder: stages 1 and 2 bucket the gradients (bucket_cap_mb; stage 2 keeps
    num_buckets_staged of them alive); stage 3 shards the parameters by fsdp's units instead (wrap,
    prefetch, reshard_after_forward)."""
    if stage == 3:
        return Zero3Sync(wrap, prefetch, reshard_after_forward, find_unused_parameters)
    return ZeroSync(stage, bucket_cap_mb, num_buckets_staged, find_unused_parameters)
