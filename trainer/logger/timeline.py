"""A timeline of every rank from a trainer.profile=true run's traces: merged on rank 0's clock, its
figures (HTA overlap, straggler gap) and its picture.

Below both its users: the training loop sends it to the sinks that keep pictures (logger=wandb), and
`python -m trainer.tools.timeline` (trainer/tools/timeline.py) writes it for a run dir.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.comm_math import busy_time
from trainer.logger import timeline_figures as fig
from trainer.logger.timeline_plot import plot
from trainer.logger.timeline_trace import Interval, RankTimeline, TimelineError, find_traces, read_rank

__all__ = ["TimelineError", "write_timeline"]


def parse_numbers(text: str, what: str) -> list[int]:
    """`3-5` or `0,1` (or both: `1,3-4`)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise TimelineError(f"{what}={text!r}: expected numbers such as 4, 3-5 or 0,1") from None
    return out


def ddp_buckets(run_dir: Path) -> list[int] | None:
    """DDP's bucket sizes (bytes, in launch order) from summary.json, to name its reducer's all_reduces."""
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    sync = json.loads(path.read_text()).get("sync", {})
    return list(sync["bucket_sizes_bytes"]) if sync.get("strategy") == "ddp" and "bucket_sizes_bytes" in sync else None


def load(run_dir: Path, steps: str | None, ranks: str | None) -> tuple[list[RankTimeline], list[int]]:
    """The chosen ranks' timelines, cut to the chosen steps (by default every profiled step)."""
    traces = find_traces(run_dir)
    wanted = parse_numbers(ranks, "--ranks") if ranks else sorted(traces)
    missing = [r for r in wanted if r not in traces]
    if missing:
        raise TimelineError(f"--ranks={ranks}: no trace for rank(s) {missing}; traced ranks: {sorted(traces)}")
    buckets = ddp_buckets(run_dir)
    timelines, profiled = [], set()
    for rank in wanted:
        timeline, step_names = read_rank(traces[rank], buckets)
        timelines.append(timeline)
        profiled |= set(step_names.values())
    chosen = parse_numbers(steps, "--steps") if steps else sorted(profiled)
    outside = [s for s in chosen if s not in profiled]
    if outside:
        raise TimelineError(f"--steps={steps}: step(s) {outside} were not profiled; profiled steps: {sorted(profiled)}")
    for t in timelines:
        t.phases = [p for p in t.phases if p.step in chosen]
        t.comm = [c for c in t.comm if c.step in chosen]
        # (CUDA kernels run behind the host: the window reaches to the last collective's end.)
        lo, hi = min(p.start for p in t.phases), max(p.end for p in [*t.phases, *t.comm])
        t.compute = [c for c in t.compute if c.end >= lo and c.start <= hi]
    return timelines, chosen


def figures(timelines: Sequence[RankTimeline], steps: Sequence[int]) -> dict[str, Any]:
    ranks: dict[str, Any] = {}
    for t in timelines:
        comm = [(c.start, c.end) for c in t.comm]
        compute = [(c.start, c.end) for c in t.compute]
        share = fig.overlap(comm, compute)
        ranks[str(t.rank)] = {
            "overlap": share,
            "comm_ms": busy_time(comm) / 1e3,
            "hidden_ms": fig.intersection(comm, compute) / 1e3,
            "collectives": len(t.comm),
            "emulated_collectives": sum(c.emulated for c in t.comm),  # network=<preset>: ended by the link
            "clock_uncertainty_us": t.uncertainty_us,
            "lanes": "GPU kernels (NCCL vs compute)" if t.on_gpu else "host (gloo vs the backward phase)",
        }
    per_step: dict[str, Any] = {}
    for step in steps:
        last: dict[int, float] = {}
        for t in timelines:
            mine = [c for c in t.comm if c.step == step]
            if mine:
                last[t.rank] = max(mine, key=lambda c: c.start).start
        if len(last) == len(timelines) and len(last) > 1:
            gap, waits = fig.straggler_gaps(last)
            per_step[str(step)] = {
                "straggler_gap_ms": gap / 1e3,
                "waits_ms": {str(r): w / 1e3 for r, w in waits.items()},
            }
    return {"steps": list(steps), "ranks": ranks, "per_step": per_step}


def merged_trace(timelines: Sequence[RankTimeline], summary: dict[str, Any]) -> dict[str, Any]:
    """One Chrome trace: each rank a process (pid = rank), its lab spans on a thread of their own."""
    events: list[dict[str, Any]] = []
    for t in timelines:
        for e in t.events:
            if e.get("ph") != "M" or not str(e.get("name", "")).startswith("process_"):  # ours name the process
                events.append({**e, "pid": t.rank})
        events.append({"ph": "M", "name": "process_name", "pid": t.rank, "args": {"name": f"rank {t.rank}"}})
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": t.rank,
                "tid": "ddplab comm",
                "args": {"name": "collectives (launch to completion)"},
            }
        )
        for c in t.comm:
            events.append(_span(t.rank, "ddplab comm", c, "ddplab_comm"))
    return {"traceEvents": events, "displayTimeUnit": "ms", "ddplab": summary}


def _span(rank: int, tid: str, item: Interval, cat: str) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": cat,
        "name": item.name,
        "pid": rank,
        "tid": tid,
        "ts": item.start,
        "dur": item.end - item.start,
        "args": {"step": item.step, **({"emulated_link": True} if item.emulated else {})},
    }


def caption(rank: dict[str, Any], waits: list[float]) -> str:
    share = percent(rank["overlap"])
    wait = f"\nwaited {max(waits):.2f} ms max" if waits else ""
    link = " (emulated)" if rank.get("emulated_collectives") else ""
    clock = f"clock ±{rank['clock_uncertainty_us']:.0f} µs"
    return f"HTA overlap {share}\ncomm {rank['comm_ms']:.1f} ms{link}{wait}\n{clock}"


def write_timeline(run_dir: Path, out: Path, steps: str | None = None, ranks: str | None = None) -> dict[str, Any]:
    timelines, chosen = load(run_dir, steps, ranks)
    summary = figures(timelines, chosen)
    out.mkdir(parents=True, exist_ok=True)
    (out / "timeline.json").write_text(json.dumps(merged_trace(timelines, summary)))
    (out / "timeline_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    captions = []
    for t in timelines:
        waits = [s["waits_ms"][str(t.rank)] for s in summary["per_step"].values()]
        captions.append(caption(summary["ranks"][str(t.rank)], waits))
    plot(timelines, captions, f"{run_dir.name}: steps {chosen[0]}-{chosen[-1]}", out / "timeline.png")
    return summary


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"
