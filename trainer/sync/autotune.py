"""Choosing a bucket cap by timing real training steps with each candidate (`bucket_cap_mb=auto`)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field

from trainer.clock import Clock, Mark
from trainer.sync.comm import Comm

log = logging.getLogger(__name__)

# The keys of bucket_cap_mb=auto, which sync=ddp and sync=bucketed share: declared here once, each
# strategy's signature takes them (their defaults are the YAMLs').
CapMb = Annotated[
    Annotated[float, Field(gt=0, strict=True)] | Literal["auto"],
    Field(description="MiB of gradients per bucket; auto: try auto_candidates_mb first, keep the fastest"),
]
CandidatesMb = Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=1)]
StepsPerTrial = Annotated[int, Field(ge=1, description="timed steps per candidate cap")]
WarmupSteps = Annotated[int, Field(ge=1, description="untimed steps per candidate first")]
AUTO_CANDIDATES_MB = [1.0, 5.0, 25.0, 100.0]  # the caps tried, in order: the signatures' default (copied)

# The strategy's rule: the tensors each bucket would hold if built with this cap (MiB), in order.
Layout = Callable[[float], Sequence[Sequence[torch.Tensor]]]


@dataclass
class Trial:
    """One bucket layout's result: the median over its timed steps of the slowest rank's step time."""

    cap_mb: float  # the candidate timed: the first that builds this layout
    median_step_s: float
    steps: int
    step_s: list[float]  # each timed step, at the slowest rank's time: their spread is the trial's noise
    same_layout_mb: list[float]  # the later candidates that build the same buckets (not timed again)
    num_buckets: int | None  # None when the tuner was given no layout rule


def same_layouts(candidates_mb: Sequence[float], layout: Layout | None) -> list[list[float]]:
    """The candidates grouped by the buckets they build (the same tensors in the same groups), in
    the order given; without a layout rule each candidate is a layout of its own."""
    groups: dict[tuple[Any, ...], list[float]] = {}
    for cap in candidates_mb:
        key = tuple(tuple(id(t) for t in bucket) for bucket in layout(cap)) if layout else (cap,)
        groups.setdefault(key, []).append(cap)
    return list(groups.values())


def choose(trials: Sequence[Trial]) -> tuple[int, str]:
    """The trial to keep, and why (a few words for the sync line).

    The fastest median, unless other trials are within noise of it: a trial whose fastest step
    was no slower than the fastest trial's slowest step could not be told apart from it. Among
    those, keep the layout with the fewest buckets (the largest cap): each bucket is a collective
    that pays its latency and launch once, and more of them pay off only through overlap, which
    is what the trials could not see.
    """
    fastest = min(range(len(trials)), key=lambda i: trials[i].median_step_s)
    tied = [i for i, t in enumerate(trials) if min(t.step_s) <= max(trials[fastest].step_s)]
    if len(tied) == 1:
        noise = "; 1 timed step per trial, so noise unknown" if trials[fastest].steps == 1 else ", beyond noise"
        return fastest, f"fastest{noise}"
    kept = min(tied, key=lambda i: (trials[i].num_buckets or 0, -trials[i].cap_mb))
    names = ", ".join(f"{trials[i].cap_mb:g}" for i in tied)
    buckets = "" if trials[kept].num_buckets is None else f" ({trials[kept].num_buckets})"
    return (
        kept,
        f"tie: {names} MiB within noise (step times overlap): kept {trials[kept].cap_mb:g}, fewest buckets{buckets}",
    )


def _on_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class CapTuner:
    """Tries each distinct bucket layout the candidate caps build for a few steps of the run, then
    stays with the fastest (or, within noise, with the fewest buckets).

    Contract with the strategy that owns the buckets: it gives its `layout` rule (which tensors
    each bucket would hold for a cap), builds the buckets with `cap_mb` before the first step and
    sets itself `tuner`; then SyncStrategy.after_step(), which the loop calls at the end of every
    step on every rank, calls `after_step()` here (it runs collectives at the end of each trial, so
    every rank must make the same calls) and, when that returns a number, the strategy's rebuild()
    with that cap. Candidates that build the same buckets are one layout, timed once with the first
    of them; when every candidate builds the same buckets nothing is timed and the first candidate
    (already built) is kept. A step's time is the time between consecutive after_step() calls: one
    full step, whatever the strategy does where. Each layout gets `warmup_steps` untimed steps (the
    step that rebuilt the buckets, caches, DDP's own first-iteration rebuild), then
    `steps_per_trial` timed ones. The timed steps' times are all-reduced with MAX (the job runs at
    the slowest rank's pace), the median of those is the layout's time, and global rank 0 picks
    (choose()) and broadcasts its choice, so every rank rebuilds identically. Times are
    trainer/clock.py's marks (CUDA events on a GPU, read at each call while trials run, and never
    after). The trial steps are real training steps: changing the cap must not change the
    numbers, only the time.
    """

    def __init__(
        self,
        candidates_mb: Sequence[float],
        steps_per_trial: int,
        warmup_steps: int,
        device: torch.device,
        comm: Comm | None = None,
        layout: Layout | None = None,
        clock: Callable[[], float] = time.perf_counter,
        rebuild: Callable[[float], None] | None = None,
    ) -> None:
        if not candidates_mb or steps_per_trial < 1 or warmup_steps < 1:
            raise ValueError("CapTuner needs candidates, steps_per_trial >= 1 and warmup_steps >= 1")
        self.candidates_mb = [float(c) for c in candidates_mb]
        self.steps_per_trial = steps_per_trial
        self.warmup_steps = warmup_steps
        self.device = device
        # Every rank holds the same model, so every rank finds the same layouts and runs the same trials.
        self.layouts = same_layouts(self.candidates_mb, layout)
        self._num_buckets = {caps[0]: len(layout(caps[0])) if layout else None for caps in self.layouts}
        self.cap_mb = self.candidates_mb[0]  # the cap the strategy must use now
        self.trials: list[Trial] = []
        self.chosen_mb: float | None = None  # set once the choice is made
        self.reason = ""  # why the choice, for the sync line
        self._clock = Clock(device, source=clock)
        self._rebuild = rebuild  # the strategy's: remakes its buckets with a cap, between steps
        self.comm = Comm() if comm is None else comm  # the strategy's: its votes counted as control traffic
        self._step = 0  # steps run with the current layout
        self._last: Mark = None  # the clock at the previous call
        self._times: list[float] = []
        if len(self.layouts) == 1:  # nothing to choose between: no trial, no rebuild
            self.chosen_mb = self.cap_mb
            count = self._num_buckets[self.cap_mb]
            same = "buckets" if count is None else f"{count} bucket(s)"
            self.reason = f"every candidate builds the same {same}: {self.cap_mb:g} MiB kept, nothing timed"
            if _on_rank0():
                log.info("bucket cap chosen: %g MiB (%s)", self.cap_mb, self.reason)

    @property
    def done(self) -> bool:
        return self.chosen_mb is not None

    def after_step(self) -> float | None:
        """Note one step (every rank at the same point, the step's communication done); when the cap
        changes, rebuild with it and return it, else None."""
        cap_mb = self._next_cap()
        if cap_mb is not None and self._rebuild is not None:
            self._rebuild(cap_mb)
        return cap_mb

    def _next_cap(self) -> float | None:
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
        if len(self.trials) < len(self.layouts):
            self.cap_mb = self.layouts[len(self.trials)][0]
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
        times = slowest.tolist()
        same = self.layouts[len(self.trials)][1:]
        trial = Trial(self.cap_mb, statistics.median(times), len(times), times, same, self._num_buckets[self.cap_mb])
        self.trials.append(trial)
        self._step, self._times = 0, []
        if _on_rank0():
            log.info(
                "bucket cap trial: %s MiB, median step %.3f ms (%.3f-%.3f) over %d step(s) (slowest rank)",
                "|".join(f"{c:g}" for c in [trial.cap_mb, *same]),
                trial.median_step_s * 1e3,
                min(times) * 1e3,
                max(times) * 1e3,
                trial.steps,
            )

    def _choose(self) -> float:
        """Global rank 0 picks (choose()); everyone takes its pick."""
        pick, reason = choose(self.trials)
        index = torch.tensor([pick], dtype=torch.int64, device=self.device)
        self.comm.agree_from(index, 0)
        # Every rank holds the same MAX-reduced times, so its reason is rank 0's.
        chosen = self.trials[int(index.item())].cap_mb
        self.reason = reason
        if _on_rank0():
            log.info("bucket cap chosen: %g MiB (%s)", chosen, reason)
        return chosen

    def table(self) -> list[dict[str, Any]]:
        """The trials as plain dicts, every timed step included: summary.json's `sync.auto_trials`."""
        return [asdict(trial) for trial in self.trials]

    def describe(self) -> dict[str, Any]:
        """For the sync line: each layout's median step in ms (rounded; caps that build the same
        buckets joined by `|`), the choice, why, and the cap in use."""
        step_ms = {
            "|".join(f"{c:g}" for c in [t.cap_mb, *t.same_layout_mb]): round(t.median_step_s * 1e3, 2)
            for t in self.trials
        }
        why = {"auto_choice": self.reason} if self.reason else {}
        return {
            **({"auto_step_ms": step_ms} if step_ms else {}),
            "auto_chosen_mb": self.chosen_mb,
            **why,
            "bucket_cap_mb_in_use": self.cap_mb,
        }
