"""Reading trainer.profile=true's per-rank traces onto one clock: phases, collectives, steps.

Every time here is in µs on rank 0's perf_counter clock: a trace's own time base, shifted by what
the profiler recorded under `ddplab` (trainer/loop/profiling.py). A collective is one span from
its launch (c10d's op on the training thread) to its completion (the backend's record of running
it: gloo's worker thread, or on CUDA the NCCL kernel), paired in launch order: the backend runs
them in the order they are issued. Its name is the lab's range around the launch where the
strategy set one (`bucket 3 all_reduce 4.0 MiB`), else from DDP's bucket layout, else the
enclosing range of the library that launched it (FSDP's), else its kind and size.

On CPU a collective is queued from its launch until the backend takes it up: gloo runs a process
group's collectives on a few worker threads (torch gives it two per network device), first come
first served, so one launched while all are busy waits for one of them. From then it is running
(which includes waiting for the peers to join). On CUDA the span is the kernel alone: no queue is
recorded.

With an emulated network (network=<preset>) a collective is done at the
later of the backend's end and the link's emulated completion, which the link marks in the trace
just after the launch, on the launching thread: that span ends at the later of the two. The link
carries one collective at a time (trainer/sync/network.py), so there a collective is queued until
the link is done with the previous one.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.trace_names import collective as collective_name
from trainer.trace_names import completion_after_us

DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4}
AUTOGRAD = "autograd::engine::evaluate_function"  # one backward op's computation on the host
KINDS = {"allreduce": "all_reduce", "reduce_scatter": "reduce_scatter", "allgather": "all_gather"}


@dataclass
class Interval:
    name: str
    start: float
    end: float
    step: int
    emulated: bool = False  # a collective's span ended by an emulated link's completion (network=<preset>)
    running_from: float | None = None  # a collective queued until then (module docstring); None: never queued


@dataclass
class RankTimeline:
    rank: int
    phases: list[Interval] = field(default_factory=list)  # data, forward, backward, sync, optimizer (host)
    comm: list[Interval] = field(default_factory=list)  # one span per collective
    compute: list[Interval] = field(default_factory=list)  # backward ops (CPU) or compute kernels (CUDA)
    on_gpu: bool = False
    uncertainty_us: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)  # the whole trace, on the common clock


class TimelineError(ValueError):
    """A run dir whose traces cannot make a timeline; the message says why."""


def find_traces(run_dir: Path) -> dict[int, Path]:
    if not run_dir.exists():
        raise TimelineError(f"{run_dir} does not exist")
    found = {}
    for path in sorted((run_dir / "profiler").glob("rank*.pt.trace.json")):
        rank = int(path.name[4:].split(".")[0])
        found[rank] = path
    if not found:
        raise TimelineError(
            f"{run_dir} has no profiler traces (profiler/rank*.pt.trace.json): train with trainer.profile=true"
        )
    return found


def _kind(op: str) -> str:
    name = op.split("::")[-1].split(":")[-1].strip("_").removesuffix("_base").strip("_")
    return next((kind for key, kind in KINDS.items() if name.startswith(key)), name)


def _nbytes(event: dict[str, Any]) -> int:
    args = event.get("args", {})
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    total = 0
    for dim, dtype in zip(dims, types, strict=False):
        while dim and isinstance(dim[0], list):  # a list of tensors: the first
            dim = dim[0]
        count = 1
        for d in dim:
            count *= d
        total = max(total, count * DTYPE_BYTES.get(dtype, 4)) if dim else total
    return total


def read_rank(path: Path, ddp_buckets: list[int] | None = None) -> tuple[RankTimeline, dict[str, int]]:
    """One rank's timeline, and its profiler steps' training step numbers."""
    trace = json.loads(path.read_text())
    lab = trace.get("ddplab")
    if lab is None:
        raise TimelineError(f"{path} has no ddplab clock record: written by an older trainer.profile=true run")
    rank = int(trace.get("distributedInfo", {}).get("rank", int(path.name[4:].split(".")[0])))
    shift = lab["trace_minus_perf_counter_us"] + lab["clock_offset_to_rank0_us"]
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    for e in events:
        e["ts"] = float(e["ts"]) - shift
    timeline = RankTimeline(rank, uncertainty_us=lab["clock_uncertainty_us"], events=trace["traceEvents"])
    steps = lab["profiler_steps"]
    main = next((e["tid"] for e in events if e["name"] in steps), None)

    for e in events:
        if e.get("args", {}).get("ddplab") == "phase":
            timeline.phases.append(Interval(e["name"], e["ts"], e["ts"] + e["dur"], int(e["args"]["step"])))
    # A step is its phases' time, data to optimizer: what runs between steps (a logged row's
    # checks) is in the profiler's step range but is no part of either step.
    bounds: dict[int, tuple[float, float]] = {}
    for p in timeline.phases:
        lo, hi = bounds.get(p.step, (p.start, p.end))
        bounds[p.step] = (min(lo, p.start), max(hi, p.end))

    def step_of(ts: float) -> int:
        return next((s for s, (lo, hi) in bounds.items() if lo <= ts <= hi), 0)

    kernels = [e for e in events if e.get("cat") == "kernel"]
    timeline.on_gpu = bool(kernels)
    if kernels:
        runs = sorted((e for e in kernels if "nccl" in e["name"].lower()), key=lambda e: e["ts"])
        timeline.compute = [
            Interval(e["name"], e["ts"], e["ts"] + e["dur"], 0) for e in kernels if "nccl" not in e["name"].lower()
        ]
    else:
        runs = sorted((e for e in events if e["name"].startswith(("gloo:", "nccl:"))), key=lambda e: e["ts"])
    launches = sorted((e for e in events if e["name"].startswith("c10d::")), key=lambda e: e["ts"])
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    emulated = emulated_ends(launches, ranges)
    link_free = link_starts(launches, emulated)
    per_step: dict[tuple[int, str], int] = {}  # all_reduces so far in the step: DDP's bucket index
    for i, (launch, run) in enumerate(zip(launches, runs, strict=False)):
        step = step_of(launch["ts"])
        if not step:
            continue
        key = (step, _kind(launch["name"]))
        index = per_step.get(key, 0)
        per_step[key] = index + 1
        name = _name(launch, ranges, ddp_buckets, index)
        # On CUDA the span is the NCCL kernel itself (GPU time); on CPU from the launch to gloo's end.
        start = run["ts"] if kernels else launch["ts"]
        end = max(run["ts"] + run["dur"], start)
        if i in emulated:  # done at the later of the backend's end and the link's
            end = max(end, emulated[i])
        running = link_free[i] if i in emulated else run["ts"]  # taken up by the link, else the backend
        running_from = None if kernels or running <= start else min(running, end)
        timeline.comm.append(Interval(name, start, end, step, emulated=i in emulated, running_from=running_from))
    if not kernels:
        # On CPU the computation is the autograd engine's work (host time, not the backward phase:
        # DDP's backward also waits for its last buckets, which hides nothing).
        timeline.compute = [
            Interval(e["name"], e["ts"], e["ts"] + e["dur"], step_of(e["ts"]))
            for e in events
            if e["tid"] == main and e["name"].startswith(AUTOGRAD)
        ]
    return timeline, {name: int(s) for name, s in steps.items()}


def emulated_ends(launches: list[dict[str, Any]], ranges: list[dict[str, Any]]) -> dict[int, float]:
    """Per launch (its index in `launches`) the emulated link's completion: each completion mark
    belongs to its thread's last launch before it (the link marks it on returning from the launch)."""
    by_thread: dict[Any, list[tuple[float, int]]] = {}
    for i, launch in enumerate(launches):  # launches are in time order
        by_thread.setdefault(launch["tid"], []).append((launch["ts"], i))
    ends: dict[int, float] = {}
    for mark in ranges:
        after = completion_after_us(mark["name"])
        if after is None:
            continue
        mine = by_thread.get(mark["tid"], [])
        k = bisect.bisect_right(mine, (mark["ts"], len(launches)))
        if k:
            ends[mine[k - 1][1]] = mark["ts"] + after
    return ends


def link_starts(launches: list[dict[str, Any]], ends: dict[int, float]) -> dict[int, float]:
    """Per emulated launch, when the link took it up: at its launch, or when the link finished the
    rank's previous emulated collective, whichever is later (the link carries one at a time)."""
    starts: dict[int, float] = {}
    free = float("-inf")
    for i in sorted(ends):  # launch order: the order the link was asked
        starts[i] = max(launches[i]["ts"], free)
        free = ends[i]
    return starts


def _name(launch: dict[str, Any], ranges: list[dict[str, Any]], ddp_buckets: list[int] | None, index: int) -> str:
    kind, nbytes = _kind(launch["name"]), _nbytes(launch)
    around = [
        r
        for r in ranges
        if r["tid"] == launch["tid"]  # the launching thread (on CUDA, backward's hooks run on autograd's)
        and r["ts"] <= launch["ts"]
        and launch["ts"] + launch.get("dur", 0) <= r["ts"] + r["dur"]
        and not r["name"].startswith("ProfilerStep")
        and r.get("args", {}).get("ddplab") != "phase"
    ]
    inner = max(around, key=lambda r: r["ts"]) if around else None
    if inner is not None and inner["name"].startswith(
        ("bucket ", "control ", "all_reduce", "reduce_scatter", "all_gather", "broadcast")
    ):
        return str(inner["name"])
    if ddp_buckets and kind == "all_reduce" and index < len(ddp_buckets) and ddp_buckets[index] == nbytes:
        return collective_name(kind, nbytes, index)
    name = collective_name(kind, nbytes)
    if inner is not None and inner["name"].startswith("FSDP::"):  # e.g. FSDP::all_gather (blocks.2)
        unit = inner["name"].rpartition("(")[2].rstrip(")")
        return f"{name} (fsdp unit {unit})"
    return name
