"""The torchrun launcher's parent side: the jobs one after another, each its own elastic group.

Hydra's plugin scan skips this module (its name starts with "_"): importing it imports torch.
The workers' side is _worker.py.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import cloudpickle  # type: ignore[import-untyped]
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import (
    JobReturn,
    JobRuntime,
    JobStatus,
    configure_log,
    env_override,
    filter_overrides,
    setup_globals,
)
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict, read_write
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ._worker import Job, run_worker
from .config import StartMethod, TorchrunLauncherConf, fork_refusal

log = logging.getLogger(__name__)

# The elastic agent takes these over while a job runs; the app gets its own handlers back afterwards.
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class JobFailed(RuntimeError):
    """One job's workers failed; the message carries the root cause."""


def launch(
    options: TorchrunLauncherConf,
    config: DictConfig,
    hydra_context: HydraContext,
    task_function: TaskFunction,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
) -> list[JobReturn]:
    """Run the jobs one after another, each as its own torchrun group."""
    for name in ("TORCHELASTIC_RUN_ID", "RANK"):
        if name in os.environ:
            raise RuntimeError(
                f"hydra/launcher=torchrun starts torchrun itself, but {name} is set (is this a torchrun worker?): "
                "run the app with plain `python app.py -m ...`"
            )
    refusal = fork_refusal(options.start_method, torch.cuda.is_available())
    if refusal:
        raise ValueError(refusal)
    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    log.info(
        f"Launching {len(job_overrides)} jobs, each as a torchrun group of "
        f"{options.nnodes} node(s) x {options.nproc_per_node} process(es)"
    )
    returns = []
    with _agent_manners():
        for idx, overrides in enumerate(job_overrides):
            num = initial_job_idx + idx
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
            returns.append(_launch_job(options, config, hydra_context, task_function, num, list(overrides)))
    return returns


@contextmanager
def _agent_manners() -> Iterator[None]:
    """The elastic agent, quieter, and the app's signal handlers back once the jobs are done.

    The agent narrates every step at INFO (its warnings and errors still show) and logs each failed
    worker with a traceback of its own process machinery: the launcher reports that failure itself,
    with the worker's traceback. The agent installs its own handlers for _AGENT_SIGNALS.
    """
    agent_log = logging.getLogger("torch.distributed.elastic")
    level = agent_log.level
    agent_log.setLevel(logging.WARNING)
    failures_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    failures_log.addFilter(_not_a_worker_failure)
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    try:
        yield
    finally:
        agent_log.setLevel(level)
        failures_log.removeFilter(_not_a_worker_failure)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)


def _not_a_worker_failure(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("failed (exitcode")


def _launch_job(
    options: TorchrunLauncherConf,
    config: DictConfig,
    hydra_context: HydraContext,
    task_function: TaskFunction,
    num: int,
    overrides: list[str],
) -> JobReturn:
    sweep_config = hydra_context.config_loader.load_sweep_config(config, overrides)
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = f"job_{num}"
        sweep_config.hydra.job.num = num
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(sweep_config)  # ${hydra:...} resolves here as in the workers
    try:
        payload = cloudpickle.dumps(Job(hydra_context, sweep_config, task_function, Singleton.get_state()))
        sweep_dir = Path(str(sweep_config.hydra.sweep.dir))
        job_dir = sweep_dir / str(sweep_config.hydra.sweep.subdir)
        # Every node derives the same rendezvous id, given the same hydra.sweep.dir.
        run_id = f"{sweep_dir.name}-{num}"
        # As the torchrun command does: N workers on one node share its cores.
        omp = {"OMP_NUM_THREADS": "1"} if options.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ else {}
        try:
            # The agent's error files live only as long as the job: their contents are in the failure.
            with tempfile.TemporaryDirectory(prefix="hydra_torchrun_") as log_dir, env_override(omp):
                values = elastic_launch(_launch_config(options, run_id, log_dir), entrypoint=run_worker)(payload)
        except ChildFailedError as failure:
            cause, callstack = root_cause(num, overrides, job_dir, failure)
            log.error(f"{cause}\n{callstack}" if callstack else cause)
            ret = _parent_return(sweep_config, overrides, job_dir)
            ret.status = JobStatus.FAILED
            ret.return_value = JobFailed(cause)
            return ret
        rank0 = [value for value in values.values() if value is not None]
        if rank0:
            ret = cloudpickle.loads(rank0[0])
            assert isinstance(ret, JobReturn)
            return ret
        # This node does not hold global rank 0 (nnodes > 1): its result is on the node that does.
        ret = _parent_return(sweep_config, overrides, job_dir)
        ret.status = JobStatus.COMPLETED
        ret.return_value = None
        return ret
    finally:
        HydraConfig.instance().cfg = previous


def _launch_config(options: TorchrunLauncherConf, run_id: str, log_dir: str) -> LaunchConfig:
    return LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        run_id=run_id,
        rdzv_backend=options.rdzv_backend,
        rdzv_endpoint=options.rdzv_endpoint,
        max_restarts=options.max_restarts,
        start_method=StartMethod(options.start_method).value,
        monitor_interval=options.monitor_interval_s,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


def _parent_return(config: DictConfig, overrides: list[str], job_dir: Path) -> JobReturn:
    """The JobReturn of a job whose rank 0 sent none: a failed job, or a node without global rank 0."""
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    hydra_cfg = copy.deepcopy(HydraConfig.instance().cfg)
    assert isinstance(hydra_cfg, DictConfig)
    return JobReturn(
        overrides=overrides,
        cfg=task_cfg,
        hydra_cfg=hydra_cfg,
        working_dir=str(job_dir) if config.hydra.job.chdir else os.getcwd(),
        task_name=JobRuntime.instance().get("name"),
    )


def root_cause(num: int, overrides: list[str], job_dir: Path, failure: ChildFailedError) -> tuple[str, str]:
    """Which rank failed first, how, and its error (one line); and that rank's traceback, if it recorded one."""
    rank, first = failure.get_first_failure()
    cause = f"job {num} ({' '.join(overrides) or 'no overrides'}) failed: rank {rank} exited with code {first.exitcode}"
    callstack = ""
    recorded = first.error_file_data.get("message")  # what @record wrote: {"message": ..., "extraInfo": ...}
    if isinstance(recorded, dict):
        cause += f": {recorded.get('message', '')}"
        callstack = str(recorded.get("extraInfo", {}).get("py_callstack", ""))
    elif first.exitcode < 0:
        cause += f" ({first.signal_name()})"
    return f"{cause} (logs in {job_dir})", callstack
