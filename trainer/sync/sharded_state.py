"""A strategy's state in a sharded checkpoint (trainer.checkpoint_format=sharded), as
torch.distributed.checkpoint (DCP) writes it: flat keys, `model/<name>` and `optim/<name>/<key>`,
each tensor whole where every rank holds it alike, a shard where ranks hold parts.

The default for every strategy whose optimizer steps the model's own parameters (SyncStrategy's
sharded_state / load_sharded_state): torch's state-dict API gives them by name, whole tensors where
they are plain, local shards where they are DTensors (fsdp). zero, whose optimizer steps a flat
shard, has its own (trainer/sync/zero_checkpoint.py). Writing and reading the files is
trainer/reliability/sharded.py's; DCP is imported here only when a sharded checkpoint is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

if TYPE_CHECKING:
    from trainer.sync.master import Masters

Read = Callable[[dict[str, Any]], None]  # fills a template's tensors in place from the checkpoint (DCP)


def flat_keys(model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, Any]:
    tensors = {f"model/{name}": value for name, value in model_state.items()}
    for name, state in optim_state["state"].items():
        for key, value in state.items():
            tensors[f"optim/{name}/{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return tensors


def optimizer_entries(tensors: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """optim/<name>/<key> entries back as {name: {key: value}}."""
    state: dict[str, dict[str, Any]] = {}
    for flat, value in tensors.items():
        if flat.startswith("optim/"):
            name, _, key = flat.removeprefix("optim/").rpartition("/")
            state.setdefault(name, {})[key] = value
    return state


def state_parts(
    model: nn.Module, optimizer: Optimizer, masters: Masters | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """This rank's part of the model and optimizer state (flat keys), and the param groups by name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if masters is not None and masters.pairs:  # torch's API names the model's parameters, not their copies
        names = _stepped_names(model, optimizer, masters)
        plain = optimizer.state_dict()
        optim_state: dict[str, Any] = {
            "state": {names[i]: state for i, state in plain["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in plain["param_groups"]],
        }
        return flat_keys(masters.model_state(model), optim_state), list(optim_state["param_groups"])
    optim_state = dict(get_optimizer_state_dict(model, optimizer))
    return flat_keys(get_model_state_dict(model), optim_state), list(optim_state["param_groups"])


def _stepped_names(model: nn.Module, optimizer: Optimizer, masters: Masters) -> list[str]:
    """Each tensor the optimizer steps (in its state_dict's numbering), by its parameter's name."""
    copy = {id(p): m for p, m in masters.pairs}
    names: dict[int, str] = {}
    for name, param in model.named_parameters():  # a tied parameter by its first name, as torch's API
        names.setdefault(id(copy.get(id(param), param)), name)
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def load_state_parts(
    model: nn.Module,
    optimizer: Optimizer,
    saved: dict[str, Any],
    read: Read,
    groups: list[dict[str, Any]],
    masters: Masters | None = None,
) -> None:
    """Read this rank's part into the model and optimizer (a collective): the model's tensors in
    place, each optimizer entry into a tensor shaped as `saved` (its metadata) says, a DTensor laid
    out like its parameter where the parameter is one."""
    if masters is not None and masters.pairs:
        _load_master_parts(model, optimizer, saved, read, groups, masters)
        return
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    model_state = get_model_state_dict(model)
    template: dict[str, Any] = {f"model/{name}": value for name, value in model_state.items()}
    for flat, meta in saved.items():
        if not flat.startswith("optim/"):
            continue
        param = params.get(flat.removeprefix("optim/").rpartition("/")[0])
        if isinstance(param, DTensor) and tuple(meta.size) == tuple(param.shape):
            template[flat] = torch.zeros_like(param)
        else:
            device = param.device if param is not None else torch.device("cpu")
            template[flat] = torch.zeros(meta.size, dtype=meta.properties.dtype, device=device)
    read(template)
    set_model_state_dict(model, {n: template[f"model/{n}"] for n in model_state})
    optim_state: Any = {"state": optimizer_entries(template), "param_groups": groups}  # torch's own layout, by name
    set_optimizer_state_dict(model, optimizer, optim_state)


def _load_master_parts(
    model: nn.Module,
    optimizer: Optimizer,
    saved: dict[str, Any],
    read: Read,
    groups: list[dict[str, Any]],
    masters: Masters,
) -> None:
    """load_state_parts() where the optimizer steps fp32 copies of 16-bit parameters: the model's
    entries are the copies' values, the optimizer's are numbered as its own state_dict numbers them."""
    model_state = masters.model_state(model)
    template: dict[str, Any] = {f"model/{name}": torch.zeros_like(value) for name, value in model_state.items()}
    for flat, meta in saved.items():
        if flat.startswith("optim/"):
            template[flat] = torch.zeros(meta.size, dtype=meta.properties.dtype, device=next(model.parameters()).device)
    read(template)
    state = {name: template[f"model/{name}"] for name in model_state}
    model.load_state_dict(state)
    masters.load_model_state(model, state)
    index = {name: i for i, name in enumerate(_stepped_names(model, optimizer, masters))}
    entries = optimizer_entries(template)
    optimizer.load_state_dict(
        {
            "state": {index[name]: entry for name, entry in entries.items()},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in groups],
        }
    )
