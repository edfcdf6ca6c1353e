"""The timeline of a trainer.profile=true run: merging, figures, every strategy end to end, the picture's
legend and labels, bad input.

One spawn of 2 gloo ranks trains every strategy with the profiler on (train_each); the command
then runs on each run dir in this process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.dist_helpers import run_on_ranks
from tests.report_helpers import markdown_header, markdown_rows, unwrapped
from tests.timeline_figure import (
    assert_labels_fit,
    assert_no_bar_hides_another,
    assert_sizes_say_bytes,
    collective_letters,
    drawn_colours,
    expected_phase_texts,
    key,
    legend_entries,
    origin_of,
    phase_texts,
    rects,
    rgba,
    row_of,
)
from tests.train_helpers import build, case_results, train_each
from trainer import trace_names
from trainer.logger import timeline_figures as fig
from trainer.logger.jsonl import JsonlLogger
from trainer.logger.timeline import load, write_timeline
from trainer.logger.timeline_plot import COLLECTIVE, figure
from trainer.logger.timeline_trace import TimelineError, link_starts, read_rank
from trainer.logger.wandb import WandbLogger
from trainer.logger.wandb_files import read_run
from trainer.loop.profiling import add_lab_events
from trainer.sync.describe import describe
from trainer.tools import report, report_timelines, timeline

COMMON = [
    "logger=none",
    "trainer.profile=true",
    "data.num_samples=128",
    "data.num_val_samples=16",
    "trainer.max_steps=6",
    "trainer.log_every_n_steps=1",  # a row per step: each profiled step's own collective counts
    "trainer.eval_every_n_steps=0",
    "trainer.progress_bar=false",
    "model.hidden_sizes=[64,48,32]",
]
CASES = {
    "manual": ["sync=manual", "sync.coalesce_mb=0.02"],
    "bucketed": ["sync=bucketed", "sync.bucket_cap_mb=0.02"],
    # DDP's first bucket holds 1 MiB whatever the cap: a larger model for several buckets.
    "ddp": ["sync=ddp", "sync.bucket_cap_mb=0.25", "model.hidden_sizes=[512,256,256]"],
    "zero": ["sync=zero", "sync.bucket_cap_mb=0.02"],  # several buckets, each reduce_scattered and gathered
    "fsdp": ["sync=fsdp"],
    "zero3": ["sync=zero", "sync.stage=3"],  # each unit gathered (forward, backward) and reduced
    "wandb": ["sync=bucketed", "sync.bucket_cap_mb=0.02"],  # with an offline W&B run per rank
    "off": ["sync=bucketed", "sync.bucket_cap_mb=0.02", "trainer.profile=false"],  # the zero-cost case
}
PROFILED = [3, 4, 5]  # StepProfiler: one step of wait, one of warm-up, three recorded
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")  # broadcast: zero's gather on gloo


def _train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    rows = JsonlLogger(Path(run_dir) / "metrics" / f"rank{rank}.jsonl")
    loggers: list[Any] = [rows]
    if run_dir.endswith("wandb"):
        (Path(run_dir) / "wandb").mkdir(parents=True, exist_ok=True)
        name = f"rank-{rank}"
        loggers.append(WandbLogger("offline", "p", None, dir=run_dir, name=name, group="g", run_config={}, rank=rank))
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir, loggers=loggers)
    named, calls = trace_names.collective, []

    def counted(*args: Any) -> Any:  # every naming of a collective the step path asks for
        calls.append(args)
        return named(*args)

    trace_names.collective = counted  # type: ignore[assignment]
    try:
        trainer.fit()
    finally:
        trace_names.collective = named
    for logger in loggers:
        logger.close()
    return {"sync": describe(trainer.sync), "named": len(calls), "timer": type(trainer.observer).__name__}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("timeline")
    ranks = run_on_ranks(train_each, 2, root / "ranks", _train, CASES, str(root / "runs"), timeout_s=600)
    return root / "runs", ranks


def _rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    lines = (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines) if "train/lr" in row}


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("off", "wandb")])
def test_every_strategy_end_to_end(runs: tuple[Path, list[dict[str, Any]]], case: str, capsys: Any) -> None:
    root, ranks = runs
    (describe, _) = (r["sync"] for r in case_results(ranks, case))
    run_dir = root / case
    assert timeline.main([str(run_dir)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("timeline: steps 3-5, HTA overlap rank0 ") and "clocks aligned within" in line
    merged = json.loads((run_dir / "timeline.json").read_text())
    names = {e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"rank 0", "rank 1"}
    summary = json.loads((run_dir / "timeline_summary.json").read_text())
    assert summary["steps"] == PROFILED
    for figures in summary["ranks"].values():
        assert figures["overlap"] is not None and 0.0 <= figures["overlap"] <= 1.0
    assert set(summary["per_step"]) == {"3", "4", "5"}
    # The phases sit on the trace's clock by their own marks (to a µs), not by the profiler's step
    # ranges, which open late: a collective launched just after a mark stays in its step.
    for trace in (run_dir / "profiler").glob("rank*.pt.trace.json"):
        assert json.loads(trace.read_text())["ddplab"]["phases_aligned_by"] == "phase marks", trace
    spans = [e for e in merged["traceEvents"] if e.get("cat") == "ddplab_comm"]
    rows = _rows(run_dir)
    for rank in (0, 1):
        for step in PROFILED:
            mine = [e["name"] for e in spans if e["pid"] == rank and e["args"]["step"] == step]
            data = [n for n in mine if not n.startswith("control ")]  # agreements are counted apart
            # Every collective the observer counted has its span, and no other.
            for kind in KINDS:
                if not any(f"comm/{kind}_per_step" in row for row in rows.values()):
                    continue  # a kind this run never sent
                expected = rows[step].get(f"comm/{kind}_per_step", 0)
                assert sum(kind in n for n in data) == expected, (case, rank, step, kind, mine)
            if case in ("fsdp", "zero3"):  # named by the unit whose gather or reduce it is (the
                # sampled step's gradient norm is a control collective, named so)
                units = data
                unit = "fsdp unit" if case == "fsdp" else "zero unit"
                assert units and all(re.search(rf" \({unit} net\.\d+\)$", n) for n in units), mine
            if case == "ddp":  # DDP's own count of its reducer's collectives in this step
                assert sum("all_reduce" in n for n in mine) == rows[step]["comm/collectives_per_step"]
            buckets = describe.get("num_buckets", describe.get("num_buffers"))
            if buckets is not None:  # per kind, the same named spans per bucket: bucket 0 .. bucket n-1
                # (one each, or zero's gather on gloo: one broadcast per rank, each of its slice)
                named: dict[str, list[int]] = {}
                for n in mine:
                    if n.startswith("bucket "):
                        named.setdefault(n.split()[2], []).append(int(n.split()[1]))
                per_bucket = {kind: len(v) // buckets for kind, v in named.items()}
                assert named and all(
                    sorted(v) == sorted(list(range(buckets)) * per_bucket[k]) for k, v in named.items()
                )
                assert per_bucket.get("broadcast", 2) == 2 and all(
                    n == 1 for k, n in per_bucket.items() if k != "broadcast"
                )
                assert buckets > 1
    width, height = Image.open(run_dir / "timeline.png").size
    assert 1000 <= width <= 2000 and 300 <= height <= 1200
    assert all(rows[s].get("trainer/profiled_steps") == 1 for s in PROFILED)
    assert not any("trainer/profiled_steps" in rows[s] for s in (1, 2, 6))


def test_zero_cost_when_off(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    """trainer.profile=false: no collective is named, the plain observer runs, no trace, no marked row;
    profile=true names exactly each bucket of each recorded step (not the wait and warm-up steps)."""
    root, ranks = runs
    for off, on in zip(case_results(ranks, "off"), case_results(ranks, "bucketed"), strict=True):
        assert off["named"] == 0 and off["timer"] == "Observer"
        assert on["named"] == on["sync"]["num_buckets"] * len(PROFILED) and on["timer"] == "ProfiledObserver"
    assert not (root / "off" / "profiler").exists()
    assert not any("trainer/profiled_steps" in row for row in _rows(root / "off").values())


def test_report_timelines(runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path, capsys: Any) -> None:
    """A sweep dir of two jobs (bucketed, ddp): one picture, a line per job; a job without traces: exit 2."""
    root, _ = runs
    sweep = sweep_of(root, ("bucketed", "ddp"), tmp_path)
    assert report.main([str(sweep), "--timelines", "--out", str(tmp_path / "out")]) == 0
    said = unwrapped(capsys.readouterr().out)
    # Each job's line: the drawn (profiled) steps' own median beside the table's, which leaves them out.
    each = r"profiled steps 3-5, median step [\d.]+ ms \(the table's, without them: [\d.]+ ms\); HTA overlap"
    assert re.search(rf"job 0: .*{each} rank 0 \d+%, rank 1 \d+%", said) and re.search(f"job 1: .*{each}", said)
    width, height = Image.open(tmp_path / "out" / "timelines.png").size
    assert 1000 <= width <= 2000 and 500 <= height <= 2000
    (sweep / "2").symlink_to(root / "off")
    assert report.main([str(sweep), "--timelines", "--out", str(tmp_path / "out")]) == 2
    assert "job 2: " in capsys.readouterr().err


@pytest.mark.parametrize("case", ["manual", "bucketed", "ddp", "zero", "fsdp", "zero3"])
def test_the_picture_says_what_it_draws(runs: tuple[Path, list[dict[str, Any]]], case: str) -> None:
    """One colour per meaning, every colour drawn named once in the legend, every collective in the
    collectives' colour, and each label kept inside its own bar."""
    root, _ = runs
    timelines, _ = load(root / case, None, None)
    fig, _ = figure(timelines, ["caption"] * len(timelines), "title")
    ax = fig.axes[0]
    entries = legend_entries(ax)
    assert len(set(entries.values())) == len(entries) and set(entries.values()) == drawn_colours(ax)
    comm = [c for c in ax.collections if c.get_gid() == "running"]
    assert len(comm) == sum(len(t.comm) for t in timelines) > 0
    assert {rgba(c.get_facecolor()[0]) for c in comm} == {entries[COLLECTIVE]}
    assert_labels_fit(fig)


@pytest.mark.parametrize("case", ["manual", "bucketed", "ddp", "zero", "fsdp", "zero3"])
def test_the_picture_reads_without_its_legend(runs: tuple[Path, list[dict[str, Any]]], case: str) -> None:
    """Every rank's compute lane names each of its phases; every collective carries its letter, in
    its bar or by a leader, and the key names it with its size in bytes; each collective's wait
    before the backend took it up is hatched, and its lane says what hatching means."""
    root, _ = runs
    timelines, _ = load(root / case, None, None)
    fig, _ = figure(timelines, ["caption"] * len(timelines), "title")
    ax = fig.axes[0]
    phases = phase_texts(fig, len(timelines))
    assert phases == [expected_phase_texts(t) for t in timelines]
    assert all({"sync", "opt"} <= set(row) for row in phases)  # told apart by their words
    names = key(fig)
    for rank, row in zip(timelines, collective_letters(fig, timelines), strict=True):
        assert sorted(name for _, name in row) == sorted(c.name for c in rank.comm)  # each its own label
        assert all(names[letter] == name for letter, name in row)
    assert_sizes_say_bytes(fig)
    origin, hatched = origin_of(timelines), rects(ax, "queued")
    waits = [(r, c) for r, t in enumerate(timelines) for c in t.comm if c.running_from is not None]
    assert waits and len(hatched) == len(waits)  # gloo takes each collective up a little after its launch
    for lane, c in waits:
        assert c.running_from is not None
        start, running = (c.start - origin) * 1e-3, (c.running_from - origin) * 1e-3
        assert any(row_of(q.y0) == lane and (q.x0, q.x1) == pytest.approx((start, running)) for q in hatched)
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks[1::2] == [f"rank {t.rank} comm\n(hatched = queued)" for t in timelines]
    assert_no_bar_hides_another(ax)
    assert_labels_fit(fig)


def test_the_sweep_picture_has_one_legend_for_every_job(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = runs
    jobs = [(f"job {n}", root / case) for n, case in enumerate(("manual", "ddp", "fsdp"))]
    fig, _, _ = report_timelines.figure(jobs)
    (legend,) = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legend is fig.axes[0].get_legend()
    entries = legend_entries(fig.axes[0])
    assert len(set(entries.values())) == len(entries)
    assert set(entries.values()) == set.union(*(drawn_colours(ax) for ax in fig.axes))
    assert_labels_fit(fig)


def sweep_of(root: Path, cases: tuple[str, ...], tmp_path: Path) -> Path:
    """A sweep dir whose numbered jobs are these cases' run dirs (symlinks)."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for number, case in enumerate(cases):
        (sweep / str(number)).symlink_to(root / case)
    return sweep


def test_the_report_names_manuals_buffers_and_fsdps_units(
    runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path, capsys: Any
) -> None:
    """The buckets column from real summary.json files: manual's buffers, fsdp's units, ddp's buckets."""
    root, ranks = runs
    cases = ("manual", "fsdp", "ddp")
    assert report.main([str(sweep_of(root, cases, tmp_path)), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    markdown = (tmp_path / "out" / "report.md").read_text()
    at = markdown_header(markdown).index("buckets")
    rows = {job: cells[at] for job, cells in markdown_rows(markdown).items()}
    manual, fsdp, ddp = (case_results(ranks, case)[0]["sync"] for case in cases)
    buffers = manual["num_buffers"]
    assert rows["0"].startswith(f"{buffers} buffer{'s' * (buffers != 1)}: ") and buffers > 1
    if manual["num_reduced_in_place"]:
        assert rows["0"].endswith(f" + {manual['num_reduced_in_place']} grads in place")
    assert rows["1"].startswith(f"{fsdp['num_units']} units: ")
    assert rows["2"].startswith(f"{ddp['num_buckets']}: ")


def test_the_command_takes_a_sweep_dir_job_by_job(
    runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path, capsys: Any
) -> None:
    root, _ = runs
    sweep = sweep_of(root, ("manual", "bucketed"), tmp_path)
    assert timeline.main([str(sweep), "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith("timeline: steps 3-5") for line in lines), lines
    assert (tmp_path / "out" / "0" / "timeline.png").is_file() and (tmp_path / "out" / "1" / "timeline.png").is_file()


def test_wandb_gets_the_timeline(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    """logger=wandb: rank 0's run holds the picture (an image in step 5's row) and the merged trace."""
    root, _ = runs
    by_rank = {run.path.name[-1]: run for run in map(read_run, (root / "wandb" / "wandb").glob("offline-run-*"))}
    assert set(by_rank) == {"0", "1"}
    rank0 = by_rank["0"]
    (row,) = [h for h in rank0.history if "profiler/timeline._type" in h]
    assert row["step"] == PROFILED[-1] and row["profiler/timeline._type"] == "image-file"
    (image,) = (rank0.path / "files" / "media" / "images").rglob("*.png")
    assert Image.open(image).size[0] >= 1000
    merged = json.loads((rank0.path / "files" / "timeline.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"] if e.get("cat") == "ddplab_comm"} == {0, 1}
    assert not any("profiler/timeline._type" in h for h in by_rank["1"].history)  # rank 0's run only


def test_named_sizes_match_the_layout(runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """DDP's reducer all_reduces get the bucket index and size of DDP's own (rebuilt) layout."""
    root, ranks = runs
    describe = case_results(ranks, "ddp")[0]["sync"]
    # its own merge (not the end-to-end test's): the test holds when run alone or in any order
    assert timeline.main([str(root / "ddp"), "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "timeline.json").read_text())
    names = {
        e["name"] for e in merged["traceEvents"] if e.get("cat") == "ddplab_comm" and e["name"].startswith("bucket")
    }
    expected = {f"bucket {i} all_reduce {trace_names.mib(n)}" for i, n in enumerate(describe["bucket_sizes_bytes"])}
    assert names == expected


def test_steps_and_ranks_options(runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    root, _ = runs
    out = tmp_path / "out"
    assert timeline.main([str(root / "bucketed"), "--steps", "4", "--ranks", "1", "--out", str(out)]) == 0
    summary = json.loads((out / "timeline_summary.json").read_text())
    assert summary["steps"] == [4] and list(summary["ranks"]) == ["1"]
    assert (out / "timeline.png").exists() and (out / "timeline.json").stat().st_size != 0


def test_bad_input(runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path, capsys: Any) -> None:
    root, _ = runs
    assert timeline.main([str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert timeline.main([str(tmp_path)]) == 2
    assert "trainer.profile=true" in capsys.readouterr().err
    assert timeline.main([str(root / "manual"), "--steps", "7-8", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--steps=7-8" in err and "[3, 4, 5]" in err
    assert timeline.main([str(root / "manual"), "--steps", "x", "--out", str(tmp_path / "o")]) == 2
    assert "--steps='x'" in capsys.readouterr().err


def _x(cat: str, name: str, tid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace(rank: int, shift_us: float, offset_s: float, starts: list[float]) -> dict[str, Any]:
    """A hand-built trace: ProfilerStep#2.. at trace time shift + perf_counter (+ the profiler's own
    delay); in each step a
    backward op 50-120 µs in, and an all_reduce launched at 100 µs that gloo runs from 110 to 150 µs."""
    events: list[dict[str, Any]] = []
    for k, t in enumerate(starts, start=2):
        ts = t * 1e6 + shift_us
        # The profiler opens a step's range a little after our note of it: here 0, 2 and 0.5 ms.
        late = {2: 0.0, 3: 2000.0, 4: 500.0}[k]
        events.append(_x("user_annotation", f"ProfilerStep#{k}", 1, ts + late, 5000.0))
        events.append(_x("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 1, ts + 50, 70.0))
        dims = {"Input Dims": [[[256]]], "Input type": ["float"]}
        events.append(_x("cpu_op", "c10d::allreduce_", 1, ts + 100, 5.0, **dims))
        events.append(_x("user_annotation", "gloo:all_reduce", 2, ts + 110, 40.0))
    trace = {"traceEvents": events, "distributedInfo": {"rank": rank}}
    marks = [(1, 0.0)] + [(k + 1, t) for k, t in enumerate(starts, start=2)]
    phases = [("backward", t + 50e-6, t + 200e-6, k + 1) for k, t in enumerate(starts, start=2)]
    add_lab_events(trace, marks, phases, {"offset_s": offset_s, "uncertainty_s": 2e-6})
    return trace


def test_merge_aligns_ranks_with_known_offsets(tmp_path: Path) -> None:
    """Rank 1's perf_counter runs 5 s ahead of rank 0's and its trace clock has another base: the
    same moments (in rank 0's time) come out at the same place."""
    (tmp_path / "profiler").mkdir()
    starts = [10.0, 10.01, 10.02]
    traces = {0: _trace(0, 7e9, 0.0, starts), 1: _trace(1, -3e9, 5.0, [t + 5.0 for t in starts])}
    for rank, trace in traces.items():
        (tmp_path / "profiler" / f"rank{rank}.pt.trace.json").write_text(json.dumps(trace))
    read = [read_rank(tmp_path / "profiler" / f"rank{r}.pt.trace.json")[0] for r in (0, 1)]
    for a, b in zip(read[0].comm, read[1].comm, strict=True):
        assert a.start == pytest.approx(b.start, abs=1e-3) and a.end == pytest.approx(b.end, abs=1e-3)
    assert [c.start for c in read[0].comm] == pytest.approx([t * 1e6 + 100 for t in starts], abs=1e-3)
    assert [c.step for c in read[0].comm] == [3, 4, 5]
    for a in read[0].comm:  # queued until gloo took it up
        assert a.running_from is not None and a.running_from - a.start == pytest.approx(10.0, abs=1e-3)
    assert read[1].comm[0].name == "all_reduce 1.0 KiB"  # 256 floats
    summary = write_timeline(tmp_path, tmp_path)
    assert all(s["straggler_gap_ms"] == pytest.approx(0.0, abs=1e-6) for s in summary["per_step"].values())
    # backward's op (50-120 µs) covers 20 of each collective's 50 µs (100-150)
    assert summary["ranks"]["0"]["overlap"] == pytest.approx(0.4)
    assert summary["ranks"]["1"]["clock_uncertainty_us"] == pytest.approx(2.0)


def test_overlap_exact() -> None:
    backward = [(0.0, 10.0)]
    assert fig.overlap([(2.0, 6.0)], backward) == 1.0  # full
    assert fig.overlap([(8.0, 12.0)], backward) == 0.5  # partial
    assert fig.overlap([(11.0, 15.0)], backward) == 0.0  # none
    # Concurrent collectives count their union once; computation in two pieces.
    assert fig.overlap([(1.0, 5.0), (3.0, 7.0), (20.0, 22.0)], [(0.0, 4.0), (6.0, 21.0)]) == pytest.approx(
        5.0 / 8.0
    )  # (1-4, 6-7, 20-21) of (1-7, 20-22)
    assert fig.overlap([], backward) is None


def test_the_link_takes_one_collective_at_a_time() -> None:
    """An emulated collective runs from its launch or, if the link is busy, from the previous one's
    completion; a launch without a completion mark never reached the link."""
    launches = [{"ts": 0.0}, {"ts": 10.0}, {"ts": 20.0}, {"ts": 50.0}]
    ends = {0: 30.0, 1: 45.0, 3: 60.0}  # the third: not on the link
    assert link_starts(launches, ends) == {0: 0.0, 1: 30.0, 3: 50.0}


def test_straggler_exact() -> None:
    gap, waits = fig.straggler_gaps({0: 100.0, 1: 103.5, 2: 100.5})  # rank 1 is slow
    assert gap == 3.5
    assert waits == {0: 3.5, 1: 0.0, 2: 3.0}


def test_no_lab_record_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "profiler").mkdir()
    (tmp_path / "profiler" / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(TimelineError, match=re.escape("no ddplab clock record")):
        write_timeline(tmp_path, tmp_path)
