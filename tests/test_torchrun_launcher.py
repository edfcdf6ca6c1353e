"""hydra/launcher=torchrun as a Hydra launcher plugin: found from any app, Hydra's own launcher test
suites against it, and an app that is not ddplab run through it end to end (ddplab's own route 2 is
in test_sweeps.py).

Process start-up is the cost here: a spawned worker imports torch afresh (about 5 s on 2 cores).
Hydra's launcher suite runs at nproc_per_node=2 with fork, and its cases that need a fresh
interpreter at nproc_per_node=1 with the default start method, spawn; the integration suite, which
starts the app itself once per case, runs at nproc_per_node=2 with fork. The launcher does the same
for every start method (the job travels to the workers as one cloudpickle payload either way);
spawn alone shows that a fresh interpreter gets everything it needs (a closure, a resolver
registered after import), and spawn with 2 ranks is covered by the tests below and by
test_sweeps.py.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra import version as hydra_version
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from hydra.test_utils.test_utils import TSweepRunner
from hydra.version import VersionBase
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from hydra_plugins.ddplab_torchrun_launcher import _core, _worker
from hydra_plugins.ddplab_torchrun_launcher.config import StartMethod, TorchrunLauncherConf, fork_refusal
from tests.compose import REPO

PLUGIN = REPO / "hydra_plugins" / "ddplab_torchrun_launcher"
APP = REPO / "tests" / "torchrun_app.py"
# The options and defaults of the `torchrun` command that route 2 has always had.
DEFAULTS = {
    "_target_": "hydra_plugins.ddplab_torchrun_launcher.torchrun_launcher.TorchrunLauncher",
    "nproc_per_node": 2,
    "nnodes": 1,
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "localhost:0",
    "max_restarts": 0,
    "start_method": "spawn",
    "monitor_interval_s": 0.1,
}
ONE_SPAWNED = ["hydra.launcher.nproc_per_node=1"]
TWO_FORKED = ["hydra.launcher.nproc_per_node=2", "hydra.launcher.start_method=fork"]


def test_discovery() -> None:
    # By name: Hydra's plugin scan executes the module again, making a class object of its own.
    found = {f"{plugin.__module__}.{plugin.__qualname__}" for plugin in Plugins.instance().discover(Launcher)}
    assert DEFAULTS["_target_"] in found


def launcher_options(config_dir: Path, config_name: str | None) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name, overrides=["hydra/launcher=torchrun"], return_hydra_config=True)
    options = OmegaConf.to_container(cfg.hydra.launcher)
    assert isinstance(options, dict)
    return options


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_any_app_finds_the_launcher_config(tmp_path: Path) -> None:
    # An app with no config files at all, and ddplab's own conf/: one definition, from the ConfigStore.
    assert launcher_options(tmp_path, None) == DEFAULTS
    assert launcher_options(REPO / "conf", "config") == DEFAULTS
    assert not (REPO / "conf" / "hydra" / "launcher" / "torchrun.yaml").exists()


def test_the_plugin_stands_alone() -> None:
    # Nothing from ddplab's packages: it could ship as its own package.
    for path in PLUGIN.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            assert not [n for n in names if n.split(".")[0] in {"trainer", "models", "data", "tests"}], path
    # Hydra imports every plugin module whenever any app starts: torch only comes with a launch.
    code = (
        "import sys; from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher;"
        "found = [p.__name__ for p in Plugins.instance().discover(Launcher)];"
        "print('TorchrunLauncher' in found, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'trainer'}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["True", "[]"], proc.stdout + proc.stderr


def test_refuses_to_run_inside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    with pytest.raises(RuntimeError, match="starts torchrun itself, but TORCHELASTIC_RUN_ID is set"):
        _core.launch(TorchrunLauncherConf(), DictConfig({}), None, print, [[]], 0)  # type: ignore[arg-type]


def test_fork_is_refused_where_cuda_is_available_and_only_there() -> None:
    # Where CUDA is available both the launcher and train.py's precheck refuse fork with this line.
    refusal = fork_refusal("fork", cuda_available=True)
    assert refusal is not None and refusal.startswith("hydra.launcher.start_method=fork is invalid"), refusal
    assert refusal.endswith("accepted here: spawn, forkserver"), refusal
    assert fork_refusal(StartMethod.fork, cuda_available=False) is None
    assert fork_refusal("spawn", cuda_available=True) is None and fork_refusal("forkserver", True) is None


def failed_task() -> SystemExit:
    """What a worker sees when a task turns an error into an exit code, as ddplab's train.py does."""
    try:
        try:
            raise KeyError("the cause's cause")
        except KeyError as err:
            raise ValueError("the error") from err
    except ValueError:
        try:
            raise SystemExit(3) from None
        except SystemExit as exit_:
            return exit_


def test_an_exit_code_after_an_error_is_reported_with_that_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    _worker._record_cause(failed_task())
    failure = ProcessFailure(local_rank=1, pid=7, exitcode=3, error_file=str(error_file))
    cause, callstack = _core.root_cause(4, ["x=1"], tmp_path, ChildFailedError("run_worker", {5: failure}))
    assert cause == f"job 4 (x=1) failed: rank 5 exited with code 3: ValueError: the error (logs in {tmp_path})"
    # The traceback as the task raised it, chained cause included, without the launcher's own frames.
    assert 'raise ValueError("the error") from err' in callstack and 'KeyError: "the cause\'s cause"' in callstack
    assert "_record_cause" not in callstack
    killed = ProcessFailure(local_rank=0, pid=8, exitcode=-9, error_file=str(tmp_path / "none.json"))
    cause, callstack = _core.root_cause(0, [], tmp_path, ChildFailedError("run_worker", {0: killed}))
    assert (cause, callstack) == (
        f"job 0 (no overrides) failed: rank 0 exited with code -9 (SIGKILL) (logs in {tmp_path})",
        "",
    )


class _VersionBaseAsHydraTestsExpect:
    @pytest.fixture(autouse=True)
    def hydra_version_base_as_hydra_tests_expect(self, hydra_restore_singletons: Any) -> None:
        """The suite's apps set no version_base, so Hydra assumes 1.1 (jobs chdir into their dirs and
        verify_dir_outputs looks for the job's log there). Earlier tests in this pytest process compose
        ddplab's config with version_base="1.3", which Hydra keeps in a singleton: reset it for each
        case (hydra_restore_singletons puts the process's state back afterwards)."""
        VersionBase.instance().setbase(hydra_version.__compat_version__)


@pytest.mark.slow
@pytest.mark.parametrize("launcher_name, overrides", [pytest.param("torchrun", TWO_FORKED, id="2-forked")])
class TestTorchrunLauncher(_VersionBaseAsHydraTestsExpect, LauncherTestSuite):
    """Hydra's launcher suite, in this process: sweeps, configs, job dirs, a resolver registered just before launch."""


@pytest.mark.slow
@pytest.mark.parametrize("launcher_name, overrides", [pytest.param("torchrun", ONE_SPAWNED, id="1-spawned")])
class TestTorchrunLauncherSpawned(_VersionBaseAsHydraTestsExpect, LauncherTestSuite):
    """The same suite in fresh interpreters, where what a spawned worker needs must travel with the job:
    one job, a resolver registered just before launch, the refusals. The cases that only sweep more
    jobs or configs run forked above: the launcher sends every job the same way whatever the start
    method, and each spawned case costs a fresh torch import per job."""

    test_sweep_2_jobs = None  # type: ignore[assignment]
    test_sweep_1_job_strict = None  # type: ignore[assignment]
    test_sweep_2_optimizers = None  # type: ignore[assignment]
    test_sweep_over_unspecified_mandatory_default = None  # type: ignore[assignment]
    test_sweep_and_override = None  # type: ignore[assignment]


@pytest.mark.slow
@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [pytest.param({}, ["-m", "hydra/launcher=torchrun", *TWO_FORKED], id="2-forked")],
)
class TestTorchrunLauncherIntegration(IntegrationTestSuite):
    """Hydra's integration suite: a fresh app per case (job names, sweep dirs, chdir, the original cwd).
    With 2 workers only: one worker checks nothing that two do not, and each case starts a fresh
    interpreter that imports torch (about 1.5 minutes of the suite per worker count)."""


def launched_returns(monkeypatch: pytest.MonkeyPatch) -> list[JobReturn]:
    """What the launcher hands to Hydra's sweeper, which only ever re-raises the first failure from them."""
    returns: list[JobReturn] = []
    launch = _core.launch

    def recording(*args: Any) -> list[JobReturn]:
        returns.extend(launch(*args))
        return returns

    monkeypatch.setattr(_core, "launch", recording)
    return returns


@pytest.mark.slow
@pytest.mark.usefixtures("hydra_restore_singletons")
def test_a_job_returns_rank_0s_value_and_a_failed_job_its_root_cause(
    hydra_sweep_runner: TSweepRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.torchrun_app import main

    returns = launched_returns(monkeypatch)
    sweep = hydra_sweep_runner(
        calling_file=None,
        calling_module="tests.torchrun_app",
        task_function=main.__wrapped__,  # type: ignore[attr-defined]
        config_path=None,
        config_name="torchrun_app",
        overrides=["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "x=1,2", "fail_x=1"],
        temp_dir=tmp_path,
    )
    cause = "job 0 (x=1 fail_x=1) failed: rank 1 exited with code 1: ValueError: rank 1 refuses x=1"
    with pytest.raises(_core.JobFailed, match=re.escape(f"{cause} (logs in {tmp_path}/0)")), sweep:
        pass
    failed, done = returns
    assert failed.status == JobStatus.FAILED and done.status == JobStatus.COMPLETED  # the next job still ran
    assert done.return_value == {"x": 2, "rank": 0, "world_size": 2, "rank_sum": 1, "writes_hydra_files": True}
    assert done.overrides == ["x=2", "fail_x=1"] and done.hydra_cfg.hydra.job.num == 1
    assert OmegaConf.to_container(done.cfg) == {"x": 2, "fail_x": 1}


@pytest.mark.slow
def test_an_app_that_is_not_ddplab_runs_in_every_worker(tmp_path: Path) -> None:
    cmd = [sys.executable, str(APP), "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "x=1,2"]
    proc = subprocess.run([*cmd, "fail_x=1"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    cause = "job 0 (x=1 fail_x=1) failed: rank 1 exited with code 1: ValueError: rank 1 refuses x=1"
    assert cause in out
    # Then the worker's traceback, from its error file, down to the task's own frame.
    worker_traceback = out.split(cause, 1)[1].split("#1 : x=2", 1)[0]
    assert re.search(r"Traceback .*\n(.*\n)*.*, in main\n(.*\n)*ValueError: rank 1 refuses x=1\n", worker_traceback)
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    # Rank 0 finished job 0, yet the job failed: every rank's failure is the job's.
    assert [path.name for path in (sweep / "0").glob("rank*.json")] == ["rank0.json"]
    # Job 1 ran on both ranks after job 0 failed, each with torchrun's variables, in one job dir;
    # rank 0 alone wrote .hydra/.
    seen = [json.loads((sweep / "1" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    expected = [{"x": 2, "rank": r, "world_size": 2, "rank_sum": 1, "writes_hydra_files": r == 0} for r in (0, 1)]
    assert seen == expected
    assert OmegaConf.load(sweep / "1" / ".hydra" / "overrides.yaml") == ["x=2", "fail_x=1"]
