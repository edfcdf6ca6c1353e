"""Which modules become FSDP units (sync.wrap), and which parameters each one holds.

module: every module that directly owns parameters is a unit (the finest grouping, the lab's first).
block: every element of an nn.ModuleList (the outermost ones: a transformer's layers) is a unit,
as torchtitan wraps a transformer block; everything else (embeddings, final norm, head) stays in
the root unit, so a tied embedding and head land in one unit. auto: block when the model has an
nn.ModuleList of modules with parameters, module otherwise (today's models keep their units).

A parameter shared by two candidate units (tied weights, a layer reused in two blocks) cannot be
sharded by both (FSDP2 raises at the first forward): every candidate holding such a parameter is
left to the root unit instead, which then holds the shared parameter once.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

Wrap = Literal["auto", "block", "module"]  # sync.wrap


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each element with parameters of every outermost nn.ModuleList in the model."""
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, nn.ModuleList):
                found.extend((f"{path}.{i}", m) for i, m in child.named_children() if any(True for _ in m.parameters()))
            else:
                visit(f"{path}.", child)

    visit("", model)
    return found


def resolve(model: nn.Module, wrap: str) -> str:
    """auto made concrete for this model."""
    if wrap != "auto":
        return wrap
    return "block" if blocks_of(model) else "module"


def choose_units(model: nn.Module, wrap: str) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """The non-root units, in registration order, and the parameters left to the root."""
    block = resolve(model, wrap) == "block"
    if block:
        candidates = blocks_of(model)
    else:
        candidates = [
            (name, m)
            for name, m in model.named_modules()
            if m is not model and next(m.parameters(recurse=False), None) is not None
        ]

    def holder(param_name: str) -> str:
        """The candidate a parameter's name lies under (every name of a tied one is seen), or the root."""
        owner = param_name.rpartition(".")[0]
        for name, _ in candidates:
            if (block and param_name.startswith(name + ".")) or (not block and owner == name):
                return name
        return ""

    holders: dict[int, set[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), set()).add(holder(param_name))
    units = [m for name, m in candidates if all(holders[id(p)] == {name} for p in m.parameters(recurse=block))]
    kept = {id(p) for m in units for p in m.parameters(recurse=block)}
    return units, [p for p in model.parameters() if id(p) not in kept]


def unit_parameters(model: nn.Module, wrap: str) -> list[list[nn.Parameter]]:
    """Each unit's parameters, the root's (the rest) last: what each unit gathers whole in its turn."""
    layers, rest = choose_units(model, wrap)
    recurse = resolve(model, wrap) == "block"  # a block holds its submodules' parameters
    return [*(list(m.parameters(recurse=recurse)) for m in layers), rest]
