"""The one place that reads the launcher's environment, and the process group's life cycle.

torchrun exports RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID and
TORCHELASTIC_RESTART_COUNT to every worker. Under Hydra's submitit launcher (Slurm, or its local
stand-in) the rank and rendezvous come from submitit's job environment instead. Without either
(``python train.py``) the job is one process of world size 1 that still runs the same code path,
collectives included.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.core import DistContext
from trainer.errors import ConfigError

log = logging.getLogger(__name__)

# How long a worker waits for the store and for rank 0's run stamp before Hydra has composed the
# config (the configured collective timeout is not known yet at that point).
STARTUP_TIMEOUT = dt.timedelta(seconds=300)
_STAMP_KEY = "ddplab/run_stamp"
RANK_WAIT_S = 30.0  # how long a rank other than 0 waits for rank 0 to report the same bad input
RANK0_FIRST_S = 5.0  # how long the others then let rank 0 exit first, so torchrun's report names it


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process about its place in the job."""

    rank: int
    local_rank: int
    world_size: int
    run_id: str
    restart_count: int
    launcher: str  # "torchrun", "submitit" or "none" (plain python)
    local_world_size: int = 1  # ranks on this node: how many GPUs the job wants here

    @property
    def launched(self) -> bool:
        return self.launcher != "none"

    @property
    def is_main_process(self) -> bool:
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
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", "1")),
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
            local_world_size=max(1, job.num_tasks // max(1, job.num_nodes)),
        )
    return LaunchEnv(rank=0, local_rank=0, world_size=1, run_id="local", restart_count=0, launcher="none")


_store: tuple[int, dist.Store] | None = None  # (the process that connected, its store)


def job_store(env: LaunchEnv) -> dist.Store:
    """This process's connection to the job's store, made once and reused by every multirun job.

    Kept per process: a worker forked by Hydra's torchrun launcher (start_method=fork) inherits
    the launching process's store, an in-process one that no other rank sees; the group's
    rendezvous over it would wait for the other ranks until the timeout.
    """
    global _store
    if _store is None or _store[0] != os.getpid():
        _store = (os.getpid(), connect_store(env))
    return _store[1]


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


@dataclass(frozen=True)
class DeviceChoice:
    """Where this node's ranks run, and why when it is not what `auto` would hope for."""

    type: str  # "cpu" or "cuda"
    warning: str | None = None


def choose_device(requested: str, ranks_per_node: int, gpus_visible: int) -> DeviceChoice:
    """trainer.device as a pure function of the counts: one GPU per local rank, or CPU for all.

    `auto` takes CUDA only when every rank on the node can have a GPU of its own (nccl refuses two
    ranks on one device, and `cuda:<local rank>` must exist); otherwise the whole job runs on CPU
    with gloo and says why. `cuda` with too few GPUs is an error, not a quiet fallback.
    """
    if requested == "cpu":
        return DeviceChoice("cpu")
    if requested == "auto":
        if gpus_visible == 0 or ranks_per_node <= gpus_visible:
            return DeviceChoice("cuda" if gpus_visible else "cpu")
        return DeviceChoice(
            "cpu",
            f"trainer.device=auto runs on CPU with gloo: {ranks_per_node} ranks on this node but "
            f"{gpus_visible} GPU(s) visible (one GPU per rank is needed for CUDA); use "
            f"--nproc_per_node={gpus_visible} for CUDA, or trainer.device=cpu to silence this",
        )
    if requested == "cuda":
        if ranks_per_node > gpus_visible:
            raise ConfigError(
                f"trainer.device=cuda needs one GPU per rank: {ranks_per_node} rank(s) on this node but "
                f"{gpus_visible} GPU(s) visible; use --nproc_per_node<={gpus_visible}"
                f"{'' if gpus_visible else ' on a machine with CUDA'}, or trainer.device=auto or cpu"
            )
        return DeviceChoice("cuda")
    raise ConfigError(f"trainer.device={requested!r} is not one of: auto, cpu, cuda")


def resolve_device(requested: str, env: LaunchEnv) -> torch.device:
    """This rank's device from trainer.device and the node's GPU count; rank 0 says so when auto falls back."""
    choice = choose_device(requested, env.local_world_size, torch.cuda.device_count())
    if choice.warning and env.is_main_process:
        log.warning("%s", choice.warning)
    if choice.type == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)
    return device


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


def rank0_signal(store: dist.Store, env: LaunchEnv) -> Callable[[bool], bool]:
    """Rank 0's word that it has reported the job's bad input, through the job's store."""
    key = f"ddplab/{env.run_id}/attempt-{env.restart_count}/config-error"

    def signal(publish: bool) -> bool:
        if publish:
            store.set(key, "reported")
            return True
        try:
            store.wait([key], dt.timedelta(seconds=RANK_WAIT_S))
        except Exception:  # timed out, or rank 0 and torchrun's store are gone: report it here
            return False
        return True

    return signal


def prints_bad_input_error() -> bool:
    """For a bad-input error found inside the app (e.g. SyncBatchNorm on CPU, a missing data root):
    whether this rank prints it. Rank 0 does and says so through the job's store; the others stay
    quiet once rank 0 has spoken (they print their own if it has not: their error may be theirs alone).
    """
    launch = read_launch_env()
    if launch.world_size == 1:
        return True
    word = rank0_signal(job_store(launch), launch)
    if launch.rank == 0:
        return word(True)
    if not word(False):
        return True
    time.sleep(RANK0_FIRST_S)  # rank 0 exits first, so torchrun's report names it
    return False
