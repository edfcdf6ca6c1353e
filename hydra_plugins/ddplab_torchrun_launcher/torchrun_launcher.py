"""A Hydra launcher that runs every multirun job as its own torchrun group.

    python train.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 sync.bucket_cap_mb=1,5,25

The jobs run one after another. Each starts its workers with PyTorch's elastic launcher API
(torch.distributed.launcher.api, what the torchrun command itself calls): `train.py <the job's
overrides>` on nproc_per_node workers, rendezvous and restarts as configured, writing into
<sweep dir>/<job num>/ exactly what a plain torchrun run writes. A failed job is reported with
its root cause and the next job still runs; the sweep exits non-zero if any job failed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import (
    JobReturn,
    JobStatus,
    configure_log,
    filter_overrides,
    setup_globals,
)
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from trainer.setup.dist import read_launch_env

log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """One sweep job's workers failed; the message carries the root cause."""


class TorchrunLauncher(Launcher):
    """hydra/launcher=torchrun: one torchrun group per job, jobs isolated from each other."""

    def __init__(
        self,
        nproc_per_node: int = 2,
        nnodes: int = 1,
        rdzv_backend: str = "c10d",
        rdzv_endpoint: str = "localhost:0",
        max_restarts: int = 0,
        start_method: str = "spawn",
        monitor_interval_s: float = 0.1,
    ) -> None:
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self.rdzv_backend = rdzv_backend
        self.rdzv_endpoint = rdzv_endpoint
        self.max_restarts = max_restarts
        self.start_method = start_method
        self.monitor_interval_s = monitor_interval_s
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # The task function is not called here: every job re-runs the script under torchrun.
        self.config = config
        self.hydra_context = hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        if read_launch_env().launched:
            raise RuntimeError(
                "hydra/launcher=torchrun starts torchrun itself: run it with plain `python train.py -m ...`"
            )
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        # The elastic agent narrates every step at INFO; its warnings and errors still show.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
        if self.nproc_per_node > 1:
            os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the torchrun command does
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(
            f"Launching {len(job_overrides)} jobs, each as a torchrun group of "
            f"{self.nnodes} node(s) x {self.nproc_per_node} process(es)"
        )
        returns = []
        for idx, overrides in enumerate(job_overrides):
            num = initial_job_idx + idx
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
            returns.append(self._run(num, list(overrides)))
        return returns

    def _run(self, num: int, overrides: list[str]) -> JobReturn:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        assert self.config is not None and self.hydra_context is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"job_{num}"
            sweep_config.hydra.job.num = num
        HydraConfig.instance().set_config(sweep_config)
        job_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
        # The same names route 1 gives a job: <run name>-<job num> is its W&B group and run id.
        run_name = f"{sweep_config.run_name}-{num}"
        launch_config = LaunchConfig(
            min_nodes=self.nnodes,
            max_nodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            run_id=run_name,
            rdzv_backend=self.rdzv_backend,
            rdzv_endpoint=self.rdzv_endpoint,
            max_restarts=self.max_restarts,
            start_method=self.start_method,
            monitor_interval=self.monitor_interval_s,
        )
        args = [os.path.abspath(sys.argv[0]), *overrides, f"hydra.run.dir={job_dir}", f"run_name={run_name}"]
        ret = JobReturn(
            overrides=overrides,
            cfg=sweep_config,
            hydra_cfg=sweep_config.hydra,
            working_dir=str(job_dir),
            task_name=str(sweep_config.hydra.job.name),
        )
        try:
            elastic_launch(launch_config, entrypoint=sys.executable)(*args)
        except ChildFailedError as failure:
            ret.status = JobStatus.FAILED
            ret.return_value = JobFailed(_root_cause(num, overrides, job_dir, failure))
            log.error(str(ret._return_value))
            return ret
        # Rank 0 wrote the job's summary, every rank's numbers included: that is the job's result.
        ret.status = JobStatus.COMPLETED
        ret.return_value = json.loads((job_dir / "summary.json").read_text())
        return ret


def _root_cause(num: int, overrides: list[str], job_dir: Path, failure: Exception) -> str:
    """Which rank failed first, how, and the last error it logged."""
    rank, first = failure.get_first_failure()  # type: ignore[attr-defined]
    cause = f"job {num} ({' '.join(overrides) or 'no overrides'}) failed: rank {rank} exited with code {first.exitcode}"
    log_file = job_dir / f"train_rank{rank}.log"
    if log_file.exists():
        errors = [line for line in log_file.read_text().splitlines() if "][ERROR]" in line]
        if errors:
            cause += f": {errors[-1].split('][ERROR] ', 1)[-1]}"
    return f"{cause} (logs in {job_dir})"
