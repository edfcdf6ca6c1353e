"""How a strategy's model and optimizer go into a checkpoint and come back: `sync.checkpointing`.

A checkpoint speaks in the full, unsharded model's terms whichever strategy wrote it, so what a
strategy must say here is only how its own layout maps to those terms. That is a concern of its
own, read by trainer/reliability/ and never by the step, which is why it is an object beside the
strategy rather than methods of the strategy interface (trainer/sync/base.py). This class is every
replicated strategy's (the optimizer steps the model's own parameters, or their fp32 copies);
fsdp (fsdp_state.py) and zero (zero_checkpoint.py) have their own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainer.sync.master import Masters
from trainer.sync.sharded_state import Read, load_state_parts, state_parts


class Checkpointing:
    """A replica's model and optimizer state, for the trainer's checkpoints.

    `trains_one_model`: the ranks train one model between them (False for sync=none, where each
    trains its own and a checkpoint holds rank 0's): only then does a checkpoint continue at
    another world size.
    """

    def __init__(self, masters: Masters, trains_one_model: bool = True) -> None:
        self.masters = masters  # 16-bit parameters: a checkpoint holds their fp32 copies' values
        self.trains_one_model = trains_one_model

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state_dict on every rank: a sharded tensor (fsdp's DTensor) gathered, so
        every rank must call it. For comparing models (tests, tools), not for checkpoints."""
        state = self.masters.model_state(model)
        return {name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in state.items()}

    def state_dicts(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model state, optimizer state) of the full unsharded model, for a checkpoint.

        Every rank calls it (a sharded strategy gathers); only global rank 0's result is written,
        so other ranks may return empty dicts.
        """
        return self.masters.model_state(model), optimizer.state_dict()

    def load_state_dicts(
        self, model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        """Load what state_dicts returned (every rank holds the full dicts, read from the file)."""
        model.load_state_dict(model_state)
        self.masters.load_model_state(model, model_state)
        optimizer.load_state_dict(optimizer_state)

    def sharded_state(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """This rank's part of a sharded checkpoint (flat keys: model/<name>, optim/<name>/<key>; a
        shard where ranks hold parts), and the param groups by name. Every rank calls it."""
        return state_parts(model, optimizer, self.masters)

    def load_sharded_state(
        self, model: nn.Module, optimizer: Optimizer, saved: dict[str, Any], read: Read, groups: list[dict[str, Any]]
    ) -> None:
        """Load this rank's part of a sharded checkpoint, at any world size: lay out what this rank
        holds from `saved` (the checkpoint's metadata by flat key), `read` fills it (a collective)."""
        load_state_parts(model, optimizer, saved, read, groups, self.masters)
