"""A torchrun launcher worker: one job's task function, in the job's Hydra context.

Hydra's plugin scan skips this module (its name starts with "_"): importing it imports torch.
Each worker gets its job as one cloudpickle payload, as with Hydra's joblib and submitit
launchers: the task function (usually a closure or defined in the app's __main__, which plain
pickle cannot carry), the HydraContext, the job's sweep config and Hydra's Singleton state
(ConfigStore, JobRuntime, and OmegaConf's resolvers, which a spawned worker lacks when the app
registered them after import).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import cloudpickle  # type: ignore[import-untyped]
from hydra.core.singleton import Singleton
from hydra.core.utils import JobStatus, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict, read_write
from omegaconf.basecontainer import BaseContainer
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record


@dataclass
class Job:
    """Everything a worker needs to run one job: the parent sends it as one cloudpickle payload."""

    hydra_context: HydraContext
    config: DictConfig  # the job's sweep config
    task_function: TaskFunction
    singleton_state: dict[str, Any]


@record
def run_worker(payload: bytes) -> bytes | None:
    """One worker of one job: the task function, run as Hydra's basic launcher runs it, in this job's context.

    Global rank 0 returns its JobReturn (pickled: the task's value need not be plain-picklable); the others None.
    """
    job: Job = cloudpickle.loads(payload)
    setup_globals()
    own_resolvers = dict(BaseContainer._resolvers)
    Singleton.set_state(job.singleton_state)
    # The parent's resolvers fill the gaps (one the app registered after import); the ones this
    # worker registered itself, on importing the app's modules, stand.
    BaseContainer._resolvers.update(own_resolvers)
    rank = int(os.environ["RANK"])
    config = job.config
    if rank != 0:
        # Global rank 0 alone writes .hydra/: the other ranks would race it for the same files.
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.output_subdir = None
    try:
        ret = run_job(
            hydra_context=job.hydra_context,
            task_function=job.task_function,
            config=config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
    except SystemExit as exit_:
        _record_cause(exit_)
        raise
    if ret.status == JobStatus.FAILED:
        # run_job caught the task's exception. Raising it fails this worker, so elastic restarts
        # the group or reports this rank's error (@record writes it down) as the job's root cause.
        _ = ret.return_value  # raises it, after naming the job's overrides on stderr
    return cloudpickle.dumps(ret) if rank == 0 else None


def _record_cause(exit_: SystemExit) -> None:
    """A task that exits non-zero while handling an error (`sys.exit(1)` in an `except`): record that error.

    @record writes down exceptions only, so the job's root cause would otherwise be an exit code alone.
    """
    cause = exit_.__cause__ or exit_.__context__
    if exit_.code in (0, None) or not isinstance(cause, Exception):
        return
    as_raised = (cause.__cause__, cause.__context__, cause.__suppress_context__, cause.__traceback__)
    try:
        raise cause  # the error handler writes down the exception being handled: make it this one...
    except Exception as err:
        # ...with the chain and traceback it had in the task (raising it again changed them)
        err.__cause__, err.__context__, err.__suppress_context__, err.__traceback__ = as_raised
        get_error_handler().record_exception(err)
