"""The one place that reads the launcher's environment, and the process group's life cycle.

torchrun exports RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID and
TORCHELASTIC_RESTART_COUNT to every worker. Under Hydra's submitit launcher (Slurm, or its local
stand-in) the rank and rendezvous come from submitit's job environment instead. Without either
(``python train.py``) the job is one process of world size 1 that still runs the same code path,
collectives included.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.errors import ConfigError

# How long a worker waits for the store and for rank 0's run stamp before Hydra has composed the
# config (the configured collective timeout is not known yet at that point).
STARTUP_TIMEOUT = dt.timedelta(seconds=300)
_STAMP_KEY = "ddplab/run_stamp"


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process about its place in the job."""

    rank: int
    local_rank: int
    world_size: int
    run_id: str
    restart_count: int
    launcher: str  # "torchrun", "submitit" or "none" (plain python)

    @property
    def launched(self) -> bool:
        return self.launcher != "none"

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class DistContext:
    """A process's rank, device and backend once the process group exists."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    attempt: int = 0  # torchrun's restart count: 0 for the first attempt
    store: dist.Store | None = None  # the process group's store (this job's key prefix)

    @property
    def is_main_process(self) -> bool:
        # Global rank 0, never local rank 0: on two nodes there are two local rank 0s.
        return self.rank == 0


def read_launch_env(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """Read the launcher's variables; fall back to a single process when there are none."""
    if "RANK" in environ:
        return LaunchEnv(
            rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            world_size=int(environ["WORLD_SIZE"]),
            run_id=environ.get("TORCHELASTIC_RUN_ID", "none"),
            restart_count=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            launcher="torchrun",
        )
    if environ.get("SUBMITIT_EXECUTOR"):
        import submitit

        job = submitit.JobEnvironment()
        return LaunchEnv(
            rank=job.global_rank,
            local_rank=job.local_rank,
            world_size=job.num_tasks,
            run_id=str(job.job_id),
            restart_count=0,
            launcher="submitit",
        )
    return LaunchEnv(rank=0, local_rank=0, world_size=1, run_id="local", restart_count=0, launcher="none")


_store: dist.Store | None = None


def job_store(env: LaunchEnv) -> dist.Store:
    """This process's connection to the job's store, made once and reused by every multirun job."""
    global _store
    if _store is None:
        _store = connect_store(env)
    return _store


def connect_store(env: LaunchEnv) -> dist.Store:
    """The job's key-value store: torchrun's (via PyTorch's env:// rendezvous) or an in-process one."""
    if env.launcher == "none":
        return dist.HashStore()
    if env.launcher == "submitit":
        from submitit.helpers import TorchDistributedEnvironment

        # MASTER_ADDR/PORT, RANK, WORLD_SIZE for env://. Each rank keeps every GPU visible and
        # picks cuda:<local rank> itself, as under torchrun.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    # env:// knows whether torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT.
    store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=STARTUP_TIMEOUT))
    return store


def agree_on_run_stamp(store: dist.Store, env: LaunchEnv) -> str:
    """Rank 0's clock names the run; every other rank reads the same name from the store.

    Hydra's ``${now:}`` is evaluated per process, so ranks started a second apart would land in
    different directories. compare_set keeps the first stamp if rank 0 ever sets it twice.
    """
    if env.rank == 0:
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        store.compare_set(_STAMP_KEY, "", stamp)
    return store.get(_STAMP_KEY).decode()


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """`auto` means CUDA when present, else CPU; each rank takes the GPU of its local rank."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but CUDA is not available here; use trainer.device=auto or cpu")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    raise ConfigError(f"trainer.device={requested!r} is not one of: auto, cpu, cuda")


def init_process_group(
    env: LaunchEnv, store: dist.Store, device: torch.device, timeout_s: float, key_prefix: str
) -> DistContext:
    """Start this job's process group: gloo on CPU, nccl on CUDA, with an explicit timeout.

    ``key_prefix`` must be new for every group created on the same store (each multirun job,
    each elastic restart): a group re-initialised over stale keys can hang or fail to connect.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = dt.timedelta(seconds=timeout_s)
    store.set_timeout(timeout)
    group_store = dist.PrefixStore(key_prefix, store)
    dist.init_process_group(
        backend=backend,
        store=group_store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return DistContext(env.rank, env.local_rank, env.world_size, device, backend, env.restart_count, group_store)


def group_key_prefix(env: LaunchEnv, job_num: int) -> str:
    """A store prefix unique to this run, attempt and multirun job."""
    return f"ddplab/{env.run_id}/attempt-{env.restart_count}/job-{job_num}/"


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_ranks_agree(what: str, value: Any) -> None:
    """Every rank must hold the same value (e.g. the multirun job it is in), or the job stops.

    Ranks that drifted apart would pair their collectives with another job's; this turns that
    into an error naming each rank's value instead.
    """
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if any(v != values[0] for v in values):
        listing = "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise RuntimeError(f"ranks disagree on {what}: {listing}")


def hostname() -> str:
    return socket.gethostname()
