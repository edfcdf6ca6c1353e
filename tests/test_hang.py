"""The hang report (trainer/reliability/flight.py, hang.py; docs/reliability.md "A collective fails").

First the reading rule on records made by hand, then real jobs: 2 gloo ranks under torchrun, one of
them broken on purpose at step 3 by trainer.fault (desync: it skips a collective; size: it sends one
element more; hang: it stops outside any collective; kill: SIGKILL mid-step), every kind under every
strategy, and the report's lines checked: the step, the collective, the rank that never came or died,
and where it was. The jobs run a few at a time (they mostly wait for a timeout).
"""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cli import CPU, launch, output, torchrun, train_rows
from trainer.reliability import hang
from trainer.tools.hang import main as hang_main

NS = 1_000_000_000


def dump(rank: int, world: int, entries: list[tuple[int, str, int, int, int]], stack: list[Any] | None = None) -> dict:
    """A snapshot as flight.py writes it: (seq, kind, numel, step, bucket) records, each in its step,
    the lab's launches naming their buckets (a control agreement: a size of 1, no bucket)."""
    fr = [
        {
            "collective_seq_id": seq,
            "profiling_name": f"gloo:{kind}",
            "process_group": ("0", "default_pg"),
            "input_sizes": [[numel]],
            "output_sizes": [[numel]],
            "input_dtypes": ["Float"],
            "time_created_ns": step * NS + seq,
            "is_p2p": False,
        }
        for seq, kind, numel, step, _ in entries
    ]
    launches = [(step * NS + seq - 1, kind, numel, b, "0") for seq, kind, numel, step, b in entries if numel > 1]
    steps = [(s, s * NS) for s in sorted({e[3] for e in entries})]
    return {
        "rank": rank,
        "world_size": world,
        "step": steps[-1][0] if steps else 0,
        "error": None,
        "stack": stack or [("/x/trainer/sync/bucketed.py", 10, "after_backward")],
        "steps": steps,
        "launches": launches,
        "fr": {"entries": fr, "pg_config": {"0": {"desc": "default_pg", "ranks": f"{list(range(world))}"}}},
    }


def steps(first: int, last: int, *per_step: tuple[str, int], skip: tuple[int, int] | None = None) -> list:
    """Records of steps first..last, each with the collectives per_step (skip: (step, index) left out)."""
    out, seq = [], 1
    for step in range(first, last + 1):
        for i, (kind, numel) in enumerate(per_step):
            if skip != (step, i):
                out.append((seq, kind, numel, step, i))
                seq += 1
    return out


def test_the_first_number_where_the_ranks_differ_is_the_collective_and_a_rank_behind_never_came() -> None:
    # Rank 1 stopped before step 3's bucket: rank 0 has a record #5 it lacks.
    pair = ("all_reduce", 1000), ("all_reduce", 1)
    fault = [("/x/trainer/reliability/fault.py", 116, "maybe_fire")]
    dumps = {0: dump(0, 2, steps(1, 3, *pair)[:5]), 1: dump(1, 2, steps(1, 2, *pair), fault)}
    lines = hang.explain(dumps, 2)
    assert len(lines) == 2, lines
    assert lines[0].startswith("collective failed at step 3: #5 all_reduce of bucket 0 (float32[1,000])"), lines
    assert "entered by rank 0; rank 1 never entered it" in lines[0], lines
    assert "rank 1 was in step 2 at trainer/reliability/fault.py:116 in maybe_fire" in lines[1], lines


def test_a_rank_that_skipped_one_is_ahead_at_that_number() -> None:
    # Rank 1 skipped step 2's bucket: its #3 is step 2's agreement, which rank 0 launches as #4.
    pair = ("all_reduce", 1000), ("all_reduce", 1)
    dumps = {0: dump(0, 2, steps(1, 3, *pair)), 1: dump(1, 2, steps(1, 4, *pair, skip=(2, 0))[:6])}
    first = hang.explain(dumps, 2)[0]
    assert first.startswith("collective failed at step 2: #3 all_reduce of bucket 0"), first
    assert "rank 1 never entered it: its #3 was step 2's all_reduce (float32[1])" in first, first


def test_a_rank_that_died_is_named_and_the_survivor_own_records_say_what_it_sent() -> None:
    # Rank 1 sent step 3's bucket one element longer; rank 0 died receiving it (no snapshot).
    entries = steps(1, 4, ("all_reduce", 1000))
    entries[2] = (3, "all_reduce", 1001, 3, 0)
    lines = hang.explain({0: None, 1: dump(1, 2, entries)}, 2)
    assert "step 3: #3 all_reduce of bucket 0 (float32[1,001])" in lines[0], lines
    assert "sent by rank 1 at this size once (its others of it: float32[1,000]); rank 0 died" in lines[0], lines
    assert lines[1] == "rank 0 left no snapshot: it died or could not answer", lines
    # Or skipped one it launched every step before.
    per_step = ("all_gather", 400), ("all_gather", 500), ("reduce_scatter", 900)
    skipped = steps(1, 3, *per_step, skip=(3, 0))[:-1]  # and died in step 3 before its end
    first = hang.explain({0: None, 1: dump(1, 2, skipped)}, 2)[0]
    assert "step 3: all_gather of bucket 0 (float32[400])" in first, first  # its first of the step
    assert "skipped by rank 1 (launched at step 2; at step 3 it went on); rank 0 died" in first, first


def test_a_rank_that_died_of_a_signal_is_found_in_its_log(tmp_path: Path) -> None:
    (tmp_path / "train_rank0.log").write_text(
        "[...] training 6 steps\nFatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 3913 in all_reduce\n'
        '  File "/x/trainer/sync/bucketed.py", line 167 in after_backward\n'
        '  File "/x/trainer/loop/step.py", line 116 in run\n'
    )
    words = hang.last_words(tmp_path / "train_rank0.log")
    assert words == "aborted at trainer/sync/bucketed.py:167 in after_backward"
    assert hang.last_words(tmp_path / "train_rank1.log") is None


def test_ranks_that_agree_and_none_missing_say_so() -> None:
    same = steps(1, 2, ("all_reduce", 1000))
    first = hang.explain({0: dump(0, 2, same), 1: dump(1, 2, same)}, 2)[0]
    assert "entered by rank 0, 1 (every rank: none is missing, and it did not complete)" in first, first


def test_the_hang_command_without_snapshots_says_why_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert hang_main([str(tmp_path)]) == 2
    assert "no snapshots in" in capsys.readouterr().err


# The jobs: name -> (sync and its keys, fault kind, rank timeout seconds).
TIMEOUT = 8  # a collective's timeout in these jobs: over a step's time with the suite's other worker
STRATEGIES = {
    "manual": ["sync=manual"],
    "bucketed": ["sync=bucketed"],
    "ddp": ["sync=ddp"],
    "zero": ["sync=zero"],
    "zero3": ["sync=zero", "sync.stage=3"],
    "fsdp": ["sync=fsdp"],
    "hsdp": ["sync=hsdp", "sync.shard=2"],
    "hierarchical": ["sync=hierarchical", "sync.shard=2"],
}
KINDS = ("desync", "size", "hang", "kill")
# Every kind under every strategy (29 jobs, about 85 s here, 4 at a time), but ddp's desync and size
# (refused: its reducer launches its own collectives) and zero stage 3's size (a broadcast received one
# element short completes on gloo: the job goes on, and there is nothing to report).
JOBS = {
    f"{name}-{kind}": (keys, kind, TIMEOUT)
    for name, keys in STRATEGIES.items()
    for kind in KINDS
    if f"{name}-{kind}" not in ("ddp-desync", "ddp-size", "zero3-size")
}
JOBS["bucketed-desync"] = (["sync=bucketed"], "desync", 20)  # the issue's case: timeout 20 s, ends within 60 s
JOBS["bucketed-desync-launcher"] = (["sync=bucketed"], "desync", TIMEOUT)  # through `make train`'s launcher
JOBS["ddp-desync-refused"] = (["sync=ddp"], "desync", TIMEOUT)
JOBS["manual-hang-unrecorded"] = (["sync=manual", "trainer.flight_recorder=0"], "hang", TIMEOUT)


def of_kind(kind: str) -> list[str]:
    return [name for name, (_, k, _) in JOBS.items() if k == kind and name.count("-") == 1]


def run_job(name: str, tmp: Path) -> dict[str, Any]:
    keys, kind, timeout = JOBS[name]
    run = tmp / name
    # A stopped rank ends 1 s after torchrun's SIGTERM; a survivor of a killed peer takes up to 10 s to
    # see its collective fail (torchrun's SIGTERM comes first, and these jobs share 2 cores).
    grace = 1 if kind == "hang" else 10
    args = [
        *keys,
        CPU,
        "trainer.max_steps=6",
        f"trainer.step_grace_s={grace}",
        f"trainer.collective_timeout_s={timeout}",
    ]
    args += ["trainer.fault.rank=1", "trainer.fault.at_step=3", f"trainer.fault.kind={kind}"]
    args += [f"hydra.run.dir={run}"]
    args += ["logger=wandb", "trainer.log_every_n_steps=1"] if name == "bucketed-desync" else ["logger=none"]
    started = time.monotonic()
    if name.endswith("-launcher"):
        proc = launch(args, tmp, timeout_s=240)
    else:  # fresh interpreters for the issue's case: the report as torchrun itself shows it for real ranks
        proc = torchrun(args, tmp, timeout_s=240, fresh=name == "bucketed-desync")
    return {"proc": proc, "out": output(proc), "seconds": time.monotonic() - started, "run": run}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hang")
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(run_job, name, tmp) for name in JOBS}
        return {name: future.result() for name, future in futures.items()}


def report(job: dict[str, Any]) -> list[str]:
    """The report's lines as the job printed them (each rank prefixes its console lines)."""
    lines = [re.sub(r"^\[rank\d+\] ", "", line) for line in job["out"].splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("collective failed at step")), None)
    assert start is not None, job["out"][-3000:]
    return lines[start : start + 3]


def test_a_desync_under_bucketed_ends_within_a_minute_naming_step_bucket_and_rank(jobs: dict[str, Any]) -> None:
    job = jobs["bucketed-desync"]
    assert job["proc"].returncode != 0 and job["seconds"] < 60, (job["seconds"], job["out"][-2000:])
    first, second, third = report(job)
    assert first.startswith("collective failed at step 3: #"), first
    assert "all_reduce of bucket 0" in first and "rank 1 never entered it" in first, first
    assert third.startswith("snapshots: ") and "python -m trainer.tools.hang" in third, third
    # torchrun's root cause, the job's last lines, is the report.
    tail = job["out"][job["out"].rindex("Root Cause") :]
    assert first in tail and second in tail, tail
    # The command prints the same three lines from the run dir.
    proc = subprocess.run(
        [__import__("sys").executable, "-m", "trainer.tools.hang", str(job["run"])],
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.splitlines() == [first, second, third], (proc.stdout, first)
    # Nothing else is lost: the rows before the failure, and both W&B runs closed (their files written).
    assert [r["step"] for r in train_rows(job["run"] / "metrics" / "rank0.jsonl")][:2] == [1, 2]
    assert len(list((job["run"] / "wandb").glob("offline-run-*/*.wandb"))) == 2, list(job["run"].rglob("*"))


def test_the_launcher_ends_with_the_report(jobs: dict[str, Any]) -> None:
    """`make train`'s launcher replaces torchrun's failure block with one line; the report follows it."""
    job = jobs["bucketed-desync-launcher"]
    last = job["out"].strip().splitlines()[-4:]
    assert last[0].startswith("launch: rank ") and "exited with code 1" in last[0], job["out"][-2000:]
    assert last[1:] == report(job), (last, job["out"][-2000:])


@pytest.mark.parametrize("name", [n for n in of_kind("desync") if n != "bucketed-desync"])
def test_a_desync_is_named(jobs: dict[str, Any], name: str) -> None:
    first = report(jobs[name])[0]
    assert first.startswith("collective failed at step 3: "), first
    # Both ranks answer (zero: the ranks time out in different collectives), or the one that skipped
    # survives and its own records say so (fsdp: gloo aborts the peer that received the wrong size).
    assert "rank 1 never entered it" in first or "skipped by rank 1" in first, first


@pytest.mark.parametrize("name", of_kind("size"))
def test_a_rank_that_sent_another_size_is_named(jobs: dict[str, Any], name: str) -> None:
    first, second, _ = report(jobs[name])
    assert first.startswith("collective failed at step 3: "), first
    assert "sent by rank 1 at this size once" in first, first
    assert "rank 0 left no snapshot: it died (aborted at trainer/" in second, second


@pytest.mark.parametrize("name", of_kind("hang"))
def test_a_rank_that_stopped_responding_is_named_with_where_it_was(jobs: dict[str, Any], name: str) -> None:
    first, second, _ = report(jobs[name])
    assert first.startswith("collective failed at step 3: #") and "; rank 1 never entered it" in first, first
    assert "rank 1 was in step 3 at trainer/reliability/fault.py:" in second, second
    assert re.search(r"its last collective #\d+ step 2's ", second), second


@pytest.mark.parametrize("name", of_kind("kill"))
def test_a_rank_killed_mid_step_is_named(jobs: dict[str, Any], name: str) -> None:
    first, second, _ = report(jobs[name])
    assert first.startswith("collective failed at step 3: #") and "; rank 1 never entered it" in first, first
    assert second.startswith("rank 1 left no snapshot: it died"), second


def test_a_fault_on_the_labs_launches_is_refused_where_torch_launches_them(jobs: dict[str, Any]) -> None:
    job = jobs["ddp-desync-refused"]
    assert job["proc"].returncode != 0, job["out"][-2000:]
    assert "configuration error: trainer.fault.kind='desync' is invalid" in job["out"], job["out"][-2000:]


def test_without_the_recorder_a_hang_fails_as_before_with_no_report(jobs: dict[str, Any]) -> None:
    job = jobs["manual-hang-unrecorded"]
    assert "training failed: StepFailed: step 3 on rank 0" in job["out"], job["out"][-2000:]
    assert "collective failed at step" not in job["out"] and not (job["run"] / "hang").exists()
