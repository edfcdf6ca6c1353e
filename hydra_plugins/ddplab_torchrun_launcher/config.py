"""hydra/launcher=torchrun's options, registered with Hydra's ConfigStore so that any Hydra app finds them.

    python my_app.py hydra/launcher=torchrun --cfg hydra -p hydra.launcher     # shows them

Hydra imports this module whenever an app starts (its plugin scan), so it imports nothing heavy.
"""

from dataclasses import dataclass
from enum import Enum

from hydra.core.config_store import ConfigStore


class StartMethod(str, Enum):
    """How the agent starts a job's workers (multiprocessing's start methods); typed, so that a
    misspelt one is refused when Hydra composes the config, naming the three."""

    spawn = "spawn"
    fork = "fork"
    forkserver = "forkserver"


def fork_refusal(start_method: str, cuda_available: bool) -> str | None:
    """Why start_method cannot run here, or None.

    torch's LaunchConfig asks torch.accelerator about the GPU in the launching process, and CUDA
    refuses to start in a process forked from one that has: every forked worker that used CUDA
    would fail ("Cannot re-initialize CUDA in forked subprocess").
    """
    if StartMethod(start_method) is StartMethod.fork and cuda_available:
        return (
            "hydra.launcher.start_method=fork is invalid where CUDA is available: a worker forked from the "
            "launching process cannot start CUDA (torch's launcher has queried the GPU there); "
            "accepted here: spawn, forkserver"
        )
    return None


@dataclass
class TorchrunLauncherConf:
    """One torchrun group per job: the `torchrun` command's own options, with its defaults."""

    _target_: str = "hydra_plugins.ddplab_torchrun_launcher.torchrun_launcher.TorchrunLauncher"
    nproc_per_node: int = 2  # workers per node (one per GPU on a GPU node)
    nnodes: int = 1  # >1: run the same command on every node, with the same hydra.sweep.dir
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"  # host:port of the rendezvous; port 0 picks a free one (single node)
    max_restarts: int = 0  # elastic restarts of a failed job before it counts as failed
    start_method: StartMethod = StartMethod.spawn  # fork: ~2 s less per job, refused where CUDA is available
    monitor_interval_s: float = 0.1  # how often the agent checks its workers


ConfigStore.instance().store(
    group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="ddplab_torchrun_launcher"
)
