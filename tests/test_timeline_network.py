"""The timeline under an emulated network: a collective's span ends at the link's emulated completion.

One torchrun launch of a 4-job sweep (sync=manual,ddp x network=none,1gbe) on 2 gloo ranks with the
profiler on; 1gbe's link time is stretched (network.time_scale) until it dwarfs gloo's real time
here, so a span that ended at gloo's record would be visibly short of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import profile

from tests.cli import CPU, output, torchrun
from trainer.links import PRESETS, ring_s
from trainer.logger.timeline import caption
from trainer.logger.timeline_trace import read_rank
from trainer.sync.network import Network
from trainer.tools import timeline
from trainer.trace_names import MARK, completion_after_us

# 1gbe's 21 ms for this model's 2.2 MiB, x20: gloo's real all_reduce here takes 1-20 ms (up to 160 ms with
# a rank waiting for a slow peer on a loaded host).
TIME_SCALE = 20
JOBS = {("manual", "none"): 0, ("manual", "1gbe"): 1, ("ddp", "none"): 2, ("ddp", "1gbe"): 3}  # Hydra's order
PROFILED = {3, 4, 5}
ARGS = [
    "-m",
    "sync=manual,ddp",
    "network=none,1gbe",
    f"network.time_scale={TIME_SCALE}",  # no link to scale with network=none
    "trainer.profile=true",
    "trainer.max_steps=5",
    CPU,
    "logger=none",
    "trainer.progress_bar=false",
    "data.num_samples=64",
    "data.batch_size=8",
    "data.num_val_samples=16",
    "trainer.eval_every_n_steps=0",
    "model.hidden_sizes=[1024,512]",  # 2.2 MiB of gradients: one all_reduce a step, manual's buffer or DDP's bucket
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("timeline_network")
    proc = torchrun([*ARGS, f"hydra.sweep.dir={root / 'sweep'}"], cwd=root, timeout_s=280)
    assert proc.returncode == 0, output(proc)
    return root / "sweep"


def emulated_s(nbytes: int) -> float:
    """trainer/links.py's ring all_reduce on 2 ranks over 1gbe, stretched as the runs are."""
    return TIME_SCALE * ring_s("all_reduce", nbytes, 2, PRESETS["1gbe"].link("all_reduce"))


def spans_of(job: Path) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """The command's summary and collective spans for a job, and the job's one gradient buffer's bytes."""
    assert timeline.main([str(job)]) == 0
    sync = json.loads((job / "summary.json").read_text())["sync"]
    sizes = sync.get("buffer_sizes_bytes") or sync["bucket_sizes_bytes"]  # manual's buffers, DDP's buckets
    assert len(sizes) == 1, sizes
    merged = json.loads((job / "timeline.json").read_text())
    spans = [e for e in merged["traceEvents"] if e.get("cat") == "ddplab_comm"]
    summary = json.loads((job / "timeline_summary.json").read_text())
    return summary, spans, sizes[0]


def ends(job: Path, rank: int) -> tuple[list[float], list[float]]:
    """On the merged trace's clock, a rank's gloo records' ends and its link's completion marks' times."""
    merged = json.loads((job / "timeline.json").read_text())["traceEvents"]
    mine = [e for e in merged if e.get("pid") == rank and e.get("ph") == "X" and e.get("cat") != "ddplab_comm"]
    backend = [e["ts"] + e["dur"] for e in mine if str(e["name"]).startswith("gloo:")]
    marks = [e["ts"] + after for e in mine if (after := completion_after_us(str(e["name"]))) is not None]
    return backend, marks


@pytest.mark.parametrize("strategy", ["manual", "ddp"])
def test_emulated_spans_end_at_the_links_completion(sweep: Path, strategy: str) -> None:
    job = sweep / str(JOBS[(strategy, "1gbe")])
    summary, spans, nbytes = spans_of(job)
    link_us = emulated_s(nbytes) * 1e6
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        assert {e["args"]["step"] for e in mine} == PROFILED and len(mine) == len(PROFILED), mine
        backend, marks = ends(job, rank)
        for e in mine:
            assert e["args"].get("emulated_link") is True, e
            end = e["ts"] + e["dur"]
            # Ended by the link's completion, after gloo's record of the real collective.
            assert any(end == pytest.approx(m, abs=1e-3) for m in marks), (e, marks)
            assert not any(end == pytest.approx(b, abs=1e-3) for b in backend), (e, backend)
            assert e["dur"] >= link_us, (e, link_us)  # the link's alpha-beta time at the least
        # one collective a step, the last one long done: the link takes each up at its launch
        read, _ = read_rank(job / "profiler" / f"rank{rank}.pt.trace.json")
        assert read.comm and all(c.running_from is None for c in read.comm)
        figures = summary["ranks"][str(rank)]
        assert figures["emulated_collectives"] == len(PROFILED)
        assert figures["comm_ms"] * 1e3 >= len(PROFILED) * link_us
        assert "comm" in caption(figures, []) and "(emulated)" in caption(figures, [])


@pytest.mark.parametrize("strategy", ["manual", "ddp"])
def test_without_emulation_the_spans_are_the_backends(sweep: Path, strategy: str) -> None:
    job = sweep / str(JOBS[(strategy, "none")])
    summary, spans, _ = spans_of(job)
    traces = "".join(p.read_text() for p in (job / "profiler").glob("rank*.pt.trace.json"))
    assert MARK not in traces  # network=none: the link is never built, nothing is marked
    assert len(spans) == 2 * len(PROFILED)
    for rank in (0, 1):
        backend, _ = ends(job, rank)
        for e in [e for e in spans if e["pid"] == rank]:
            assert "emulated_link" not in e["args"], e
            # Today's span: from the launch to the backend's record of running it.
            assert any(e["ts"] + e["dur"] == pytest.approx(b, abs=1e-3) for b in backend), (e, backend)
        read, _ = read_rank(job / "profiler" / f"rank{rank}.pt.trace.json")  # queued until gloo takes it up
        assert read.comm and all(c.running_from is not None and c.start < c.running_from <= c.end for c in read.comm)
    for figures in summary["ranks"].values():
        assert figures["emulated_collectives"] == 0
        assert "(emulated)" not in caption(figures, [])


def test_a_completion_is_marked_only_while_the_profiler_records() -> None:
    """With the profiler off the link reads one flag per collective and marks nothing."""
    link = Network(preset="1gbe").link(2)
    assert link is not None
    marks: dict[bool, list[float]] = {}
    for recording in (False, True):
        real: torch.futures.Future[Any] = torch.futures.Future()
        with profile() as prof:
            out = link.delayed_future(real, "all_reduce", 2**20, recording=recording)
        real.set_result(1)
        assert out.wait() == 1  # the value is the real collective's, after the link's time
        found = [completion_after_us(e.name) for e in prof.events()]
        marks[recording] = [after for after in found if after is not None]
    assert marks[False] == []
    (after_us,) = marks[True]
    assert after_us == pytest.approx(link.seconds("all_reduce", 2**20) * 1e6, rel=0.05)
