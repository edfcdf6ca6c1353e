"""Who arrived last (trainer/arrivals.py, docs/metrics.md "Who arrived last").

The arithmetic on numbers made by hand, then real jobs: 4 gloo ranks under torchrun, one of them
slowed by trainer.fault.kind=slow (100 ms at the start of every step), under a strategy that
reduces during backward (bucketed), one that reduces after it and gathers after the optimizer
step (zero), and FSDP2's units (fsdp): the rows and the summary name the slowed rank, late by the
delay within 20 %. Issue 75 asks 30 ms read as 24-36 ms; on an idle machine here it reads 28.5-35.4
ms a row. In the suite a second worker's ranks share the 2 cores with these 4, and a row moves by
±6 ms (measured: medians 25.4 and 36.2 ms for 30 ms beside a 4-rank job), so the test injects 100 ms
and keeps the issue's ±20 %.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli import CPU, output, torchrun, train_rows
from trainer import arrivals
from trainer.measures import Collective

NONE = arrivals.NONE


def sent(step: int, *inside_us: int) -> list[int]:
    return [step, *inside_us, *[NONE] * (arrivals.SLOTS - len(inside_us))]


def test_the_rank_the_others_waited_for_is_named_with_how_late_it_was() -> None:
    # Rank 2 starts 30 ms late: at the first collective the others wait 27-31 ms for it. The ranks then
    # start level, and the last arrivals of the next four are noise of 1-6 ms, rank 1's most often
    # (3 of 5: counting who is last would name it).
    rows = [
        sent(9, 42_000, 3_100, 3_800, 5_600, 7_500),
        sent(9, 44_000, 1_000, 1_100, 2_000, 2_000),
        sent(9, 13_000, 1_800, 1_500, 1_500, 5_200),
        sent(9, 40_000, 2_100, 3_400, 3_800, 5_700),
    ]
    late = arrivals.late_row(rows)
    assert late["comm/late_rank"] == 2 and late["comm/late_of_step"] == 9
    assert late["comm/late_ms"] == pytest.approx(29.0)  # 42 (the others' median) - 13: the typical wait
    assert late["comm/late_rank_share"] == pytest.approx(2 / 5)  # the first collective and the fourth
    # Ranks that sent different sampled steps, or none, or one rank alone: nothing to compare.
    assert arrivals.late_row([sent(9, 5), sent(19, 5)]) == {}
    assert arrivals.late_row([sent(NONE), sent(NONE)]) == {}
    assert arrivals.late_row([sent(9, 5)]) == {}


def test_a_rank_sends_its_times_inside_the_data_collectives_at_a_fixed_width() -> None:
    collectives = [
        Collective("all_reduce", 1024, 2, False, launched=0.010, completed=0.040, needed=0.040),
        Collective("all_reduce", 8, 2, True, launched=0.041, completed=0.042, needed=0.042),  # control: left out
        Collective("all_gather", 1024, 2, False, launched=0.050, completed=0.0525, needed=0.06),
    ]
    mine = arrivals.mine(7, collectives)
    assert len(mine) == arrivals.WIDTH == len(arrivals.mine(None, []))
    assert mine[:3] == [7, 30_000, 2_500] and set(mine[3:]) == {NONE}


def test_the_summary_calls_a_straggler_persistent_only_when_most_rows_name_it() -> None:
    def row(rank: int, ms: float) -> dict[str, Any]:
        return {"comm/late_rank": rank, "comm/late_ms": ms, "comm/late_rank_share": 1.0}

    steady = arrivals.straggler([row(3, 30), row(3, 28), row(1, 2), row(3, 33)])
    assert steady["late_rank"] == 3 and steady["late_rows"] == 3 and steady["compared_rows"] == 4
    assert steady["late_ms"] == 30 and steady["persistent"] == 1
    line = arrivals.straggler_line(steady)
    assert line is not None and "rank 3" in line and "30.0 ms" in line
    # Two equally fast ranks, each last about half the time: no straggler line.
    even = arrivals.straggler([row(0, 1), row(1, 1), row(0, 1), row(1, 2)])
    assert even["persistent"] == 0 and arrivals.straggler_line(even) is None
    assert arrivals.straggler([{"train/loss": 1.0}]) == {}


def test_the_docs_give_the_numbers_the_code_uses() -> None:
    text = " ".join((Path(__file__).parent.parent / "docs" / "metrics.md").read_text().split())
    assert f"(its first {arrivals.SLOTS} data collectives)" in text
    share = f"{arrivals.PERSISTENT_SHARE:.0%}".replace("%", " %")
    assert f"named in at least {share} of at least {arrivals.PERSISTENT_ROWS} rows" in text


SLOW = ["trainer.fault.rank=3", "trainer.fault.at_step=1", "trainer.fault.kind=slow", "trainer.fault.delay_ms=100"]
# Every candidate step sampled (the budget would space them out unevenly): a row every 10 steps, each
# answering the one before it, so 5 of the 6 rows compare arrivals.
EVERY_ROW = ["trainer.sample_budget=null"]


@pytest.fixture(scope="module", params=["bucketed", "zero", "fsdp"])
def slowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """60 steps on 4 ranks, rank 3 sleeping 100 ms at the start of each: a row every 10 steps."""
    tmp = tmp_path_factory.mktemp(f"slow-{request.param}")
    args = [f"sync={request.param}", CPU, "logger=none", "trainer.max_steps=60", *SLOW, *EVERY_ROW]
    args.append(f"hydra.run.dir={tmp / 'run'}")
    proc = torchrun(args, tmp, nproc=4, timeout_s=300)
    assert proc.returncode == 0, output(proc)[-3000:]
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    rows = [train_rows(tmp / "run" / "metrics" / f"rank{r}.jsonl") for r in range(4)]
    return {"sync": request.param, "out": output(proc), "summary": summary, "rows": rows, "run": tmp / "run"}


def test_the_rows_name_the_slowed_rank_and_how_late_it_was(slowed: dict[str, Any]) -> None:
    """Every row but the first compares; nearly all name rank 3. Not every one: 4 ranks on this
    machine's 2 cores (and a second test worker) can hold a rank off its core for long, and a row
    whose sampled step that happened to names that rank instead."""
    compared = [row for row in slowed["rows"][0] if "comm/late_rank" in row]
    assert len(compared) == 5, slowed["rows"][0]
    named = [row for row in compared if row["comm/late_rank"] == 3]
    assert len(named) >= 4, compared
    lateness = sorted(row["comm/late_ms"] for row in named)
    assert 80 <= lateness[len(lateness) // 2] <= 120, (slowed["sync"], lateness)
    # Every rank's rows say the same: the numbers came from one collective.
    for rows in slowed["rows"][1:]:
        assert [r.get("comm/late_rank") for r in rows] == [r.get("comm/late_rank") for r in slowed["rows"][0]]


def test_the_summary_names_the_persistent_straggler(slowed: dict[str, Any]) -> None:
    found = slowed["summary"]["straggler"]
    assert found["late_rank"] == 3 and found["persistent"] == 1, found
    assert 80 <= found["late_ms"] <= 120, found
    assert "straggler  rank 3 " in slowed["out"], slowed["out"][-2000:]


def test_the_sweep_report_names_it_too(slowed: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.tools.report import main

    assert main([str(slowed["run"]), "--out", str(slowed["run"] / "report")]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert ": straggler rank 3 arrived last in " in printed, printed[-2000:]
