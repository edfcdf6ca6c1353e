import os
import signal
import types
from collections.abc import Callable
from typing import Any

import pytest

# Tests never reach W&B's servers: offline runs only, and quietly.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
# Ctrl-C reaches the processes the tests start as it reaches a command typed at a terminal: a
# shell starts a background job (`make test &`, a script's `... &`) with SIGINT ignored, which
# every child would inherit through exec, and the tests that send Ctrl-C would see it lost. A
# handler here (each xdist worker imports this file) is reset to the default in every child.
signal.signal(signal.SIGINT, signal.default_int_handler)

# What starts a process: spawned gloo ranks, torchrun, train.py under plain python, any subprocess.
STARTS_A_PROCESS = {"run_on_ranks", "torchrun", "python_train", "subprocess"}

# The files that take longest (seconds on a worker: `--durations=0` per file), longest first.
# `make test` hands whole files to its two workers in collection order (--no-loadscope-reorder), and
# these go first so that the run ends on short files, both workers busy until then: handed out last,
# one of them would leave the other idle for its whole length. Out of date, this list costs balance,
# never a test.
LONGEST_FIRST = (
    "test_sweeps.py",
    "test_restarts.py",
    "test_torchrun_launcher.py",
    "test_config_schema.py",
    "test_failures.py",
    "test_benchmarks.py",
    "test_cli.py",
    "test_checkpoint_kills.py",
    "test_gpt_equivalence.py",
    "test_hang.py",
    "test_jsonl_resume.py",
    "test_launch.py",
    "test_terminal.py",
    "test_wandb_runs.py",
)


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' and lambdas' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _starts_processes(fn: object, seen: set[Callable[..., Any]]) -> bool:
    """Whether fn, or a function of tests/ that it calls by name (transitively), starts a process."""
    if not isinstance(fn, types.FunctionType) or fn in seen or not fn.__module__.startswith("tests"):
        return False
    seen.add(fn)
    names = _names(fn.__code__)
    return bool(names & STARTS_A_PROCESS) or any(_starts_processes(fn.__globals__.get(n), seen) for n in names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts processes, itself or through a fixture, is `slow` (make test-fast leaves it
    out), whether or not it says so. Tests marked `gpu` run where CUDA is available and are skipped,
    saying why, everywhere else. The files listed in LONGEST_FIRST come first, in that order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
    for item in items:
        if not isinstance(item, pytest.Function) or item.get_closest_marker("slow"):
            continue
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        if any(_starts_processes(fn, set()) for fn in [item.function, *fixtures]):
            item.add_marker(pytest.mark.slow)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The tiny GPT's overrides on a corpus of one 4-step epoch (tests/text_helpers.py), written once."""
    from tests.text_helpers import tiny_gpt_corpus

    return tiny_gpt_corpus(tmp_path_factory.mktemp("text"))
