"""ZeRO stage 3 by hand (sync=zero sync.stage=3): the parameters are sharded too.

Each rank keeps 1/N of every unit's parameters (one flat shard), of their gradient and of the
optimizer state; a unit's full parameters exist only while it computes. The units are fsdp's
(sync.wrap, trainer/sync/fsdp_units.py: a transformer's blocks, or each module owning parameters;
the root keeps the rest, and a parameter two units share stays in the root). A unit's parameters
lie in flat buckets, one per optim.weight_decay_on group, each padded to a multiple of N
(zero_state.Layout); a rank's shard is its 1/N slice of every bucket, one optimizer piece per group.

A step, in the order it happens:
1. forward, before each unit: all_gather its shards into its full buckets (on gloo one broadcast
   per rank of its slice) and wait; its parameters are views of those buckets, whose storage is
   what comes and goes. With `prefetch` n, the gathers of the next n units forward meets start
   now, so they travel while this unit computes.
2. forward, after each unit: free its buckets (reshard_after_forward), except the root's, which
   backward needs at once. A hook on the unit's outputs marks where backward will reach it.
3. backward, before each unit (its outputs' gradients arrived): its turn. Gather it again, and
   start the gathers of the next n units backward meets. A unit whose outputs get no gradient on
   this rank (used elsewhere, unused here) takes its turn when backward reaches the next one (or
   after backward), where a rank that used it took it: every rank sends the same collectives in the
   same order.
4. backward, once a unit has every gradient this backward computes for it (a hook per parameter
   counts them, against the number autograd's engine says it will compute, so a parameter left out
   of this backward is not waited for): copy its gradients into a padded bucket each, drop them,
   reduce_scatter each bucket into this rank's gradient shard (gloo: all_reduce, then this rank's
   slice), and free the unit's parameters. Units start strictly in backward's order (buckets.py's
   InOrder), so every rank pairs up, and one unit's reductions are in flight at a time (the next
   waits for them), so beyond the shard a rank holds about one unit's full gradients, from the
   first step on. Autograd runs first what forward made last, so a unit's gradients have all come
   by the next unit's turn: one that gets none on this rank is complete then. The root reduces
   after backward: its gradients come last (an embedding's), and under reentrant checkpointing in
   parts.
5. after_backward: the root is freed (nothing needs its parameters any more), then the units not
   reduced yet go (a gradient that never came counts as zero), before any control collective, so
   that the ranks' gradient collectives pair up whichever units each reduced during backward; then
   the ranks' rule for parameters without a gradient (trainer/sync/unused.py); every reduction is
   waited for and the shard divided by N.
6. optimizer_step: the optimizer updates this rank's shard. Nothing is gathered here: the next
   forward gathers each unit in its turn.

The first training forward learns the units' order and checks that every rank enters the same
unit each time (one small all_reduce per unit, as fsdp_usage.py does for FSDP2): a unit one rank
skips would pair its gathers with another unit's. Its backward already reduces in the order just
learned, with find_unused_parameters too: when a unit's zeros are summed does not matter, a
parameter no rank used keeping its value by the ranks' agreed flags (zero_state.unchanged). A unit
run without grad inside the training forward (reentrant activation checkpointing) is refused: its
backward would rerun it with no hook announcing it; non-reentrant checkpointing regathers it in
the recomputed forward.

Gradient accumulation: under no_sync a unit's backward only frees its parameters; autograd keeps
the full gradients until the last micro-batch, which reduces their sum once (as zero stage 2 and
FSDP do: one reduce-scatter per step, at the price of full gradient memory while accumulating).
A parameter no rank used keeps its value and optimizer state (zero_state.unchanged). Checkpoints
gather every unit in turn (full) or write each rank's shard as per-parameter ranges (sharded,
zero_checkpoint.py), which load at any world size and stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import _unsafe_preserve_version_counter
from torch.optim import Optimizer

from trainer.comm_schedule import Schedule, ShardedUnits
from trainer.core import TrainSettings
from trainer.errors import ConfigError
from trainer.footprint import Footprint, Held, Plan, nbytes
from trainer.sync.base import DecayGroups, OptimizerFactory, SyncStrategy
from trainer.sync.buckets import InOrder
from trainer.sync.flat import names_of
from trainer.sync.fsdp_units import Wrap, choose_units, resolve, unit_parameters
from trainer.sync.master import master_dtype
from trainer.sync.unused import Arrivals
from trainer.sync.zero_checkpoint import Zero3Checkpointing
from trainer.sync.zero_state import (
    Layout,
    Skipped,
    check_one_kind,
    check_optimizer,
    unchanged,
)


class Zero3Sync(SyncStrategy):
    """Parameters, gradients and optimizer state sharded; each unit gathered just in time."""

    name = "zero"
    key_attributes = {"wrap": "wrap_policy"}

    keeps_replicas_equal = False  # between steps ranks hold shards; state_dicts() gathers the full model
    grads_sharded = True
    gathers_parameters = True  # each unit's parameters: gathered in full for its turn, freed after

    def __init__(
        self,
        wrap: Wrap,
        prefetch: int,
        reshard_after_forward: bool,
        find_unused_parameters: bool,
    ) -> None:
        super().__init__()
        self.checkpointing = Zero3Checkpointing(self)
        self.wrap_policy, self.prefetch = wrap, prefetch
        self.reshard_after_forward, self.find_unused_parameters = reshard_after_forward, find_unused_parameters
        self.layout: Layout | None = None
        self.flat: torch.Tensor | None = None  # stage 3 keeps no full buffer (zero_checkpoint writes the shard)
        self.param_shard: torch.Tensor | None = None
        self.spans: list[tuple[int, int]] = []  # each optimizer piece's [lo, hi) in the shard
        self.full_groups: list[list[int]] = []  # each group's positions in model.parameters(), for checkpoints
        self._units: list[nn.Module] = []  # the root last
        self._labels: list[str] = []  # "unit blocks.2": what its collectives are named
        self._owner: dict[int, int] = {}  # id(parameter) -> its unit; the root's are not listed
        self._buckets: list[list[int]] = []  # per unit, its buckets' indices in the layout
        self._full: list[torch.Tensor] = []  # per bucket, its full buffer (storage freed between turns)
        self._views: list[list[tuple[nn.Parameter, int]]] = []  # per bucket, (parameter, offset in it)
        self._grads: torch.Tensor | None = None  # this rank's gradient shard
        self._pieces: list[nn.Parameter] = []
        self._gathers: dict[int, list[dist.Work]] = {}  # unit -> its gathers in flight
        self._gathered: set[int] = set()  # units whose full parameters are in place
        self._in_backward: set[int] = set()  # units whose backward began and whose parameters it still needs
        self._ran: set[int] = set()  # units this training forward entered
        self._reached: set[int] = set()  # units whose turn this backward has taken
        self._next_turn = 0  # the first unit of _backward_gathers whose turn may still come
        self._forward: list[int] = []  # the units in forward's order (learned in the first training forward)
        self._backward: list[int] = []  # the order units finish backward: forward's reversed, the root last
        self._backward_gathers: list[int] = []  # the order backward reaches them: the root first
        self._ahead: dict[int, int] = {}  # per unit of _backward_gathers, how many of _backward come before it
        self._accumulators: list[list[Any]] = []  # per unit, its parameters' gradient accumulators (kept alive)
        self._order: InOrder | None = None  # which units may reduce now
        self._arrived: list[int] = []  # per unit, its gradients accumulated in this backward
        self._expected: list[int | None] = []  # ...and how many this backward computes (None: none came yet)
        self._reducing: list[tuple[int, torch.Tensor, dist.Work]] = []  # (bucket, its gradients, the reduction)
        self._filled: list[tuple[int, torch.Tensor]] = []  # the unit's buckets filled, launched or about to be
        self._arrivals: Arrivals | None = None
        self._unused: list[tuple[int, int]] = []
        self._unused_names: list[str] = []
        self._skipped = Skipped(3)
        self._accumulating, self._rank, self._native, self._training = False, 0, True, False
        self._trainable: list[bool] = []  # per unit: whether it has trainable parameters

    def refuses(self, settings: TrainSettings) -> str | None:
        if settings.compile:
            return (
                "trainer.compile=true cannot run under sync=zero sync.stage=3: its hooks free and refill the "
                "parameters' storage around every unit, which torch.compile's graphs do not expect; accepted: "
                "trainer.compile=false, or sync.stage=1 or 2, or sync=fsdp"
            )
        if settings.fault.kind == "perturb":
            return (
                "trainer.fault.kind=perturb nudges a parameter for the replica check, which sync=zero "
                "sync.stage=3 does not run (each rank holds a shard); accepted: another fault kind or strategy"
            )
        return None

    def wrap(self, model: nn.Module) -> nn.Module:
        check_one_kind([p for p in model.parameters() if p.requires_grad])  # before any collective: on every rank
        self.comm.broadcast_parameters(model)
        self._rank = dist.get_rank()
        self._native = dist.get_backend() != "gloo" or self.comm.link is not None
        layers, _ = choose_units(model, self.wrap_policy)
        self._units = [*layers, model]
        recurse = resolve(model, self.wrap_policy) == "block"  # a block holds its submodules' parameters
        self._owner = {id(p): u for u, unit in enumerate(layers) for p in unit.parameters(recurse=recurse)}
        names = {id(m): name for name, m in model.named_modules()}
        self._labels = [f"zero unit {names[id(m)] or 'root'}" for m in self._units]
        self._trainable = [any(p.requires_grad for p in m.parameters()) for m in self._units]
        # The padded gradient buckets filled and being reduced (_reduce); the full gradients and the
        # shards are .grad tensors, which the probe sees.
        self.comm.holds(lambda: {"comm_buffers": sum(b.numel() * b.element_size() for _, b in self._filled)})
        return model  # sharded in build_optimizer(), by the optimizer's groups

    def build_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> Optimizer:
        """The optimizer over this rank's shard, one piece per group of optim.weight_decay_on."""
        rule = factory if isinstance(factory, DecayGroups) else DecayGroups(factory)
        groups = rule.groups(model.parameters())
        if self.layout is None:
            self._shard(model, groups)
        assert self.param_shard is not None and self._grads is not None
        self._pieces = [nn.Parameter(self.param_shard[lo:hi]) for lo, hi in self.spans]
        for piece, (lo, hi) in zip(self._pieces, self.spans, strict=True):
            piece.grad = self._grads[lo:hi]
        optimizer = rule.build_groups([([p], decays) for p, (_, decays) in zip(self._pieces, groups, strict=True)])
        check_optimizer(optimizer, self._pieces)
        return optimizer

    def _shard(self, model: nn.Module, groups: list[tuple[list[nn.Parameter], bool]]) -> None:
        """The buckets, group-major (every unit's decaying parameters, then every unit's others), so a
        rank's shard holds each group's elements side by side; this rank's shard; the hooks."""
        buckets, self._buckets, per_group = unit_buckets(self._owner, len(self._units), groups)
        self.layout = layout = Layout.of(model, buckets, dist.get_world_size())
        self.spans = layout.group_spans(per_group)
        position = {id(p): i for i, p in enumerate(model.parameters())}
        self.full_groups = [[position[id(p)] for p in group] for group, _ in groups]
        trainable = [p for p in model.parameters() if p.requires_grad]  # in layout order
        full = torch.zeros(layout.padded_numel, dtype=trainable[0].dtype, device=trainable[0].device)
        with torch.no_grad():
            for param, view in zip(trainable, layout.split(full), strict=True):
                view.copy_(param)
        # Its own memory (the rest of `full` goes), in fp32 where the parameters are 16-bit: the copy
        # the optimizer steps, and the gradient shard it reads
        self.param_shard = layout.shard_of(full, self._rank).to(master_dtype(full.dtype))
        self._grads = torch.zeros_like(self.param_shard)
        offset = {id(p): o for p, o in zip(trainable, layout.offsets, strict=True)}
        self._views = [
            [(p, offset[id(p)] - start) for p in params]
            for params, (start, _) in zip(buckets, layout.buckets, strict=True)
        ]
        self._full = [full[start : start + padded].clone() for start, padded in layout.buckets]
        with torch.no_grad():
            for bucket, views in zip(self._full, self._views, strict=True):
                for param, at in views:  # from now on the parameter is a view of its bucket
                    param.data = bucket[at : at + param.numel()].view_as(param)
                bucket.untyped_storage().resize_(0)  # freed: gathered in the unit's turn
        self._arrived, self._expected = [0] * len(self._units), [None] * len(self._units)
        for u, unit in enumerate(self._units):
            unit.register_forward_pre_hook(partial(self._before_forward, u))
            unit.register_forward_hook(partial(self._after_forward, u))
        # The units' gradients, counted; the root's are not: it reduces after backward.
        *units, _ = [[param for b in self._buckets[u] for param, _ in self._views[b]] for u in range(len(self._units))]
        self._accumulators = [[accumulator(p) for p in params] for params in units]
        for u, params in enumerate(units):
            for param in params:
                param.register_post_accumulate_grad_hook(lambda _, u=u: self._gradient_ready(u))
        self._arrivals = Arrivals(trainable, names_of(model, trainable), self.comm, "zero", self.find_unused_parameters)

    # A unit's full parameters: gathered, waited for, freed.

    def _grads_device(self) -> torch.device:
        assert self._grads is not None, "build_optimizer() first"
        return self._grads.device

    def _gather(self, u: int) -> None:
        """Start filling unit u's buckets with every rank's slice (their storage grown back first)."""
        if u in self._gathered or u in self._gathers:
            return
        assert self.layout is not None and self.param_shard is not None
        works = []
        for b in self._buckets[u]:
            full, (_, at, size) = self._full[b], self.layout.pieces(self._rank)[b]
            full.untyped_storage().resize_(full.numel() * full.element_size())
            mine, own = self.param_shard[at : at + size], full[self._rank * size : (self._rank + 1) * size]
            # Autograd saved views of this buffer in the forward: refilling it must not bump their version.
            with torch.no_grad(), _unsafe_preserve_version_counter(full):
                if mine.dtype != full.dtype:  # 16-bit parameters: the fp32 copy rounded into its slot, sent from there
                    mine = own.copy_(mine)
                if self._native:
                    works.append(self.comm.all_gather(full, mine, self._labels[u]))
                else:  # gloo, whose all_gather is a slow path: each rank broadcasts its own slice
                    for owner in range(full.numel() // size):
                        slot = mine if owner == self._rank else full[owner * size : (owner + 1) * size]
                        works.append(self.comm.broadcast(slot, owner, self._labels[u]))
                    if mine is not own:
                        own.copy_(mine)
        self._gathers[u] = works

    def _wait(self, u: int) -> None:
        self._gather(u)
        for work in self._gathers.pop(u, []):
            work.wait()
        self._gathered.add(u)

    def _free(self, u: int) -> None:
        """Unit u's buckets back to no storage; its parameters' views stay, pointing at nothing."""
        for work in self._gathers.pop(u, []):  # never free under a gather in flight
            work.wait()
            self._gathered.add(u)
        if u not in self._gathered:
            return
        for b in self._buckets[u]:
            self._full[b].untyped_storage().resize_(0)
        self._gathered.discard(u)

    # The hooks: a unit's forward, its backward, each of its gradients.

    def _before_forward(self, u: int, module: nn.Module, args: Any) -> None:
        root, learning = u == len(self._units) - 1, self._order is None
        if root:
            self._training = torch.is_grad_enabled()  # an evaluation's forward runs without grad
            if self._training:  # a new backward to come: no unit has had its turn or a gradient of it yet
                self._arrived, self._expected = [0] * len(self._units), [None] * len(self._units)
                self._ran, self._reached, self._in_backward, self._next_turn = set(), set(), set(), 0
        # The first training forward (and every one with find_unused_parameters): every rank must enter the
        # same unit, whose gathers pair up; a later forward only where a rank may leave one out.
        if self._training and (learning or self.find_unused_parameters):
            self._refuse_unless_agreed(u)
        if self._training:
            self._ran.add(u)
        if learning and self._training:
            if not torch.is_grad_enabled() and self._trainable[u]:
                raise ConfigError(
                    f"sync=zero sync.stage=3 cannot train this model: {self._labels[u]} ran without grad inside "
                    "the training forward, as under reentrant activation checkpointing (use_reentrant=True), "
                    "whose backward reruns it where no hook says its gradients are coming; use "
                    "use_reentrant=False (PyTorch's recommended form)"
                )
            if u not in self._forward:  # a unit run twice gathers twice, but is prefetched once
                self._forward.append(u)
        self._wait(u)
        # Prefetch the units forward meets next; a unit the first forward did not run (a branch unused
        # then) has no place in its order: gathered when it runs, it prefetches nothing.
        if not learning and u not in self._in_backward and u in self._forward:
            at = self._forward.index(u)
            for v in self._forward[at + 1 : at + 1 + self.prefetch]:
                self._gather(v)

    def _refuse_unless_agreed(self, u: int) -> None:
        """The ranks' next unit (len(units): the forward's end), in one small all_reduce: each unit's
        gathers pair up only if every rank enters it (fsdp's first-forward check, fsdp_usage.py)."""
        at = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=self._grads_device())
        at[self._rank] = u
        where = self.comm.agree(at).tolist()
        if len(set(where)) > 1:
            label = [*self._labels, "the end of the forward"]
            seen = "; ".join(f"rank {r}: {label[v]}" for r, v in enumerate(where))
            raise ConfigError(
                f"sync=zero sync.stage=3 cannot train this model: in a training forward the ranks reached "
                f"different units ({seen}); every rank must run the same units, whose gathers pair up "
                "(a unit used on all ranks, its output multiplied by 0 where unwanted), or use sync.stage=2"
            )

    def _after_forward(self, u: int, module: nn.Module, args: Any, output: Any) -> None:
        root = u == len(self._units) - 1
        if root and torch.is_grad_enabled() and self.find_unused_parameters and self._order is not None:
            self._refuse_unless_agreed(len(self._units))  # no rank has another unit left
        if root and torch.is_grad_enabled() and self._order is None:  # forward's order known: backward's too
            self._refuse_unless_agreed(len(self._units))
            blocks = [v for v in reversed(self._forward) if v != u]
            self._backward_gathers = [u, *blocks]  # the root's outputs are the first a backward reaches
            skipped = [v for v in range(len(self._units)) if v not in self._forward]  # after every unit it ran
            # The root's gradients complete last (an embedding's). A unit with nothing to reduce (frozen)
            # takes no place: it would hold every unit after it until backward's end.
            self._backward = [v for v in (*blocks, *skipped) if self._trainable[v]] + [u]
            turns = self._backward_gathers
            self._ahead = {v: len([w for w in turns[1:i] if self._trainable[w]]) for i, v in enumerate(turns)}
            self._order = InOrder([1] * len(self._backward))
        if torch.is_grad_enabled():  # backward reaches this unit when its outputs' gradients arrive
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda _, u=u: self._before_backward(u))
        if not root and self.reshard_after_forward and u not in self._in_backward:
            self._free(u)

    def _before_backward(self, u: int) -> None:
        """Backward reached unit u (its outputs' gradients arrived). The units before it in backward's
        order that backward passed on this rank without reaching (their outputs unused here) take
        their turn first, where a rank that used them took it: the ranks' collectives keep one order."""
        if u in self._reached:
            return
        if u not in self._backward_gathers:  # a unit the first forward did not run: no place in the order
            self._reached.add(u)
            self._in_backward.add(u)
            self._wait(u)
            return
        self._turns_until(self._backward_gathers.index(u) + 1)

    def _turns_until(self, end: int, ended: bool = False) -> None:
        """The turn of each unit of backward's order before `end` that this forward ran and that has
        not had it (in order: the same gathers and reductions as on every rank). `ended`: backward is
        over."""
        for v in self._backward_gathers[self._next_turn : end]:
            if v in self._ran and v not in self._reached:
                self._turn(v, ended)
        self._next_turn = max(self._next_turn, end)

    def _turn(self, u: int, ended: bool = False) -> None:
        """Unit u's turn in backward: the units before it that get no gradient here are complete; it
        is gathered, and the gathers of the next `prefetch` units backward meets start."""
        self._reached.add(u)
        self._in_backward.add(u)
        self._passed(self._ahead[u], ended)
        self._wait(u)
        at = self._backward_gathers.index(u)
        for v in self._backward_gathers[at + 1 : at + 1 + self.prefetch]:
            self._gather(v)

    def _gradient_ready(self, u: int) -> None:
        """A gradient of unit u (not the root) was accumulated; once every one this backward computes
        for it was, its turn in backward is over. The first one asks the engine how many will come."""
        expected = self._expected[u]
        if expected is None:
            expected = self._expected[u] = will_compute(self._accumulators[u])
        self._arrived[u] += 1
        if self._arrived[u] < expected:
            return
        if self._accumulating:  # the gradients wait for the last micro-batch; the parameters go
            self._done(u)
            return
        self._complete(self._backward.index(u))

    def _passed(self, ahead: int, ended: bool) -> None:
        """Backward reached a unit: the first `ahead` units of the order have had every gradient it
        computes for them (autograd runs first what forward made last). One that gets none on this
        rank (its output unused here; or any, once backward has `ended`) is complete now, where a rank
        that used it completed it, so that the ranks' collectives stay in the same order."""
        if self._accumulating or self._order is None:
            return
        for position in range(self._order.next, ahead):
            accumulators = self._accumulators[self._backward[position]]
            if self._order.missing[position] and (ended or not will_compute(accumulators)):
                self._complete(position)

    def _complete(self, position: int) -> None:
        """The unit at `position` of the order is complete: it and the complete ones after it reduce,
        strictly in backward's order, once every one before them has."""
        assert self._order is not None
        for start in self._order.arrived(position):
            self._reduce(self._backward[start])

    def _reduce(self, u: int) -> None:
        """Unit u's gradients into a padded bucket each, reduce_scattered into this rank's gradient
        shard; the full gradients dropped, the unit freed. The unit before it must have landed first:
        one unit's reductions in flight at a time, so gradient memory stays the shard and about one
        unit's."""
        assert self.layout is not None and self._grads is not None
        self._settle()
        self._filled = [(b, self._fill(b)) for b in self._buckets[u]]  # alive until settled (declared in wrap())
        for b, bucket in self._filled:
            _, shard_at, size = self.layout.pieces(self._rank)[b]
            if self._native:  # each rank receives only its 1/N slice of the sum
                work = self.comm.reduce_scatter(self._grads[shard_at : shard_at + size], bucket, self._labels[u])
            else:  # gloo's fast path: the whole sum, this rank's slice read after
                work = self.comm.all_reduce(bucket, self._labels[u])
            self._reducing.append((b, bucket, work))
        self._done(u)

    def _fill(self, b: int) -> torch.Tensor:
        """Bucket b's full gradients in a padded buffer of their own; their .grad dropped."""
        assert self.layout is not None and self._grads is not None
        # In the dtype it is reduced in (trainer.reduce_dtype); a gradient that never came counts as zero
        bucket = self._grads.new_zeros(self.layout.buckets[b][1], dtype=self.comm.reduce_dtype or self._grads.dtype)
        for param, at in self._views[b]:
            if param.grad is not None:
                bucket[at : at + param.numel()].copy_(param.grad.view(-1))
                param.grad = None
        return bucket

    def _settle(self) -> None:
        """Wait for the reductions in flight; this rank's slice of each sum, divided by N, in its shard."""
        assert self.layout is not None and self._grads is not None
        for b, bucket, work in self._reducing:
            work.wait()
            _, at, size = self.layout.pieces(self._rank)[b]
            shard = self._grads[at : at + size]
            if self._native:
                shard.div_(dist.get_world_size())
            else:
                torch.div(bucket[self._rank * size : (self._rank + 1) * size], dist.get_world_size(), out=shard)
        self._reducing, self._filled = [], []

    def _done(self, u: int) -> None:
        self._in_backward.discard(u)
        self._arrived[u], self._expected[u] = 0, None
        self._free(u)

    def after_backward(self, model: nn.Module) -> None:
        assert self._arrivals is not None and self.layout is not None and self._order is not None
        self._turns_until(len(self._backward_gathers), ended=True)  # the last units, if backward never reached them
        for u in list(self._gathered):  # backward is over: the root (kept for it) freed before its bucket is filled
            self._free(u)
        # Every rank, the same units in the same order, before any control collective: whichever
        # units a rank reduced during backward, the gradient collectives pair up.
        for position in self._order.rest():
            self._reduce(self._backward[position])
        unused = self._arrivals.unused_everywhere()  # the rule for parameters without a gradient
        self._unused = self.layout.shard_slices(unused, self._rank)
        self._unused_names = [self._arrivals.names[i] for i in unused]
        self._settle()
        self._order.reset()
        assert self._grads is not None
        for piece, (lo, hi) in zip(self._pieces, self.spans, strict=True):  # a plain zero_grad() may have
            piece.grad = self._grads[lo:hi]  # set them to None: the optimizer reads the shard either way

    def optimizer_step(self, optimizer: Optimizer) -> None:
        assert self.param_shard is not None
        assert self._arrivals is not None
        self._skipped.check(optimizer, self._unused_names, self._arrivals.checked)  # agreed: alike on every rank
        with unchanged(self.param_shard, optimizer, self._unused, self.spans):  # one process skips them
            optimizer.step()  # this rank's shard: the next forward gathers each unit anew

    def zero_grad(self, optimizer: Optimizer) -> None:
        """Nothing to clear: every reduction overwrites the shard, and the full gradients were dropped."""

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def footprint(self, plan: Plan) -> Footprint:
        """Its shard of parameters and gradient. In forward and backward the root gathered, and each
        unit with the next `prefetch` (every unit, kept from forward for backward, without
        reshard_after_forward); in backward one unit's full gradients at a time, then its bucket while
        it is reduced; after backward the root's gradients, then its bucket (the root freed first).
        While micro-batches accumulate, every unit's full gradients are kept. The root's gradients that
        come early in backward (a final norm's) are counted after it only, where all of them are."""
        units = unit_parameters(plan.model, self.wrap_policy)
        owner = {id(p): u for u, params in enumerate(units[:-1]) for p in params}
        buckets, per_unit, per_group = unit_buckets(owner, len(units), plan.groups)
        layout = Layout.of(plan.model, buckets, plan.world_size)
        size = plan.trainable[0].element_size()  # one dtype for every trainable parameter (check_one_kind)
        *gathered, root = [sum(layout.buckets[b][1] for b in unit) * size for unit in per_unit]
        # 16-bit parameters: the shards are fp32 (the copy the optimizer steps, its gradient), and a unit's
        # buckets are filled in the dtype they are reduced in
        master = master_dtype(plan.param_dtype).itemsize
        sent = plan.reduce_dtype.itemsize if size < master else size
        *reduced, root_reduced = [sum(layout.buckets[b][1] for b in unit) * sent for unit in per_unit]
        *grads, root_grads = [sum(nbytes(p for b in unit for p in buckets[b])) for unit in per_unit]
        window = 1 + self.prefetch if self.reshard_after_forward else 0
        if plan.accumulating:  # every unit's, kept from micro-batch to micro-batch
            full_grads = [Held("gradients", (*grads, root_grads), 0, ("backward", "after"), beyond=True)]
        else:  # each unit's until its bucket takes them; the root's complete once backward is (an embedding's)
            full_grads = [
                Held("gradients", tuple(grads), 1, ("backward",), beyond=True),
                Held("gradients", (root_grads,), 0, ("after",), beyond=True),
            ]
        held = [
            Held("parameters", (layout.shard_numel * master, *nbytes(plan.frozen))),
            Held("gradients", (layout.shard_numel * master,)),
            *full_grads,
            Held("comm_buffers", (root,), 0, ("forward", "backward")),
            Held("comm_buffers", tuple(gathered), window, ("forward", "backward")),
            Held("comm_buffers", tuple(reduced), 1, ("backward",)),  # the bucket being reduced
            Held("comm_buffers", (*reduced, root_reduced), 1, ("after",)),  # the last unit's, then the root's
        ]
        return Footprint(tuple(held), tuple(hi - lo for lo, hi in layout.group_spans(per_group)))

    def gathered_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state_dict on every rank (a collective): each unit gathered in turn,
        copied, freed (its checkpoints: zero_checkpoint.Zero3Checkpointing)."""
        state = {}
        for u in range(len(self._units)):
            self._wait(u)
            for b in self._buckets[u]:
                for param, _ in self._views[b]:
                    state[id(param)] = param.detach().clone()
            self._free(u)
        return {name: state.get(id(t), t).detach() for name, t in model.state_dict(keep_vars=True).items()}

    def gather_parameters(self) -> None:
        """Nothing to gather after a sharded checkpoint's load: each unit is gathered in its turn."""

    def facts(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "stage": 3,
            "collectives": "all_gather + reduce_scatter" if self._native else "broadcast + all_reduce",
        }
        if self.layout is not None:
            unit_bytes = [sum(self._full[b].numel() * self._full[b].element_size() for b in u) for u in self._buckets]
            info |= {"num_units": len(self._units), "unit_bytes": unit_bytes, "shard_numel": self.layout.shard_numel}
        return info

    def schedule(self) -> Schedule:
        """fsdp's units: each all_gathered before its forward (and its backward, if freed after the
        forward), its gradients reduce_scattered after its backward; the optimizer steps this rank's shard."""
        units = ShardedUnits(self.wrap_policy, reshard_after_forward=self.reshard_after_forward)
        return Schedule(units, optimizer_shard="world")


def unit_buckets(
    owner: dict[int, int], num_units: int, groups: list[tuple[list[nn.Parameter], bool]]
) -> tuple[list[list[nn.Parameter]], list[list[int]], list[int]]:
    """The buckets, one per unit and group, group-major (every unit's decaying parameters, then every
    unit's others: a rank's shard holds each group's elements side by side); each unit's buckets;
    each group's count. A parameter no unit owns is the root's (the last unit)."""
    buckets: list[list[nn.Parameter]] = []
    per_unit: list[list[int]] = [[] for _ in range(num_units)]
    per_group: list[int] = []
    for group, _ in groups:
        per_group.append(0)
        for u in range(num_units):
            params = [p for p in group if p.requires_grad and owner.get(id(p), num_units - 1) == u]
            if params:
                per_unit[u].append(len(buckets))
                buckets.append(params)
                per_group[-1] += 1
    return buckets, per_unit, per_group


def accumulator(param: nn.Parameter) -> Any:
    """The node that accumulates the parameter's gradient (AccumulateGrad). Held, it stays the one
    every backward runs (the parameter itself holds it weakly)."""
    return torch.autograd.graph.get_gradient_edge(param).node


def will_compute(accumulators: list[Any]) -> int:
    """How many of these accumulators the running backward executes: the engine's answer that
    torch's register_multi_grad_hook is built on, asked without that hook, which keeps each incoming
    gradient until the last one comes, so that AccumulateGrad copies it instead of taking it (a
    kernel per gradient and a unit's gradients twice; torch 2.14.1)."""
    return sum(map(torch._C._will_engine_execute_node, accumulators))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        yield from (t for v in value.values() for t in _tensors(v))
    elif isinstance(value, (list, tuple)):
        yield from (t for v in value for t in _tensors(v))
