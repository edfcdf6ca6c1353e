"""sync=zero's optimizer state in the full model's terms, and back: what its checkpoints hold.

The shard optimizer has one parameter, this rank's 1/N slice of a flat padded buffer laid out by
`Layout`. A checkpoint must not depend on that: it holds the state a plain
`factory(model.parameters())` optimizer would have (integer keys in model.parameters() order, one
tensor per parameter shaped like it), so it reads the same whichever strategy wrote it. Gathering
is a collective (every rank calls it, in the same key order); scattering is local (every rank
reads the full dicts from the file and keeps its own slice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.sync.collectives import all_gather_tensor


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

    def shard_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's shard of a flat buffer of this layout (a copy: its pieces are not contiguous)."""
        return torch.cat([flat[lo : lo + n] for lo, _, n in self.pieces(rank)])

    def gather(self, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's shard into `flat`, bucket by bucket (a collective: every rank must reach it)."""
        for (start, padded), (_, at, n) in zip(self.buckets, self.pieces(0), strict=True):
            all_gather_tensor(flat[start : start + padded], shard[at : at + n])

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


def gather_full_state(shard_state: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """The full optimizer state dict from the shard optimizer's state_dict(); a collective.

    A shard-sized 1-D tensor (exp_avg, momentum_buffer, ...) is per element: all_gathered, the
    padding stripped, split per parameter. Anything else (Adam's 0-d "step", a float) is the same
    for every element, so every parameter gets a copy. Not counted in the comm metrics: those are
    per-step training traffic, and this runs only at checkpoints.
    """
    (group,) = shard_state["param_groups"]
    mine: dict[str, Any] = shard_state["state"].get(0, {})  # empty before the first step, on every rank alike
    per_param: list[dict[str, Any]] = [{} for _ in layout.indices]
    for key, value in mine.items():  # the same keys in the same order on every rank: same optimizer, same steps
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == layout.shard_numel:
            full = value.new_empty(layout.padded_numel)
            layout.gather(full, value.contiguous())  # every rank must reach this
            pieces = layout.split(full)
        else:
            pieces = [value.clone() if isinstance(value, torch.Tensor) else value for _ in layout.indices]
        for state, piece in zip(per_param, pieces, strict=True):
            state[key] = piece
    return {
        "state": {index: state for index, state in zip(layout.indices, per_param, strict=True) if state},
        "param_groups": [{**group, "params": list(range(layout.num_params))}],
    }


def shard_of_full_state(full_state: dict[str, Any], layout: Layout, rank: int) -> dict[str, Any]:
    """The reverse, locally: this rank's slice of the full state, as the shard optimizer's state_dict."""
    groups = full_state["param_groups"]
    if len(groups) != 1:
        raise ValueError(f"sync=zero loads optimizer state with one param group; this one has {len(groups)}")
    states = [full_state["state"].get(index) for index in layout.indices]
    shard_groups = [{**groups[0], "params": [0]}]
    if not any(states):  # saved before the first optimizer step
        return {"state": {}, "param_groups": shard_groups}
    if not all(states):
        missing = [index for index, state in zip(layout.indices, states, strict=True) if not state]
        raise ValueError(f"optimizer state has no entry for trainable parameter(s) {missing}: cannot shard it")
    present: list[dict[str, Any]] = [state for state in states if state]
    mine: dict[str, Any] = {}
    for key in present[0]:
        values = [state[key] for state in present]
        if _per_element(values, layout.shapes):
            flat = values[0].new_zeros(layout.padded_numel)  # the padding stays zero
            for view, value in zip(layout.split(flat), values, strict=True):
                view.copy_(value)
            mine[key] = layout.shard_of(flat, rank)  # its own memory: the checkpoint's tensors are not kept alive
        else:
            mine[key] = values[0].clone() if isinstance(values[0], torch.Tensor) else values[0]
    return {"state": {0: mine}, "param_groups": shard_groups}


def _per_element(values: Sequence[Any], shapes: Sequence[torch.Size]) -> bool:
    """Whether a state entry has one value per parameter element: shaped like every parameter.

    A 0-d parameter's per-element state is as 0-d as a scalar "step"; any parameter with dims
    tells them apart, so a model whose trainable parameters are all 0-d reads its state as scalar.
    """
    shaped = all(isinstance(v, torch.Tensor) and v.shape == s for v, s in zip(values, shapes, strict=True))
    return shaped and any(len(shape) > 0 for shape in shapes)
