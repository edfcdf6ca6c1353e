"""The README's commands as written: every train.py command line is one train.py accepts (composed and
validated as the launcher does, with its world size), and every module a command runs exists."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from tests.compose import REPO
from trainer.setup.precheck import check_overrides


def readme_commands() -> list[list[str]]:
    """The shell lines of the README's bash blocks, continuations joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


COMMANDS = readme_commands()
TRAIN = [c for c in COMMANDS if "train.py" in c]


def train_args(words: list[str]) -> tuple[list[str], int]:
    """(train.py's arguments, the world size the launcher gives them)."""
    nproc = next((int(w.split("=")[1]) for w in words if w.startswith("--nproc_per_node=")), 1)
    if "hydra.launcher.nproc_per_node=2" in words:
        nproc = 2
    return words[words.index("train.py") + 1 :], nproc


def test_the_readme_has_its_commands() -> None:
    assert len(TRAIN) >= 8 and any(c[:3] == ["python", "-m", "trainer.tools.launch"] for c in TRAIN)


@pytest.mark.parametrize("words", TRAIN, ids=[" ".join(c)[:90] for c in TRAIN])
def test_each_train_command_is_accepted(words: list[str]) -> None:
    args, world_size = train_args(words)
    check_overrides(args, world_size)  # a ConfigError names what is wrong


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(c)[:90] for c in COMMANDS])
def test_each_module_a_command_runs_exists(words: list[str]) -> None:
    modules = [words[i + 1] for i, w in enumerate(words) if w == "-m" and i + 1 < len(words)]
    for module in (m for m in modules if "=" not in m):  # train.py -m: multirun, then overrides
        assert importlib.util.find_spec(module) is not None, f"{' '.join(words)}: no module {module}"


def test_no_command_writes_into_the_checkout() -> None:
    # A file a README command writes (--out) lands in a run's or a sweep's dir, which git ignores,
    # never in the repository's root where `git status` would show it.
    outs = [words[words.index("--out") + 1] for words in COMMANDS if "--out" in words]
    assert outs and all(out.startswith(("outputs/", "multirun/")) for out in outs), outs
