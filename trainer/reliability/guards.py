"""Checks that stop a job before it trains garbage: non-finite losses and drifting replicas."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from trainer.sync.comm import all_gather_tensor


class NonFiniteError(RuntimeError):
    """A loss became NaN or infinite (trainer.on_nonfinite=raise)."""


class ReplicaMismatch(RuntimeError):
    """Ranks that should hold identical parameters do not."""


class NonFiniteCheck:
    """trainer.on_nonfinite=raise: every rank stops together, naming the first non-finite loss.

    The ranks must agree (each knows only its own losses), which takes a collective. At a logged
    row it is launched and not waited for: waiting would hold every rank at every row until the
    slowest arrives, which on a sub-millisecond step costs more than the step. Its answer is read
    at the next row, together with that row's own tensors (Window.totals: one host read), so a
    non-finite loss stops the job one logged row after the one that saw it. Before a checkpoint
    and at the end of training the check waits and looks at everything so far: no checkpoint holds
    a model that saw one. Every rank must call it at the same points (the loop's periodic events
    are on every rank alike).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: tuple[torch.Tensor, dist.Work] | None = None
        self._world_size: int | None = None

    def previous(self) -> torch.Tensor | None:
        """The previous row's answers (every rank's first bad step), waited for but not read: the
        row reads them with its own tensors."""
        if self._pending is None:
            return None
        gathered, work = self._pending
        self._pending = None
        work.wait()
        return gathered

    def at_row(self, first_bad_step: int, previous: list[float] | None = None, more: Sequence[int] = ()) -> list[float]:
        """Raise for the previous row's answers (read), then send this row's first bad step (-1: none).

        `more`: numbers of the same length on every rank that ride along (the observer's sample budget,
        trainer/sample_budget.py): returned for the previous row, every rank's in rank order, so every
        rank gets the same; on one rank, this row's own at once."""
        if self._world_size is None:  # the run's group: looked up once (a lookup costs µs at every row)
            self._world_size = dist.get_world_size()
        others: list[float] = []
        if previous:
            width = len(previous) // self._world_size  # 1, or 1 + len(more) of the row that sent them
            others = [value for i, value in enumerate(previous) if i % width]
            _raise_if_bad([int(step) for step in previous[::width]])
        if self._world_size == 1:
            _raise_if_bad([first_bad_step])
            return [float(value) for value in more]
        mine = torch.tensor([first_bad_step, *more], dtype=torch.int64, device=self.device)
        gathered = torch.empty(self._world_size * mine.numel(), dtype=torch.int64, device=self.device)
        work = all_gather_tensor(gathered, mine, async_op=True)  # torch 2.14 deprecates the older name
        assert work is not None, "async_op=True returns the collective's Work"
        self._pending = (gathered, work)
        return others

    def now(self, first_bad_step: int) -> None:
        """Before a checkpoint and at the end: every rank's answer so far, waited for."""
        previous = self.previous()
        self.at_row(first_bad_step, previous.tolist() if previous is not None else None)
        last = self.previous()
        if last is not None:
            _raise_if_bad([int(step) for step in last.tolist()])  # now() sends its step alone


def _raise_if_bad(first_bad_steps: list[int]) -> None:
    """Raise naming the first non-finite loss among the ranks' (-1: none on that rank)."""
    bad = {rank: step for rank, step in enumerate(first_bad_steps) if step >= 0}
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
