"""PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard): every rank holds a 1/world_size shard.

The units are chosen by sync.wrap (fsdp_units.py): one per transformer-style block (each element
of an nn.ModuleList) or one per module that directly owns parameters (Linear, Conv2d, ...), then
the root with the rest; a parameter shared by two candidates (tied weights) stays in the root.
A unit's parameters live as DTensor shards (dim 0 split across ranks); its forward
all-gathers them, its backward reduce-scatters the gradients, so each rank holds and updates only
its shard of parameters, gradients and optimizer state. FSDP2 issues those collectives itself,
so what this strategy reports in `self.comm.counts` is counted from the layout, not measured.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from trainer.errors import ConfigError
from trainer.sync.base import OptimizerFactory, SyncStrategy
from trainer.sync.fsdp_state import by_index, by_name
from trainer.sync.fsdp_units import Wrap, choose_units, resolve
from trainer.sync.fsdp_usage import FirstForwardCheck, expected_usage

# What the parameters are all-gathered in, and the gradients reduce-scattered in.
MIXED_PRECISION = {"none": None, "bf16": (torch.bfloat16, torch.float32)}


@dataclass
class Unit:
    """One fully_shard call's parameters, as they travel (sizes padded the way FSDP2 pads them)."""

    module: nn.Module
    probe: tuple[nn.Module, str]  # (owning module, attribute) of one of its parameters, as FSDP2 registers it
    is_root: bool
    all_gather_bytes: int  # the unsharded, padded parameters in the all-gather dtype
    reduce_scatter_bytes: int  # the unsharded, padded gradients in the reduce dtype
    sharded_bytes: int  # what one rank stores: all_gather_bytes / world_size in the storage dtype


def padded_numel(shape: torch.Size, world_size: int) -> int:
    """FSDP2 shards dim 0 in chunks of ceil(d0 / world_size) rows, padding the last: every rank's
    shard, and so every collective's slice, has the same size (_get_dim0_padded_size)."""
    dims = list(shape) or [1]
    return math.ceil(dims[0] / world_size) * world_size * math.prod(dims[1:])


def is_sharded(unit: Unit) -> bool:
    """Whether a unit's parameters are registered as its DTensor shards, i.e. its next forward
    (or backward) all-gathers; FSDP2 registers the plain unsharded tensors while it holds them
    (on the module that owns each parameter, which for a block is one of its submodules)."""
    owner, name = unit.probe
    return isinstance(getattr(owner, name), DTensor)


class FSDPSync(SyncStrategy):
    """Sharded data parallelism: parameters, gradients and optimizer state split across ranks."""

    # Ranks hold different shards, not replicas: there are no full local parameters for the
    # trainer's replica check to compare (state_dicts() gathers them when a checkpoint needs them).
    keeps_replicas_equal = False
    grads_sharded = True  # each parameter's .grad is a DTensor: this rank's shard of the average
    not_emulated = "FSDP2 issues its collectives itself"  # network=<preset> cannot delay them: the run says so

    def __init__(
        self,
        reshard_after_forward: bool = True,
        mixed_precision: Literal["none", "bf16"] = "none",
        wrap: Wrap = "auto",
    ) -> None:
        super().__init__()
        self.wrap_policy = wrap
        self._wrapped = ""  # what auto resolved to
        self.reshard_after_forward = reshard_after_forward
        self.mixed_precision = mixed_precision
        self._units: list[Unit] = []
        self._world_size = 1
        self._param_names: list[str] = []  # the optimizer's parameters, in its own order
        self._evaluated = False  # forwards without grad ran since the last training forward
        self._first_forward: FirstForwardCheck | None = None  # same units and parameters on every rank

    def check_device(self, device: torch.device) -> None:
        if self.mixed_precision == "bf16" and device.type != "cuda":
            raise ConfigError(
                f"sync.mixed_precision=bf16 cannot run on {device}: FSDP2's bf16 parameters and fp32 "
                "gradient reduction are CUDA-only here; use trainer.device=cuda, or sync.mixed_precision=none "
                "(trainer.precision=bf16 autocasts the compute on any device)"
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        # fully_shard keeps each rank's own slice of its local tensors; it does not make them equal.
        self.comm.broadcast_parameters(model)
        self._world_size = dist.get_world_size()
        device = next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device
        mesh = init_device_mesh(device.type, (self._world_size,))
        dtypes = MIXED_PRECISION[self.mixed_precision]
        policy = MixedPrecisionPolicy(*dtypes) if dtypes else MixedPrecisionPolicy()
        layers, rest = choose_units(model, self.wrap_policy)
        self._wrapped = resolve(model, self.wrap_policy)
        recurse = self._wrapped == "block"
        owners = {id(p): (m, n) for m in model.modules() for n, p in m.named_parameters(recurse=False)}
        units = [self._unit(m, list(m.parameters(recurse=recurse)), owners, is_root=False) for m in layers]
        units.append(self._unit(model, rest, owners, is_root=True))
        self._units = [u for u in units if u.all_gather_bytes]  # a root without parameters of its own gathers nothing
        usage = expected_usage(model, layers, owners, recurse)  # names, while the parameters are the plain ones
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        # The root follows torch's own rule: left to its default (None), FSDP2 keeps the root's
        # parameters gathered after forward (backward needs them at once); false is false.
        root_reshard = None if self.reshard_after_forward else False
        fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=policy)
        # Runs before FSDP's own pre-forward hook on the root (prepend), so it sees every unit
        # as the forward finds it.
        model.register_forward_pre_hook(self._before_forward, prepend=True)
        if self._world_size > 1:
            self._first_forward = FirstForwardCheck(model, *usage, comm=self.comm)
        return model  # sharded in place: the trainer's model and the forward module are one object

    def _unit(
        self, module: nn.Module, params: list[nn.Parameter], owners: dict[int, tuple[nn.Module, str]], is_root: bool
    ) -> Unit:
        dtypes = MIXED_PRECISION[self.mixed_precision]
        gather_size = (lambda p: dtypes[0].itemsize) if dtypes else (lambda p: p.element_size())
        reduce_size = (lambda p: dtypes[1].itemsize) if dtypes else (lambda p: p.element_size())
        n = self._world_size
        return Unit(
            module,
            owners[id(params[0])] if params else (module, ""),
            is_root,
            sum(padded_numel(p.shape, n) * gather_size(p) for p in params),
            sum(padded_numel(p.shape, n) * reduce_size(p) for p in params if p.requires_grad),
            sum(padded_numel(p.shape, n) // n * p.element_size() for p in params),
        )

    def build_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> Optimizer:
        optimizer = factory(model.parameters())  # the DTensor shards: its state is sharded alike
        # Names in the optimizer's order, taken now, while every unit is registered sharded.
        names = {id(p): name for name, p in model.named_parameters()}
        self._param_names = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        return optimizer

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate this micro-batch's unsharded gradients locally: no reduce-scatter."""
        assert isinstance(model, FSDPModule), "no_sync needs the module wrap() returned"
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """Starts a training step's forward clean, and counts its all-gathers from the layout.

        A unit registered sharded is gathered in this forward; a non-root unit that reshards after
        forward is gathered again in its backward. Evaluation's forwards (no grad) are not training
        steps and are not counted.
        """
        if not torch.is_grad_enabled():
            self._evaluated = True
            return
        if self._evaluated:
            # FSDP2 records each forward's units for its backward prefetch, and only a backward
            # clears the record: evaluation's forwards leave stale entries that make the next
            # backward prefetch a unit it has already resharded (a wasted all-gather, a unit left
            # gathered), and leave the root (every unit, with reshard_after_forward=false)
            # gathered. reset_iter_state clears the record and reshards everything (no step is in
            # flight between steps): this step runs, and is counted, like any other.
            assert isinstance(module, FSDPModule)
            module.reset_iter_state()
            self._evaluated = False
        if self._world_size == 1:  # a single rank gathers nothing
            return
        for unit in self._units:
            if is_sharded(unit):
                self._count("all_gather", unit.all_gather_bytes)
            if self.reshard_after_forward and not unit.is_root:
                self._count("all_gather", unit.all_gather_bytes)

    def after_backward(self, model: nn.Module) -> None:
        # FSDP2 has reduce-scattered each unit's gradients during the last backward already (and
        # waited for them at its end): only the counting is left, from the layout.
        if self._world_size == 1:
            return
        for unit in self._units:
            if unit.reduce_scatter_bytes:
                self._count("reduce_scatter", unit.reduce_scatter_bytes)

    def _count(self, kind: str, nbytes: int) -> None:
        self.comm.counts.add(kind, nbytes)
        # comm/bytes_per_step is in all_reduce-equivalent bytes, as for every strategy: a
        # reduce-scatter or all-gather of S bytes moves half of what an all_reduce of S moves, so
        # manual's rs_ag and zero count a gradient's S once, and FSDP's two parameter all-gathers
        # plus one gradient reduce-scatter count 1.5 S.
        self.comm.counts.bytes += nbytes // 2

    def grads_finite(self, model: nn.Module, optimizer: Optimizer) -> bool:
        """Each rank sees only its gradient shard: every rank must agree (one tiny all_reduce)."""
        params = list(model.parameters())
        if not params:
            return True
        flags = [torch.isfinite(local_of(p.grad)).all() for p in params if p.grad is not None]
        finite = torch.stack(flags).all() if flags else torch.tensor(True)
        agreed = finite.to(device=local_of(params[0]).device, dtype=torch.int32)
        self.comm.agree(agreed, dist.ReduceOp.MIN)  # every rank calls this, whatever its shard held
        return bool(agreed.item())

    def state_dicts(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The full unsharded state on rank 0 (others get empty dicts): the plain model's keys, and
        the optimizer's usual state_dict() layout, numbered in its parameter order."""
        reshard(model)  # collective: every rank gathers its part
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
        return model_state, by_index(optimizer_state, self._param_names)

    def load_state_dicts(
        self, model: nn.Module, optimizer: Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> None:
        # Every rank read the whole file: each keeps its own shard, no broadcast needed.
        reshard(model)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optimizer, by_name(optimizer_state, self._param_names), options=options)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "strategy": "fsdp",
            "reshard_after_forward": self.reshard_after_forward,
            "mixed_precision": self.mixed_precision,
            "wrap": self.wrap_policy,
        }
        if self._wrapped:
            info["wrap_in_use"] = self._wrapped
        if self._units:
            info["num_units"] = len(self._units)
            info["unit_bytes"] = [u.all_gather_bytes for u in self._units]  # each forward's gathers
            info["sharded_bytes_per_rank"] = sum(u.sharded_bytes for u in self._units)
        return info


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def reshard(model: nn.Module) -> None:
    """Register every unit's shards again, freeing what an evaluation left gathered (the root; every
    unit with reshard_after_forward=false): the state-dict functions read the registered
    parameters, which must be the shards the optimizer holds."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
