"""ZeRO stage 2 by hand: every rank keeps the full parameters, but only 1/N of the optimizer state
and of the averaged gradient.

wrap() lays every trainable parameter into one flat buffer padded to a multiple of the world size
(each parameter a view of it) and the gradients into a flat buffer of the same layout (FlatGrads).
A step then moves what all_reduce would, in its two halves, with the optimizer in between:

    after_backward:  reduce_scatter(SUM) the gradient buffer -> this rank's shard; divide by N
    optimizer_step:  the shard optimizer updates this rank's slice of the parameter buffer in place;
                     all_gather the slices back into the buffer: every rank holds the new parameters

Forward, backward and evaluation stay local (every rank has the whole model); the optimizer holds
one parameter, the shard, so its state (momentum, Adam's moments) is 1/N of ddp's. Checkpoints
speak in the full model's terms (zero_state.py).

A parameter no rank used (find_unused_parameters=true, trainer/sync/unused.py) gets no update: the
optimizer steps on the whole shard, so its slice of the shard's parameters and optimizer state is
put back as it was. The gradient buffer is cleared right after the step, so a caller's plain
optimizer.zero_grad() (which drops the shard's .grad, re-bound here at the next step) is enough.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer.errors import ConfigError, check
from trainer.sync import averaging
from trainer.sync.base import OptimizerFactory, SyncStrategy
from trainer.sync.flat import Bucket, FlatGrads
from trainer.sync.manual import broadcast_from_rank0
from trainer.sync.unused import UsedParams, names_of
from trainer.sync.zero_state import Layout, gather_full_state, shard_of_full_state

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


class ZeroSync(SyncStrategy):
    """Sharded optimizer state and gradient (ZeRO-2) from reduce_scatter and all_gather."""

    # The reduce_scatter runs in after_backward, but the all_gather in the optimizer phase, which
    # the trainer times as optimizer time: the sync phase is not all of this strategy's
    # communication, and nothing else times it, so rows carry bytes and calls but no comm time.
    comm_in_sync_phase = False
    keeps_replicas_equal = True  # the all_gather leaves every rank the same full parameters

    def __init__(self, find_unused_parameters: bool = False) -> None:
        super().__init__()
        check(
            isinstance(find_unused_parameters, bool),
            "sync.find_unused_parameters",
            find_unused_parameters,
            "accepted: true or false",
        )
        self.find_unused_parameters = find_unused_parameters
        self._used: UsedParams | None = None
        self._frozen: list[tuple[int, int]] = []  # this step: shard slices [lo, hi) of parameters no rank used
        self._shard: nn.Parameter | None = None  # the optimizer's one parameter
        self._cleared = False  # the gradient buffer was zeroed after this step's optimizer step
        self._flat: FlatGrads | None = None
        self._layout: Layout | None = None
        self._params: torch.Tensor | None = None  # the flat parameter buffer
        self._param_shard: torch.Tensor | None = None  # this rank's slice of it (a view)
        self._rank = 0

    @property
    def _bucket(self) -> Bucket:
        assert self._flat is not None, "wrap() first"
        return self._flat.buckets[0]

    def wrap(self, model: nn.Module) -> nn.Module:
        params = [p for p in model.parameters() if p.requires_grad]
        _check_one_kind(params)  # before any collective: every rank refuses alike
        broadcast_from_rank0(model)
        world_size, self._rank = dist.get_world_size(), dist.get_rank()
        self._layout = Layout.of(model, world_size)
        flat = torch.zeros(self._layout.padded_numel, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for param, view in zip(params, self._layout.split(flat), strict=True):
                view.copy_(param)
                param.data = view  # the parameter now lives in the buffer: all_gather updates it
        self._params = flat
        shard = self._layout.shard_numel
        self._param_shard = flat[self._rank * shard : (self._rank + 1) * shard]
        # One group: the gradient buffer has the parameter buffer's layout and padding.
        self._flat = FlatGrads([params], world_size)
        assert self._bucket.buffer.numel() == flat.numel()
        self._used = UsedParams(params, names_of(model, params), self.find_unused_parameters, "zero")
        return model

    def build_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> Optimizer:
        """The optimizer over one parameter: this rank's slice of the parameter buffer.

        Its .grad is the shard reduce_scatter writes, and its in-place update lands in the buffer.
        """
        assert self._param_shard is not None, "wrap() first"
        shard = nn.Parameter(self._param_shard)  # shares the buffer's memory: no copy
        shard.grad = self._bucket.shard
        self._shard = shard
        optimizer = factory([shard])
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
        return optimizer

    def after_backward(self, model: nn.Module) -> None:
        assert self._flat is not None and self._used is not None and self._layout is not None, "wrap() first"
        self._frozen = self._layout.shard_slices(self._used.unused_everywhere(), self._rank)
        self._cleared = False
        self._flat.bind()  # a no-op unless something replaced a gradient
        bucket = self._bucket
        # Every rank, the same call: even one whose micro-batch had no samples (zero gradients).
        averaging.reduce_scatter_tensor(bucket.shard, bucket.buffer, op=dist.ReduceOp.SUM)
        bucket.shard.div_(dist.get_world_size())
        # comm.bytes counts the gradient bytes once per step, as for manual's rs_ag: the pair moves
        # what one all_reduce of them does. Each collective counts its padded buffer.
        self.comm.bytes += bucket.nbytes
        self.comm.add("reduce_scatter", bucket.padded_nbytes)

    def optimizer_step(self, optimizer: Optimizer) -> None:
        assert self._params is not None and self._param_shard is not None and self._shard is not None, "wrap() first"
        assert self._flat is not None
        if self._shard.grad is not self._bucket.shard:  # a plain optimizer.zero_grad() dropped it
            self._shard.grad = self._bucket.shard
        kept = _keep(self._param_shard, optimizer, self._frozen)
        optimizer.step()  # updates this rank's slice of the parameter buffer
        _restore(self._param_shard, optimizer, kept)
        # In place: this rank's input is its own slot of the output. Every rank must reach this
        # (a skipped step, on_nonfinite=skip, skips it on every rank alike).
        averaging.all_gather_tensor(self._params, self._param_shard)
        self.comm.add("all_gather", self._bucket.padded_nbytes)
        # Cleared now, not only in zero_grad: the optimizer cannot reach the model's gradient views,
        # so a caller that clears gradients with optimizer.zero_grad() alone would accumulate them.
        self._flat.zero()
        self._cleared = True

    def zero_grad(self, optimizer: Optimizer) -> None:
        # The flat buffer, never set_to_none: that would drop the views autograd accumulates into.
        # The shard's .grad needs no zeroing: reduce_scatter overwrites it. After a step the buffer
        # is clear already; a skipped step (on_nonfinite=skip) leaves it to clear here.
        assert self._flat is not None, "wrap() first"
        if not self._cleared:
            self._flat.zero()

    def grads_finite(self, model: nn.Module, optimizer: Optimizer) -> bool:
        """Each rank holds only its shard's average: the ranks agree through a one-element all_reduce
        (not counted in comm: a check, like the replica check, not gradient traffic)."""
        finite = torch.isfinite(self._bucket.shard).all().to(torch.int32)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank must reach this
        return bool(finite.item())

    def state_dicts(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's state is full on every rank already; the optimizer's is gathered (a collective)."""
        assert self._layout is not None, "wrap() first"
        return model.state_dict(), gather_full_state(optimizer.state_dict(), self._layout)

    def load_state_dicts(
        self, model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        assert self._layout is not None, "wrap() first"
        model.load_state_dict(model_state)  # copies into the parameters: into the flat buffer
        optimizer.load_state_dict(shard_of_full_state(optimizer_state, self._layout, self._rank))

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"strategy": "zero"}
        if self._layout is not None:
            info["world_size"] = self._layout.world_size
            info["num_params"] = len(self._layout.indices)
            info["numel"] = self._layout.numel
            info["padded_numel"] = self._layout.padded_numel
            info["shard_numel"] = self._layout.shard_numel
        return info


Kept = list[tuple[torch.Tensor, torch.Tensor]]


def _per_element_state(shard: torch.Tensor, optimizer: Optimizer) -> dict[str, torch.Tensor]:
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == shard.shape}


def _keep(
    shard: torch.Tensor, optimizer: Optimizer, slices: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], Kept]:
    """Copies of the shard's parameters and per-element optimizer state in `slices`, to put back after
    the step: one process's optimizer skips a parameter without a gradient."""
    if not slices:  # the usual step: nothing to keep, nothing looked up
        return slices, []
    tensors = [shard, *_per_element_state(shard, optimizer).values()]
    return slices, [(t[lo:hi], t[lo:hi].clone()) for t in tensors for lo, hi in slices]


def _restore(shard: torch.Tensor, optimizer: Optimizer, kept: tuple[list[tuple[int, int]], Kept]) -> None:
    """Put back what _keep copied; state this step created (e.g. Adam's moments) starts at zero there."""
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


def _check_one_kind(params: list[nn.Parameter]) -> None:
    """One flat buffer holds every trainable parameter, so they must share a dtype and a device."""
    if not params:
        raise ConfigError("sync=zero needs a model with trainable parameters; this one has none")
    kinds = sorted({f"{p.dtype} on {p.device}" for p in params})
    if len(kinds) > 1:
        raise ConfigError(
            f"sync=zero lays every trainable parameter into one flat buffer, so they must share one dtype "
            f"and device; this model mixes {', '.join(kinds)}: cast the model to one dtype, or use sync=ddp"
        )
