"""trainer.profile=true: a torch.profiler trace of a few steps per rank, in the run dir.

The traces (`profiler/rank{r}.pt.trace.json`) are the profiler's own Chrome-trace format (Perfetto,
TensorBoard and Holistic Trace Analysis read them), with the lab's additions: each step's phases
(data, forward, backward, sync, optimizer) as ranges on the training thread, the names of the
collectives (the strategy's communication object names them while the profiler records), and
under the key `ddplab` the clock reference that puts every
rank on rank 0's clock (`python -m trainer.tools.timeline <run dir>` merges them). The profiler
costs time while it records, so it is off by default and records only a few steps, after one
step of wait and one of warm-up; with it off nothing here runs in the step.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from trainer.logger.base import MetricLogger, TimelineLogger
from trainer.observer import Observer
from trainer.sample_budget import SampleBudget
from trainer.sync.comm import Comm

log = logging.getLogger(__name__)

WAIT, WARMUP = 1, 1  # steps before the profiler records
PHASE_MARK = "ddplab: phase mark"  # an empty range at each phase mark, on the trace's own clock
CLOCK_ROUNDS = 8  # barriers whose exits give each rank's clock offset to rank 0's
# Above kineto's highest level (USDT, 5): it then prints none of "profiler_start", "profiler_stop" or,
# without a GPU, "gpuGetDeviceCount failed with code 35". Read when the first profiler starts.
KINETO_SILENT = "6"


class ProfiledObserver(Observer):
    """The observer of a profiled run: it also keeps each phase's host interval of the steps the
    profiler records (every one of them, sampled or not), for the trace."""

    def __init__(
        self, device: torch.device, every: int = 0, emulated: bool = False, budget: SampleBudget | None = None
    ) -> None:
        super().__init__(device, every, emulated, budget)
        self.host: list[tuple[str, float, float, int]] = []  # (phase, start, end, step) while recording
        self.step = 0  # the step being run (set by StepProfiler)
        self.recording = False  # the profiler records this step (set by StepProfiler)
        self._last = 0.0

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        super().mark(phase)
        if self.recording:
            now = time.perf_counter()
            # The same moment on the trace's clock, a µs later: add_lab_events places the phases
            # on the trace by these (a collective launched a few µs after a mark stays in its phase).
            with torch.profiler.record_function(PHASE_MARK):
                pass
            self.host.append((phase, self._last, now, self.step))
            self._last = now

    def end_step(self) -> None:
        super().end_step()
        if self.recording:
            self.profiled += 1


def clock_offsets(device: torch.device) -> tuple[list[float], list[float]]:
    """Every rank's perf_counter minus rank 0's, and its uncertainty, in seconds (every rank calls this).

    Each round all ranks leave one barrier and note their clock; the offset is the median over
    rounds of the difference to rank 0's note, the uncertainty the largest deviation from it (how
    far apart the ranks left the barriers: a bound on the error, not the error).
    """
    world = dist.get_world_size()
    notes = torch.zeros(CLOCK_ROUNDS, dtype=torch.float64)
    for i in range(CLOCK_ROUNDS):
        dist.barrier()  # every rank must reach this
        notes[i] = time.perf_counter()
    everyone = [torch.zeros_like(notes, device=device) for _ in range(world)]
    dist.all_gather(everyone, notes.to(device))
    offsets, uncertainty = [], []
    for theirs in everyone:
        diffs = (theirs.cpu() - everyone[0].cpu()).tolist()
        mid = statistics.median(diffs)
        offsets.append(mid)
        uncertainty.append(max(abs(d - mid) for d in diffs))
    return offsets, uncertainty


class StepProfiler(AbstractContextManager["StepProfiler"]):
    """Wraps the training loop; step(done_step) after every optimizer step. A no-op when disabled."""

    def __init__(
        self,
        enabled: bool,
        device: torch.device,
        rank: int,
        out_dir: Path,
        observer: Observer | None = None,
        active_steps: int = 3,
        on_traces: Callable[[int], None] | None = None,
        wait_for_parameters: Callable[[], None] | None = None,
        comm: Comm | None = None,
    ) -> None:
        self._profile: profile | None = None
        self._device, self._rank, self._out_dir = device, rank, out_dir
        self._timer = observer if isinstance(observer, ProfiledObserver) else None
        self._step_marks: list[tuple[int, float]] = []  # (training step starting, perf_counter) per step()
        self._clock: dict[str, Any] = {}
        self._active = active_steps
        self._on_traces = on_traces  # called with the last profiled step once every rank's trace is written
        # The strategy's wait_for_parameters(): communication a step leaves in flight (zero's gathers, waited for
        # in the next forward) lands before the trace closes, or the last step's spans would be cut.
        self._wait_for_parameters = wait_for_parameters
        self._comm = comm  # asked to name its collectives while the profiler records
        self.trace_path: Path | None = None
        if enabled:
            if device.type == "cpu":  # kineto's lines on CPU are about the GPU it lacks: silent (docs/performance.md)
                os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self._profile = profile(
                activities=activities,
                schedule=schedule(wait=WAIT, warmup=WARMUP, active=active_steps, repeat=1),
                on_trace_ready=self._trace_ready,
                record_shapes=True,
                with_stack=False,
            )

    def __enter__(self) -> StepProfiler:
        if self._profile is not None:
            self._out_dir.mkdir(parents=True, exist_ok=True)
            if dist.is_initialized():  # the common reference, just before the profiled steps
                offsets, uncertainty = clock_offsets(self._device)
            else:
                offsets, uncertainty = [0.0], [0.0]
            self._clock = {"offset_s": offsets[self._rank], "uncertainty_s": uncertainty[self._rank]}
            self._profile.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._profile is not None:
            self._record(False)
            self._profile.__exit__(kind, exc, tb)

    def step(self, done_step: int = 0) -> None:
        if self._profile is not None:
            if self._timer is not None:
                self._timer.step = done_step + 1
            if self._wait_for_parameters is not None and self._profile.step_num == WAIT + WARMUP + self._active - 1:
                self._wait_for_parameters()  # the last recorded step: inside its range, before the trace is written
            self._step_marks.append((done_step + 1, time.perf_counter()))
            self._profile.step()  # opens ProfilerStep#k for the next step (or writes the trace)
            # Names and phases only for the steps the profiler records (not its wait and warm-up).
            self._record(WAIT + WARMUP <= self._profile.step_num < WAIT + WARMUP + self._active)

    def _record(self, on: bool) -> None:
        """Phases and collective names go into the trace only while the profiler records."""
        if self._timer is not None:
            self._timer.recording = on
        if self._comm is not None:
            self._comm.recording = on

    def _trace_ready(self, prof: profile) -> None:
        """Write the profiler's trace, then add the phases and the clock reference to it."""
        self._record(False)  # the profiled steps are over: nothing more to name
        path = self._out_dir / f"rank{self._rank}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        add_lab_events(trace, self._step_marks, self._timer.host if self._timer else [], self._clock)
        path.write_text(json.dumps(trace))
        self.trace_path = path
        if self._timer is not None:
            self._timer.host = []
        if dist.is_initialized():
            dist.barrier()  # every rank reaches this at the same step: all traces are on disk after it
        if self._on_traces is not None:
            self._on_traces(self._step_marks[-1][0] - 1)


def send_timeline(run_dir: Path, loggers: Sequence[MetricLogger], step: int) -> None:
    """Rank 0, for the sinks that keep pictures (logger=wandb): the timeline of the profiled steps.

    A timeline that cannot be drawn is a warning, never a stopped training run.
    """
    wanting = [logger for logger in loggers if isinstance(logger, TimelineLogger)]
    if not wanting:
        return
    from trainer.logger.timeline import write_timeline  # matplotlib: only for a profiled run that wants it

    try:
        write_timeline(run_dir, run_dir)
    except Exception as err:  # noqa: BLE001  (any failure of the picture is reported, training goes on)
        log.warning("trainer.profile: no timeline for the loggers: %s: %s", type(err).__name__, err)
        return
    for logger in wanting:
        logger.log_timeline(run_dir / "timeline.png", run_dir / "timeline.json", step)


def add_lab_events(
    trace: dict[str, Any],
    step_marks: list[tuple[int, float]],
    phases: list[tuple[str, float, float, int]],
    clock: dict[str, Any],
) -> None:
    """Phase ranges and the `ddplab` record, on the trace's own time base.

    The trace's clock is not perf_counter. Each phase mark left an empty range (PHASE_MARK) on
    the trace's clock right after its perf_counter note: paired in order, they give the offset to
    within a µs. Without them (a trace cut short), ProfilerStep#k, which opens when step() is called
    for the k-th time at a noted perf_counter, gives it less closely (the profiler's own work in
    step() comes first).
    """
    events = trace["traceEvents"]
    opened = {int(e["name"].split("#")[1]): e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    pairs = [(opened[k]["ts"], step_marks[k - 1]) for k in sorted(opened) if 0 < k <= len(step_marks)]
    if not pairs:
        return
    marks = sorted((e["ts"] for e in events if e.get("name") == PHASE_MARK), key=float)
    events[:] = [e for e in events if e.get("name") != PHASE_MARK]  # their work is done
    aligned_by = "phase marks" if marks and len(marks) == len(phases) else "profiler steps"
    if aligned_by == "phase marks":
        shift_us = min(float(ts) - end * 1e6 for ts, (_, _, end, _) in zip(marks, phases, strict=True))
    else:  # each range opens a little after our note: the smallest difference is the closest
        shift_us = min(ts - mark * 1e6 for ts, (_, mark) in pairs)
    first = next(e for e in opened.values())
    pid, tid = first["pid"], first["tid"]
    steps = {k: step_marks[k - 1][0] for k in opened if 0 < k <= len(step_marks)}
    start, end = min(opened[k]["ts"] for k in steps), max(opened[k]["ts"] + opened[k]["dur"] for k in steps)
    for phase, begin, finish, step in phases:
        ts = begin * 1e6 + shift_us
        if start <= ts <= end:
            args = {"ddplab": "phase", "step": step}
            events.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": phase,
                    "pid": pid,
                    "tid": tid,
                    "ts": ts,
                    "dur": (finish - begin) * 1e6,
                    "args": args,
                }
            )
    trace["ddplab"] = {
        "trace_minus_perf_counter_us": shift_us,
        "phases_aligned_by": aligned_by,
        "clock_offset_to_rank0_us": clock.get("offset_s", 0.0) * 1e6,
        "clock_uncertainty_us": clock.get("uncertainty_s", 0.0) * 1e6,
        "profiler_steps": {f"ProfilerStep#{k}": s for k, s in sorted(steps.items())},
    }
