"""sync=zero in a sharded checkpoint (its sharded_state / load_sharded_state): its shard as per-parameter ranges.

zero's optimizer steps one flat piece of the shard per param group, not the model's parameters,
so torch's state-dict API cannot name its state. Here each per-element entry (exp_avg, ...) of
each trainable parameter becomes a ShardedTensor over the flattened parameter: this rank's chunk
is the part of the parameter its shard holds, at its offset, and the metadata lists every rank's
chunk (computed from the layout, no collective). Saved as one plain tensor per rank under one key,
the shards would be taken as replicas and de-duplicated (all but one lost), and their padding
would depend on N; as ranges of each parameter they read back at any world size. A scalar entry
(Adam's step) is the same for every element and every rank: one plain tensor. Under stages 1 and
2 the model's parameters are whole on every rank after the gathers: plain tensors, written once.
Under stage 3 (zero3.py, no full buffer: `flat` is None) each trainable parameter is written as
its ranges too, from the parameter shard, so nothing is gathered to save or load; torch's DCP
reads either form into the other, so a checkpoint moves between the stages and world sizes.

zero.py's and zero3.py's methods call these; they read the layout through the public attributes
kept for checkpoints (layout, spans, flat, param_shard, full_groups).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.optim import Optimizer

from trainer.sync.flat import names_of
from trainer.sync.sharded_state import Read, optimizer_entries
from trainer.sync.zero_state import Layout, _group_of, _is_piece


class ZeroShard(Protocol):
    """What these read of ZeroSync and Zero3Sync: the layout and shard, public for checkpoints."""

    layout: Layout | None
    spans: list[tuple[int, int]]
    flat: torch.Tensor | None  # the full parameters (stages 1, 2); None where they are sharded (stage 3)
    param_shard: torch.Tensor | None
    full_groups: list[list[int]]

    def wait_for_parameters(self) -> None: ...


Chunk = tuple[int, int, int]  # (start, end) in the flattened parameter, and where the start lies in the shard


def chunks(layout: Layout, i: int) -> list[Chunk]:
    """Every rank's chunk of trainable parameter i (layout order): (0, 0, 0) for a rank holding none."""
    offset, numel = layout.offsets[i], layout.shapes[i].numel()
    out = []
    for rank in range(layout.world_size):
        found = (0, 0, 0)
        for lo, at, size in layout.pieces(rank):
            a, b = max(offset, lo), min(offset + numel, lo + size)
            if a < b:  # a parameter lies in one bucket: one contiguous chunk per rank at most
                found = (a - offset, b - offset, at + a - lo)
                break
        out.append(found)
    return out


def _sharded(local: torch.Tensor, mine: Chunk, every: list[Chunk], numel: int, rank: int) -> ShardedTensor:
    device = str(local.device)
    metas = [ShardMetadata([a], [b - a], f"rank:{r}/{device}") for r, (a, b, _) in enumerate(every) if b > a]
    shards = [Shard(local, ShardMetadata([mine[0]], [mine[1] - mine[0]], f"rank:{rank}/{device}"))]
    properties = TensorProperties(dtype=local.dtype)
    global_meta = ShardedTensorMetadata(metas, torch.Size([numel]), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards if mine[1] > mine[0] else [], global_meta)


def _parameter_ranges(strategy: ZeroShard, model: nn.Module) -> dict[str, ShardedTensor]:
    """Stage 3: every state_dict name of a trainable parameter (a tied one has several), as this
    rank's range of it: a view of the parameter shard, written from and read into in place."""
    assert strategy.layout is not None and strategy.param_shard is not None
    layout, rank = strategy.layout, dist.get_rank()
    index = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}  # layout order
    ranges = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        i = index.get(id(tensor))
        if i is not None:
            every = chunks(layout, i)
            a, b, at = every[rank]
            ranges[name] = _sharded(strategy.param_shard[at : at + b - a], (a, b, at), every, tensor.numel(), rank)
    return ranges


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
        g, every = group_of[i], chunks(layout, i)
        lo, hi = strategy.spans[g]
        a, b, at = every[rank]
        for key, value in shard_state["state"].get(g, {}).items():
            if _is_piece(value, lo, hi):
                local = value[at - lo : at - lo + b - a]
                tensors[f"optim/{name}/{key}"] = _sharded(local, (a, b, at), every, layout.shapes[i].numel(), rank)
            else:
                tensors[f"optim/{name}/{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    if strategy.flat is None:  # stage 3: each parameter (under each of its names) is this rank's range of it
        tensors.update({f"model/{name}": part for name, part in _parameter_ranges(strategy, model).items()})
    all_names = names_of(model, list(model.parameters()))
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [all_names[p] for p in positions]}
        for group, positions in zip(shard_state["param_groups"], strategy.full_groups, strict=True)
    ]
    return tensors, groups


def load_state_parts(
    strategy: ZeroShard, model: nn.Module, optimizer: Optimizer, saved: dict[str, Any], read: Read, groups: list[Any]
) -> None:
    rank = dist.get_rank()
    strategy.wait_for_parameters()  # a gather landing after the load would overwrite it
    assert strategy.param_shard is not None
    layout, names, group_of = _named(strategy, model)
    template: dict[str, Any] = {f"model/{name}": value for name, value in model.state_dict().items()}  # in place
    index = {name: i for i, name in enumerate(names)}
    if strategy.flat is None:  # stage 3: each trainable parameter read as this rank's range, into its shard
        template.update({f"model/{name}": part for name, part in _parameter_ranges(strategy, model).items()})
    for flat, meta in saved.items():
        if flat.startswith("optim/"):
            i = index[flat.removeprefix("optim/").rpartition("/")[0]]
            every, numel = chunks(layout, i), layout.shapes[i].numel()
            a, b, at = every[rank]
            if tuple(meta.size) == (numel,) and numel > 0 and len(meta.size) == 1:
                local = torch.zeros(b - a, dtype=meta.properties.dtype, device=strategy.param_shard.device)
                template[flat] = _sharded(local, (a, b, at), every, numel, rank)
            else:
                template[flat] = torch.zeros(meta.size, dtype=meta.properties.dtype)
    read(template)  # stage 3's parameters land in the shard itself (its ranges are views of it)
    if strategy.flat is not None:
        with torch.no_grad():
            strategy.param_shard.copy_(layout.shard_of(strategy.flat, rank))
    optimizer.load_state_dict(_shard_state(strategy, template, names, group_of, groups, layout))


def _shard_state(
    strategy: ZeroShard,
    loaded: dict[str, Any],
    names: list[str],
    group_of: list[int],
    groups: list[dict[str, Any]],
    layout: Layout,
) -> dict[str, Any]:
    """The loaded per-parameter chunks put back together as the shard optimizer's state_dict."""
    rank = dist.get_rank()
    assert strategy.param_shard is not None
    device = strategy.param_shard.device
    state: dict[int, dict[str, Any]] = {}
    entries = optimizer_entries(loaded)
    for i, name in enumerate(names):
        g = group_of[i]
        lo, hi = strategy.spans[g]
        a, b, at = chunks(layout, i)[rank]
        pieces = state.setdefault(g, {})
        for key, value in entries.get(name, {}).items():
            if isinstance(value, ShardedTensor):  # this rank's chunk, at its place in the group's piece
                if key not in pieces:
                    pieces[key] = torch.zeros(hi - lo, dtype=value.dtype, device=device)  # padding stays zero
                if b > a:
                    pieces[key][at - lo : at - lo + b - a] = value.local_tensor()
            else:
                pieces[key] = value
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    return {"state": state, "param_groups": [{**h, "params": [g]} for g, h in enumerate(hyper)]}
