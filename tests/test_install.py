"""`make setup`'s installer (trainer/tools/install.py): which wheels pip's report names, and how they are
dealt to the pips; the check of what it installed (torch and torchvision import, torchvision's nms runs),
run for real in a new process; PyTorch's index probed before pip. The install itself runs in every
`make test` on a new clone (CI's included)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.compose import REPO
from trainer.tools import install

REAL_CHECK, REAL_PROBE = install.check_pair, install.probe


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


# The set-up's steps, run by main() against a fake pip: a script that records its arguments, answers
# --dry-run with the report the test gives (or fails with the message it gives), and takes a moment to
# "install". Nothing is installed anywhere.
FAKE_PIP = """
import json, os, sys, time
args, here = sys.argv[1:], os.environ["FAKE_PIP"]
with open(os.path.join(here, "calls.jsonl"), "a") as calls:
    calls.write(json.dumps(args) + "\\n")
if args[:2] == ["config", "list"]:
    with open(os.path.join(here, "config.txt")) as config:
        print(config.read(), end="")
elif "--dry-run" in args:
    step = "torch" if any(a.startswith("torch") for a in args) else "project"
    with open(os.path.join(here, step + ".json")) as answer_file:
        answer = json.load(answer_file)
    if isinstance(answer, str):
        sys.stderr.write(answer)
        sys.exit(1)
    print(json.dumps(answer))
else:
    print("fake pip:", *args)  # pip's own output: for the log, not the screen
    if "--requirement" in args:  # unpacking wheels
        time.sleep(float(os.environ.get("FAKE_PIP_S", "0")))
"""
NO_TORCH = (
    "ERROR: Could not find a version that satisfies the requirement torch>=2.14 (from versions: 2.13.0+cpu)\n"
    "ERROR: No matching distribution found for torch>=2.14\n"
)
# What `pip config list` says on the project's machines (their pip reaches local folders, not PyTorch's index).
PIP_CONFIG = (
    "global.constraint='/etc/xdg/pip/constraints.txt'\n"
    "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'\n"
    "global.find-links='/opt/wheels'\n"
    ":env:.find-links='/opt/wheels'\n"
)
CUDA_REQUIRES = ['nvidia-cudnn-cu13==9.24.0.43; platform_system == "Linux"', "filelock"]


def zipped_wheel(tmp_path: Path, name: str, nbytes: int) -> str:
    """A wheel of `nbytes` once unpacked, small on disk (zeros, deflated)."""
    path = tmp_path / name
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive,
        archive.open("payload", "w") as out,
    ):
        for start in range(0, nbytes, 2**20):
            out.write(bytes(min(2**20, nbytes - start)))
    return str(path)


def item(wheel: str, name: str, version: str, requires: list[str] | None = None) -> dict:
    url = wheel if wheel.startswith("https://") else f"file://{wheel}"
    meta = {"name": name, "version": version, "requires_dist": requires or []}
    return {"download_info": {"url": url, "archive_info": {}}, "metadata": meta}


class FakePip:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir, self.tmp_path = tmp_path / "fake-pip", tmp_path
        self.dir.mkdir()
        script = self.dir / "pip.py"
        script.write_text(FAKE_PIP)
        monkeypatch.setenv("FAKE_PIP", str(self.dir))
        monkeypatch.setattr(install, "pip", lambda *args: [sys.executable, str(script), *args])
        monkeypatch.setattr(install, "site_packages", lambda: self.dir)  # what the progress lines measure
        # The last step's check and the index's probe, real in the tests that are about them.
        monkeypatch.setattr(install, "check_pair", lambda *args: None)
        monkeypatch.setattr(install, "probe", lambda index: None)
        (self.dir / "config.txt").write_text(PIP_CONFIG)
        self.monkeypatch = monkeypatch

    def answer(self, step: str, answer: dict | str) -> None:
        (self.dir / f"{step}.json").write_text(json.dumps(answer))

    def torch(self, before: tuple[str, str] | None, after: tuple[str, str] | None) -> None:
        """What installed_torch() says at the start of main() and at its end."""
        answers = iter([before, after])
        self.monkeypatch.setattr(install, "installed_torch", lambda: next(answers))

    def calls(self) -> list[list[str]]:
        path = self.dir / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def main(self, *args: str) -> int:
        log, stamp = self.tmp_path / "pip.log", self.tmp_path / ".installed"
        return install.main(["--log", str(log), "--stamp", str(stamp), *args])


@pytest.fixture
def fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakePip:
    return FakePip(tmp_path, monkeypatch)


@pytest.mark.parametrize(
    ("version", "requires", "platform", "build"),
    [
        ("2.14.1", CUDA_REQUIRES, "linux", "cuda"),  # PyPI's Linux torch
        ("2.14.1", ["filelock"], "linux", "cpu"),
        ("2.14.1", CUDA_REQUIRES, "darwin", "cpu"),  # the same requirements, for Linux only
        ("2.13.0+cpu", [], "linux", "cpu"),
        ("2.9.0+cu128", CUDA_REQUIRES, "linux", "cuda"),
        ("2.9.0+rocm6.4", [], "linux", "rocm"),
    ],
)
def test_torch_build_is_read_from_its_version_label_or_its_cuda_requirements(
    version: str, requires: list[str], platform: str, build: str
) -> None:
    assert install.torch_build(version, requires, platform) == build


def test_a_folder_is_read_alone_and_an_index_with_its_requirements(tmp_path: Path) -> None:
    assert install.cpu_torch(str(tmp_path)) == [
        *("torch>=2.14", "torchvision>=0.29", "--no-deps", "--no-index", "--find-links", str(tmp_path))
    ]
    assert install.cpu_torch(install.CPU_INDEX) == [
        *("torch>=2.14", "torchvision>=0.29", "--index-url", install.CPU_INDEX)
    ]


def test_the_default_set_up_says_each_step_with_its_estimate_and_stamps_the_torch_it_installed(
    fake_pip: FakePip, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = zipped_wheel(tmp_path, "torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl", 400_000_000)
    small = zipped_wheel(tmp_path, "tqdm-4.67.1-py3-none-any.whl", 1000)
    download = "https://files.pythonhosted.org/packages/2a/07/wandb-0.31.0-py3-none-any.whl"
    fake_pip.answer(
        "project",
        {
            "install": [
                item(torch, "torch", "2.14.1", CUDA_REQUIRES),
                item(small, "tqdm", "4"),
                item(download, "wandb", "0.31.0"),
            ]
        },
    )
    fake_pip.torch(None, ("2.14.1", "cuda"))
    monkeypatch.setattr(install, "TICK_S", 0.2)
    monkeypatch.setenv("FAKE_PIP_S", "0.7")  # each "install" takes a moment: the unpacking step ticks
    assert fake_pip.main() == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("[")]
    assert [line.split("]")[0] + "]" for line in steps] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"]
    assert steps[0].startswith("[1/5] pip, upgraded (5-10 s on the project's 2-core machine) ... ")
    assert steps[2].startswith("[3/5] 3 wheels, 0.4 GB to write (largest: torch, tqdm), by 2 pip(s) at once")
    assert "1 more to download" in steps[2] and "(5-15 s on the project's 2-core machine)" in steps[2]
    assert steps[4].startswith("[5/5] torch and torchvision: imported, and torchvision's nms run")
    assert any(re.fullmatch(r" +\d+ s: 0\.\d GB written", line) for line in lines), lines  # progress
    venv, log = os.path.relpath(sys.prefix), tmp_path / "pip.log"
    assert lines[0] == f"setting up {venv} with pip's default torch>=2.14; pip's own output goes to {log}"
    assert lines[-1].startswith("set up in ") and lines[-1].endswith(f"with torch 2.14.1 (cuda), from {torch}")
    assert not any("fake pip" in line for line in lines)  # pip's output went to the log
    assert "fake pip: install --upgrade pip" in (tmp_path / "pip.log").read_text()
    assert (tmp_path / ".installed").read_text() == "torch=cuda 2.14.1\n"


def test_torch_cpu_installs_torch_from_the_cpu_index_before_the_project(
    fake_pip: FakePip, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = zipped_wheel(tmp_path, "torch-2.14.1+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", 1000)
    fake_pip.answer("torch", {"install": [item(torch, "torch", "2.14.1+cpu")]})
    fake_pip.answer("project", {"install": []})
    fake_pip.torch(None, ("2.14.1+cpu", "cpu"))
    assert fake_pip.main("--torch-index", install.CPU_INDEX) == 0
    calls = fake_pip.calls()
    assert calls[1][:7] == ["install", "--dry-run", "--quiet", "--report", "-", "torch>=2.14", "torchvision>=0.29"]
    assert calls[1][-2:] == ["--index-url", install.CPU_INDEX]  # reached: pip's own retries
    assert calls[2][:2] == ["install", "--no-deps"] and calls[3][-2:] == ["-e", ".[dev]"]  # torch, then the project
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        f"setting up {os.path.relpath(sys.prefix)} with a CPU-only torch>=2.14 from {install.CPU_INDEX};"
    )
    assert "[2/7] torch and torchvision, CPU-only: resolved" in "\n".join(lines) and lines[-2].startswith("[7/7]")
    assert lines[-1].endswith(f"with torch 2.14.1+cpu (cpu), from {torch}")  # where the torch came from
    assert (tmp_path / ".installed").read_text() == "torch=cpu 2.14.1+cpu\n"


def test_torch_cpu_that_pip_cannot_find_says_where_the_cpu_wheels_live_and_how_to_point_pip_elsewhere(
    fake_pip: FakePip, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_pip.answer("torch", NO_TORCH)
    fake_pip.torch(None, None)
    assert fake_pip.main("--torch-index", install.CPU_INDEX) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("[2/7] torch and torchvision, CPU-only: resolved") and lines[-2].endswith(" failed")
    assert lines[-1] == (  # one line, naming the version needed (pip's own lines are in its log)
        f"pip found no torch>=2.14 in the sources it was given (its log: {tmp_path / 'pip.log'}): "
        + install.NO_CPU_WHEELS
    )
    assert install.CPU_INDEX in lines[-1] and "TORCH_CPU_INDEX" in lines[-1]
    assert "No matching distribution found for torch>=2.14" in (tmp_path / "pip.log").read_text()
    assert len(fake_pip.calls()) == 2 and not (tmp_path / ".installed").exists()  # pip's upgrade and the plan


def test_torch_cpu_refuses_a_cuda_build_that_pip_would_take_from_another_source(
    fake_pip: FakePip, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = zipped_wheel(tmp_path, "torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl", 1000)
    fake_pip.answer("torch", {"install": [item(torch, "torch", "2.14.1", CUDA_REQUIRES)]})
    fake_pip.torch(None, None)
    assert fake_pip.main("--torch-index", install.CPU_INDEX) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"TORCH=cpu: pip would take torch 2.14.1, a CUDA build, from file://{torch}")
    assert last.endswith(install.NO_CPU_WHEELS) and len(fake_pip.calls()) == 2  # nothing installed


def test_torch_cpu_on_a_venv_holding_the_cuda_build_is_refused_in_one_line_before_pip_runs(
    fake_pip: FakePip, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_pip.torch(("2.14.1", "cuda"), None)
    assert fake_pip.main("--torch-index", install.CPU_INDEX, "--command", "make train TORCH=cpu") == 2
    out = capsys.readouterr().out
    venv = os.path.relpath(sys.prefix)
    assert out == (
        f"{venv} holds torch 2.14.1, the CUDA build, which pip does not swap for the CPU-only one in place: "
        f"`rm -rf {venv} && make train TORCH=cpu` deletes {venv}, with anything you installed into it, and sets "
        "it up again with the CPU-only torch\n"
    )
    assert fake_pip.calls() == [] and not (tmp_path / "pip.log").exists()


def test_torch_cpu_on_a_venv_holding_the_cpu_build_keeps_it_and_records_it(
    fake_pip: FakePip, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_pip.answer("project", {"install": []})
    fake_pip.torch(("2.14.1+cpu", "cpu"), ("2.14.1+cpu", "cpu"))
    assert fake_pip.main("--torch-index", install.CPU_INDEX) == 0
    assert not any("torch>=2.14" in call for call in fake_pip.calls())  # no CPU step: the project's only
    out = capsys.readouterr().out
    assert "[5/5]" in out and out.splitlines()[-1].endswith("with torch 2.14.1+cpu (cpu), already installed, kept")
    assert (tmp_path / ".installed").read_text() == "torch=cpu 2.14.1+cpu\n"


def test_torch_cpu_on_a_venv_holding_a_cpu_torch_below_the_floor_installs_the_floor_in_its_place(
    fake_pip: FakePip, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = zipped_wheel(tmp_path, "torch-2.14.1+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", 1000)
    fake_pip.answer("torch", {"install": [item(torch, "torch", "2.14.1+cpu")]})
    fake_pip.answer("project", {"install": []})
    fake_pip.torch(("2.13.0+cpu", "cpu"), ("2.14.1+cpu", "cpu"))
    assert fake_pip.main("--torch-index", install.CPU_INDEX) == 0
    assert fake_pip.calls()[1][5:7] == ["torch>=2.14", "torchvision>=0.29"]  # the CPU step, not pip's CUDA default
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        f"setting up {os.path.relpath(sys.prefix)} with a CPU-only torch>=2.14 from {install.CPU_INDEX}, in place "
        "of its torch 2.13.0+cpu;"
    )
    assert (tmp_path / ".installed").read_text() == "torch=cpu 2.14.1+cpu\n"


def dist_wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    """A wheel with only its metadata: what pip's resolver and installer read."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{info}/METADATA": "".join(
            [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", *(f"Requires-Dist: {r}\n" for r in requires)]
        ),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)


@pytest.mark.parametrize("torch", [None, ("9.0+cpu", []), ("9.0", CUDA_REQUIRES)], ids=["none", "cpu", "cuda"])
def test_a_folder_of_wheels_through_the_real_pip(
    torch: tuple[str, list[str]] | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """pip's own answers to the CPU step: its report's torch and the failure when a folder holds none.
    pip installs into a --target folder, where this venv's own torch is not seen."""
    folder, target = tmp_path / "wheels", tmp_path / "target"
    folder.mkdir()
    if torch is not None:
        dist_wheel(folder, "torch", torch[0], torch[1])
        dist_wheel(folder, "torchvision", "9.1", [])
    for variable in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # the folder alone, whatever this machine's pip config says
    monkeypatch.setattr(install, "pip", lambda *args: [sys.executable, "-m", "pip", *args, "--target", str(target)])
    with (tmp_path / "pip.log").open("w") as log:
        setup = install.Setup(tmp_path / "pip.log", log, install.Screen(2), jobs=2)
        done = install.install_cpu_torch(setup, str(folder))
    last = capsys.readouterr().out.splitlines()[-1]
    if torch is None:
        assert not done and last.startswith("pip found no torch>=2.14 in the sources it was given")
        assert last.endswith(install.NO_CPU_WHEELS)
        assert "No matching distribution found for torch>=2.14" in (tmp_path / "pip.log").read_text()
    elif torch[0] == "9.0":
        assert not done and last.startswith("TORCH=cpu: pip would take torch 9.0, a CUDA build, from file://")
        assert not target.exists()
    else:
        assert done, last
        assert sorted(p.name for p in target.iterdir() if p.name.endswith(".dist-info")) == [
            "torch-9.0+cpu.dist-info",
            "torchvision-9.1.dist-info",
        ]


# The check of what was installed, for real: the venv's python in a new process. A torchvision that does not
# match its torch cannot be installed offline here, so a stand-in takes its place first on that process's
# path: a package named torchvision (with its metadata, 0.28.0, the release built for torch 2.13) that raises
# torch's own message for a missing operator where a mismatched one raises it: at import (its meta
# registrations, as torchvision 0.29.1 does over torch 2.13.0) or in ops.nms. The check's code and the
# process that runs it are the real ones; only the package it is handed is a stand-in.
STAND_IN = {
    "import": 'raise RuntimeError("operator torchvision::nms does not exist")\n',
    "nms": (
        "from types import SimpleNamespace\n"
        "def nms(boxes, scores, iou_threshold):\n"
        '    raise RuntimeError("operator torchvision::nms does not exist")\n'
        "ops = SimpleNamespace(nms=nms)\n"
    ),
}


def stand_in_torchvision(root: Path, fails_at: str) -> Path:
    package = root / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN[fails_at])
    info = root / "torchvision-0.28.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    return root


def check_command(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m trainer.tools.install --check`, as a person runs it after a set-up."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (pythonpath, REPO) if p is not None)}
    cmd = [sys.executable, "-m", "trainer.tools.install", "--check", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_the_check_passes_on_this_venvs_torch_and_torchvision() -> None:
    done = check_command()
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"torch and torchvision work together in {os.path.relpath(sys.prefix, REPO)}: both import, and "
        "torchvision.ops.nms runs"
    ]


@pytest.mark.parametrize("fails_at", ["import", "nms"])
def test_the_check_fails_in_one_line_on_a_torchvision_built_for_another_torch(tmp_path: Path, fails_at: str) -> None:
    import torch

    index = tmp_path / "wheels"
    index.mkdir()
    done = check_command("--torch-index", str(index), pythonpath=stand_in_torchvision(tmp_path / "path", fails_at))
    assert done.returncode == 1, done.stdout + done.stderr
    step = "import torchvision" if fails_at == "import" else "torchvision.ops.nms"
    fix = f"--force-reinstall --no-deps 'torchvision==0.29.*' --no-index --find-links {index}"
    assert done.stdout.splitlines() == [
        f"torch and torchvision do not work together: {step} failed with RuntimeError: operator torchvision::nms "
        f"does not exist (torch {torch.__version__}, torchvision 0.28.0): `{sys.executable} -m pip install {fix}` "
        f"installs the torchvision built for torch {torch.__version__}"
    ]
    assert done.stderr == ""


@pytest.mark.slow  # the check starts a process
def test_a_set_up_whose_torchvision_fails_the_check_ends_on_that_line_with_no_stamp(
    fake_pip: FakePip, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_pip.answer("project", {"install": []})
    fake_pip.torch(("2.14.1", "cuda"), ("2.14.1", "cuda"))
    monkeypatch.setattr(install, "check_pair", REAL_CHECK)
    monkeypatch.setenv("PYTHONPATH", str(stand_in_torchvision(tmp_path / "path", "nms")))
    assert fake_pip.main() == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("[5/5] torch and torchvision: imported, and torchvision's nms run") and lines[
        -2
    ].endswith(" failed")
    assert lines[-1].startswith("torch and torchvision do not work together: torchvision.ops.nms failed with ")
    assert lines[-1].endswith(
        f"-m pip install --force-reinstall --no-deps 'torchvision==0.29.*'` installs the "
        f"torchvision built for torch {__import__('torch').__version__}"
    )
    assert not any(line.startswith("set up in ") for line in lines)
    assert not (tmp_path / ".installed").exists()


def closed_port() -> int:
    """A local port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_torch_index_is_said_first_with_where_pip_looks_next_and_pip_tries_it_once(
    fake_pip: FakePip, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    index = f"http://127.0.0.1:{closed_port()}/whl/cpu"
    monkeypatch.setattr(install, "probe", REAL_PROBE)
    torch = zipped_wheel(tmp_path, "torch-2.14.1+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", 1000)
    fake_pip.answer("torch", {"install": [item(torch, "torch", "2.14.1+cpu")]})
    fake_pip.answer("project", {"install": []})
    fake_pip.torch(None, ("2.14.1+cpu", "cpu"))
    assert fake_pip.main("--torch-index", index) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"PyTorch's index {index} is unreachable ([Errno 111] Connection refused): pip looks next in the sources "
        "it is configured with (file:///opt/pypi/simple, file:///opt/pypi-more/simple, /opt/wheels; `pip config "
        "list`), and does not retry the index"
    )
    assert lines[1].startswith(
        f"setting up {os.path.relpath(sys.prefix)} with a CPU-only torch>=2.14 from pip's other sources;"
    )
    plan = fake_pip.calls()[2]  # after `pip config list` and pip's upgrade
    assert plan[-6:] == ["--index-url", index, "--retries", "0", "--timeout", str(install.PROBE_S)]
    assert lines[-1].endswith(f"with torch 2.14.1+cpu (cpu), from {torch}")  # where it came from instead


def test_the_probe_answers_for_a_local_mirror_and_a_folder_path_but_not_a_missing_one(tmp_path: Path) -> None:
    assert install.probe(tmp_path.as_uri()) is None
    assert install.probe((tmp_path / "none").as_uri()) == f"{tmp_path / 'none'} does not exist"
    assert install.probe(f"http://127.0.0.1:{closed_port()}/simple") == "[Errno 111] Connection refused"
