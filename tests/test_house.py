"""The house rules that no linter checks: leaves stay leaves, no import circles, W&B only when asked."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.compose import REPO, compose_config
from trainer.errors import ConfigError
from trainer.setup.build import instantiate

PACKAGES = ("trainer", "models", "data", "hydra_plugins")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module this file imports from our own packages, at import time or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def our_modules() -> dict[str, set[str]]:
    files = [p for package in PACKAGES for p in (REPO / package).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    # "from trainer.setup import dist" names the module trainer.setup.dist: keep only names that are modules.
    return {name: {i for i in imports_of(path) if i in modules and i != name} for name, path in modules.items()}


@pytest.mark.parametrize("leaf", ["models", "data"])
def test_leaves_import_nothing_from_the_trainer(leaf: str) -> None:
    offenders = {
        m: sorted(i) for m, imps in our_modules().items() if m.startswith(leaf) for i in imps if not i.startswith(leaf)
    }
    assert offenders == {}, f"{leaf}/ must know nothing of training: {offenders}"


def test_sinks_depend_on_no_command() -> None:
    # trainer/tools/ holds the python -m commands: a logger needing one would pull a command's
    # imports (argparse, matplotlib) into every rank's training process.
    offenders = {m: sorted(i) for m, imps in our_modules().items() if m.startswith("trainer.logger") for i in imps}
    offenders = {m: [i for i in imps if i.startswith("trainer.tools")] for m, imps in offenders.items()}
    assert {m: i for m, i in offenders.items() if i} == {}


def test_nothing_below_the_commands_imports_one() -> None:
    # The arrows point one way: the loop, the strategies, the sinks and the set-up never need a
    # command; what a command and the loop share (the timeline, text sampling) lives below both.
    offenders = {
        m: sorted(i for i in imps if i.startswith("trainer.tools"))
        for m, imps in our_modules().items()
        if m.startswith("trainer.") and not m.startswith("trainer.tools")
    }
    assert {m: i for m, i in offenders.items() if i} == {}


def test_no_import_circles() -> None:
    graph = our_modules()
    for package in {m.rsplit(".", 1)[0] for m in graph if "." in m}:  # a package's __init__ is not an edge
        graph.get(package, set()).clear()
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in done:
            return
        assert module not in visiting, f"import circle: {' -> '.join([*visiting[visiting.index(module) :], module])}"
        visiting.append(module)
        for dependency in sorted(graph.get(module, ())):
            visit(dependency)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


# What each package of trainer/ may import (besides the leaves: core, errors, clock, comm_math,
# links, trace_names, which import nothing of trainer/ but each other): the composition root builds
# everything; the loop uses sync, reliability and logger; reliability may read a strategy's state
# (sync) and log (logger); sync imports none of the others; the scaling model builds conf/sync's
# options through setup to read their schedules. docs/architecture.md draws this.
LEAVES = {
    "core",
    "errors",
    "clock",
    "comm_math",
    "comm_schedule",
    "links",
    "trace_names",
    "measures",
    "arrivals",
    "observer",
    "footprint",
    "sample_budget",
    "windows",
}
MAY_IMPORT = {
    "setup": {"loop", "sync", "reliability", "logger"},
    "loop": {"sync", "reliability", "logger"},
    "reliability": {"sync", "logger"},
    "logger": set(),
    "sync": set(),
    "scaling": {"setup"},
    "tools": {"setup", "loop", "sync", "reliability", "logger", "scaling"},
}


def test_the_packages_of_the_trainer_point_one_way() -> None:
    """Package to package, imports under `if TYPE_CHECKING:` aside: no cycle, and only the allowed arrows."""
    arrows: set[tuple[str, str]] = set()
    for module, imports in our_modules().items():
        parts = module.split(".")
        if parts[0] != "trainer" or len(parts) < 2:
            continue
        path = REPO.joinpath(*parts).with_suffix(".py")
        path = path if path.exists() else REPO.joinpath(*parts, "__init__.py")
        checked_only = {
            f"{node.module}.{a.name}" if node.module else a.name
            for guard in ast.walk(ast.parse(path.read_text()))
            if isinstance(guard, ast.If) and "TYPE_CHECKING" in ast.unparse(guard.test)
            for node in ast.walk(guard)
            if isinstance(node, ast.ImportFrom)
            for a in node.names
        }
        for imported in imports - checked_only:
            target = imported.split(".")
            if target[0] == "trainer" and len(target) > 1 and target[1] != parts[1]:
                arrows.add((parts[1], target[1]))
    wrong = sorted((a, b) for a, b in arrows if b not in LEAVES and (a in LEAVES or b not in MAY_IMPORT.get(a, set())))
    assert not wrong, f"imports against the layers (docs/architecture.md): {wrong}"


def test_a_leafs_value_error_reaches_the_user_as_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"data\.batch_size=0 is invalid"):
        instantiate(compose_config(["data.batch_size=0"]).data)


def python_printed(code: str) -> str:
    """What `python -c code` printed, run in a fresh interpreter from the repository (it must succeed)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_logger_none_never_imports_wandb(tmp_path: Path) -> None:
    # train.py's own path: build the parts, then every rank's loggers, with logger=none.
    code = (
        "import sys, torch; from pathlib import Path; from tests.compose import compose_config;"
        "from trainer.setup.dist import DistContext;"
        "from trainer.setup.build import add_loggers, build_parts, instantiate;"
        "cfg = compose_config(['logger=none']); parts = build_parts(cfg); loggers = [];"
        f"add_loggers(loggers, cfg, {{}}, DistContext(0, 0, 1, torch.device('cpu'), 'gloo'), Path('{tmp_path}'), 'g');"
        "print(len(loggers), 'wandb' in sys.modules)"
    )
    printed = python_printed(code)
    assert printed.split() == ["2", "False"]


def test_checking_a_command_imports_only_the_chosen_strategy() -> None:
    # What the launcher and every rank run before training: fsdp's module brings torch's DTensor and
    # distributed checkpoint (most of a second per process), which sync=ddp has no use for.
    code = (
        "import sys; from trainer.setup import precheck;"
        "precheck.check_command_line(['sync=ddp'], rank=0, world_size=2);"
        "print(sorted(m for m in sys.modules if m.startswith('trainer.sync.') and m.count('.') == 2"
        " and m.split('.')[-1] in ('ddp', 'fsdp', 'hsdp', 'zero', 'zero3', 'manual')),"
        " 'torch.distributed.tensor' in sys.modules)"
    )
    printed = python_printed(code)
    assert printed.strip() == "['trainer.sync.ddp'] False"


def test_a_rank_builds_its_strategy_once() -> None:
    # train.py on a rank: the command-line check builds the strategy to check its layout against
    # the world size, then the job's build (build_parts) takes that one rather than building another.
    code = """
import functools
from tests.compose import compose_config
from trainer.setup import precheck
from trainer.setup.build import build_parts
from trainer.sync.hierarchical import HierarchicalSync

built = []
init = HierarchicalSync.__init__

@functools.wraps(init)  # the signature stays the schema's
def counted(self, *args, **kwargs):
    built.append(self)
    init(self, *args, **kwargs)

HierarchicalSync.__init__ = counted
overrides = ["sync=hierarchical", "sync.shard=2"]
precheck.check_command_line(overrides, rank=0, world_size=4)
first = build_parts(compose_config(overrides), 4).sync
again = build_parts(compose_config(overrides), 4).sync  # a tool's second build: a new one
print(len(built), first is built[0], again is not first)
"""
    printed = python_printed(code)
    assert printed.split() == ["2", "True", "True"], printed


def test_the_scaling_and_memory_tools_build_strategies_without_the_trainers_loop() -> None:
    # They ask each conf/sync/ option what it sends and keeps: the strategies, not the loop that
    # trains with them. --help answers before torch is imported.
    code = (
        "import sys, runpy; sys.argv = ['trainer.scaling', '--help']\n"
        "try:\n    runpy.run_module('trainer.scaling', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('torch' in sys.modules)\n"
        "from trainer.scaling.options import schedules; from trainer.tools import memory; schedules()\n"
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('trainer.') and m.count('.') >= 1}))"
    )
    printed = python_printed(code)
    lines = printed.strip().splitlines()
    assert lines[-2] == "False", printed
    packages = set(eval(lines[-1]))
    assert "sync" in packages and not packages & {"loop", "reliability"}, packages


STRATEGY_FILES = ("manual", "bucketed", "zero", "zero3")
# What a strategy may say beside its algorithm: the facts of what it built (for the sync line), what
# it holds (for the observer's memory probe) and keeps (for the memory predictor), its name, and the
# wiring of bucket_cap_mb=auto's tuner.
BOOKKEEPING_DEFS = ("facts", "held", "footprint", "describe", "settled")
BOOKKEEPING_WORDS = ("tuner", "CapTuner", "auto_", 'name = "', "key_attributes", "comm.holds")
# A strategy measures nothing: no clock, no counter, no peak (trainer/observer.py does).
MEASURING = re.compile(r"perf_counter|\bClock\b|peak|_count\(|counts?\b\s*[+-]?=|time\.time|elapsed_time|Event\(")


def _code_lines(path: Path) -> list[tuple[int, str, str]]:
    """(line number, text, enclosing function) of every line that is code: no blank, comment or docstring."""
    tree = ast.parse(path.read_text())
    docs, owner = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
        if isinstance(node, ast.FunctionDef):
            for n in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                owner.setdefault(n, node.name)
            for inner in ast.walk(node):  # the innermost function wins
                if isinstance(inner, ast.FunctionDef) and inner is not node:
                    for n in range(inner.lineno, (inner.end_lineno or inner.lineno) + 1):
                        owner[n] = inner.name
    lines = path.read_text().splitlines()
    return [
        (n, text, owner.get(n, ""))
        for n, text in enumerate(lines, 1)
        if text.strip() and not text.strip().startswith("#") and n not in docs
    ]


@pytest.mark.parametrize("name", STRATEGY_FILES)
def test_a_strategy_file_is_its_algorithm(name: str) -> None:
    """At most 15 % of a strategy's code lines are anything but its algorithm and the guards of it,
    and none of them counts, times or tracks a peak (docs/architecture.md, reading a strategy)."""
    lines = _code_lines(REPO / "trainer" / "sync" / f"{name}.py")
    measuring = [f"{n}: {text.strip()}" for n, text, _ in lines if MEASURING.search(text.split("#")[0])]
    assert not measuring, f"trainer/sync/{name}.py measures: {measuring}"
    bookkeeping = [n for n, text, fn in lines if fn in BOOKKEEPING_DEFS or any(w in text for w in BOOKKEEPING_WORDS)]
    assert len(bookkeeping) <= 0.15 * len(lines), (name, len(bookkeeping), len(lines))


def strategy_modules() -> list[str]:
    """Every module a sync option builds its strategy from (conf/sync/*.yaml's _target_), and zero
    stage 3's, which zero_sync returns for sync.stage=3."""
    targets = {yaml.safe_load(path.read_text())["_target_"] for path in (REPO / "conf" / "sync").glob("*.yaml")}
    return sorted({target.split(".")[2] for target in targets} | {"zero3"})


def test_no_strategy_module_measures() -> None:
    """The measuring half of the check above, on every strategy's module (the observer measures)."""
    modules = strategy_modules()
    assert len(modules) == 9 and set(STRATEGY_FILES) < set(modules), modules
    for name in modules:
        lines = _code_lines(REPO / "trainer" / "sync" / f"{name}.py")
        measuring = [f"{n}: {text.strip()}" for n, text, _ in lines if MEASURING.search(text.split("#")[0])]
        assert not measuring, f"trainer/sync/{name}.py measures: {measuring}"


def test_the_bookkeeping_counted_above(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/architecture.md quotes these numbers: they are this count."""
    text = (REPO / "docs" / "architecture.md").read_text()
    for name in STRATEGY_FILES:
        lines = _code_lines(REPO / "trainer" / "sync" / f"{name}.py")
        kept = [n for n, t, fn in lines if fn in BOOKKEEPING_DEFS or any(w in t for w in BOOKKEEPING_WORDS)]
        assert f"{name} {len(kept)} of {len(lines)}" in text, (name, len(kept), len(lines))


def test_the_network_keys_are_declared_once() -> None:
    """trainer/sync/network.py's Network holds each network key's type, bounds and default (it is also
    the schema); conf/network/none.yaml repeats them (gpus_per_node: the launcher's ranks per node), and
    each preset's YAML extends it, setting only its preset and one rank per node."""
    from trainer.sync.network import Network

    defaults = {f.name: f.default for f in dataclasses.fields(Network)}
    node = compose_config(["network=none"]).network
    keys = [k for k in node if k != "_target_"]
    assert sorted(keys) == sorted(defaults), keys
    for key in keys:
        if not OmegaConf.is_interpolation(node, key):
            assert node[key] == defaults[key], (key, node[key], defaults[key])
    assert OmegaConf.is_interpolation(node, "gpus_per_node")
    for path in sorted((REPO / "conf" / "network").glob("*.yaml")):
        if path.stem != "none":
            raw = yaml.safe_load(path.read_text())
            assert raw["defaults"] == ["none", "_self_"] and raw["preset"] == path.stem, path.name
            assert set(raw) == {"defaults", "_target_", "preset", "gpus_per_node"}, (path.name, sorted(raw))
