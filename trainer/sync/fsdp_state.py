"""sync=fsdp's checkpoints: torch's state-dict API over FSDP2's DTensors, in the plain model's terms.

An optimizer state dict keyed by parameter name (torch.distributed.checkpoint's) <-> by index.

torch.distributed.checkpoint's get_optimizer_state_dict names each parameter by its fully
qualified name; Optimizer.state_dict() numbers them 0, 1, ... across param_groups in order. A
checkpoint must look the same whichever strategy wrote it, so sync=fsdp writes the numbered layout
(it loads into a plain optimizer) and renames it back to load. `names` lists the parameter names
in the optimizer's order: names[i] is parameter number i.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from trainer.sync.checkpointing import Checkpointing
from trainer.sync.master import Masters
from trainer.sync.sharded_state import Read


class FSDPCheckpointing(Checkpointing):
    """The full state gathered by torch's state-dict functions; a sharded checkpoint holds each
    rank's DTensor shards (the default's parts, named by the registered parameters)."""

    def __init__(self, masters: Masters, param_names: Callable[[], list[str]]) -> None:
        super().__init__(masters)
        self.param_names = param_names  # the optimizer's parameters by name, in its order (after build_optimizer)

    def state_dicts(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The full unsharded state on rank 0 (others get empty dicts): the plain model's keys, and
        the optimizer's usual state_dict() layout, numbered in its parameter order."""
        reshard(model)  # collective: every rank gathers its part
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
        return model_state, by_index(optimizer_state, self.param_names())

    def load_state_dicts(
        self, model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        # Every rank read the whole file: each keeps its own shard, no broadcast needed.
        reshard(model)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optimizer, by_name(optimizer_state, self.param_names()), options=options)

    def sharded_state(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        reshard(model)  # the state-dict functions name the registered parameters: the optimizer's shards
        return super().sharded_state(model, optimizer)

    def load_sharded_state(
        self, model: nn.Module, optimizer: Optimizer, saved: dict[str, Any], read: Read, groups: list[dict[str, Any]]
    ) -> None:
        reshard(model)
        super().load_sharded_state(model, optimizer, saved, read, groups)


def reshard(model: nn.Module) -> None:
    """Register every unit's shards again, freeing what an evaluation left gathered (the root; every
    unit with reshard_after_forward=false): the state-dict functions read the registered
    parameters, which must be the shards the optimizer holds."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The named layout renumbered as Optimizer.state_dict() numbers it; {} stays {} (ranks > 0)."""
    if not state:
        return state
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]],
    }


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The numbered layout with each parameter number replaced by its name."""
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }
