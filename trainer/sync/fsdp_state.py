"""An optimizer state dict keyed by parameter name (torch.distributed.checkpoint's) <-> by index.

torch.distributed.checkpoint's get_optimizer_state_dict names each parameter by its fully
qualified name; Optimizer.state_dict() numbers them 0, 1, ... across param_groups in order. A
checkpoint must look the same whichever strategy wrote it, so sync=fsdp writes the numbered layout
(it loads into a plain optimizer) and renames it back to load. `names` lists the parameter names
in the optimizer's order: names[i] is parameter number i.
"""

from __future__ import annotations

from typing import Any


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
