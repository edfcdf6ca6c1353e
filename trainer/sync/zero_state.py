"""sync=zero's flat shard: where each parameter lies in it, what it requires, and its state in the
full model's terms (what checkpoints hold).

The shard optimizer has one parameter, this rank's 1/N slice of a flat padded buffer laid out by
`Layout`. That is only the same training as one process when every trainable parameter shares a
dtype and device (one buffer) and the optimizer is element-wise (the update of an element depends
only on that element): check_one_kind and check_optimizer refuse the rest, known only with the
model and the optimizer. A parameter no rank used gets no update although the optimizer steps on
the whole shard: `unchanged` keeps its slice of the shard and of the per-element optimizer state
as it was (one process's optimizer skips a parameter without a gradient).

A checkpoint must not depend on the layout: it holds the state a plain
`factory(model.parameters())` optimizer would have (integer keys in model.parameters() order, one
tensor per parameter shaped like it), so it reads the same whichever strategy wrote it. Gathering
is a collective (every rank calls it, in the same key order); scattering is local (every rank
reads the full dicts from the file and keeps its own slice).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainer.errors import ConfigError
from trainer.sync.comm import Comm


@dataclass(frozen=True)
class Layout:
    """Where each trainable parameter lies in the flat buffer, and which of model.parameters() it is.

    The buffer is bucket-major: the buckets (groups of parameters, in the order their gradients
    are reduced) one after another, each padded to a multiple of the world size, so that each
    bucket's reduce_scatter and all_gather split it evenly. Rank r's shard is the concatenation of
    its 1/N slice of every bucket: `pieces(r)` says which.
    """

    indices: list[int]  # position in model.parameters() (parameters with requires_grad=False are not in the buffer)
    shapes: list[torch.Size]
    offsets: list[int]  # in the padded, bucket-major buffer
    num_params: int  # every parameter of the model, untrainable ones included: the full state's key range
    numel: int  # trainable elements
    padded_numel: int  # the buffer: every bucket rounded up to a multiple of the world size
    world_size: int
    buckets: list[tuple[int, int]]  # per bucket, (start, padded numel) in the buffer

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @staticmethod
    def of(model: nn.Module, groups: Sequence[Sequence[nn.Parameter]], world_size: int) -> Layout:
        """The layout of these buckets (every trainable parameter of the model in exactly one)."""
        params = list(model.parameters())
        position = {id(p): i for i, p in enumerate(params)}
        offset_of: dict[int, int] = {}
        buckets, start = [], 0
        for group in groups:
            offset = start
            for param in group:
                offset_of[position[id(param)]] = offset
                offset += param.numel()
            padded = -(-(offset - start) // world_size) * world_size
            buckets.append((start, padded))
            start += padded
        indices = [i for i, p in enumerate(params) if p.requires_grad]
        assert sorted(offset_of) == indices, "every trainable parameter in exactly one bucket"
        shapes = [params[i].shape for i in indices]
        numel = sum(shape.numel() for shape in shapes)
        return Layout(indices, shapes, [offset_of[i] for i in indices], len(params), numel, start, world_size, buckets)

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """Rank's shard as (start in the buffer, start in the shard, length), one per bucket."""
        out, shard_at = [], 0
        for start, padded in self.buckets:
            size = padded // self.world_size
            out.append((start + rank * size, shard_at, size))
            shard_at += size
        return out

    def group_spans(self, buckets_per_group: Sequence[int]) -> list[tuple[int, int]]:
        """Each group's [lo, hi) in a rank's shard: its buckets are consecutive, so their slices are."""
        spans, first, at = [], 0, 0
        for count in buckets_per_group:
            size = sum(n for _, _, n in self.pieces(0)[first : first + count])
            spans.append((at, at + size))
            first, at = first + count, at + size
        return spans

    def shard_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's shard of a flat buffer of this layout (a copy: its pieces are not contiguous)."""
        return torch.cat([flat[lo : lo + n] for lo, _, n in self.pieces(rank)])

    def gather(self, comm: Comm, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's shard into `flat`, bucket by bucket (collectives: every rank must reach them)."""
        works = [
            comm.all_gather(flat[start : start + padded], shard[at : at + n], index)
            for index, ((start, padded), (_, at, n)) in enumerate(zip(self.buckets, self.pieces(0), strict=True))
        ]
        for work in works:
            work.wait()

    def shard_slices(self, trainable: list[int], rank: int) -> list[tuple[int, int]]:
        """The parts of rank's shard, as [lo, hi) in the shard, that the given trainable parameters
        (positions in layout order) occupy."""
        slices = []
        for i in trainable:
            first, last = self.offsets[i], self.offsets[i] + self.shapes[i].numel()
            for lo, at, n in self.pieces(rank):
                a, b = max(first, lo), min(last, lo + n)
                if a < b:
                    slices.append((a - lo + at, b - lo + at))
        return slices

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per trainable parameter, shaped like it, from a flat (padded) buffer."""
        return [
            flat[offset : offset + shape.numel()].view(shape)
            for offset, shape in zip(self.offsets, self.shapes, strict=True)
        ]


def gather_full_state(
    shard_state: dict[str, Any],
    layout: Layout,
    spans: Sequence[tuple[int, int]],
    full_groups: Sequence[list[int]],
    comm: Comm,
) -> dict[str, Any]:
    """The full optimizer state dict from the shard optimizer's state_dict(); a collective.

    The shard optimizer has one parameter per group, each a piece of the shard (`spans`). A
    per-element entry (exp_avg, momentum_buffer, ...) is put back together from the pieces into a
    shard-sized tensor, all_gathered, the padding stripped, split per parameter. Anything else
    (Adam's 0-d "step", a float) is the same for every element of a group, so each parameter gets
    its group's. The groups list the model's parameters as a plain optimizer built on
    model.parameters() would (`full_groups`). It runs between steps (checkpoints), which the observer
    never samples: the rows' comm/* stay per training step.
    """
    groups = shard_state["param_groups"]
    states = [shard_state["state"].get(g, {}) for g in range(len(groups))]  # empty before the first step
    group_of = _group_of(layout, spans)
    per_param: list[dict[str, Any]] = [{} for _ in layout.indices]
    # The same keys in the same order on every rank: same optimizer, same steps.
    for key in next((state for state in states if state), {}):
        values = [state.get(key) for state in states]
        if all(_is_piece(v, lo, hi) for v, (lo, hi) in zip(values, spans, strict=True)):
            shard = torch.cat([v for v in values if v is not None]) if len(values) > 1 else values[0]
            assert isinstance(shard, torch.Tensor)
            full = shard.new_empty(layout.padded_numel)
            layout.gather(comm, full, shard.contiguous())  # every rank must reach this
            pieces: list[Any] = layout.split(full)
        else:
            pieces = [_copy(values[g]) for g in group_of]
        for state, piece in zip(per_param, pieces, strict=True):
            state[key] = piece
    ids = _ids(full_groups)
    return {
        "state": {ids[index]: state for index, state in zip(layout.indices, per_param, strict=True) if state},
        "param_groups": [
            {**group, "params": [ids[i] for i in params]} for group, params in zip(groups, full_groups, strict=True)
        ],
    }


def gather_full_model(model: nn.Module, layout: Layout, shard: torch.Tensor, comm: Comm) -> dict[str, torch.Tensor]:
    """model.state_dict() with every trainable parameter's value taken from the ranks' shards, in the
    shard's dtype (a collective): the fp32 copy the optimizer steps, where the parameters are 16-bit."""
    full = shard.new_empty(layout.padded_numel)
    layout.gather(comm, full, shard)  # every rank must reach this
    trainable = [p for p in model.parameters() if p.requires_grad]  # layout order
    value = {id(p): v for p, v in zip(trainable, layout.split(full), strict=True)}
    return {name: value.get(id(t), t).detach() for name, t in model.state_dict(keep_vars=True).items()}


def shard_of_full_model(
    model: nn.Module, layout: Layout, rank: int, state: dict[str, Any], like: torch.Tensor
) -> torch.Tensor:
    """The reverse, locally: rank's shard of the trainable parameters' values in a full state_dict
    (read from a checkpoint), in `like`'s dtype and on its device."""
    names = {id(p): name for name, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    full = torch.zeros(layout.padded_numel, dtype=like.dtype, device=like.device)
    for view, param in zip(layout.split(full), trainable, strict=True):
        view.copy_(state[names[id(param)]])
    return layout.shard_of(full, rank)


def _ids(full_groups: Sequence[list[int]]) -> dict[int, int]:
    """Each parameter's id in a plain optimizer's state_dict (torch numbers them in order of
    appearance, group after group) by its position in model.parameters()."""
    return {position: i for i, position in enumerate(p for group in full_groups for p in group)}


def shard_of_full_state(
    full_state: dict[str, Any],
    layout: Layout,
    rank: int,
    spans: Sequence[tuple[int, int]],
    full_groups: Sequence[list[int]],
) -> dict[str, Any]:
    """The reverse, locally: this rank's pieces of the full state, as the shard optimizer's state_dict."""
    groups = full_state["param_groups"]
    if len(groups) != len(spans):
        raise ValueError(
            f"sync=zero loads optimizer state with {len(spans)} param group(s) (optim.weight_decay_on); "
            f"this one has {len(groups)}"
        )
    shard_groups = [{**group, "params": [g]} for g, group in enumerate(groups)]
    ids = _ids(full_groups)
    states = [full_state["state"].get(ids[index]) for index in layout.indices]
    if not any(states):  # saved before the first optimizer step
        return {"state": {}, "param_groups": shard_groups}
    if not all(states):
        missing = [ids[index] for index, state in zip(layout.indices, states, strict=True) if not state]
        raise ValueError(f"optimizer state has no entry for trainable parameter(s) {missing}: cannot shard it")
    present: list[dict[str, Any]] = [state for state in states if state]
    group_of = _group_of(layout, spans)
    mine: list[dict[str, Any]] = [{} for _ in spans]
    for key in present[0]:
        values = [state[key] for state in present]
        if _per_element(values, layout.shapes):
            flat = values[0].new_zeros(layout.padded_numel)  # the padding stays zero
            for view, value in zip(layout.split(flat), values, strict=True):
                view.copy_(value)
            shard = layout.shard_of(flat, rank)  # its own memory: the checkpoint's tensors are not kept alive
            for g, (lo, hi) in enumerate(spans):
                mine[g][key] = shard[lo:hi].clone() if len(spans) > 1 else shard
        else:
            for g in range(len(spans)):
                first = next((v for v, of in zip(values, group_of, strict=True) if of == g), values[0])
                mine[g][key] = _copy(first)
    return {"state": dict(enumerate(mine)), "param_groups": shard_groups}


def _group_of(layout: Layout, spans: Sequence[tuple[int, int]]) -> list[int]:
    """Each trainable parameter's group (in layout order): the span its bucket's shard slice falls in."""
    pieces = layout.pieces(0)
    out = []
    for offset in layout.offsets:
        bucket = next(b for b, (start, padded) in enumerate(layout.buckets) if start <= offset < start + padded)
        at = pieces[bucket][1]
        out.append(next(g for g, (lo, hi) in enumerate(spans) if lo <= at < hi))
    return out


def _is_piece(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == hi - lo


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _per_element(values: Sequence[Any], shapes: Sequence[torch.Size]) -> bool:
    """Whether a state entry has one value per parameter element: shaped like every parameter.

    A 0-d parameter's per-element state is as 0-d as a scalar "step"; any parameter with dims
    tells them apart, so a model whose trainable parameters are all 0-d reads its state as scalar.
    """
    shaped = all(isinstance(v, torch.Tensor) and v.shape == s for v, s in zip(values, shapes, strict=True))
    return shaped and any(len(shape) > 0 for shape in shapes)


# Optimizers whose update of an element depends only on that element's parameter, gradient and
# state (and on scalars such as the step count): on a flat shard they compute exactly what they
# compute on the parameters. An allowlist, not a denylist: an optimizer not known to be
# element-wise (LBFGS's line search over all parameters, Adafactor's row/column factors, Muon's
# orthogonalised matrices, SparseAdam's sparse gradients, a third-party LAMB's per-layer trust
# ratio) would silently train a different model on a shard.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
)


# Optimizers whose update of an element also depends on its parameter's own step count (Adam's bias
# corrections, ASGD's averaging, Adagrad's lr_decay). One process skips a parameter without a
# gradient, its count included; a flat shard has one count per piece, which every step advances.
STEP_COUNTED = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Adagrad,
)


class Skipped:
    """Parameters no rank used in some step (find_unused_parameters=true; agreed, so alike on every
    rank). unchanged() keeps them and their state as they were, so a parameter never used again
    trains as in one process; one that gets gradients again would be stepped with its piece's count,
    which advanced while one process's stood still: refused at that step, before it diverges."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.names: set[str] = set()

    def check(self, optimizer: Optimizer, unused_now: Sequence[str], step: int) -> None:
        back = sorted(self.names.difference(unused_now))
        if back and isinstance(optimizer, STEP_COUNTED):
            raise ConfigError(
                f"sync=zero (stage {self.stage}) cannot step parameter(s) {back[:5]} in step {step} with "
                f"torch.optim.{type(optimizer).__name__}: no rank used them in an earlier step, and the step count "
                "that sets their update's bias correction is one for a whole piece of the flat shard, so it "
                "advanced where one process's stood still; use sync=ddp or sync=manual with "
                "sync.find_unused_parameters=true, or an optimizer without a step count (torch.optim.SGD, RMSprop)"
            )
        self.names.update(unused_now)


def check_optimizer(optimizer: Optimizer, pieces: Sequence[nn.Parameter]) -> None:
    """The shard optimizer must be element-wise and hold each piece of the shard as one group's one parameter."""
    cls = type(optimizer)
    # The name a config would use: torch.optim.LBFGS rather than torch.optim.lbfgs.LBFGS.
    exported = getattr(torch.optim, cls.__name__, None) is cls
    name = f"torch.optim.{cls.__name__}" if exported else f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(optimizer, ELEMENTWISE):
        raise ConfigError(
            f"optim._target_={name} is invalid with sync=zero: {cls.__name__} is not known to be element-wise, "
            "and sync=zero runs the optimizer on a flat 1/N slice of all parameters, which only gives the "
            "same update for element-wise optimizers; accepted: "
            + ", ".join(f"torch.optim.{c.__name__}" for c in ELEMENTWISE)
            + "; or use sync=ddp"
        )
    groups = optimizer.param_groups
    held = [group["params"] for group in groups]
    if len(held) != len(pieces) or any(len(ps) != 1 or ps[0] is not p for ps, p in zip(held, pieces, strict=False)):
        raise ConfigError(
            f"optim._target_={name} built {len(groups)} param groups: sync=zero gives the optimizer one flat "
            f"parameter per group of optim.weight_decay_on ({len(pieces)} here), so other groups cannot apply"
        )


def check_one_kind(params: list[nn.Parameter]) -> None:
    """One flat buffer holds every trainable parameter, so they must share a dtype and a device."""
    if not params:
        raise ConfigError("sync=zero needs a model with trainable parameters; this one has none")
    kinds = sorted({f"{p.dtype} on {p.device}" for p in params})
    if len(kinds) > 1:
        raise ConfigError(
            f"sync=zero lays every trainable parameter into one flat buffer, so they must share one dtype "
            f"and device; this model mixes {', '.join(kinds)}: cast the model to one dtype, or use sync=ddp"
        )


def _per_element_state(optimizer: Optimizer, spans: Sequence[tuple[int, int]]) -> list[tuple[int, torch.Tensor]]:
    """(where in the shard it starts, tensor) of each per-element state entry of every piece."""
    out = []
    for group, (lo, _) in zip(optimizer.param_groups, spans, strict=True):
        (piece,) = group["params"]
        for value in optimizer.state.get(piece, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == piece.shape:
                out.append((lo, value))
    return out


def _within(value: torch.Tensor, start: int, lo: int, hi: int) -> torch.Tensor | None:
    """value's part for the shard's [lo, hi), if that lies in the piece starting at `start`."""
    return value[lo - start : hi - start] if start <= lo and hi <= start + value.numel() else None


@contextmanager
def unchanged(
    shard: torch.Tensor, optimizer: Optimizer, slices: list[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> Iterator[None]:
    """Around the optimizer step: the shard's parameters and per-element optimizer state in `slices`
    (parameters no rank used) come out as they went in; state the step created there (Adam's
    moments on its first step) starts at zero. One process's optimizer skips such a parameter."""
    if not slices:  # the usual step: nothing kept, nothing looked up
        yield
        return
    kept = [(shard[lo:hi], shard[lo:hi].clone()) for lo, hi in slices]
    for start, value in _per_element_state(optimizer, spans):
        kept += [(view, view.clone()) for lo, hi in slices if (view := _within(value, start, lo, hi)) is not None]
    yield
    with torch.no_grad():
        for view, copy in kept:
            view.copy_(copy)
        restored = {view.data_ptr() for view, _ in kept}
        for start, value in _per_element_state(optimizer, spans):
            for lo, hi in slices:
                part = _within(value, start, lo, hi)
                if part is not None and part.data_ptr() not in restored:
                    part.zero_()
