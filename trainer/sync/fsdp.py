"""PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard): every rank holds a 1/world_size shard.

What torch does: each unit's parameters live as DTensor shards (dim 0 split across ranks). Before a
unit's forward, FSDP2 all-gathers its parameters into full tensors (prefetching the next unit's
while this one computes); after it, frees them (reshard_after_forward; never the root, which
backward needs at once); before the unit's backward, gathers them again; once its gradients are
in, reduce-scatters them so each rank keeps its shard of the average, and frees the full ones. The
optimizer steps on the shards. A parameter without a gradient keeps none (FSDP2 reduces only those
that got one), so every rank must use the same ones: the first forward checks it (fsdp_usage.py).

What ddplab adds: the units, chosen by sync.wrap (fsdp_units.py): one per transformer-style block
(each element of an nn.ModuleList) or one per module that directly owns parameters, then the root
with the rest (a parameter shared by two candidates, tied weights, stays in the root); and FSDP2's
all-gathers and reduce-scatters handed to `self.comm` through torch's custom-collective hooks
(FSDPModule.set_custom_all_gather / set_custom_reduce_scatter), so they are counted from what was
sent, named, timed and carried by an emulated link like every strategy's.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.optim import Optimizer

from trainer.comm_schedule import Schedule, ShardedUnits
from trainer.footprint import Footprint, Held, Plan
from trainer.sync.base import OptimizerFactory, SyncStrategy
from trainer.sync.comm import Comm
from trainer.sync.fsdp_buffers import backward_buffers, forward_buffers
from trainer.sync.fsdp_state import FSDPCheckpointing
from trainer.sync.fsdp_units import Wrap, choose_units, resolve, unit_parameters
from trainer.sync.fsdp_usage import FirstForwardCheck, expected_usage
from trainer.sync.master import SIXTEEN_BITS, cast_parameters

# fsdp's keys, declared once (sync=hsdp takes them too).
ReshardAfterForward = Annotated[bool, Field(description="free a unit's parameters after its forward")]
Units = Annotated[Wrap, Field(description="the units: one per block (ModuleList element) or per module")]
CheckEveryForward = Annotated[
    bool, Field(description="check every training forward for units or parameters some rank leaves out")
]


class CommAllGather(AllGather):
    """FSDP2's all-gather of a unit's parameters, sent through the strategy's communication object."""

    def __init__(self, comm: Comm, unit: str) -> None:
        self.comm, self.unit = comm, f"fsdp unit {unit}"
        # held(): the flat outputs, alive from the launch (a prefetched unit's, while the unit before it
        # computes) until FSDP2 has copied them out into the unit's parameters
        self.outputs: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        output = torch.empty(*size, dtype=dtype, device=device)
        self.outputs.add(output)
        return output

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        work = self.comm.all_gather(output_tensor, input_tensor, self.unit, group=group)
        if async_op:
            return work
        work.wait()
        return None


class CommReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of a unit's gradients (called synchronously on CPU), through the comm."""

    def __init__(self, comm: Comm, unit: str) -> None:
        self.comm, self.unit = comm, f"fsdp unit {unit}"
        # held(): the flat gradients reduced, alive while FSDP2 holds them (an output becomes the sharded
        # .grad, which the probe sees), and at the launch the unit's full gradients, alive in FSDP2's hands
        # until it returns, and the shard the sum lands in, not yet any parameter's .grad
        self.inputs: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        self.reducing: tuple[torch.Tensor, torch.Tensor] | None = None

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)  # the unit's gradients, flattened to be reduced

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.inputs.add(input_tensor)
        self.reducing = input_tensor, output_tensor
        try:
            work = self.comm.reduce_scatter(output_tensor, input_tensor, self.unit, op=op, group=group)
        finally:
            self.reducing = None
        if async_op:
            return work
        work.wait()
        return None


def padded_numel(shape: torch.Size, world_size: int) -> int:
    """FSDP2 shards dim 0 in chunks of ceil(d0 / world_size) rows, padding the last: every rank's
    shard, and so every collective's slice, has the same size (_get_dim0_padded_size)."""
    dims = list(shape) or [1]
    return math.ceil(dims[0] / world_size) * world_size * math.prod(dims[1:])


def unit_bytes(units: Sequence[Sequence[nn.Parameter]], world_size: int, dtype: torch.dtype | None) -> list[int]:
    """Each unit's parameters gathered whole: dim 0 padded (padded_numel), in `dtype` (bf16: 2 bytes
    each) or their own."""
    return [sum(padded_numel(p.shape, world_size) * (dtype or p.dtype).itemsize for p in unit) for unit in units]


class FSDPSync(SyncStrategy):
    """Sharded data parallelism: parameters, gradients and optimizer state split across ranks."""

    # Ranks hold different shards, not replicas: there are no full local parameters for the
    # trainer's replica check to compare (state_dicts() gathers them when a checkpoint needs them).
    name = "fsdp"
    key_attributes = {"wrap": "wrap_policy"}
    keeps_replicas_equal = False
    grads_sharded = True  # each parameter's .grad is a DTensor: this rank's shard of the average

    def __init__(
        self,
        reshard_after_forward: ReshardAfterForward = True,
        wrap: Units = "auto",
        find_unused_parameters: CheckEveryForward = False,
    ) -> None:
        super().__init__()
        self.checkpointing = FSDPCheckpointing(self.masters, lambda: self._param_names)
        # true: every training forward is checked as the first is (a unit or parameter some rank
        # leaves out in a later step is refused there, not left to FSDP2's unpaired collectives)
        self.find_unused_parameters = find_unused_parameters
        self.wrap_policy = wrap
        self._wrapped = ""  # what auto resolved to
        self.reshard_after_forward = reshard_after_forward
        self._unit_bytes: list[int] = []  # each unit's padded parameters, gathered in full
        self._fsdp_units: list[Any] = []  # the FSDPModules, the root last
        self._fsdp_params: list[Any] | None = None  # their FSDPParams, for held() (listed at its first call)
        self._reduce_scatters: list[CommReduceScatter] = []
        self._all_gathers: list[CommAllGather] = []
        self._sharded_bytes = 0  # what one rank stores of them
        self._world_size = 1
        self._param_names: list[str] = []  # the optimizer's parameters, in its own order
        self._evaluated = False  # forwards without grad ran since the last training forward
        self._first_forward: FirstForwardCheck | None = None  # same units and parameters on every rank

    def wrap(self, model: nn.Module) -> nn.Module:
        # fully_shard keeps each rank's own slice of its local tensors; it does not make them equal.
        self.comm.broadcast_parameters(model)
        device = next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device
        mesh = self.device_mesh(device)
        self._world_size = mesh.size()  # the ranks that split each unit
        # 16-bit parameters (trainer.param_dtype): FSDP2's own policy. The sharded parameters it
        # registers are the fp32 master copy the optimizer steps (the 16-bit values, exactly); each
        # unit is gathered in 16 bits, its gradients reduce-scattered in trainer.reduce_dtype and kept
        # as fp32 shards.
        compute = next(p.dtype for p in model.parameters())
        policy = MixedPrecisionPolicy()
        if compute in SIXTEEN_BITS:
            cast_parameters(model, torch.float32)
            policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=self.comm.reduce_dtype or compute)
        gathered = compute if compute in SIXTEEN_BITS else None
        layers, rest = choose_units(model, self.wrap_policy)
        self._wrapped = resolve(model, self.wrap_policy)
        recurse = self._wrapped == "block"
        owners = {id(p): (m, n) for m in model.modules() for n, p in m.named_parameters(recurse=False)}
        units = [list(m.parameters(recurse=recurse)) for m in layers] + [rest]
        self._unit_bytes = [b for b in unit_bytes(units, self._world_size, gathered) if b]
        self._sharded_bytes = sum(padded_numel(p.shape, self._world_size) * p.element_size() for u in units for p in u)
        self._sharded_bytes //= self._world_size
        usage = expected_usage(model, layers, owners, recurse)  # names, while the parameters are the plain ones
        names = {id(m): name for name, m in model.named_modules()}
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        # The root follows torch's own rule: left to its default (None), FSDP2 keeps the root's
        # parameters gathered after forward (backward needs them at once); false is false.
        root_reshard = None if self.reshard_after_forward else False
        fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=policy)
        self._fsdp_units = [*layers, model]
        self.comm.holds(self._fsdp_holds)  # what FSDP2 allocates beside the registered shards
        for unit in self._fsdp_units:  # every unit's collectives through self.comm
            assert isinstance(unit, FSDPModule)
            self.connect(unit, names[id(unit)] or "root")
        # Runs before FSDP's own pre-forward hook on the root (prepend), so it sees every unit
        # as the forward finds it.
        model.register_forward_pre_hook(self._before_forward, prepend=True)
        if dist.get_world_size() > 1:
            self._first_forward = FirstForwardCheck(model, *usage, self.comm, self.find_unused_parameters)
        return model  # sharded in place: the trainer's model and the forward module are one object

    def device_mesh(self, device: torch.device) -> DeviceMesh:
        """The ranks that split every unit: all of them."""
        return init_device_mesh(device.type, (dist.get_world_size(),))

    def connect(self, unit: FSDPModule, label: str) -> None:
        """Hand a unit's all-gathers and reduce-scatters to self.comm (torch's custom-collective hooks)."""
        self._all_gathers.append(CommAllGather(self.comm, label))
        unit.set_custom_all_gather(self._all_gathers[-1])
        self._reduce_scatters.append(CommReduceScatter(self.comm, label))
        unit.set_custom_reduce_scatter(self._reduce_scatters[-1])

    def shards(self, world_size: int) -> int:
        """How many ranks split each unit at this world size (for the memory predictor)."""
        return world_size

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
        """Starts a training step's forward clean after an evaluation.

        FSDP2 records each forward's units for its backward prefetch, and only a backward clears the
        record: evaluation's forwards (no grad) leave stale entries that make the next backward
        prefetch a unit it has already resharded (a wasted all-gather, a unit left gathered), and
        leave the root (every unit, with reshard_after_forward=false) gathered. reset_iter_state
        clears the record and reshards everything (no step is in flight between steps).
        """
        if not torch.is_grad_enabled():
            self._evaluated = True
        elif self._evaluated:
            assert isinstance(module, FSDPModule)
            module.reset_iter_state()
            self._evaluated = False

    def facts(self) -> dict[str, Any]:
        if not self._unit_bytes:
            return {}
        units = {"num_units": len(self._unit_bytes), "unit_bytes": self._unit_bytes}  # each gathered in full (padded)
        return {"wrap_in_use": self._wrapped, **units, "sharded_bytes_per_rank": self._sharded_bytes}

    def footprint(self, plan: Plan) -> Footprint:
        """Each parameter's and gradient's dim-0 shard; in forward the root and the unit computing
        gathered, in backward the root and two units (the one computing, or its gradients flattened
        to be reduce-scattered, and the next, prefetched; every unit with reshard_after_forward=false);
        a unit's unsharded gradients until reduced, beside the shards of those reduced before it (every
        unit's while micro-batches accumulate), the root's last. One rank: FSDP2 still copies each
        unit whole for its turn, but reduces nothing (the gradient it computes is the shard's)."""
        n = self.shards(plan.world_size)
        compute, reduce = (plan.param_dtype, plan.reduce_dtype) if plan.param_dtype in SIXTEEN_BITS else (None, None)
        units = unit_parameters(plan.model, self.wrap_policy)
        trained = [[p for p in unit if p.requires_grad] for unit in units]
        *gathered, root = unit_bytes(units, n, compute)
        *reduced, root_reduced = unit_bytes(trained, n, reduce)
        *grads, root_grads = [sum(p.numel() * (compute or p.dtype).itemsize for p in unit) for unit in trained]
        size = torch.float32.itemsize if compute else None  # 16-bit parameters: the shards are the fp32 copy
        shard = lambda params: tuple(padded_numel(p.shape, n) // n * (size or p.element_size()) for p in params)  # noqa: E731
        shards = [sum(shard(unit)) for unit in trained]
        # Backward reduces the last unit first, the root (an embedding's gradients complete last) after
        # every block: a unit's full gradients, flattened for its reduce-scatter, beside the shards of
        # the units reduced before it (zero_grad(set_to_none) left none from the last step).
        # At its launch the shard its sum lands in exists too (reduced / n).
        reducing = [sum(shards[u + 1 : -1]) + reduced[u] + reduced[u] // n for u in range(len(reduced))]
        grads_held = [
            Held("gradients", (max(reducing, default=0),), 0, ("backward",)),
            Held("gradients", (sum(shards[:-1]) + root_reduced + root_reduced // n,), 0, ("after",)),
        ]
        if plan.accumulating:  # every unit's unsharded gradients, kept from micro-batch to micro-batch
            grads_held = [Held("gradients", shard(plan.trainable)), Held("gradients", (*grads, root_grads))]
        if n == 1:
            grads_held, reduced, root_reduced = [Held("gradients", shard(plan.trainable))], [0] * len(reduced), 0
        held = [
            Held("parameters", shard(plan.model.parameters())),
            *grads_held,
            Held("comm_buffers", (root,), 0, ("forward", "backward")),
            Held("comm_buffers", (forward_buffers(gathered, self.reshard_after_forward),), 0, ("forward",)),
            Held("comm_buffers", (backward_buffers(gathered, reduced, self.reshard_after_forward),), 0, ("backward",)),
            Held("comm_buffers", (root_reduced,), 0, ("after",)),
        ]
        return Footprint(tuple(held), tuple(padded_numel(p.shape, n) // n for p in plan.trainable))

    def _fsdp_holds(self) -> dict[str, int]:
        """FSDP2's unsharded parameters of the units gathered now (and their all-gather buffers), the
        flat gradients being reduce-scattered, and the full gradients until then: outside the
        model's registered DTensors, allocated by FSDP2 (declared in wrap())."""
        flat = [t for rs in self._reduce_scatters for t in rs.inputs] + [
            t for ag in self._all_gathers for t in ag.outputs
        ]
        buffers = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in flat}
        # the full gradients of the unit being reduced: FSDP2 took them off .grad, but holds them until
        # its copy into the flat input returns (counted at that input's size); and the shard its sum lands in
        reducing = [t for rs in self._reduce_scatters if rs.reducing is not None for t in rs.reducing]
        grads = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in reducing}
        if self._fsdp_params is None:  # listed once: looking up a unit's FSDP state costs µs per unit
            groups = [unit._get_fsdp_state()._fsdp_param_group for unit in self._fsdp_units]  # torch 2.14's FSDP2
            self._fsdp_params = [param for group in groups if group is not None for param in group.fsdp_params]
        for param in self._fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)
            for tensor in [*param.all_gather_outputs, *([unsharded] if unsharded is not None else [])]:
                storage = tensor.untyped_storage()
                buffers[storage._cdata] = storage.nbytes()
            if unsharded is not None and unsharded.grad is not None:
                storage = unsharded.grad.untyped_storage()
                grads[storage._cdata] = storage.nbytes()
        return {"comm_buffers": sum(buffers.values()), "gradients": sum(grads.values())}

    def schedule(self) -> Schedule:
        """Each unit all_gathered before its forward (and its backward, if freed after the forward), its
        gradients reduce_scattered after its backward; the optimizer steps this rank's shard."""
        units = ShardedUnits(self.wrap_policy, reshard_after_forward=self.reshard_after_forward)
        return Schedule(units, optimizer_shard="world")
