"""The Makefile's set-up choices, read by make itself in a copy of the two files it needs (nothing installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.compose import REPO


def make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    return subprocess.run(["make", "--no-print-directory", *args], cwd=tmp_path, capture_output=True, text=True)


def test_torch_cpu_installs_the_cpu_only_build_first(tmp_path: Path) -> None:
    proc = make(tmp_path, "-n", "setup", "TORCH=cpu")  # -n: the commands, not run
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    cpu = next(i for i, line in enumerate(lines) if "--index-url https://download.pytorch.org/whl/cpu" in line)
    project = next(i for i, line in enumerate(lines) if "-m trainer.tools.install" in line)
    assert "pip install torch torchvision" in lines[cpu] and cpu < project  # the project then finds torch installed


def test_default_setup_takes_pips_own_torch(tmp_path: Path) -> None:
    proc = make(tmp_path, "-n", "setup")
    assert proc.returncode == 0, proc.stderr
    assert "--index-url" not in proc.stdout
    assert not any(line.startswith("pip install torch") for line in proc.stdout.splitlines())


def test_an_unknown_torch_choice_is_refused_naming_the_accepted_ones(tmp_path: Path) -> None:
    proc = make(tmp_path, "setup", "TORCH=cuda")
    assert proc.returncode == 2
    assert proc.stdout.splitlines()[0] == "TORCH=cuda is not a choice: accepted: cpu, or unset (pip's default torch)"
    assert not (tmp_path / ".venv").exists()  # refused before anything is created
