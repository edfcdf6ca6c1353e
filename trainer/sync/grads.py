"""The averaged gradient as the optimizer reads it: its global norm and its clip, for every strategy.

None of this is a strategy's to write: it follows from two of its facts (base.py), whether the
gradients its optimizer reads are this rank's shard (`grads_sharded`) and, if so, on how many ranks
each shard lives (`norm_copies`). Replicated, every rank holds the whole averaged gradient and
answers alone; sharded, the ranks' sums of squares are reduced once (a plain clip_grad_norm_ would
see only this rank's shard, or under zero stage 1 the unaveraged sums in the parameters' .grad).
The step's finite check is this norm's: one agreement answers both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.optim import Optimizer

if TYPE_CHECKING:
    from trainer.sync.base import SyncStrategy


@dataclass
class NormLater:
    """A gradient norm left for the host to finish: sqrt((sum of norms² + sum of squares) / copies),
    once `pending` (the squares' agreement across ranks) is waited for."""

    norms: list[torch.Tensor]
    squares: list[torch.Tensor] = field(default_factory=list)
    pending: dist.Work | None = None
    copies: int = 1

    def finish(self, norms: list[float], squares: list[float]) -> float:
        """The norm from the values of `norms` and `squares`, read on the host."""
        if not squares and self.copies == 1:
            return math.hypot(*norms)  # one norm: itself, exactly
        return math.sqrt((sum(n * n for n in norms) + sum(squares)) / self.copies)


def grad_norm(sync: SyncStrategy, optimizer: Optimizer) -> torch.Tensor:
    """The global L2 norm of the averaged gradient the optimizer step is about to use: the same on every rank."""
    grads = optimizer_grads(optimizer)
    device = optimizer.param_groups[0]["params"][0].device
    norm = total_norm(grads) if grads else torch.zeros((), device=device)
    if not sync.grads_sharded:
        return norm
    squares = norm.to(torch.float32) ** 2
    sync.comm.agree(squares)  # a control collective: a few bytes, not gradient traffic
    return squares.sqrt() if sync.norm_copies == 1 else (squares / sync.norm_copies).sqrt()


def grad_norm_later(sync: SyncStrategy, optimizer: Optimizer) -> NormLater:
    """grad_norm(), for the row to finish on the host where nothing on the device needs it (the
    sampled step's norm, without a clip or a finite check): each gradient's norm where every rank
    holds the whole averaged gradient (two kernels fewer on the step); where the ranks hold shards,
    this rank's sum of squares with its agreement launched, waited for by the row (the step does not
    wait for the other ranks, which its unsampled steps never do)."""
    grads = optimizer_grads(optimizer)
    if not sync.grads_sharded:
        return NormLater(norm_pieces(grads) if grads else [])
    device = optimizer.param_groups[0]["params"][0].device
    squares = (total_norm(grads) if grads else torch.zeros((), device=device)).to(torch.float32) ** 2
    return NormLater([], [squares], sync.comm.agree_later(squares), sync.norm_copies)


def scale_grads(optimizer: Optimizer, factor: torch.Tensor) -> None:
    """Multiply the gradients the optimizer step is about to use by `factor` (a 0-dim tensor: no host sync)."""
    grads = optimizer_grads(optimizer)
    if grads:
        torch._foreach_mul_(grads, factor.to(grads[0].device))  # what clip_grad_norm_ itself does


def norm_pieces(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-dim tensors whose root-sum-of-squares is the L2 norm of all these tensors together: each
    one's norm, in one foreach call where they share a device (torch's get_total_norm groups them
    in Python first), else the total itself."""
    if len({t.device for t in tensors}) > 1:
        return [torch.nn.utils.get_total_norm(tensors)]
    return list(torch._foreach_norm(tensors))


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all these tensors together, as torch.nn.utils.get_total_norm computes it."""
    pieces = norm_pieces(tensors)
    return pieces[0] if len(pieces) == 1 else torch.linalg.vector_norm(torch.stack(pieces))


def optimizer_grads(optimizer: Optimizer) -> list[torch.Tensor]:
    """The gradients the optimizer reads, as plain tensors (a DTensor's local shard)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    # A DTensor's _local_tensor is what to_local() returns a view of, without its autograd Function (µs each).
    return [g if type(g) is torch.Tensor else getattr(g, "_local_tensor", g) for g in grads]
