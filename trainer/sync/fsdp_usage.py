"""fsdp's first-forward check: every rank runs the same units and uses the same parameters.

FSDP2 all-gathers a unit's parameters when its forward starts and reduce-scatters the gradients of
the parameters that got one: collectives every rank must enter alike. A unit one rank skips (an
unused branch) or a parameter one rank leaves out pairs one rank's collective with another's
(gloo aborts the job, NCCL waits for its timeout, equal sizes would mix the wrong data). So, in
the first training forward only:

- before each unit's forward (ahead of FSDP2's all-gather) the ranks agree on which unit they
  are entering, in one small all_reduce; at the forward's end, that no rank has another unit left;
- at the forward's end, each rank walks the autograd graph from the outputs to the parameters it
  used (DDP's find_unused_parameters walk), and the ranks count the users of each in one
  all_reduce.

A unit whose forward also runs under reentrant activation checkpointing (its forward without grad
inside a training forward: torch.utils.checkpoint's use_reentrant=True) and more than once in the
forward gets its gradient reduce-scattered before all of it has arrived (one backward per
checkpoint: measured, a wrong model). It is refused too, counted in the same all_reduce; used
twice inside one checkpoint it would be exact, but the hooks cannot tell that case apart.

A difference is a ConfigError on every rank alike (the same all_reduce told them all), naming the
parameters, before any gradient collective. A parameter no rank used is fine (FSDP2 leaves it
without a gradient, as one process does). Then the hooks are removed: later steps pay nothing,
and a rank that drops a parameter only later is not caught (as DDP without find_unused_parameters):
its unit's collectives go unpaired. With every_step (sync.find_unused_parameters=true) the hooks
stay and every training forward is checked alike, for one small all_reduce per unit and one at
the forward's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from trainer.errors import ConfigError
from trainer.sync.comm import Comm
from trainer.sync.unused import refuse_missing

REMEDY = (
    "FSDP2's collectives need every rank to run the same units with the same parameters: use "
    "sync=ddp sync.find_unused_parameters=true (or manual/zero with sync.find_unused_parameters=true), "
    "or make every rank use them (a unit used on all ranks, its output multiplied by 0 where unwanted)"
)


class FirstForwardCheck:
    """Hooks on the units (the root last) for the first training forward; removed once it passed,
    unless every training forward is to be checked."""

    def __init__(
        self,
        root: nn.Module,
        units: Sequence[tuple[str, nn.Module, list[str]]],
        params: Sequence[tuple[str, nn.Module, str]],
        comm: Comm,
        every_step: bool = False,
    ) -> None:
        """units: (name, module, its parameters' names) of each non-root unit; params: (name, owning
        module, attribute) of every trainable parameter, where FSDP2 registers its unsharded tensor."""
        self.units = list(units)
        self.every_step = every_step
        self._forwards = 0  # training forwards checked
        self.comm = comm  # the strategy's: the ranks' agreements are counted as control traffic, on the link
        self.params = list(params)
        self._unsharded: dict[int, int] = {}  # id of an unsharded parameter -> index in params
        self._training = False  # inside a forward that started with grad enabled
        self._entered = [0] * len(self.units)  # times each unit's forward ran in it
        # A frozen unit run twice without grad (a teacher under no_grad) reduces nothing: not refused.
        self._trainable = [any(p.requires_grad for p in m.parameters()) for _, m, _ in self.units]
        self._without_grad: set[int] = set()  # units whose forward ran without grad in it (reentrant checkpoint)
        self._handles: list[RemovableHandle] = [root.register_forward_pre_hook(self._forward_starts, prepend=True)]
        # After fully_shard, prepended: these run before FSDP2's pre-forward (its all-gather) and
        # before its post-forward (its reshard, after which the unsharded tensors are unregistered).
        for index, (_, module, _) in enumerate(self.units):
            self._handles.append(module.register_forward_pre_hook(lambda *_, i=index: self._entering(i), prepend=True))
            self._handles.append(module.register_forward_hook(lambda *_: self._note_unsharded(), prepend=True))
        self._handles.append(root.register_forward_hook(self._forward_done, prepend=True))

    def _forward_starts(self, *_: Any) -> None:
        self._training = torch.is_grad_enabled()  # an evaluation's forward (no grad) is not checked
        if self._training:  # each training forward is checked on its own
            self._forwards += 1
            self._entered, self._without_grad, self._unsharded = [0] * len(self.units), set(), {}

    def _entering(self, index: int) -> None:
        if not self._training:
            return
        self._agree_on(index)  # FSDP2 all-gathers without grad too
        self._entered[index] += 1
        if not torch.is_grad_enabled():
            self._without_grad.add(index)

    def _agree_on(self, index: int) -> None:
        """Which unit each rank enters next (len(units): the forward's end): an error if they differ."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        at = torch.zeros(world_size, dtype=torch.int64, device=self._device())
        at[rank] = index
        self.comm.agree(at)  # each rank fills its own slot: every rank learns where every other is
        where = at.tolist()
        if len(set(where)) == 1:
            return
        self.remove()
        seen = "; ".join(f"rank {r}: {self._describe(i)}" for r, i in enumerate(where))
        raise ConfigError(
            f"sync=fsdp cannot train this model: in {self._which()} the ranks reached different FSDP "
            f"units ({seen}); a unit one rank skips leaves its parameters unused there. {REMEDY}"
        )

    def _which(self) -> str:
        return "the first training forward" if self._forwards == 1 else f"training forward {self._forwards}"

    def _describe(self, index: int) -> str:
        if index == len(self.units):
            return "the end of the forward"
        name, _, names = self.units[index]
        shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"unit {name!r} (parameters {shown})"

    def _note_unsharded(self) -> None:
        """The unsharded tensors registered while a unit's forward runs: what the graph holds."""
        for index, (_, owner, attr) in enumerate(self.params):
            tensor = getattr(owner, attr, None)
            if tensor is not None and not isinstance(tensor, DTensor):
                self._unsharded[id(tensor)] = index

    def _forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._training:
            return
        self._training = False  # a forward run inside this one's hooks is not a new training forward
        self._agree_on(len(self.units))
        self._note_unsharded()  # the root's own parameters
        used = [False] * len(self.params)
        for leaf in graph_leaves(tensors_in(output)):
            index = self._unsharded.get(id(leaf))
            if index is not None:
                used[index] = True
        reentrant = [i in self._without_grad and n > 1 and self._trainable[i] for i, n in enumerate(self._entered)]
        counts = torch.tensor(used + reentrant, dtype=torch.int32, device=self._device())
        self.comm.agree(counts)  # per parameter: on how many ranks used; per unit: how many saw it reentrant
        if not self.every_step:
            self.remove()
        world_size = dist.get_world_size()
        per_param, per_unit = counts.tolist()[: len(used)], counts.tolist()[len(used) :]
        twice = [self._describe(i) for i, n in enumerate(per_unit) if n]
        if twice:
            raise ConfigError(
                f"sync=fsdp cannot train this model: {'; '.join(twice)} ran without grad inside the training "
                "forward, as under reentrant activation checkpointing (torch.utils.checkpoint with "
                "use_reentrant=True), and more than once in it; under reentrant checkpointing FSDP2 would "
                "reduce-scatter its gradient before all of it arrived (a wrong model). Use "
                "use_reentrant=False (PyTorch's recommended form), or sync.wrap=block with the layer outside "
                "the blocks (the root unit reduces once, after the whole backward)"
            )
        # The rule of trainer/sync/unused.py; a parameter no rank used is fine here (FSDP2 leaves it
        # without a gradient, as one process does), so it counts as used everywhere.
        used_on = [n or world_size for n in per_param]
        refuse_missing(used_on, [name for name, _, _ in self.params], "fsdp", REMEDY, self._which())

    def _device(self) -> torch.device:
        owner, attr = self.params[0][1:] if self.params else (None, "")
        tensor = getattr(owner, attr, None) if owner is not None else None
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        return tensor.device if tensor is not None else torch.device("cpu")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._unsharded = {}


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def graph_leaves(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors (parameters) the outputs' autograd graph accumulates gradients into."""
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[Any] = set()
    leaves = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return leaves


def expected_usage(
    model: nn.Module, layers: list[nn.Module], owners: dict[int, tuple[nn.Module, str]], recurse: bool
) -> tuple[list[tuple[str, nn.Module, list[str]]], list[tuple[str, nn.Module, str]]]:
    """FirstForwardCheck's units (name, module, parameter names) and parameters (name, owner, attribute)."""
    names = {id(p): name for name, p in model.named_parameters()}  # a tied parameter: its first name
    module_names = {id(m): name for name, m in model.named_modules()}
    units = [(module_names[id(m)], m, [names[id(p)] for p in m.parameters(recurse=recurse)]) for m in layers]
    params = [(names[id(p)], *owners[id(p)]) for p in model.parameters() if p.requires_grad]
    return units, params
