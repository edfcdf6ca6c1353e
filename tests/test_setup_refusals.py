"""A set-up the lab cannot run on says so in one line, before anything is written: a torch older than the
floor (trainer/setup/torch_version.py, at the start of train.py and of the launcher), and a _target_ whose
module fails to import (trainer/setup/validate.py): reported as that package and its error, not as a bad key.

The older torch: the check reads the installed torch's version from its metadata (what pip reads), before
torch is imported, so the subprocess tests put a torch-2.13.0+cpu.dist-info first on PYTHONPATH; the torch
that would be imported stays this venv's. A run with the real torch 2.13.0 wheel unpacked first on the path
(its torchvision then fails with `operator torchvision::nms does not exist`) printed the same line.
The failing import: modules written to a temp folder on the path, imported for real by the real
compose-and-validate call train.py makes (precheck.check_command_line); and `data=fake` in a real train.py
whose torchvision is a stand-in raising torch's message for a missing operator (a torchvision built for
another torch cannot be installed offline here).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import TRAIN, env
from tests.compose import REPO
from trainer.setup import torch_version
from trainer.setup.precheck import EXIT_CODE, check_command_line

OLD_TORCH_LINE = (
    f"ddplab needs torch>=2.14, and {sys.executable} has torch 2.13.0+cpu: `make setup` installs it "
    "(in a venv of your own: pip install 'torch>=2.14' 'torchvision>=0.29')"
)


@pytest.mark.parametrize(
    ("version", "refused"),
    [
        ("2.13.0+cpu", True),
        ("2.13.9", True),
        ("2.9.1", True),  # 9 < 14 as numbers, not as text
        ("1.99", True),
        (None, True),  # no torch at all
        ("2.14.0", False),
        ("2.14.1+cu130", False),
        ("2.14.0a0+git1a2b3c", False),  # a source build of 2.14
        ("2.14.0.dev20260101+cpu", False),  # a nightly of 2.14
        ("2.15", False),
        ("3.0.0", False),
    ],
)
def test_the_floor_compares_release_numbers(version: str | None, refused: bool) -> None:
    line = torch_version.refusal(version)
    assert (line is not None) == refused, line
    if line is not None:
        assert line.startswith(f"ddplab needs torch>=2.14, and {sys.executable} has ")
        assert "`make setup`" in line and "pip install 'torch>=2.14' 'torchvision>=0.29'" in line
        assert "\n" not in line


def test_pyproject_asks_for_the_floor_the_start_checks() -> None:
    text = (REPO / "pyproject.toml").read_text()
    torch = re.findall(r'"torch>=([\d.]+)"', text)
    vision = re.findall(r'"torchvision>=([\d.]+)"', text)
    assert torch == [torch_version.dotted(torch_version.TORCH_FLOOR)]
    assert vision == [torch_version.dotted(torch_version.TORCHVISION_FLOOR)]


def older_torch(root: Path) -> Path:
    """A folder that makes torch's metadata say 2.13.0+cpu, for a process that has it first on its path."""
    info = root / "torch-2.13.0+cpu.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
    return root


@pytest.mark.parametrize("how", ["python train.py", "launcher"])
def test_an_older_torch_is_refused_at_start_in_one_line_with_exit_2_and_nothing_on_disk(
    tmp_path: Path, how: str
) -> None:
    run_env = {**env(), "PYTHONPATH": os.pathsep.join([str(older_torch(tmp_path / "path")), str(REPO)])}
    launcher = [sys.executable, "-m", "trainer.tools.launch", "--standalone", "--nproc_per_node=2"]
    cmd = [*launcher, TRAIN] if how == "launcher" else [sys.executable, TRAIN]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    done = subprocess.run([*cmd, "logger=none"], cwd=cwd, env=run_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr.splitlines() == [OLD_TORCH_LINE], done.stderr
    assert list(cwd.iterdir()) == []  # no run dir, no worker: it stopped before Hydra


def write_modules(root: Path) -> None:
    """Data modules that fail as a broken install makes them fail, and one that does not exist."""
    (root / "ddplab_stand_in_vision").mkdir(parents=True)
    (root / "ddplab_stand_in_vision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    (root / "ddplab_images.py").write_text("import ddplab_stand_in_vision\n\n\nclass Images:\n    pass\n")
    (root / "ddplab_raises.py").write_text('raise RuntimeError("boom")\n\n\nclass Images:\n    pass\n')
    (root / "ddplab_needs_missing.py").write_text("import ddplab_not_installed\n\n\nclass Images:\n    pass\n")


INVALID = "is invalid: accepted: the dotted path of a class or function that can be imported (as in conf/data/*.yaml)"


@pytest.mark.parametrize(
    ("target", "line"),
    [
        (
            "ddplab_images.Images",
            "set-up error: data._target_=ddplab_images.Images needs ddplab_stand_in_vision, whose import failed: "
            "RuntimeError: operator torchvision::nms does not exist",
        ),
        (
            "ddplab_raises.Images",
            "set-up error: data._target_=ddplab_raises.Images cannot be built: importing ddplab_raises failed: "
            "RuntimeError: boom",
        ),
        (
            "ddplab_needs_missing.Images",
            "set-up error: data._target_=ddplab_needs_missing.Images needs ddplab_not_installed, which is not "
            "installed: ModuleNotFoundError: No module named 'ddplab_not_installed'",
        ),
        # What does not exist is still a bad key.
        ("ddplab_images_typo.Images", f"configuration error: data._target_=ddplab_images_typo.Images {INVALID}"),
        ("data.fake.NoSuchImages", f"configuration error: data._target_=data.fake.NoSuchImages {INVALID}"),
        ("data.no_such_module.Images", f"configuration error: data._target_=data.no_such_module.Images {INVALID}"),
    ],
)
def test_a_data_module_that_fails_to_import_is_reported_as_that_failure(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    target: str,
    line: str,
) -> None:
    write_modules(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        check_command_line([f"data._target_={target}"], rank=0)
    assert stopped.value.code == EXIT_CODE
    assert capsys.readouterr().err.splitlines() == [line]


def test_data_fake_whose_torchvision_fails_to_import_names_the_option_and_torchvision(tmp_path: Path) -> None:
    stand_in = tmp_path / "path" / "torchvision"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    run_env = {**env(), "PYTHONPATH": os.pathsep.join([str(stand_in.parent), str(REPO)])}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cmd = [sys.executable, TRAIN, "model=cnn", "data=fake", "logger=none"]
    done = subprocess.run(cmd, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "set-up error: data=fake needs torchvision, whose import failed: RuntimeError: operator torchvision::nms "
        "does not exist"
    ], done.stderr
    assert list(cwd.iterdir()) == []
