"""A switch that makes one rank fail on purpose: a testing aid for the failure paths.

`trainer.fault.rank=1 trainer.fault.at_step=3` makes rank 1 raise at the start of step 3, so
tests (and users checking their cluster) can watch a real job lose a rank and stop cleanly.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import check, is_int

KINDS = ("crash",)


class InjectedFault(RuntimeError):
    """Raised by the fault switch; never by anything else."""


@dataclass(frozen=True)
class Fault:
    """Off unless both rank and at_step are set."""

    rank: int | None = None
    at_step: int | None = None
    kind: str = "crash"

    def __post_init__(self) -> None:
        check(self.kind in KINDS, "trainer.fault.kind", self.kind, f"accepted: {', '.join(KINDS)}")
        check(self.rank is None or (is_int(self.rank) and self.rank >= 0), "trainer.fault.rank", self.rank,
              "must be a rank number >= 0, or null (off)")  # fmt: skip
        check(self.at_step is None or (is_int(self.at_step) and self.at_step >= 1), "trainer.fault.at_step",
              self.at_step, "must be a step number >= 1, or null (off)")  # fmt: skip

    def maybe_fire(self, rank: int, step: int) -> None:
        """Called at the start of every step (1-based) on every rank."""
        if rank == self.rank and step == self.at_step:
            raise InjectedFault(f"injected fault (trainer.fault.kind={self.kind}) on rank {rank} at step {step}")
