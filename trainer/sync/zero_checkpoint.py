"""sync=zero in a sharded checkpoint (its sharded_state / load_sharded_state): its shard as per-parameter ranges.

zero's optimizer steps one flat piece of the shard per param group, not the model's parameters,
so torch's state-dict API cannot name its state. Here each per-element entry (exp_avg, ...) of
each trainable parameter is written as the part of that parameter this rank's shard holds: a range
of the flattened parameter, which DCP is told is the blocks of the parameter (shaped like it) that
the range covers (`part`: torch's CheckpointableTensor, a plain tensor that names its global shape
and where its blocks lie in it; no collective). The checkpoint then holds every tensor at the
model's shape, whichever strategy and world size wrote it, as a plain optimizer's state_dict would
(what export, sample and torch's own dcp_to_torch_save read). Saved as one plain tensor per rank
under one key, the shards would be taken as replicas and de-duplicated (all but one lost), and
their padding would depend on N; as blocks of each parameter they read back at any world size. A
scalar entry (Adam's step) is the same for every element and every rank: one plain tensor. Under
stages 1 and 2 the model's parameters are whole on every rank after the gathers: plain tensors,
written once. Under stage 3 (zero3.py, no full buffer: `flat` is None) each trainable parameter is
written as its part too, from the parameter shard, so nothing is gathered to save or load; and so it
is under stages 1 and 2 with 16-bit parameters, whose shard is their fp32 copy (read back, the full
buffer is gathered from every rank's). DCP reads either form into the other.

zero.py's and zero3.py's methods call these; they read the layout through the public attributes
kept for checkpoints (layout, spans, flat, param_shard, full_groups).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer.sync.checkpointing import Checkpointing
from trainer.sync.flat import names_of
from trainer.sync.master import Masters
from trainer.sync.sharded_state import Read, optimizer_entries
from trainer.sync.zero_state import (
    Layout,
    _group_of,
    _is_piece,
    gather_full_model,
    gather_full_state,
    shard_of_full_model,
    shard_of_full_state,
)

if TYPE_CHECKING:  # DCP is imported where a checkpoint is written or read (trainer/reliability/sharded.py)
    from torch.distributed.checkpoint import CheckpointableTensor

    from trainer.sync.comm import Comm


class ZeroShard(Protocol):
    """What these read of ZeroSync and Zero3Sync: the layout and shard, public for checkpoints."""

    layout: Layout | None
    spans: list[tuple[int, int]]
    flat: torch.Tensor | None  # the full parameters (stages 1, 2); None where they are sharded (stage 3)
    param_shard: torch.Tensor | None
    full_groups: list[list[int]]
    comm: Comm
    masters: Masters

    def wait_for_parameters(self) -> None: ...

    def gather_parameters(self) -> None: ...


class Zero3Shard(ZeroShard, Protocol):
    """Stage 3 gathers its units for a full model."""

    def gathered_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]: ...


class ZeroCheckpointing(Checkpointing):
    """sync=zero's checkpoints: the optimizer steps this rank's slice of a flat shard, so the full
    state is gathered from the slices, and a loaded one is cut back into them. Stages 1 and 2 hold
    the full parameters on every rank; stage 3 gathers them unit by unit (Zero3Checkpointing)."""

    def __init__(self, strategy: ZeroShard) -> None:
        super().__init__(strategy.masters)
        self.strategy = strategy

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full on every rank already; 16-bit parameters: their fp32 copies, gathered from the shards."""
        zero = self.strategy
        assert zero.layout is not None and zero.flat is not None and zero.param_shard is not None
        if zero.param_shard.dtype == zero.flat.dtype:
            return model.state_dict()
        return gather_full_model(model, zero.layout, zero.param_shard, zero.comm)

    def state_dicts(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The full model, and the optimizer's state gathered into a plain optimizer's terms (collectives)."""
        zero = self.strategy
        assert zero.layout is not None, "build_optimizer() first"
        zero.wait_for_parameters()
        state = gather_full_state(optimizer.state_dict(), zero.layout, zero.spans, zero.full_groups, zero.comm)
        return self.full_model_state(model), state

    def load_state_dicts(
        self, model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        zero = self.strategy
        assert zero.layout is not None and zero.param_shard is not None
        zero.wait_for_parameters()  # a gather landing after the load would overwrite it
        model.load_state_dict(model_state)  # copies into the parameters: into the flat buffer
        self._load_shards(model, optimizer, model_state, optimizer_state)

    def _load_shards(
        self, model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        """This rank's slices of the file's parameters (its values, not the buffer's: 16-bit ones are
        rounded there) and of its optimizer state."""
        zero, rank = self.strategy, dist.get_rank()
        assert zero.layout is not None and zero.param_shard is not None
        with torch.no_grad():
            zero.param_shard.copy_(shard_of_full_model(model, zero.layout, rank, model_state, zero.param_shard))
        optimizer.load_state_dict(shard_of_full_state(optimizer_state, zero.layout, rank, zero.spans, zero.full_groups))

    def sharded_state(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Its shard as per-parameter ranges: the optimizer steps a flat shard."""
        return state_parts(self.strategy, model, optimizer)

    def load_sharded_state(
        self, model: nn.Module, optimizer: Optimizer, saved: dict[str, Any], read: Read, groups: list[Any]
    ) -> None:
        load_state_parts(self.strategy, model, optimizer, saved, read, groups)


class Zero3Checkpointing(ZeroCheckpointing):
    """Stage 3: no rank holds the full parameters between steps."""

    def __init__(self, strategy: Zero3Shard) -> None:
        super().__init__(strategy)
        self.zero3 = strategy

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state_dict on every rank (a collective); 16-bit parameters: their fp32
        copies, gathered from the shards."""
        zero = self.strategy
        assert zero.layout is not None and zero.param_shard is not None
        if any(p.dtype != zero.param_shard.dtype for p in model.parameters() if p.requires_grad):
            return gather_full_model(model, zero.layout, zero.param_shard, zero.comm)
        return self.zero3.gathered_model_state(model)

    def load_state_dicts(
        self, model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        """Every rank read the whole file: each keeps its own shard of the parameters and optimizer state."""
        own = model.state_dict(keep_vars=True)  # a tied parameter under each of its names
        missing, unexpected = sorted(own.keys() - model_state.keys()), sorted(model_state.keys() - own.keys())
        if missing or unexpected:  # what load_state_dict(strict=True) refuses, before anything is changed
            raise RuntimeError(
                f"the checkpoint's model does not match: missing keys {missing}, unexpected keys {unexpected}"
            )
        self._load_shards(model, optimizer, model_state, optimizer_state)
        sharded = {id(p) for p in model.parameters() if p.requires_grad}  # their storage is freed: never written
        rest = {k: v for k, v in model_state.items() if id(own[k]) not in sharded}
        model.load_state_dict(rest, strict=False)  # buffers and frozen parameters, whole on every rank


Chunk = tuple[int, int, int]  # (start, end) in the flattened parameter, and where the start lies in the shard
Block = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a block of a tensor, one per dimension


def chunk(layout: Layout, i: int, rank: int) -> Chunk:
    """Rank's chunk of trainable parameter i (layout order): (0, 0, 0) where it holds none."""
    offset, numel = layout.offsets[i], layout.shapes[i].numel()
    for lo, at, size in layout.pieces(rank):
        a, b = max(offset, lo), min(offset + numel, lo + size)
        if a < b:  # a parameter lies in one bucket: one contiguous chunk per rank at most
            return a - offset, b - offset, at + a - lo
    return 0, 0, 0


def blocks(start: int, end: int, shape: tuple[int, ...]) -> list[Block]:
    """[start, end) of a row-major tensor of `shape`, flattened, as the fewest blocks that make it up
    (each contiguous in memory): the end of a first row, the whole rows, the start of a last row,
    the partial rows split the same way in their own dimensions. DCP's chunks are blocks."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])  # elements per row (per index of dimension 0)
    full_lo, full_hi = -(-start // inner), end // inner  # the whole rows: [full_lo, full_hi)
    if full_lo > full_hi:  # inside one row
        row = start // inner
        return [((row, *o), (1, *s)) for o, s in blocks(start - row * inner, end - row * inner, shape[1:])]
    out = []
    if start < full_lo * inner:
        row = full_lo - 1
        out += [((row, *o), (1, *s)) for o, s in blocks(start - row * inner, inner, shape[1:])]
    if full_lo < full_hi:
        out.append(((full_lo, *(0 for _ in shape[1:])), (full_hi - full_lo, *shape[1:])))
    if full_hi * inner < end:
        out += [((full_hi, *o), (1, *s)) for o, s in blocks(0, end - full_hi * inner, shape[1:])]
    return out


def part(values: torch.Tensor, start: int, shape: torch.Size) -> torch.Tensor:
    """values, the range [start, start + values.numel()) of a flattened tensor of `shape`, as DCP's
    CheckpointableTensor: the blocks of that tensor the range covers, each a slice of one view of
    values (no copy: written from and read into in place).

    DCP wants every block a slice of one local tensor of the tensor's dimensions. A view with the
    tensor's own row-major strides lays each block out as the tensor does; a block's place in it
    is its start in values written in those strides (each digit as large as the view's size leaves
    room for, the rest in the last dimension), so the view's rows overlap in memory and it spans
    exactly values' elements (tests/test_sharded_export.py checks every range of several shapes).
    """
    spans = blocks(start, start + values.numel(), tuple(shape))
    local_offsets: list[tuple[int, ...]]
    if not shape or not spans:  # a 0-d tensor (one element), or none of it here
        local = values.view(spans[0][1]) if spans else values
        local_offsets = [() for _ in spans]
    else:
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        size = [max(sizes[d] for _, sizes in spans) for d in range(len(shape))]
        local_offsets = []
        for offsets, sizes in spans:
            left = sum(o * st for o, st in zip(offsets, strides, strict=True)) - start  # its start in values
            digits = []
            for d in range(len(shape) - 1):
                digits.append(min(left // strides[d], size[d] - sizes[d]))
                left -= digits[-1] * strides[d]
            local_offsets.append((*digits, left))
        size[-1] = max(at[-1] + sizes[-1] for at, (_, sizes) in zip(local_offsets, spans, strict=True))
        local = values.as_strided(size, strides)
    said = cast("CheckpointableTensor", local)  # the attributes DCP reads: no wrapper, no subclass
    said.global_shape = tuple(shape)
    said.global_offsets = tuple(o for o, _ in spans)
    said.local_offsets = tuple(local_offsets)
    said.local_sizes = tuple(s for _, s in spans)
    return local


def values_of(part: torch.Tensor, numel: int) -> torch.Tensor:
    """A part's range back as the flat values it views."""
    return part.as_strided((numel,), (1,))


def _parameter_parts(strategy: ZeroShard, model: nn.Module) -> dict[str, torch.Tensor]:
    """Stage 3: every state_dict name of a trainable parameter (a tied one has several), as this
    rank's part of it: a view of the parameter shard, written from and read into in place."""
    assert strategy.layout is not None and strategy.param_shard is not None
    layout, rank = strategy.layout, dist.get_rank()
    index = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}  # layout order
    parts = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        i = index.get(id(tensor))
        if i is not None:
            a, b, at = chunk(layout, i, rank)
            parts[name] = part(strategy.param_shard[at : at + b - a], a, layout.shapes[i])
    return parts


def _from_shard(strategy: ZeroShard) -> bool:
    """Whether the model's trainable parameters are written and read as parts of the parameter shard:
    under stage 3 (no full buffer), and where the shard is the fp32 copy of 16-bit parameters (its
    values, not their rounding, are what a resumed run continues from)."""
    assert strategy.param_shard is not None
    return strategy.flat is None or strategy.flat.dtype != strategy.param_shard.dtype


def _named(strategy: ZeroShard, model: nn.Module) -> tuple[Layout, list[str], list[int]]:
    assert strategy.layout is not None, "wrap() and build_optimizer() first"
    layout = strategy.layout
    trainable = [p for p in model.parameters() if p.requires_grad]  # layout order
    return layout, names_of(model, trainable), _group_of(layout, strategy.spans)


def state_parts(
    strategy: ZeroShard, model: nn.Module, optimizer: Optimizer
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rank = dist.get_rank()
    strategy.wait_for_parameters()  # the model's parameters whole before they are written
    layout, names, group_of = _named(strategy, model)
    tensors: dict[str, Any] = {f"model/{name}": value for name, value in model.state_dict().items()}
    shard_state = optimizer.state_dict()
    for i, name in enumerate(names):
        lo, hi = strategy.spans[group_of[i]]
        a, b, at = chunk(layout, i, rank)
        for key, value in shard_state["state"].get(group_of[i], {}).items():
            if _is_piece(value, lo, hi):
                tensors[f"optim/{name}/{key}"] = part(value[at - lo : at - lo + b - a], a, layout.shapes[i])
            else:
                tensors[f"optim/{name}/{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    if _from_shard(strategy):  # each parameter (under each of its names) is this rank's part of it
        tensors.update({f"model/{name}": p for name, p in _parameter_parts(strategy, model).items()})
    all_names = names_of(model, list(model.parameters()))
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [all_names[p] for p in positions]}
        for group, positions in zip(shard_state["param_groups"], strategy.full_groups, strict=True)
    ]
    return tensors, groups


def _per_element_keys(saved: dict[str, Any]) -> set[str]:
    """The optimizer keys saved with one value per parameter element: those with dimensions (a
    scalar such as Adam's step is 0-d). A 0-d parameter's per-element state is as 0-d as a step;
    any parameter with dimensions tells them apart (zero_state._per_element's rule)."""
    return {flat.rpartition("/")[2] for flat, meta in saved.items() if flat.startswith("optim/") and len(meta.size)}


def load_state_parts(
    strategy: ZeroShard, model: nn.Module, optimizer: Optimizer, saved: dict[str, Any], read: Read, groups: list[Any]
) -> None:
    rank = dist.get_rank()
    strategy.wait_for_parameters()  # a gather landing after the load would overwrite it
    assert strategy.param_shard is not None
    layout, names, group_of = _named(strategy, model)
    template: dict[str, Any] = {f"model/{name}": value for name, value in model.state_dict().items()}  # in place
    index = {name: i for i, name in enumerate(names)}
    from_shard = _from_shard(strategy)
    if from_shard:  # each trainable parameter read as this rank's part, into its shard
        template.update({f"model/{name}": p for name, p in _parameter_parts(strategy, model).items()})
    per_element = _per_element_keys(saved)
    for flat, meta in saved.items():
        if flat.startswith("optim/"):
            name, _, key = flat.removeprefix("optim/").rpartition("/")
            a, b, _ = chunk(layout, index[name], rank)
            if key in per_element:
                local = torch.zeros(b - a, dtype=meta.properties.dtype, device=strategy.param_shard.device)
                template[flat] = part(local, a, layout.shapes[index[name]])
            else:
                template[flat] = torch.zeros(meta.size, dtype=meta.properties.dtype)
    read(template)  # parts land in the shard itself (they are views of it)
    if strategy.flat is not None and from_shard:  # the full parameters from every rank's fp32 copy
        strategy.gather_parameters()
    elif strategy.flat is not None:
        with torch.no_grad():
            strategy.param_shard.copy_(layout.shard_of(strategy.flat, rank))
    optimizer.load_state_dict(_shard_state(strategy, template, names, group_of, groups, layout, per_element))


def _shard_state(
    strategy: ZeroShard,
    loaded: dict[str, Any],
    names: list[str],
    group_of: list[int],
    groups: list[dict[str, Any]],
    layout: Layout,
    per_element: set[str],
) -> dict[str, Any]:
    """The loaded per-parameter parts put back together as the shard optimizer's state_dict."""
    rank = dist.get_rank()
    assert strategy.param_shard is not None
    device = strategy.param_shard.device
    state: dict[int, dict[str, Any]] = {}
    entries = optimizer_entries(loaded)
    for i, name in enumerate(names):
        g = group_of[i]
        lo, hi = strategy.spans[g]
        a, b, at = chunk(layout, i, rank)
        pieces = state.setdefault(g, {})
        for key, value in entries.get(name, {}).items():
            if key in per_element:  # this rank's part, at its place in the group's piece
                if key not in pieces:
                    pieces[key] = torch.zeros(hi - lo, dtype=value.dtype, device=device)  # padding stays zero
                pieces[key][at - lo : at - lo + b - a] = values_of(value, b - a)
            else:
                pieces[key] = value
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    return {"state": state, "param_groups": [{**h, "params": [g]} for g, h in enumerate(hyper)]}
