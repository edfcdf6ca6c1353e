"""ZeRO by hand, stages 1 and 2: every rank keeps the full parameters, but only 1/N of the optimizer
state and (stage 2) of the gradient.

build_optimizer() groups the trainable parameters into buckets of about `bucket_cap_mb` (bucketed's
rule, reverse registration order; a bucket never mixes optim.weight_decay_on's groups) and lays
them into one flat buffer, each bucket padded to a multiple of the world size (zero_state.Layout;
each parameter a view of it). This rank's shard is its 1/N slice of every bucket, side by side in
a tensor of its own; the optimizer gets one piece of it per group. A step:

    backward:        bucketed's hooks (bucket_launch.py) start each bucket's collective as soon as
                     backward has produced its gradients, in order: stage 1 all_reduces the full
                     bucket, stage 2 reduce_scatters it into this rank's shard of the gradient and
                     frees it (zero_grads.py)
    after_backward:  waits only for what is still in flight; this rank's shard, averaged
    optimizer_step:  the optimizer updates the shard; each bucket's updated slices are all_gathered
                     back into every rank's parameter buffer (the first layers' buckets first),
                     and waited for lazily: just before the next forward (a pre-hook on the
                     model), or in wait_for_parameters() where the trainer reads the parameters otherwise

Forward, backward and evaluation stay local; the optimizer's state is 1/N of ddp's. Checkpoints
speak in the full model's terms (zero_state.py). Micro-batches under no_sync accumulate locally.

A parameter no rank used (find_unused_parameters=true, trainer/sync/unused.py) gets no update: the
optimizer steps on the whole shard, so its slice of the shard's parameters and optimizer state is
put back as it was (zero_state.py). With find_unused_parameters=true no bucket starts during
backward (one could wait for a gradient that never comes): they all start after it, in order. The
gradient buckets are cleared right after the step, so a caller's plain optimizer.zero_grad() (which
drops the pieces' .grad, re-bound after the next backward) is enough.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer.sync.base import DecayGroups, OptimizerFactory, SyncStrategy
from trainer.sync.bucket_launch import BucketLauncher, TimerFactory, Untimed
from trainer.sync.collectives import CommCounters
from trainer.sync.flat import group_by_size, names_of
from trainer.sync.unused import UsedParams
from trainer.sync.zero_grads import ShardedGrads
from trainer.sync.zero_state import (
    ELEMENTWISE,
    Layout,
    check_one_kind,
    check_optimizer,
    gather_full_state,
    restore_unused,
    save_unused,
    shard_of_full_state,
)

__all__ = ["ELEMENTWISE", "ZeroSync"]


class ZeroSync(SyncStrategy):
    """Sharded optimizer state (stage 1) and gradient (stage 2), reduced bucket by bucket during backward."""

    # The reduction overlaps backward and the all_gather runs in the optimizer phase: the sync phase
    # is not this strategy's communication time; its own per-collective clocks are (pop_comm_counts).
    comm_in_sync_phase = False
    keeps_replicas_equal = True  # the all_gather leaves every rank the same full parameters
    grads_sharded = True  # the optimizer reads this rank's shard of the averaged gradient

    def __init__(
        self,
        stage: Literal[1, 2] = 2,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        time_every_n_steps: int = 10,
        bucket_timer: TimerFactory | None = None,
    ) -> None:
        super().__init__()
        self.stage, self.bucket_cap_mb = stage, float(bucket_cap_mb)
        self.find_unused_parameters = find_unused_parameters
        self.time_every_n_steps = time_every_n_steps
        self.bucket_timer = bucket_timer  # conf/sync: bucket_timing.BucketTimer; None: nothing timed
        self._used: UsedParams | None = None
        self._unused: list[tuple[int, int]] = []  # this step: shard slices [lo, hi) of parameters no rank used
        self._pieces: list[nn.Parameter] = []  # the optimizer's parameters: one piece of the shard per group
        self._spans: list[tuple[int, int]] = []  # each piece's [lo, hi) in the shard
        self._full_groups: list[list[int]] = []  # each group's positions in model.parameters(), for checkpoints
        self._cleared = False  # the gradient buckets were cleared after this step's optimizer step
        self._step_open = False  # the launcher's step has not ended yet
        self._grads: ShardedGrads | None = None
        self._launcher: BucketLauncher | None = None
        self._layout: Layout | None = None
        self._params: torch.Tensor | None = None  # the flat parameter buffer
        self._param_shard: torch.Tensor | None = None  # this rank's shard of it (its own memory)
        self._gather_order: list[tuple[torch.Tensor, torch.Tensor]] = []  # (bucket in the buffer, its shard)
        self._held_after_backward = 0  # gradient bytes held when after_backward returned
        self._rank = 0
        self._in_flight: list[tuple[Any, list[dist.Work]]] = []  # the step's gathers: (launch mark, works)

    def wrap(self, model: nn.Module) -> nn.Module:
        check_one_kind([p for p in model.parameters() if p.requires_grad])  # before any collective: on every rank
        self.comm.broadcast_parameters(model)
        self._rank = dist.get_rank()
        # Every forward (training, evaluation) reads the parameters: the gathers land first.
        model.register_forward_pre_hook(self._before_forward)
        return model  # the buffer is laid out in build_optimizer(), by the optimizer's groups

    def _lay_out(self, model: nn.Module, groups: list[tuple[list[nn.Parameter], bool]]) -> None:
        """The flat buffer, bucket after bucket, each group's buckets together (a bucket never mixes
        groups), so this rank's shard holds each group's elements side by side: one piece each."""
        trainable = [[p for p in group if p.requires_grad] for group, _ in groups]
        # Reverse registration order: the last layers' gradients are ready first in backward.
        cap = int(self.bucket_cap_mb * 2**20)
        per_group = [list(group_by_size(reversed(params), cap)) for params in trainable]
        buckets = [bucket for group in per_group for bucket in group]
        self._layout = layout = Layout.of(model, buckets, dist.get_world_size())
        params = [p for p in model.parameters() if p.requires_grad]  # in layout order
        flat = torch.zeros(layout.padded_numel, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for param, view in zip(params, layout.split(flat), strict=True):
                view.copy_(param)
                param.data = view  # the parameter now lives in the buffer: all_gather updates it
        self._params = flat
        self._param_shard = layout.shard_of(flat, self._rank)
        # The last bucket holds the first layers: gathered first, as the next forward needs them first.
        self._gather_order = [
            (flat[lo : lo + padded], self._param_shard[at : at + n])
            for (lo, padded), (_, at, n) in zip(layout.buckets, layout.pieces(0), strict=True)
        ][::-1]
        self._spans = layout.group_spans([len(group) for group in per_group])
        position = {id(p): i for i, p in enumerate(model.parameters())}
        self._full_groups = [[position[id(p)] for p in group] for group, _ in groups]
        self._grads = ShardedGrads(self.stage, buckets, layout, self._rank, self.comm)
        names = names_of(model, params)
        # Its step ends when the gathers are waited for, before the next forward (True): the timer's lag.
        timer = (
            Untimed() if self.bucket_timer is None else self.bucket_timer(flat.device, self.time_every_n_steps, True)
        )
        self._launcher = BucketLauncher(
            "zero", params, names, timer, self.comm, strict=False, in_backward=not self.find_unused_parameters
        )
        self._launcher.build(buckets, self._grads.on_grad, self._grads.start)
        self._used = UsedParams(params, names, self.find_unused_parameters, "zero", self.comm)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self._in_flight:
            self.wait_for_parameters()

    def wait_for_parameters(self) -> None:
        """Wait for the last step's gathers (first layers' buckets first), then close its books."""
        if not self._in_flight:
            return
        assert self._launcher is not None, "wrap() first"
        timer = self._launcher.timer
        waited_from = timer.now()  # before this, the gathers ran hidden behind the loop's own work
        for started, works in self._in_flight:
            for work in works:
                work.wait()
            timer.note_after(started, waited_from)
        self._in_flight = []
        self._end_step()

    def build_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> Optimizer:
        """The optimizer over this rank's shard of the parameter buffer, one piece per group of
        optim.weight_decay_on (a piece's .grad: this rank's shard of the averaged gradient)."""
        rule = factory if isinstance(factory, DecayGroups) else DecayGroups(factory)
        groups = rule.groups(model.parameters())
        if self._layout is None:
            self._lay_out(model, groups)
        assert self._param_shard is not None and self._grads is not None
        self._pieces = [nn.Parameter(self._param_shard[lo:hi]) for lo, hi in self._spans]  # views: no copy
        self._bind_grads()
        pieces = [([piece], decays) for piece, (_, decays) in zip(self._pieces, groups, strict=True)]
        optimizer = rule.build_groups(pieces)
        check_optimizer(optimizer, self._pieces)
        return optimizer

    def _bind_grads(self) -> None:
        """Each piece's .grad: its slice of the gradient shard (again, if a plain optimizer.zero_grad() dropped it)."""
        assert self._grads is not None
        for piece, (lo, hi) in zip(self._pieces, self._spans, strict=True):
            if piece.grad is None or piece.grad.data_ptr() != self._grads.shard[lo:hi].data_ptr():
                piece.grad = self._grads.shard[lo:hi]

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        assert self._launcher is not None, "wrap() first"
        return self._launcher.local()

    def after_backward(self, model: nn.Module) -> None:
        assert self._grads is not None and self._used is not None and self._layout is not None, "wrap() first"
        assert self._launcher is not None
        self._unused = self._layout.shard_slices(self._used.unused_everywhere(), self._rank)
        self._cleared = False
        # Every rank, the same buckets in the same order: even one whose micro-batch had no samples.
        works = self._launcher.finish_backward(self._grads.fill_missing)
        for index, work in enumerate(works):
            self._grads.finish(index, work)
        self._held_after_backward = self._grads.held_bytes
        self._step_open = True
        self._bind_grads()  # clipping reads them next

    def optimizer_step(self, optimizer: Optimizer) -> None:
        assert self._params is not None and self._param_shard is not None, "build_optimizer() first"
        assert self._grads is not None and self._layout is not None and self._launcher is not None
        self.wait_for_parameters()  # a step whose forward did not wait for the last gathers (none in the trainer)
        kept = save_unused(self._param_shard, optimizer, self._unused, self._spans)
        optimizer.step()  # updates this rank's shard
        restore_unused(self._param_shard, optimizer, kept, self._spans)
        # Every rank must reach these (a skipped step, on_nonfinite=skip, skips them on every rank
        # alike), in _gather_order. They are waited for in wait_for_parameters(), before the next forward.
        timer = self._launcher.timer
        last = len(self._gather_order) - 1
        for position, (output, mine) in enumerate(self._gather_order):
            started = timer.now()
            index = last - position  # the bucket's own index: gathered last bucket first
            self._in_flight.append((started, self._grads.gather(output, mine, index)))
        # Cleared now, not only in zero_grad: the optimizer cannot reach the model's gradient views,
        # so a caller that clears gradients with optimizer.zero_grad() alone would accumulate them.
        # (The gathers write the parameters, not the gradients: this runs while they fly.)
        self._grads.zero()
        self._cleared = True

    def _end_step(self) -> None:
        """The launcher's step ends once its collectives are all done: its gathers too."""
        if self._step_open and not self._in_flight:
            assert self._launcher is not None
            self._launcher.end_step()
            self._step_open = False

    def zero_grad(self, optimizer: Optimizer) -> None:
        # The buckets, never set_to_none: that would drop the views autograd accumulates into.
        # The shard's .grad needs no zeroing: the reduction overwrites it. After a step the buckets
        # are clear already; a skipped step (on_nonfinite=skip) leaves them to clear here.
        assert self._grads is not None, "wrap() first"
        if not self._cleared:
            self._grads.zero()
        self._end_step()

    def grads_finite(self, model: nn.Module, optimizer: Optimizer) -> bool:
        """Each rank holds only its shard's average: the ranks agree through a one-element all_reduce
        (counted as control traffic: a check, not gradient bytes)."""
        assert self._grads is not None, "wrap() first"
        finite = torch.isfinite(self._grads.shard).all().to(torch.int32)
        self.comm.agree(finite, dist.ReduceOp.MIN)  # every rank must reach this
        return bool(finite.item())

    def pop_comm_counts(self) -> CommCounters:
        counts = self.comm.counts.pop()
        assert self._launcher is not None, "wrap() first"
        self._launcher.timer.add_to(counts)
        return counts

    def row_metrics(self) -> dict[str, float]:
        """Gradient memory a rank holds: when after_backward returned, and at most (backward included)."""
        assert self._grads is not None, "wrap() first"
        return {
            "memory/gradients_mb": self._held_after_backward / 2**20,
            "memory/gradients_peak_mb": self._grads.peak_bytes / 2**20,
        }

    def state_dicts(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's state is full on every rank already; the optimizer's is gathered (a collective)."""
        assert self._layout is not None, "wrap() first"
        self.wait_for_parameters()
        return model.state_dict(), gather_full_state(
            optimizer.state_dict(), self._layout, self._spans, self._full_groups
        )

    def load_state_dicts(
        self, model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        assert self._layout is not None and self._params is not None and self._param_shard is not None, "wrap() first"
        self.wait_for_parameters()  # a gather landing after the load would overwrite it
        model.load_state_dict(model_state)  # copies into the parameters: into the flat buffer
        with torch.no_grad():
            self._param_shard.copy_(self._layout.shard_of(self._params, self._rank))
        shard_state = shard_of_full_state(optimizer_state, self._layout, self._rank, self._spans, self._full_groups)
        optimizer.load_state_dict(shard_state)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "strategy": "zero",
            "stage": self.stage,
            "bucket_cap_mb": self.bucket_cap_mb,
            "comm_timing": "none" if self.bucket_timer is None else f"per bucket, 1 step in {self.time_every_n_steps}",
        }
        if self._grads is not None:
            grads = self._grads
            info["collectives"] = ("all_reduce" if self.stage == 1 else grads.reduce_kind) + f" + {grads.gather_kind}"
        if self._layout is not None:
            layout = self._layout
            info["world_size"] = layout.world_size
            info["num_params"] = len(layout.indices)
            info["numel"] = layout.numel
            info["padded_numel"] = layout.padded_numel
            info["shard_numel"] = layout.shard_numel
            info["num_buckets"] = len(layout.buckets)
        if self._grads is not None:  # the gradient bytes per bucket, without padding, as bucketed lists them
            info["bucket_sizes_bytes"] = [n * self._grads.element_size for n in self._grads.numels]
        return info
