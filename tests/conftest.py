import os
import types
from collections.abc import Callable
from typing import Any

import pytest

# Tests never reach W&B's servers: offline runs only, and quietly.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"

# What starts a process: spawned gloo ranks, torchrun, train.py under plain python, any subprocess.
STARTS_A_PROCESS = {"run_on_ranks", "torchrun", "python_train", "subprocess"}


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
    saying why, everywhere else."""
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
