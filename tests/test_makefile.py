"""The Makefile's set-up choices and `make clean`, read by make itself in a copy of the two files it needs
(nothing installed: a venv is a stamp file and, where a recipe must run, a fake python)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.compose import REPO


def copy(tmp_path: Path) -> None:
    for name in ("Makefile", "pyproject.toml"):
        if not (tmp_path / name).exists():
            shutil.copy(REPO / name, tmp_path / name)


def make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    copy(tmp_path)
    return subprocess.run(["make", "--no-print-directory", *args], cwd=tmp_path, capture_output=True, text=True)


def test_torch_cpu_hands_pytorchs_cpu_index_to_the_installer(tmp_path: Path) -> None:
    proc = make(tmp_path, "-n", "train", "TORCH=cpu")  # -n: the commands, not run
    assert proc.returncode == 0, proc.stderr
    assert "-m trainer.tools.install --log .venv/pip.log --stamp .venv/.installed" in proc.stdout
    assert "--torch-index 'https://download.pytorch.org/whl/cpu' --command 'make train TORCH=cpu'" in proc.stdout


def test_default_setup_takes_pips_own_torch(tmp_path: Path) -> None:
    proc = make(tmp_path, "-n", "setup")
    assert proc.returncode == 0, proc.stderr
    assert "-m trainer.tools.install" in proc.stdout and "--torch-index" not in proc.stdout


def stamp(tmp_path: Path, text: str) -> None:
    """A venv set up, as far as make can tell: its stamp, newer than pyproject.toml."""
    copy(tmp_path)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").write_text(text)


@pytest.mark.parametrize(
    ("recorded", "torch", "runs"),
    [
        ("torch=cuda 2.14.1\n", "TORCH=cpu", True),  # a default set-up, then TORCH=cpu: the installer says what to do
        ("", "TORCH=cpu", True),  # a stamp from before it recorded torch: the installer looks
        ("torch=cpu 2.13.0+cpu\n", "TORCH=cpu", False),
        ("torch=cuda 2.14.1\n", "TORCH=", False),  # no choice: whatever the venv holds
        ("torch=cpu 2.13.0+cpu\n", "TORCH=", False),
    ],
)
def test_the_installer_runs_again_when_torch_cpu_is_asked_of_a_venv_not_recorded_as_cpu(
    tmp_path: Path, recorded: str, torch: str, runs: bool
) -> None:
    stamp(tmp_path, recorded)
    proc = make(tmp_path, "-n", "setup", torch)
    assert proc.returncode == 0, proc.stderr
    assert ("-m trainer.tools.install" in proc.stdout) == runs, proc.stdout


def test_torch_cpu_on_a_default_venv_stops_make_train_with_the_installers_answer(tmp_path: Path) -> None:
    """The venv is kept (no `python -m venv` over it) and train does not start when the installer refuses."""
    stamp(tmp_path, "torch=cuda 2.14.1\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir()
    python.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\necho "the installer refuses"\nexit 2\n')
    python.chmod(0o755)
    proc = make(tmp_path, "train", "TORCH=cpu", "PYTHON=false")  # false: a new venv would fail
    assert proc.returncode == 2 and proc.stdout == "the installer refuses\n", proc.stdout + proc.stderr
    calls = (python.parent / "calls").read_text().splitlines()
    assert calls == [
        "-m trainer.tools.install --log .venv/pip.log --stamp .venv/.installed "
        "--torch-index https://download.pytorch.org/whl/cpu --command make train TORCH=cpu"
    ]


def test_an_unknown_torch_choice_is_refused_on_an_existing_venv_too(tmp_path: Path) -> None:
    stamp(tmp_path, "torch=cuda 2.14.1\n")
    proc = make(tmp_path, "train", "TORCH=gpu")
    assert proc.returncode == 2
    assert proc.stdout.splitlines()[0] == "TORCH=gpu is not a choice: accepted: cpu, or unset (pip's default torch)"


def test_an_unknown_torch_choice_is_refused_naming_the_accepted_ones(tmp_path: Path) -> None:
    proc = make(tmp_path, "setup", "TORCH=cuda")
    assert proc.returncode == 2
    assert proc.stdout.splitlines()[0] == "TORCH=cuda is not a choice: accepted: cpu, or unset (pip's default torch)"
    assert not (tmp_path / ".venv").exists()  # refused before anything is created


# What `make clean` keeps, of what .gitignore names: the venv and pip's record of the editable install,
# your own config, Python's bytecode; datasets/ holds data sets as well as the token cache it removes.
KEPT = {".venv/", "*.egg-info/", "conf/local/", "__pycache__/", "datasets/"}


def test_make_clean_removes_what_the_lab_writes_and_keeps_the_venv_and_data_sets(tmp_path: Path) -> None:
    ignored = [line for line in (REPO / ".gitignore").read_text().splitlines() if line and not line.startswith("#")]
    written = [name for name in ignored if name not in KEPT] + [".ruff_cache/", ".mypy_cache/", "datasets/tokens/"]
    for name in [*written, ".venv/", "conf/local/", "datasets/MNIST/raw/"]:
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / name / "file").write_text("x")
    proc = make(tmp_path, "clean")
    assert proc.returncode == 0, proc.stderr
    assert [name for name in written if (tmp_path / name).exists()] == []
    assert all((tmp_path / name / "file").exists() for name in (".venv/", "conf/local/", "datasets/MNIST/raw/"))


def test_make_clean_removes_datasets_when_the_token_cache_was_all_it_held(tmp_path: Path) -> None:
    (tmp_path / "datasets" / "tokens").mkdir(parents=True)
    (tmp_path / "datasets" / "tokens" / "abc.char.u16").write_text("x")
    proc = make(tmp_path, "clean")
    assert proc.returncode == 0 and not (tmp_path / "datasets").exists(), proc.stderr
