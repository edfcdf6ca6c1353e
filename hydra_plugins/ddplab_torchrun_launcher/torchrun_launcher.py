"""A Hydra launcher that runs every multirun job as its own torchrun group.

    python my_app.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 lr=0.1,0.01

The jobs run one after another. Each starts nproc_per_node workers per node through PyTorch's
elastic launcher API (torch.distributed.launcher.api, what the `torchrun` command itself calls),
and every worker runs the app's task function in the job's Hydra context, with torchrun's
variables set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). The job's return
value is global rank 0's; a failed job is reported with its root cause and the next job still runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from .config import TorchrunLauncherConf


class TorchrunLauncher(Launcher):
    """hydra/launcher=torchrun: one torchrun group per job, jobs isolated from each other."""

    def __init__(self, **options: Any) -> None:
        # The options and their defaults live in one place, the ConfigStore's dataclass.
        self.options = TorchrunLauncherConf(**options)
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # Imported here: Hydra imports every plugin module whenever any app starts, and _core imports
        # torch (seconds); Hydra's plugin scan skips modules whose names start with "_".
        from . import _core

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        return _core.launch(
            self.options, self.config, self.hydra_context, self.task_function, job_overrides, initial_job_idx
        )
