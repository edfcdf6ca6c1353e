"""No communication at all: each rank trains its own model on its own shard (a baseline)."""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

from trainer.comm_schedule import Nothing, Schedule
from trainer.sync.base import SyncStrategy
from trainer.sync.checkpointing import Checkpointing

log = logging.getLogger(__name__)


class NoSync(SyncStrategy):
    """Replicas drift apart on purpose; useful for single-process runs and divergence baselines."""

    name = "none"
    keeps_replicas_equal = False

    def __init__(self) -> None:
        super().__init__()
        self.checkpointing = Checkpointing(self.masters, trains_one_model=False)  # a checkpoint holds rank 0's

    def wrap(self, model: nn.Module) -> nn.Module:
        if dist.get_world_size() > 1 and dist.get_rank() == 0:
            log.warning(
                "sync=none with world_size=%d: ranks never communicate, so each trains a different model",
                dist.get_world_size(),
            )
        return model

    def schedule(self) -> Schedule:
        return Schedule(Nothing())
