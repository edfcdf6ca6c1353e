"""hydra/launcher=torchrun's options, registered with Hydra's ConfigStore so that any Hydra app finds them.

    python my_app.py hydra/launcher=torchrun --cfg hydra -p hydra.launcher     # shows them

Hydra imports this module whenever an app starts (its plugin scan), so it imports nothing heavy.
"""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore


@dataclass
class TorchrunLauncherConf:
    """One torchrun group per job: the `torchrun` command's own options, with its defaults."""

    _target_: str = "hydra_plugins.ddplab_torchrun_launcher.torchrun_launcher.TorchrunLauncher"
    nproc_per_node: int = 2  # workers per node (one per GPU on a GPU node)
    nnodes: int = 1  # >1: run the same command on every node, with the same hydra.sweep.dir
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"  # host:port of the rendezvous; port 0 picks a free one (single node)
    max_restarts: int = 0  # elastic restarts of a failed job before it counts as failed
    start_method: str = "spawn"  # spawn, fork or forkserver
    monitor_interval_s: float = 0.1  # how often the agent checks its workers


ConfigStore.instance().store(
    group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="ddplab_torchrun_launcher"
)
