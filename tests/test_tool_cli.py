"""Every `python -m` command: an argparse --help, and a path that does not exist said in one line."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

TOOLS = {  # module -> the arguments that name a path
    "trainer.tools.report": [],
    "trainer.tools.wandb_offline": [],
    "trainer.tools.timeline": [],
    "trainer.tools.collectives": None,  # no input path: it measures
    "trainer.tools.launch": None,  # torchrun's arguments, no run dir
    "trainer.tools.memory": None,  # train.py's overrides, no run dir
    "trainer.tools.export": ["--out", "model.pt"],
    "trainer.tools.sample": [],
    "trainer.scaling.__main__": ["--run"],
}


@pytest.mark.parametrize("module", sorted(TOOLS))
def test_help_prints_usage_and_exits_0(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: ") and "--help" in out


@pytest.mark.parametrize("module", sorted(m for m, args in TOOLS.items() if args is not None))
def test_a_missing_path_is_one_line_saying_so(module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-run"
    code = importlib.import_module(module).main([*TOOLS[module], str(missing)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"{missing} does not exist" in err and len(err.splitlines()) == 1, err
