"""sync=zero's gradient buckets: what a bucket holds while backward fills it.

Stage 1 (only the optimizer state sharded): the gradients live in flat bucket buffers (each .grad a
view, as `bucketed`'s), and the full bucket is what zero.py all-reduces. A bucket of one parameter
that needs no padding (a tensor above the cap) has no buffer: its .grad, autograd's own tensor, is
reduced in place and dropped after the step (a flat view would cost an in-place accumulation and a
zeroing pass over it every step). A rank holds the full gradient, plus its 1/N shard.

Stage 2 (the gradients sharded too): a gradient is moved, as its hook fires, into its bucket's
staging buffer (allocated when the bucket's first gradient arrives), and the parameter's .grad is
dropped; once zero.py has reduced the bucket into this rank's shard, the buffer is released. A
bucket of one parameter that needs no padding stages autograd's own gradient tensor: no buffer to
allocate, no copy. Before a bucket is staged, `make_room` (zero.py's) may land and release older
ones (.grad is dropped first: the gradient is the bucket's from then on), so during backward a
rank holds a few buckets (zero.py's `num_buckets_staged`), and 1/N of the gradient after it. Under
no_sync the hooks do nothing: autograd accumulates the full local gradient in each .grad, and the
last micro-batch's hooks move it. A gradient that comes after its bucket has left (step 1 took
each parameter for one gradient per backward; a layer reused under reentrant checkpointing gets
more) goes into the bucket's late buffer, which zero.py reduces after backward.

A gradient that never arrived in the last backward (a parameter unused there, or one whose .grad
was replaced) is folded in by fill_missing() before its bucket starts: it counts as zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from trainer.sync.flat import FlatGrads
from trainer.sync.master import master_dtype
from trainer.sync.zero_state import Layout


class GradientBuckets:
    """The gradient buckets of one stage, and this rank's contiguous shard of the averaged gradient."""

    def __init__(
        self,
        stage: int,
        groups: Sequence[Sequence[nn.Parameter]],
        layout: Layout,
        rank: int,
        make_room: Callable[[], None],
        staging_dtype: torch.dtype | None = None,
    ) -> None:
        self.stage = stage
        self.make_room = make_room  # stage 2, called before a bucket is staged: zero.py may free older ones
        self.world_size = layout.world_size
        params = groups[0][0]
        # The optimizer's .grad: fp32 where the parameters are 16-bit (it steps their fp32 copy)
        self.shard = torch.zeros(layout.shard_numel, dtype=master_dtype(params.dtype), device=params.device)
        self.staging_dtype = staging_dtype or params.dtype  # stage 2: what buckets are reduced in (reduce_dtype)
        pieces = layout.pieces(rank)
        self.shards = [self.shard[at : at + n] for _, at, n in pieces]  # per bucket, this rank's slice
        self.groups = [list(g) for g in groups]
        self.padded = [padded for _, padded in layout.buckets]
        self.numels = [sum(p.numel() for p in g) for g in self.groups]
        # Per bucket and parameter, where its gradient lies in the bucket.
        self.offsets = [[sum(p.numel() for p in g[:j]) for j in range(len(g))] for g in self.groups]
        self.element_size = params.element_size()
        self._rank = rank
        self.flat: FlatGrads | None = None
        self.staging: list[torch.Tensor | None] = [None] * len(self.groups)
        self.late: list[torch.Tensor | None] = [None] * len(self.groups)  # per bucket, gradients after it left
        # Per bucket: one parameter that needs no padding, whose gradient can be reduced where autograd put it.
        self.in_place = [len(g) == 1 and n == p for g, n, p in zip(self.groups, self.numels, self.padded, strict=True)]
        # Stage 1: per bucket, its place among the flat buffers, or None for a gradient reduced in place.
        self.in_flat: list[int | None] = [None] * len(self.groups)
        if stage == 1:
            flat = [i for i, alone in enumerate(self.in_place) if not alone]
            self.flat = FlatGrads([self.groups[i] for i in flat], self.world_size)
            for position, (index, bucket) in enumerate(zip(flat, self.flat.buckets, strict=True)):
                bucket.shard = self.shards[index]  # one contiguous shard for the optimizer, not one per bucket
                self.in_flat[index] = position

    def staged_bytes(self) -> int:
        """Stage 2's staging and late buffers alive now (gradients no .grad holds); stage 1 keeps them in .grad."""
        return sum(b.numel() * b.element_size() for b in (*self.staging, *self.late) if b is not None)

    def hold(self, index: int, j: int, param: nn.Parameter, first: bool) -> None:
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
        param.grad = None  # stage 2 keeps only the staged copy: the gradient is the bucket's from here
        alone = self.in_place[index] and grad.is_contiguous() and grad.dtype == self.staging_dtype
        if first and self.staging[index] is None and alone:
            self.make_room()
            self.staging[index] = grad.detach().view(-1)  # autograd's tensor, ours now that .grad let go of it
            return
        lo = self.offsets[index][j]
        staged = self._staging(index)[lo : lo + param.numel()].view_as(param)
        if first:
            staged.copy_(grad)
        else:  # a reused parameter's next gradient: autograd began a fresh .grad after we dropped it
            staged.add_(grad)

    def _staging(self, index: int) -> torch.Tensor:
        buffer = self.staging[index]
        if buffer is None:
            self.make_room()
            # zeros: a gradient that never comes counts as zero
            buffer = self.shard.new_zeros(self.padded[index], dtype=self.staging_dtype)
            self.staging[index] = buffer
        return buffer

    def hold_late(self, index: int, j: int, param: nn.Parameter) -> None:
        """Stage 2: a gradient for `param` after its bucket has left, added into the bucket's late buffer."""
        grad = param.grad
        assert grad is not None, "autograd calls this hook after accumulating a gradient"
        lo = self.offsets[index][j]
        self.late_of(index)[lo : lo + param.numel()].view_as(param).add_(grad)
        param.grad = None

    def late_of(self, index: int) -> torch.Tensor:
        """Bucket `index`'s late buffer, padded as the bucket: zeros where no late gradient came."""
        late = self.late[index]
        if late is None:
            late = self.late[index] = self.shard.new_zeros(self.padded[index], dtype=self.staging_dtype)
        return late

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
                self.hold(index, j, param, False)

    def to_reduce(self, index: int) -> torch.Tensor:
        """What bucket `index` sends: stage 1 its gradients (its padding is zero on every rank and
        need not travel), stage 2 the padded staging buffer (a reduce_scatter splits it evenly)."""
        if self.flat is not None:
            place = self.in_flat[index]
            return self.flat.buckets[place].grads if place is not None else self._in_place_grad(index)
        return self.summed(index)

    def summed(self, index: int) -> torch.Tensor:
        """Bucket `index` padded, where an all_reduce leaves the sum: this rank's slice is read from it."""
        if self.flat is not None:
            place = self.in_flat[index]
            return self.flat.buckets[place].buffer if place is not None else self._in_place_grad(index)
        staged = self.staging[index]
        assert staged is not None, "a bucket starts after its gradients (or fill_missing()) staged it"
        return staged

    def release(self, index: int) -> None:
        """Stage 2: the bucket is reduced into the shard, its full buffer is freed."""
        if self.flat is None:
            self.staging[index] = None

    def release_late(self, index: int) -> None:
        self.late[index] = None

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
