"""How often the observer may take a deep sample: a share of the run's time, and a ceiling in steps.

A sampled step costs more than another (saved-tensor hooks, a clock read per phase and collective,
a memory probe per mark, a callback per collective's completion, the accuracy's argmax and the
norm): on a sub-millisecond step a sample every row is several per cent of the run. So the observer
samples a candidate step (1 in `trainer.sample_every_n_steps`, the step before a row) only while
what its samples cost stays under `trainer.sample_budget` of the run's training time, and in any
case at the first candidate `trainer.sample_max_gap_steps` or more after the previous sample.

What a sample costs is measured, not assumed: at each row, the window's wall time less its sampled
steps' own host time, over its other steps, is a plain step; each sampled step's excess over that is
its cost. The ranks must take the same decision (a sampled step may launch collectives an unsampled
one does not, e.g. a sharded norm's agreement), so each rank's running totals travel in the row's
one collective (trainer/reliability/guards.py's RowAgreement) and every rank decides from the same
numbers: a sample is allowed while every rank's share is under the budget. Numbers sent at a row
are read at the next, so a decision rests on the windows up to the row before.
"""

from __future__ import annotations

from collections.abc import Sequence

BUDGET_NUMBERS = 2  # what a rank sends at a row: its samples' cost and its training time so far, in µs


class SampleBudget:
    """The observer's allowance; `fraction=None`: every candidate step is sampled (no budget)."""

    def __init__(self, fraction: float | None = None, max_gap_steps: int = 1) -> None:
        self.fraction = fraction
        self.max_gap_steps = max_gap_steps
        self.spent_s = 0.0  # this rank's estimated cost of its samples so far
        self.run_s = 0.0  # this rank's training time so far (the rows' windows)
        self.allowed = True  # until the ranks' numbers say otherwise

    @property
    def active(self) -> bool:
        return self.fraction is not None

    def may_sample(self, step: int, last_sampled: int | None) -> bool:
        """Whether a candidate step is sampled: within budget, or the ceiling reached (every rank alike)."""
        if self.allowed:
            return True
        return last_sampled is None or step - last_sampled >= self.max_gap_steps

    def window(self, elapsed_s: float, steps: int, sampled_s: Sequence[float]) -> None:
        """A row: this rank's window took `elapsed_s` over `steps` steps, of which those sampled took
        `sampled_s` (host time each)."""
        self.run_s += elapsed_s
        plain_steps = steps - len(sampled_s)
        if sampled_s and plain_steps > 0:
            plain = (elapsed_s - sum(sampled_s)) / plain_steps
            self.spent_s += sum(max(0.0, took - plain) for took in sampled_s)

    def mine(self) -> list[int]:
        """This rank's numbers for the row's collective (whole µs: exact in the float64 they are read as)."""
        return [round(self.spent_s * 1e6), round(self.run_s * 1e6)]

    def agree(self, numbers: Sequence[float]) -> None:
        """Every rank's `mine()`, in rank order, flattened: the same on every rank, so the same decision."""
        if self.fraction is None:
            return
        pairs = zip(numbers[::BUDGET_NUMBERS], numbers[1::BUDGET_NUMBERS], strict=True)
        self.allowed = all(run <= 0 or spent <= self.fraction * run for spent, run in pairs)

    def describe(self) -> str:
        """For the sync line: `1 % of the run, at least every 100 steps`."""
        return f"{100 * (self.fraction or 1):g} % of the run, at least every {self.max_gap_steps} steps"
