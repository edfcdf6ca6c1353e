"""The sweep report's columns for an emulated link: "link ms" (`time/comm_exposed_link_s`, the link's ideal)
beside "exposed ms" in the jobs, the points and the printed tables, and "inter-node MB/step"
(`comm/inter_node_bytes_per_step`, network.gpus_per_node > 1) beside "MB/step"; each taken by the rule
of the column it stands beside (per rank the median over its rows, then the median over ranks; the
points: the median over repeats), and shown only when some job's rows carry its key."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.report_helpers import DDP, MANUAL, comm_keys, printed_columns, train_row, write_job
from trainer.tools.report import main
from trainer.tools.report_screen import JOB_DROP_ORDER, Column, fit
from trainer.tools.report_table import INTER_NODE_HEADER

TWO_TIER = {"preset": "1gbe", "gpus_per_node": 2}  # two emulated nodes of 2 ranks, 1 GbE between them
ONE_TIER = {"preset": "1gbe"}


def rank_rows(link_ms: list[float], inter_mb: list[float] | None) -> list[dict[str, Any]]:
    """A rank's training rows: one unsampled (bytes only, as ddp's rows between sampled steps), then one
    sampled row per link_ms, exposed 10 ms above the link's ideal; inter_mb: its bytes across nodes (None:
    a run without the key)."""
    rows = [train_row(5, 0.1, 0.0, 640, 1.0, comm_keys(4.86e6))]
    for i, link in enumerate(link_ms):
        keys = comm_keys(4.86e6, (link + 11) / 1000, (link + 10) / 1000) | {"time/comm_exposed_link_s": link / 1000}
        if inter_mb is not None:
            keys["comm/inter_node_bytes_per_step"] = inter_mb[i] * 1e6
        rows.append(train_row(10 * (i + 1), 0.1, 0.0, 640, 1.0, keys))
    return rows


def job_on(path: Path, target: str, overrides: list[str], network: dict[str, Any] | None, ranks: list[Any]) -> None:
    """A finished job whose resolved config holds `network` (None: network=none) and whose ranks wrote `ranks`."""
    write_job(path, ranks, target, overrides, 25 if target == DDP else None)
    config = yaml.safe_load((path / ".hydra" / "config.yaml").read_text())
    config["network"] = {"_target_": "trainer.sync.network.Network", "preset": "none"} | (network or {})
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))


def tables(markdown: str) -> dict[str, dict[str, dict[str, str]]]:
    """report.md's points table (a sweep with repeats) and jobs table: each line's cells by column name, the
    line named by its first cell."""
    found: dict[str, dict[str, dict[str, str]]] = {}
    for title in ("Points", "Jobs"):
        if f"## {title}" not in markdown:
            continue
        section = markdown.split(f"## {title}")[1].split("\n## ")[0]
        lines = [line for line in section.splitlines() if line.startswith("| ")]
        header, *rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])] for line in lines]
        found[title] = {cells[0]: dict(zip(header, cells, strict=True)) for cells in rows}
    return found


def printed_tables(out: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The printed jobs table and points table, by column (the title may wrap: the jobs' header starts `job `)."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("job "))
    end = lines.index("", at)
    points = lines.index("Points (median over repeats, spread = min-max of the jobs' medians):") + 1
    return printed_columns(lines[at:end]), printed_columns(lines[points : points + 3])


@pytest.fixture
def two_tier(tmp_path: Path) -> Path:
    """ddp and manual, each twice (`+repeat`), 4 ranks in two emulated nodes. ddp's link ms per rank are
    20, 45, 6, 61 (job 0: median 32.5, not the mean) and 12, 30, 40, 70 (job 2: 35); its inter-node MB
    per rank 2, 2, 5, 6 (3.5). manual's are 8 ms and 1.62 MB on every rank."""
    root = tmp_path / "two_tier"
    ddp_0 = [
        rank_rows([10, 30, 20], [1, 3, 2]),
        rank_rows([40, 50, 45], [2, 2, 2]),
        rank_rows([5, 7, 6], [5, 5, 5]),
        rank_rows([60, 61, 62], [6, 6, 6]),
    ]
    # A row whose window the profiler recorded is left out, as from exposed ms: its 900 ms would move rank 0's median.
    profiled = {"trainer/profiled_steps": 1.0, "time/comm_exposed_link_s": 0.9, "comm/inter_node_bytes_per_step": 9e8}
    ddp_0[0].append(train_row(40, 0.1, 0.0, 640, 1.0, comm_keys(4.86e6, 0.911, 0.910) | profiled))
    ddp_2 = [rank_rows([v] * 3, [m] * 3) for v, m in ((12, 2), (30, 2), (40, 5), (70, 6))]
    manual = [rank_rows([8, 8, 8], [1.62] * 3)] * 4
    job_on(root / "0", DDP, ["+repeat=1", "sync=ddp"], TWO_TIER, ddp_0)
    job_on(root / "1", MANUAL, ["+repeat=1", "sync=manual"], TWO_TIER, manual)
    job_on(root / "2", DDP, ["+repeat=2", "sync=ddp"], TWO_TIER, ddp_2)
    job_on(root / "3", MANUAL, ["+repeat=2", "sync=manual"], TWO_TIER, manual)
    return root


def test_link_ms_and_inter_node_mb_stand_beside_their_columns(
    two_tier: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(two_tier)]) == 0
    out = capsys.readouterr().out
    markdown = (two_tier / "report.md").read_text()
    found = tables(markdown)
    jobs, points = found["Jobs"], found["Points"]
    names = list(jobs["0"])
    assert names[names.index("exposed ms") + 1] == "link ms"
    assert names[names.index("MB/step") + 1] == "inter-node MB/step"
    assert {j: jobs[j]["link ms"] for j in "0123"} == {"0": "32.50", "1": "8.00", "2": "35.00", "3": "8.00"}
    assert {j: jobs[j]["exposed ms"] for j in "0123"} == {"0": "42.50", "1": "18.00", "2": "45.00", "3": "18.00"}
    assert {j: jobs[j]["inter-node MB/step"] for j in "0123"} == {"0": "3.50", "1": "1.62", "2": "3.50", "3": "1.62"}
    assert {j: jobs[j]["MB/step"] for j in "0123"} == {j: "4.86" for j in "0123"}
    # The points: the median over the repeats, as for exposed ms.
    point_names = list(points["sync=ddp"])
    assert point_names[point_names.index("exposed ms") + 1] == "link ms"
    assert (points["sync=ddp"]["link ms"], points["sync=manual"]["link ms"]) == ("33.75", "8.00")
    assert (points["sync=ddp"]["exposed ms"], points["sync=manual"]["exposed ms"]) == ("43.75", "18.00")
    # report.csv: the same numbers unrounded.
    records = {r["job"]: r for r in csv.DictReader((two_tier / "report.csv").open())}
    assert float(records["0"]["comm_exposed_link_ms"]) == pytest.approx(32.5)
    assert float(records["2"]["comm_exposed_link_ms"]) == pytest.approx(35.0)
    assert float(records["0"]["inter_node_mb_per_step"]) == pytest.approx(3.5)
    assert float(records["1"]["inter_node_mb_per_step"]) == pytest.approx(1.62)
    # The printed tables: link ms right after exposed ms in both, the numbers report.md's.
    printed_jobs, printed_points = printed_tables(out)
    assert [line for line in out.splitlines() if len(line) > 100 and not line.startswith("full tables")] == []
    for printed in (printed_jobs, printed_points):
        assert list(printed)[list(printed).index("exposed ms") + 1] == "link ms"
    assert printed_jobs["link ms"] == ["32.50", "8.00", "35.00", "8.00"]
    assert list(printed_jobs)[list(printed_jobs).index("MB/step") + 1] == "inter-node MB/step"  # it fits here
    assert printed_jobs["inter-node MB/step"] == ["3.50", "1.62", "3.50", "1.62"]
    assert printed_points["link ms"] == ["33.75", "8.00"]
    assert "link ms" in markdown.split("## Legend")[1] and "inter-node MB/step" in markdown.split("## Legend")[1]


def test_a_link_without_nodes_has_link_ms_only_and_a_job_without_it_a_dash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rank per node: no bytes cross nodes, no inter-node column; a job on no emulated link: `-`."""
    root = tmp_path / "one_tier"
    job_on(root / "0", DDP, ["sync=ddp", "network=1gbe"], ONE_TIER, [rank_rows([4, 6, 5], None)] * 2)
    job_on(root / "1", DDP, ["sync=ddp", "network=none"], None, [rank_rows([7], None)] * 2)
    # network=none's rows carry no link key (the fake rows above do: take it away).
    for rank in (0, 1):
        path = root / "1" / "metrics" / f"rank{rank}.jsonl"
        path.write_text(path.read_text().replace('"time/comm_exposed_link_s"', '"other/key"'))
    assert main([str(root)]) == 0
    out = capsys.readouterr().out
    jobs = tables((root / "report.md").read_text())["Jobs"]
    assert (jobs["0"]["link ms"], jobs["1"]["link ms"]) == ("5.00", "-")
    assert "inter-node MB/step" not in jobs["0"] and "inter-node MB/step" not in out
    records = list(csv.DictReader((root / "report.csv").open()))
    assert [r["inter_node_mb_per_step"] for r in records] == ["", ""]
    assert [r["comm_exposed_link_ms"] for r in records] == ["5.0", ""]


def test_a_sweep_without_the_keys_has_neither_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "plain"
    rows = [train_row(10 * i, 0.1, 0.0, 640, 1.0, comm_keys(4.86e6, 0.011, 0.010)) for i in (1, 2)]
    for job, (repeat, target, sync) in enumerate([("1", DDP, "ddp"), ("1", MANUAL, "manual"), ("2", DDP, "ddp")]):
        job_on(root / str(job), target, [f"+repeat={repeat}", f"sync={sync}"], None, [rows, rows])
    assert main([str(root)]) == 0
    out = capsys.readouterr().out
    markdown = (root / "report.md").read_text()
    found = tables(markdown)
    for table in (found["Jobs"]["0"], found["Points"]["sync=ddp"]):
        assert "exposed ms" in table and "link ms" not in table and "inter-node MB/step" not in table
    assert "link ms" not in out and "inter-node" not in out
    records = list(csv.DictReader((root / "report.csv").open()))
    assert {r["comm_exposed_link_ms"] for r in records} == {r["inter_node_mb_per_step"] for r in records} == {""}


def test_on_a_narrow_screen_the_bytes_across_nodes_go_before_link_ms_and_mb_per_step() -> None:
    """The printed table keeps link ms beside exposed ms; inter-node MB/step only if it fits (105 columns
    with a swept value 50 wide, 95 with one 40 wide)."""
    numbers = [("MB/step", "4.86"), (INTER_NODE_HEADER, "1.62"), ("exposed ms", "18.00"), ("link ms", "8.00")]
    for swept, kept in (("h" * 50, ["MB/step", "exposed ms", "link ms"]), ("h" * 40, [n for n, _ in numbers])):
        columns = [Column("job", ["0"]), Column("comm_hook", [swept], clip=True, swept=True)]
        table = fit([*columns, *(Column(name, [cell]) for name, cell in numbers)], JOB_DROP_ORDER)
        assert list(printed_columns(table.splitlines())) == ["job", "comm_hook", *kept]
