"""A Hydra app that is not ddplab, for hydra/launcher=torchrun's end-to-end tests.

    python tests/torchrun_app.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 x=1,2 fail_x=1

Its task starts a process group from torchrun's variables alone (init_process_group's defaults),
all_reduces the ranks, writes what it saw to <job dir>/rank<r>.json and returns it. In the job
whose x is fail_x, rank 1 raises instead of writing and returning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig


@dataclass
class AppConfig:
    x: int = 0
    fail_x: int | None = None  # the job with this x fails on rank 1


ConfigStore.instance().store(name="torchrun_app", node=AppConfig)


@hydra.main(version_base="1.3", config_path=None, config_name="torchrun_app")
def main(cfg: AppConfig) -> dict[str, int | bool]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([rank])
    dist.all_reduce(total)
    seen = {
        "x": cfg.x,
        "rank": rank,
        "world_size": dist.get_world_size(),
        "rank_sum": int(total.item()),
        "writes_hydra_files": HydraConfig.get().output_subdir is not None,  # global rank 0 only
    }
    dist.destroy_process_group()
    # After the collective, so rank 0 finishes this job normally: rank 1 alone fails it, and is its only root cause.
    if cfg.x == cfg.fail_x and rank == 1:
        raise ValueError(f"rank 1 refuses x={cfg.x}")
    (Path(HydraConfig.get().runtime.output_dir) / f"rank{rank}.json").write_text(json.dumps(seen))
    return seen


if __name__ == "__main__":
    main()
