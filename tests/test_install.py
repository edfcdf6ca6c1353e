"""`make setup`'s installer (trainer/tools/install.py): which wheels pip's report names, and how they are
dealt to the pips. The install itself runs in every `make test` on a new clone (CI's included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.tools import install


def wheel(tmp_path: Path, name: str, size: int) -> str:
    path = tmp_path / name
    path.write_bytes(b"\0" * size)
    return str(path)


def test_the_report_gives_local_paths_and_downloads_but_not_the_project(tmp_path: Path) -> None:
    local = wheel(tmp_path, "torch-2.14.1+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", 1)
    download = "https://files.pythonhosted.org/packages/2a/07/wandb-0.31.0-py3-none-any.whl"
    report = {  # the fields of pip's --report that the installer reads (pip's installation report, version 1)
        "version": "1",
        "install": [
            {"download_info": {"url": "file://" + local.replace("+", "%2B"), "archive_info": {}}},
            {"download_info": {"url": download, "archive_info": {}}},
            {"download_info": {"url": f"file://{tmp_path}", "dir_info": {"editable": True}}},
        ],
    }
    assert install.planned_wheels(report) == [local, download]


def test_wheels_are_dealt_by_bytes_and_downloads_alternate(tmp_path: Path) -> None:
    big, mid_a, mid_b = (wheel(tmp_path, f"{n}.whl", s) for n, s in (("big", 500), ("mid_a", 300), ("mid_b", 280)))
    small = wheel(tmp_path, "small.whl", 10)
    downloads = [f"https://example.invalid/d{i}.whl" for i in range(4)]
    groups = install.deal([small, *downloads, mid_b, big, mid_a], jobs=2)
    assert sorted(w for g in groups for w in g) == sorted([big, mid_a, mid_b, small, *downloads])  # each once
    local = [[w for w in g if w.startswith(str(tmp_path))] for g in groups]
    assert sorted(local) == sorted([[big, small], [mid_a, mid_b]])  # 510 and 580 bytes: the closest split
    assert sorted(sum(1 for w in g if w in downloads) for g in groups) == [2, 2]


def test_one_job_is_one_pip_and_no_group_is_empty(tmp_path: Path) -> None:
    only = wheel(tmp_path, "only.whl", 3)
    assert install.deal([only], jobs=1) == [[only]]
    assert install.deal([only], jobs=4) == [[only]]  # three pips with nothing to do are not started
    assert install.deal([], jobs=2) == []


def test_jobs_below_one_is_refused_naming_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        install.main(["--jobs", "0"])
    assert exit_info.value.code == 2
    assert "--jobs=0 is invalid: accepted: an integer >= 1" in capsys.readouterr().err
