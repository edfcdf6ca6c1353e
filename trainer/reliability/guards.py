"""Checks that stop a job before it trains garbage: non-finite losses and drifting replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class NonFiniteError(RuntimeError):
    """A loss became NaN or infinite (trainer.on_nonfinite=raise)."""


class ReplicaMismatch(RuntimeError):
    """Ranks that should hold identical parameters do not."""


def raise_if_nonfinite(first_bad_step: int, device: torch.device) -> None:
    """Raise naming the first non-finite loss on any rank (first_bad_step -1: none on this rank).

    Every rank must call this at the same point: it all-gathers each rank's first bad step, so that
    all of them stop together with the same message. It is called at logged steps, before
    checkpoints and at the end, where the loop synchronises anyway; alone, it needs no collective.
    """
    seen = [first_bad_step]
    if dist.get_world_size() > 1:
        mine = torch.tensor(first_bad_step, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        seen = [int(step) for step in torch.stack(gathered).tolist()]
    bad = {rank: step for rank, step in enumerate(seen) if step >= 0}
    if bad:
        first = min(bad.values())
        ranks = ", ".join(str(r) for r, s in sorted(bad.items()) if s == first)
        raise NonFiniteError(
            f"non-finite loss at step {first} on rank(s) {ranks}; "
            "trainer.on_nonfinite=skip would skip such optimizer steps instead"
        )


def check_replicas(model: nn.Module, step: int) -> None:
    """Compare a checksum of every parameter across ranks; raise naming the ranks that differ.

    Per-tensor sums in float64 change when any element changes by even one ulp (short of an
    exact cancellation), at the cost of one pass over the parameters and a tiny all_gather.
    """
    sums = torch.stack([p.detach().sum(dtype=torch.float64) for p in model.parameters()])  # no float64 copy
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    differ = [rank for rank, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
    if differ:
        raise ReplicaMismatch(
            f"replica check at step {step}: the parameters of rank(s) "
            f"{', '.join(map(str, differ))} differ from rank 0's; a strategy or a rank "
            "broke the promise that every rank holds the same model"
        )
