"""Choosing a bucket cap by timing real training steps with each candidate (`bucket_cap_mb=auto`)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.clock import Clock, Mark
from trainer.sync.comm import Comm

log = logging.getLogger(__name__)

DEFAULT_CANDIDATES_MB = (1.0, 5.0, 25.0, 100.0)


@dataclass
class Trial:
    """One candidate's result: the median over its timed steps of the slowest rank's step time."""

    cap_mb: float
    median_step_s: float
    steps: int


class CapTuner:
    """Tries each candidate bucket cap for a few steps of the run, then stays with the fastest.

    Contract with the strategy that owns the buckets (nothing here knows what a bucket is): it
    builds the buckets with `cap_mb` before the first step and sets itself `tuner`; then
    SyncStrategy.after_step(), which the loop calls at the end of every step on every rank, calls
    `after_step()` here (it runs collectives at the end of each trial, so every rank must make the
    same calls) and, when that returns a number, the strategy's rebuild() with that cap.
    A step's time is the time between consecutive after_step() calls: one full step, whatever the
    strategy does where. Each candidate gets `warmup_steps` untimed steps (the step that rebuilt
    the buckets, caches, DDP's own first-iteration rebuild), then `steps_per_trial` timed ones. The
    timed steps' times are all-reduced with MAX (the job runs at the slowest rank's pace), the
    median of those is the candidate's time, and global rank 0 picks the fastest and broadcasts its
    choice, so every rank rebuilds identically. Times are trainer/clock.py's marks (CUDA events on a
    GPU, read at each call while trials run, and never after). The trial steps are real training
    steps: changing the cap must not change the numbers, only the time.
    """

    def __init__(
        self,
        candidates_mb: Sequence[float],
        steps_per_trial: int,
        warmup_steps: int,
        device: torch.device,
        comm: Comm | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not candidates_mb or steps_per_trial < 1 or warmup_steps < 1:
            raise ValueError("CapTuner needs candidates, steps_per_trial >= 1 and warmup_steps >= 1")
        self.candidates_mb = [float(c) for c in candidates_mb]
        self.steps_per_trial = steps_per_trial
        self.warmup_steps = warmup_steps
        self.device = device
        self.cap_mb = self.candidates_mb[0]  # the cap the strategy must use now
        self.trials: list[Trial] = []
        self.chosen_mb: float | None = None  # set once every candidate was tried
        self._clock = Clock(device, source=clock)
        self.comm = Comm() if comm is None else comm  # the strategy's: its votes counted as control traffic
        self._step = 0  # steps run with the current candidate
        self._last: Mark = None  # the clock at the previous call
        self._times: list[float] = []

    @property
    def done(self) -> bool:
        return self.chosen_mb is not None

    def after_step(self) -> float | None:
        """Note one step; returns the cap to rebuild with when it changes, else None."""
        if self.chosen_mb is not None:
            return None
        now = self._clock.now()  # a fresh event on CUDA: only while trials run
        self._step += 1
        if self._step > self.warmup_steps:  # the interval since the previous call: this whole step
            self._times.append(self._clock.seconds(self._last, now))
        self._last = now
        if self._step < self.warmup_steps + self.steps_per_trial:
            return None
        self._end_trial()
        if len(self.trials) < len(self.candidates_mb):
            self.cap_mb = self.candidates_mb[len(self.trials)]
            return self.cap_mb
        chosen = self._choose()
        self.chosen_mb = chosen
        if chosen == self.cap_mb:
            return None
        self.cap_mb = chosen
        return chosen

    def _end_trial(self) -> None:
        # Every rank reaches this collective at the same step: trials have a fixed number of steps.
        slowest = torch.tensor(self._times, dtype=torch.float64, device=self.device)
        self.comm.agree(slowest, dist.ReduceOp.MAX)
        trial = Trial(self.cap_mb, statistics.median(slowest.tolist()), len(self._times))
        self.trials.append(trial)
        self._step, self._times = 0, []
        if dist.get_rank() == 0:
            log.info(
                "bucket cap trial: %g MiB, median step %.3f ms over %d step(s) (slowest rank)",
                trial.cap_mb,
                trial.median_step_s * 1e3,
                trial.steps,
            )

    def _choose(self) -> float:
        """Global rank 0 picks the fastest trial; everyone takes its pick."""
        fastest = min(range(len(self.trials)), key=lambda i: self.trials[i].median_step_s)
        index = torch.tensor([fastest], dtype=torch.int64, device=self.device)
        self.comm.agree_from(index, 0)
        chosen = self.trials[int(index.item())].cap_mb
        if dist.get_rank() == 0:
            log.info("bucket cap chosen: %g MiB (fastest of %s MiB)", chosen, [t.cap_mb for t in self.trials])
        return chosen

    def table(self) -> list[dict[str, Any]]:
        """The trials as plain dicts, for summaries."""
        return [asdict(trial) for trial in self.trials]

    def describe(self) -> dict[str, Any]:
        """The trials, the choice and the cap in use, for the sync line."""
        return {"auto_trials": self.table(), "auto_chosen_mb": self.chosen_mb, "bucket_cap_mb_in_use": self.cap_mb}
