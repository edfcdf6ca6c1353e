"""The report of a sweep on an emulated link (network=<preset>) names the link its numbers are for: the
preset, its latency and bandwidth (as the run's own sync line says them) and time_scale, read from
each job's resolved config, in the title (printed, report.md, the plot) when every job ran on one
link, else one line per link under the table and in the plot's title."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from matplotlib.figure import Figure

from tests.report_helpers import DDP, MANUAL, train_row, unwrapped, write_job
from trainer.tools import report

NONE: dict[str, Any] = {
    "_target_": "trainer.sync.network.Network",
    "preset": "none",
    "latency_us": None,
    "bandwidth_gbps": None,
    "gpus_per_node": 1,
    "intra": "nvlink",
    "intra_latency_us": None,
    "intra_bandwidth_gbps": None,
    "time_scale": 1.0,
}


def job_on(path: Path, target: str, overrides: list[str], network: dict[str, Any] | None) -> None:
    """A finished job of 2 ranks whose resolved config (.hydra/config.yaml) holds `network`, as train.py's does."""
    write_job(path, [[train_row(10, 0.1, 0.0, 640, 1.0)]] * 2, target, overrides, 25 if target == DDP else None)
    if network is not None:
        config = yaml.safe_load((path / ".hydra" / "config.yaml").read_text())
        (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config | {"network": NONE | network}))


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures report.main draws (the real plot, kept to be read back)."""
    figures: list[Figure] = []
    real = report.plot

    def keep(*args: Any, **kwargs: Any) -> Figure:
        figures.append(real(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(report, "plot", keep)
    return figures


def test_a_sweep_on_one_link_names_it_in_every_title(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], drawn: list[Figure]
) -> None:
    # experiment=network_strategies' link: 100 GbE, every link time x25.
    root = tmp_path / "net"
    link = {"preset": "100gbe", "time_scale": 25}
    job_on(root / "0", DDP, ["+repeat=1", "sync=ddp"], link)
    job_on(root / "1", MANUAL, ["+repeat=1", "sync=manual"], link)
    assert report.main([str(root)]) == 0
    title = "Strategy sweep: net, 2 ranks, emulated link 100gbe (alpha 15 us, beta 10 GB/s), time_scale 25"
    assert unwrapped(capsys.readouterr().out).splitlines()[0] == title
    assert (root / "report.md").read_text().splitlines()[0] == f"# {title}"
    (fig,) = drawn
    assert fig.get_suptitle() == title
    # A preset with its latency replaced: named as the run's sync line names it, with a star.
    one = tmp_path / "slow"
    job_on(one, DDP, ["sync=ddp", "network=1gbe", "network.latency_us=2000"], {"preset": "1gbe", "latency_us": 2000})
    assert report.main([str(one)]) == 0
    first = unwrapped(capsys.readouterr().out).splitlines()[0]
    assert first == "Job slow, 2 ranks, emulated link 1gbe* (alpha 2000 us, beta 0.11 GB/s)"


def test_jobs_on_different_links_each_name_theirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], drawn: list[Figure]
) -> None:
    root = tmp_path / "links"
    job_on(root / "0", DDP, ["sync=ddp", "network=1gbe"], {"preset": "1gbe"})
    job_on(
        root / "1", DDP, ["sync=ddp", "network=10gbe", "network.time_scale=10"], {"preset": "10gbe", "time_scale": 10}
    )
    job_on(root / "2", DDP, ["sync=ddp", "network=1gbe"], {"preset": "1gbe"})
    job_on(root / "3", DDP, ["sync=ddp", "network=none"], {})
    assert report.main([str(root)]) == 0
    printed = unwrapped(capsys.readouterr().out).splitlines()
    lines = [
        "jobs 0 and 2: emulated link 1gbe (alpha 50 us, beta 0.11 GB/s)",
        "job 1: emulated link 10gbe (alpha 25 us, beta 1.1 GB/s), time_scale 10",
        "job 3: no emulated link",
    ]
    assert printed[0] == "Sweep links, 2 ranks"
    at = printed.index(lines[0])
    assert printed[at : at + 3] == lines
    # Under the table (title, header, 4 jobs, ddp's dagger note), before what the sweep allows one to say.
    assert printed[5].startswith("3 ") and printed[6].startswith("†") and at == 7
    markdown = (root / "report.md").read_text().splitlines()
    assert all(f"- {line}" in markdown for line in lines)
    (fig,) = drawn
    assert fig.get_suptitle() == "\n".join(["Sweep links, 2 ranks", *lines])


def test_a_sweep_without_an_emulated_link_says_nothing_of_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "plain"
    job_on(root / "0", DDP, ["sync=ddp"], {})  # network=none
    job_on(root / "1", MANUAL, ["sync=manual"], None)  # a config from before the key
    assert report.main([str(root)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == "Strategy sweep: plain, 2 ranks" and "link" not in printed
