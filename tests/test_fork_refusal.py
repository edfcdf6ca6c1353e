"""hydra.launcher.start_method=fork refused where CUDA is available, at the two places that decide it:
the launcher plugin (hydra_plugins/ddplab_torchrun_launcher/_core.py `launch`) and train.py's
precheck (trainer/setup/precheck.py), each asking torch.cuda.is_available() itself.

On a CPU-only machine the refusal never triggers on its own, so the answer is faked where they ask
it (as test_units.py fakes the GPU count for choose_device): refused in one line naming the key and
the accepted values when CUDA is "available", accepted when it is not. fork_refusal's wording alone
is test_torchrun_launcher.py's.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import DictConfig

from hydra_plugins.ddplab_torchrun_launcher import _core
from hydra_plugins.ddplab_torchrun_launcher.config import StartMethod, TorchrunLauncherConf
from trainer.setup.precheck import EXIT_CODE, check_command_line

KEY = "hydra.launcher.start_method=fork"
ACCEPTED = "accepted here: spawn, forkserver"
SWEEP = ["-m", "hydra/launcher=torchrun", KEY, "trainer.device=cpu", "logger=none"]


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Outside torchrun (the launcher refuses to run inside it), with the CUDA answer set by the test."""
    for name in ("TORCHELASTIC_RUN_ID", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


class _PastTheCheck(Exception):
    """The launcher went on to set its jobs up: the start method was accepted."""


def _launch(monkeypatch: pytest.MonkeyPatch, start_method: StartMethod) -> str:
    """The plugin's launch() up to its first step after the check: 'accepted', or the refusal's text."""

    def past_the_check() -> None:
        raise _PastTheCheck

    monkeypatch.setattr(_core, "setup_globals", past_the_check)
    try:
        _core.launch(TorchrunLauncherConf(start_method=start_method), DictConfig({}), None, print, [[]], 0)  # type: ignore[arg-type]
    except _PastTheCheck:
        return "accepted"
    except ValueError as refused:
        return str(refused)
    raise AssertionError("launch() neither refused nor went on to set its jobs up")


def test_the_launcher_refuses_fork_only_where_cuda_is_available(cuda: pytest.MonkeyPatch) -> None:
    cuda.setattr(torch.cuda, "is_available", lambda: True)
    refusal = _launch(cuda, StartMethod.fork)
    assert refusal.startswith(f"{KEY} is invalid where CUDA is available") and refusal.endswith(ACCEPTED), refusal
    assert "\n" not in refusal
    assert _launch(cuda, StartMethod.spawn) == "accepted"
    assert _launch(cuda, StartMethod.forkserver) == "accepted"
    cuda.setattr(torch.cuda, "is_available", lambda: False)
    assert _launch(cuda, StartMethod.fork) == "accepted"


def test_the_precheck_refuses_fork_only_where_cuda_is_available(
    cuda: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cuda.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exited:
        check_command_line(SWEEP, rank=0)  # what train.py runs on every rank before Hydra's app
    assert exited.value.code == EXIT_CODE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"configuration error: {KEY} is invalid where CUDA is available"), lines[0]
    assert lines[0].endswith(ACCEPTED), lines[0]
    check_command_line([*SWEEP[:2], "hydra.launcher.start_method=spawn", *SWEEP[3:]], rank=0)
    cuda.setattr(torch.cuda, "is_available", lambda: False)
    check_command_line(SWEEP, rank=0)
    assert capsys.readouterr().err == ""
