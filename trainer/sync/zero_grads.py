"""sync=zero's gradients, bucket by bucket: what a bucket holds in backward and which collective it starts.

Stage 1 (only the optimizer state sharded): the gradients live in flat bucket buffers (each .grad a
view, as `bucketed`'s), each bucket is all-reduced in full as soon as backward has filled it, and
this rank's slice of the averaged bucket is read into its shard of the gradient (what the
optimizer steps on). A bucket of one parameter that needs no padding (a tensor above the cap)
has no buffer: its .grad, autograd's own tensor, is all-reduced in place and set to None after
the step (a flat view would cost an in-place accumulation and a zeroing pass over it every step:
a few percent of the step for a large weight; docs/performance.md). A rank holds the full
gradient, plus its 1/N shard.

Stage 2 (the gradients sharded too): a gradient is moved, as its hook fires, into its bucket's
staging buffer (allocated when the bucket's first gradient arrives), and the parameter's .grad is
dropped; the full bucket is reduced into this rank's shard of the gradient (a reduce_scatter, or
on gloo an all_reduce and a slice: see below), then the staging buffer is freed. A bucket
of one parameter that needs no padding (a tensor above the cap, typically) stages autograd's own
gradient tensor: no buffer to allocate, no copy (a fresh buffer of that size costs its page
faults every step). After backward a rank holds 1/N of the gradient; during backward, the buckets
being filled or in flight. Under no_sync the hooks do nothing: autograd accumulates the
full local gradient in each .grad, and the last micro-batch's hooks move it.

A gradient that never arrived in the last backward (a parameter unused there, or one whose .grad
was replaced) is folded in by fill_missing() before its bucket starts (after backward, in order).

gloo's reduce_scatter and all_gather are slow paths (about twice an all_reduce each, where one
broadcast per rank of its shard costs half of one: the numbers are in docs/sync.md). So on gloo a
bucket is all_reduced in place and this rank's slice read into its shard (the full bucket is held
until then either way), and the shards are gathered by one broadcast per rank, each from its owner
(as ZeroRedundancyOptimizer broadcasts its parameters). Same bytes, bit-identical results: only the
collectives differ, and comm/* counts the ones really issued. An emulated network (network=<preset>)
takes the native ones even on gloo: the link charges each collective its own kind's time, and the
lesson is what a cluster sends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from trainer.sync.collectives import Collectives, Waitable
from trainer.sync.flat import FlatGrads
from trainer.sync.zero_state import Layout


def kinds(native: bool) -> tuple[str, str]:
    """The collectives that reduce a bucket to a shard and gather the shards: natively, or on gloo."""
    return ("reduce_scatter", "all_gather") if native else ("all_reduce", "broadcast")


def reduce(
    comm: Collectives, shard: torch.Tensor, full: torch.Tensor, native: bool, bucket: int, grad_bytes: int
) -> dist.Work:
    """Start summing `full` (a padded bucket) across ranks: into `shard` (reduce_scatter), or in place
    (gloo's all_reduce; take() then reads this rank's slice)."""
    if native:
        return comm.reduce_scatter(shard, full, bucket, grad_bytes=grad_bytes)
    return comm.all_reduce(full, bucket, grad_bytes=grad_bytes)


def take(shard: torch.Tensor, full: torch.Tensor, rank: int, divisor: int, native: bool) -> None:
    """After reduce()'s wait: this rank's slice of the sum, divided, in `shard` (read and divided in
    one pass where it lies in `full`, not a copy and then a division)."""
    if native:
        shard.div_(divisor)
        return
    size = shard.numel()
    torch.div(full[rank * size : (rank + 1) * size], divisor, out=shard)


def gather(comm: Collectives, full: torch.Tensor, mine: torch.Tensor, native: bool, bucket: int) -> list[dist.Work]:
    """Start filling `full` (a padded bucket) with every rank's slice; `mine` is this rank's."""
    if native:
        return [comm.all_gather(full, mine, bucket)]
    rank, size = dist.get_rank(), mine.numel()
    works = []
    for owner in range(dist.get_world_size()):  # every rank issues the same broadcasts, in the same order
        tensor = mine if owner == rank else full[owner * size : (owner + 1) * size]
        works.append(comm.broadcast(tensor, owner, bucket))
    full[rank * size : (rank + 1) * size].copy_(mine)
    return works


class ShardedGrads:
    """The gradient buckets of one stage, and this rank's contiguous shard of the averaged gradient."""

    def __init__(
        self, stage: int, groups: Sequence[Sequence[nn.Parameter]], layout: Layout, rank: int, comm: Collectives
    ) -> None:
        self.stage = stage
        self.comm = comm
        # gloo's own reduce_scatter and all_gather are slow paths: see the module's doc. On an emulated
        # link (network=<preset>), which charges each collective its kind's time, the real ones.
        self.native = dist.get_backend() != "gloo" or hasattr(comm, "link")  # EmulatedCollectives has one
        self.reduce_kind, self.gather_kind = kinds(self.native)
        self.world_size = layout.world_size
        params = groups[0][0]
        self.shard = torch.zeros(layout.shard_numel, dtype=params.dtype, device=params.device)  # the optimizer's .grad
        pieces = layout.pieces(rank)
        self.shards = [self.shard[at : at + n] for _, at, n in pieces]  # per bucket, this rank's slice
        self.groups = [list(g) for g in groups]
        self.padded = [padded for _, padded in layout.buckets]
        self.numels = [sum(p.numel() for p in g) for g in self.groups]
        # Per bucket and parameter, where its gradient lies in the bucket.
        self.offsets = [[sum(p.numel() for p in g[:j]) for j in range(len(g))] for g in self.groups]
        self.element_size = self.shard.element_size()
        self._rank = rank
        self.flat: FlatGrads | None = None
        self.staging: list[torch.Tensor | None] = [None] * len(self.groups)
        # Per bucket: one parameter that needs no padding, whose gradient can be reduced where autograd put it.
        self.in_place = [len(g) == 1 and n == p for g, n, p in zip(self.groups, self.numels, self.padded, strict=True)]
        in_place_numel = sum(n for n, alone in zip(self.numels, self.in_place, strict=True) if alone)
        self._in_place_bytes = in_place_numel * self.element_size
        # Stage 1: per bucket, its place among the flat buffers, or None for a gradient reduced in place.
        self.in_flat: list[int | None] = [None] * len(self.groups)
        if stage == 1:
            flat = [i for i, alone in enumerate(self.in_place) if not alone]
            self.flat = FlatGrads([self.groups[i] for i in flat], self.world_size)
            for position, (index, bucket) in enumerate(zip(flat, self.flat.buckets, strict=True)):
                bucket.shard = self.shards[index]  # one contiguous shard for the optimizer, not one per bucket
                self.in_flat[index] = position
        self._live = 0  # bytes of staging buffers allocated now (stage 2)
        self.peak_bytes = self.held_bytes  # the most gradient memory held at once, during backward included

    @property
    def held_bytes(self) -> int:
        """Gradient bytes this rank holds now: the shard, and the full buckets (stage 1: the gradients
        reduced in place counted whole, as they are from backward to the step) or those staged (stage 2)."""
        if self.flat is None:
            return self.shard.numel() * self.element_size + self._live
        full = sum(b.padded_nbytes for b in self.flat.buckets)
        return self.shard.numel() * self.element_size + full + self._in_place_bytes

    def on_grad(self, index: int, j: int, param: nn.Parameter, first: bool) -> None:
        """A gradient for `param` was accumulated (its hook): into its bucket (see the module's doc)."""
        grad = param.grad
        assert grad is not None, "autograd calls this hook after accumulating a gradient"
        if self.flat is not None:
            place = self.in_flat[index]
            if place is None:  # reduced where autograd put it
                if not grad.is_contiguous():
                    param.grad = grad.contiguous()
                return
            view = self.flat.buckets[place].views[j]
            if grad is not view:  # e.g. set_to_none: put the view back
                view.copy_(grad)
                param.grad = view
            return
        if first and self.staging[index] is None and self.in_place[index] and grad.is_contiguous():
            self.staging[index] = grad.detach().view(-1)  # autograd's tensor, ours once .grad lets go of it
            self._grew(grad.numel())
            param.grad = None
            return
        lo = self.offsets[index][j]
        staged = self._staging(index)[lo : lo + param.numel()].view_as(param)
        if first:
            staged.copy_(grad)
        else:  # a reused parameter's next gradient: autograd began a fresh .grad after we dropped it
            staged.add_(grad)
        param.grad = None  # stage 2 keeps only the staged copy

    def _staging(self, index: int) -> torch.Tensor:
        buffer = self.staging[index]
        if buffer is None:
            buffer = self.shard.new_zeros(self.padded[index])  # zeros: a gradient that never comes counts as zero
            self.staging[index] = buffer
            self._grew(buffer.numel())
        return buffer

    def _grew(self, numel: int) -> None:
        self._live += numel * self.element_size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def fill_missing(self, index: int) -> None:
        """Before a bucket starts after backward: gradients its hooks did not deliver, folded in."""
        if self.flat is not None:
            place = self.in_flat[index]
            if place is not None:
                self.flat.bind_bucket(place)
            else:  # a gradient reduced in place that never came still sends its zeros
                (param,) = self.groups[index]
                param.grad = torch.zeros_like(param) if param.grad is None else param.grad.contiguous()
            return
        self._staging(index)  # a bucket none of whose gradients came still sends its zeros
        for j, param in enumerate(self.groups[index]):
            if param.grad is not None:  # accumulated under no_sync, no hook in the last backward
                self.on_grad(index, j, param, False)

    def start(self, index: int) -> dist.Work:
        """The bucket's collective, asynchronously: all_reduce of the full bucket (stage 1), or its
        reduction into this rank's shard (stage 2: reduce_scatter; gloo: all_reduce, sliced in finish)."""
        grad_bytes = self.numels[index] * self.element_size  # the gradient bytes, once per step
        if self.flat is not None:
            place = self.in_flat[index]
            full = self.flat.buckets[place].grads if place is not None else self._in_place_grad(index)
            return self.comm.all_reduce(full, index)
        staged = self.staging[index]
        assert staged is not None, "a bucket starts after its gradients (or fill_missing()) staged it"
        return reduce(self.comm, self.shards[index], staged, self.native, index, grad_bytes)

    def finish(self, index: int, work: Waitable) -> None:
        """Wait for the bucket's collective; this rank's slice of the sum, averaged, in the shard."""
        work.wait()
        shard = self.shards[index]
        if self.flat is not None:  # stage 1 all-reduced the full bucket: read this rank's slice
            place = self.in_flat[index]
            summed = self.flat.buckets[place].buffer if place is not None else self._in_place_grad(index)
            take(shard, summed, self._rank, self.world_size, native=False)
            return
        staged = self.staging[index]
        assert staged is not None
        take(shard, staged, self._rank, self.world_size, self.native)
        self._live -= staged.numel() * self.element_size
        self.staging[index] = None  # freed: only the shard is kept

    def gather(self, full: torch.Tensor, mine: torch.Tensor, bucket: int) -> list[dist.Work]:
        """Start filling `full` (a padded bucket of parameters) with every rank's slice; `mine` is this rank's."""
        return gather(self.comm, full, mine, self.native, bucket)

    def _in_place_grad(self, index: int) -> torch.Tensor:
        """Stage 1: the gradient reduced where autograd put it, flat (on_grad and fill_missing() made
        it contiguous)."""
        grad = self.groups[index][0].grad
        assert grad is not None, "its bucket starts after its gradient (or fill_missing()) arrived"
        return grad.view(-1)

    def zero(self) -> None:
        """Clear the full gradient buckets (stage 1: the gradients reduced in place set to None,
        autograd's next is fresh); stage 2's shard is overwritten by the next reduce."""
        if self.flat is not None:
            self.flat.zero()
            for index, place in enumerate(self.in_flat):
                if place is None:
                    self.groups[index][0].grad = None
