"""sync=zero's rules beside its algorithm: what it refuses, known only with the model and the
optimizer, before it would train a different model than one process (an optimizer that is not
element-wise or has several groups, parameters of mixed kinds); and a parameter no rank used,
which gets no update although the optimizer steps on the whole shard: its slice of the shard's
parameters and per-element optimizer state is kept before the step and put back after it (one
process's optimizer skips a parameter without a gradient).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from trainer.errors import ConfigError

# Optimizers whose update of an element depends only on that element's parameter, gradient and
# state (and on scalars such as the step count): on a flat shard they compute exactly what they
# compute on the parameters. An allowlist, not a denylist: an optimizer not known to be
# element-wise (LBFGS's line search over all parameters, Adafactor's row/column factors, Muon's
# orthogonalised matrices, SparseAdam's sparse gradients, a third-party LAMB's per-layer trust
# ratio) would silently train a different model on a shard.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
)


def check_optimizer(optimizer: Optimizer, shard: nn.Parameter) -> None:
    """The shard optimizer must be element-wise and hold the shard as its one parameter."""
    cls = type(optimizer)
    # The name a config would use: torch.optim.LBFGS rather than torch.optim.lbfgs.LBFGS.
    exported = getattr(torch.optim, cls.__name__, None) is cls
    name = f"torch.optim.{cls.__name__}" if exported else f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(optimizer, ELEMENTWISE):
        raise ConfigError(
            f"optim._target_={name} is invalid with sync=zero: {cls.__name__} is not known to be element-wise, "
            "and sync=zero runs the optimizer on a flat 1/N slice of all parameters, which only gives the "
            "same update for element-wise optimizers; accepted: "
            + ", ".join(f"torch.optim.{c.__name__}" for c in ELEMENTWISE)
            + "; or use sync=ddp"
        )
    groups = optimizer.param_groups
    if len(groups) != 1 or len(groups[0]["params"]) != 1 or groups[0]["params"][0] is not shard:
        raise ConfigError(
            f"optim._target_={name} built {len(groups)} param groups: sync=zero gives "
            "the optimizer one flat parameter, so per-group hyperparameters cannot apply; use one group"
        )


def check_one_kind(params: list[nn.Parameter]) -> None:
    """One flat buffer holds every trainable parameter, so they must share a dtype and a device."""
    if not params:
        raise ConfigError("sync=zero needs a model with trainable parameters; this one has none")
    kinds = sorted({f"{p.dtype} on {p.device}" for p in params})
    if len(kinds) > 1:
        raise ConfigError(
            f"sync=zero lays every trainable parameter into one flat buffer, so they must share one dtype "
            f"and device; this model mixes {', '.join(kinds)}: cast the model to one dtype, or use sync=ddp"
        )


Kept = list[tuple[torch.Tensor, torch.Tensor]]


def _per_element_state(shard: torch.Tensor, optimizer: Optimizer) -> dict[str, torch.Tensor]:
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == shard.shape}


def save_unused(
    shard: torch.Tensor, optimizer: Optimizer, slices: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], Kept]:
    """Copies of the shard's parameters and per-element optimizer state in `slices`, to put back after
    the step: one process's optimizer skips a parameter without a gradient."""
    if not slices:  # the usual step: nothing to keep, nothing looked up
        return slices, []
    tensors = [shard, *_per_element_state(shard, optimizer).values()]
    return slices, [(t[lo:hi], t[lo:hi].clone()) for t in tensors for lo, hi in slices]


def restore_unused(shard: torch.Tensor, optimizer: Optimizer, kept: tuple[list[tuple[int, int]], Kept]) -> None:
    """Put back what save_unused copied; state this step created (e.g. Adam's moments) starts at zero there."""
    slices, saved = kept
    if not slices:
        return
    with torch.no_grad():
        for view, copy in saved:
            view.copy_(copy)
        restored = {view.data_ptr() for view, _ in saved}
        for value in _per_element_state(shard, optimizer).values():
            for lo, hi in slices:
                if value[lo:hi].data_ptr() not in restored:
                    value[lo:hi].zero_()
