"""The interface every gradient-sync strategy implements; the trainer calls nothing else.

A step, as the trainer runs it (k = grad_accum_steps):

    for each of the first k-1 micro-batches:  with sync.no_sync(model): forward; backward
    last micro-batch:                          forward; backward
    sync.after_backward(model)                 # gradients are now equal on every rank
    sync.optimizer_step(optimizer)             # optimizer.step(), plus what sharding needs after it
    sync.zero_grad(optimizer)

The optimizer comes from build_optimizer (a sharded strategy's optimizer holds only its shard),
and checkpoints go through state_dicts / load_state_dicts, which always speak in the full,
unsharded model's terms: a checkpoint looks the same whichever strategy wrote it.
"""

from __future__ import annotations

import math
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer.comm_schedule import Schedule
from trainer.core import TrainSettings
from trainer.footprint import Footprint, Plan, replicated
from trainer.sync.autotune import CapTuner
from trainer.sync.comm import Comm
from trainer.sync.master import Masters
from trainer.sync.sharded_state import Read, load_state_parts, state_parts

OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]
WeightDecayOn = Literal["all", "matrices"]


class DecayGroups:
    """An optimizer factory that puts weight decay where optim.weight_decay_on says.

    `all`: one group, torch's default. `matrices` (nanoGPT's rule): parameters with two or more
    dimensions (weights, embeddings) decay; biases and normalisation scales do not (a second
    group with weight_decay 0). A strategy that hands the optimizer something else than the
    model's parameters (zero's flat shard) asks for the groups and builds one piece per group.
    """

    def __init__(self, build: Callable[..., Optimizer], weight_decay_on: WeightDecayOn = "all") -> None:
        self.build, self.weight_decay_on = build, weight_decay_on

    def groups(self, params: Iterable[nn.Parameter]) -> list[tuple[list[nn.Parameter], bool]]:
        """(parameters, whether they decay), in order, empty groups left out."""
        params = list(params)
        if self.weight_decay_on == "all":
            return [(params, True)]
        split = [([p for p in params if p.dim() >= 2], True), ([p for p in params if p.dim() < 2], False)]
        return [(group, decays) for group, decays in split if group]

    def build_groups(self, groups: Sequence[tuple[Sequence[torch.Tensor], bool]]) -> Optimizer:
        """The optimizer over these groups (one group: torch's plain parameter list, as without groups)."""
        if self.weight_decay_on == "all":
            ((params, _),) = groups
            return self.build(list(params))
        return self.build(
            [{"params": list(ps)} if decays else {"params": list(ps), "weight_decay": 0.0} for ps, decays in groups]
        )

    def __call__(self, params: Iterable[nn.Parameter]) -> Optimizer:
        return self.build_groups(self.groups(params))


class SyncStrategy(ABC):
    """How the replicas' gradients become one averaged gradient.

    A strategy sends every collective through `self.comm` (trainer/sync/comm.py) and measures
    nothing: the observer (trainer/observer.py) watches its collectives, and reads the facts it
    states (`facts()`, `held()`). `keeps_replicas_equal` says every rank holds the same full
    parameters after each step (the trainer's replica check compares them; a strategy whose ranks
    hold shards sets it False). `grads_sharded` says the gradients its optimizer reads are this
    rank's shard of the averaged gradient (zero, fsdp), so their global norm needs a reduction
    across ranks (`norm_copies`: how many times that reduction counts each element, hsdp's once per
    node). `trains_one_model` says the ranks train one model between them (False for
    sync=none, where each trains its own): only then does a checkpoint continue at another world size.
    """

    name = ""  # its option in conf/sync/, for the sync line
    key_attributes: dict[str, str] = {}  # a key stored under another name (`wrap`, which is a method here)
    keeps_replicas_equal: bool = True  # the trainer's replica check applies
    grads_sharded: bool = False  # each rank's optimizer reads its own disjoint shard of the gradient
    norm_copies: int = 1  # grads_sharded: ranks holding each shard (the world's sum of squares counts it so often)
    gathers_parameters: bool = False  # the model's parameters are full copies gathered per unit, not the optimizer's
    trains_one_model: bool = True  # the ranks train one model (sync=none: one each)
    torch_collectives: bool = False  # torch launches some of its collectives from C++, past self.comm (DDP's reducer)
    tuner: CapTuner | None = None  # bucket_cap_mb=auto: tries caps, then rebuild() with the fastest

    def __init__(self) -> None:
        self.comm = Comm()  # the builder gives it the link and the observer before wrap()
        # 16-bit parameters (trainer.param_dtype): the fp32 copies build_optimizer() has the optimizer
        # step, for a strategy whose optimizer steps the model's parameters (trainer/sync/master.py)
        self.masters = Masters()

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Return the module the forward pass runs; every replica must start equal after this."""

    def check_device(self, device: torch.device) -> None:
        """Refuse (ConfigError) options this device cannot run; called before any process group exists."""

    def refuses(self, settings: TrainSettings) -> str | None:
        """Why this strategy cannot run with these trainer settings (one line naming the key and
        what is accepted), or None; asked before any process group exists."""
        return None

    def check_world_size(self, world_size: int) -> None:
        """Refuse (ConfigError, one line naming the keys) a layout this many ranks cannot form; asked
        before any process group exists, by precheck (the launcher, every rank) and by the builder."""

    def build_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> Optimizer:
        """The optimizer over what this rank updates, after wrap(): by default every parameter (a
        16-bit one's fp32 copy)."""
        return factory(self.masters.stepped(model.parameters()))

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Context for micro-batches whose gradients must only accumulate locally."""
        return nullcontext()

    def after_backward(self, model: nn.Module) -> None:
        """Runs after the last micro-batch's backward, before optimizer.step()."""

    def optimizer_step(self, optimizer: Optimizer) -> None:
        """The optimizer step on the averaged gradients (ZeRO then gathers the updated shards; 16-bit
        parameters are rounded from their stepped fp32 copies)."""
        optimizer.step()
        self.masters.refresh()

    def wait_for_parameters(self) -> None:
        """Wait for whatever this strategy still writes into the parameters (zero's gathers after
        the optimizer step, which it waits for only before the next forward): the trainer calls it
        before it reads the parameters outside a forward (the replica check, a fault that nudges
        them, the end of train()). Cheap when nothing is in flight."""

    def grads_finite(self, model: nn.Module, optimizer: Optimizer) -> bool:
        """Whether the gradients the optimizer is about to use are finite: the same answer on every
        rank (trainer.on_nonfinite=skip skips the step everywhere or nowhere).

        After after_backward the full gradients are equal on every rank, so each rank answers
        alone; a strategy whose ranks hold different gradient shards must agree through a collective.
        """
        flags = [torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None]
        return bool(torch.stack(flags).all()) if flags else True

    def grad_norm(self, optimizer: Optimizer) -> torch.Tensor:
        """The global L2 norm of the averaged gradient optimizer_step is about to use: the same on every rank.

        Computed on what the optimizer reads. Replicated, that is the whole averaged gradient on
        every rank, and each rank answers alone. Sharded, each rank holds a disjoint piece: the
        sum of the pieces' squares is reduced once (a plain clip_grad_norm_ there would see only
        this rank's shard, or under zero stage 1 the unaveraged sums in the parameters' .grad).
        """
        grads = optimizer_grads(optimizer)
        device = optimizer.param_groups[0]["params"][0].device
        norm = total_norm(grads) if grads else torch.zeros((), device=device)
        if not self.grads_sharded:
            return norm
        squares = norm.to(torch.float32) ** 2
        self.comm.agree(squares)  # a control collective: a few bytes, not gradient traffic
        return squares.sqrt() if self.norm_copies == 1 else (squares / self.norm_copies).sqrt()

    def grad_norm_later(self, optimizer: Optimizer) -> NormLater:
        """grad_norm(), for the row to finish on the host where nothing on the device needs it (the
        sampled step's norm, without a clip or a finite check): each gradient's norm where every
        rank holds the whole averaged gradient (two kernels fewer on the step); where the ranks
        hold shards, this rank's sum of squares with its agreement launched, waited for by the row
        (the step does not wait for the other ranks, which its unsampled steps never do)."""
        grads = optimizer_grads(optimizer)
        if not self.grads_sharded:
            return NormLater(norm_pieces(grads) if grads else [])
        device = optimizer.param_groups[0]["params"][0].device
        squares = (total_norm(grads) if grads else torch.zeros((), device=device)).to(torch.float32) ** 2
        return NormLater([], [squares], self.comm.agree_later(squares), self.norm_copies)

    def scale_grads(self, optimizer: Optimizer, factor: torch.Tensor) -> None:
        """Multiply the gradients optimizer_step is about to use by `factor` (a 0-dim tensor: no host sync)."""
        grads = optimizer_grads(optimizer)
        if grads:
            torch._foreach_mul_(grads, factor.to(grads[0].device))  # what clip_grad_norm_ itself does

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state_dict on every rank: a sharded tensor (fsdp's DTensor) gathered, so
        every rank must call it. For comparing models (tests, tools), not for checkpoints."""
        state = self.masters.model_state(model)  # 16-bit parameters: their fp32 copies
        return {name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in state.items()}

    def state_dicts(self, model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model state, optimizer state) of the full unsharded model, for a checkpoint.

        Every rank calls it (a sharded strategy gathers); only global rank 0's result is written,
        so other ranks may return empty dicts. 16-bit parameters: their fp32 copies' values.
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
        self,
        model: nn.Module,
        optimizer: Optimizer,
        saved: dict[str, Any],
        read: Read,
        groups: list[dict[str, Any]],
    ) -> None:
        """Load this rank's part of a sharded checkpoint, at any world size: lay out what this rank
        holds from `saved` (the checkpoint's metadata by flat key), `read` fills it (a collective)."""
        load_state_parts(model, optimizer, saved, read, groups, self.masters)

    def zero_grad(self, optimizer: Optimizer) -> None:
        """After optimizer.step(): clear the gradients for the next step.

        Strategies whose gradients are views into persistent flat buffers zero the buffers instead,
        so that autograd keeps accumulating into them (set_to_none would drop the views).
        """
        optimizer.zero_grad(set_to_none=True)
        self.masters.zero_grad()

    def rebuild(self, cap_mb: float) -> None:
        """Remake the buckets with this cap (bucket_cap_mb=auto's tuner calls it between steps)."""
        raise NotImplementedError(f"sync={self.name} has no bucket cap to tune")

    def after_step(self) -> None:
        """The loop ends a step (every rank at the same point): bucket_cap_mb=auto's trials run here."""
        if self.tuner is not None:
            cap_mb = self.tuner.after_step()
            if cap_mb is not None:  # every rank at the same step; the step's communication is done
                self.rebuild(cap_mb)

    def facts(self) -> dict[str, Any]:
        """What the algorithm built, for the sync line and summary.json (its buckets, its units)."""
        return {}

    def held(self) -> dict[str, int]:
        """Bytes this strategy holds now, by kind of memory, beyond what the model's parameters and
        gradients and the optimizer's parameters and state show (`comm_buffers`: a bucket being
        reduced, DDP's reducer buckets, gathered units; `gradients`: full ones outside any .grad);
        the observer asks on the sampled step."""
        return {}

    def footprint(self, plan: Plan) -> Footprint:
        """What this rank keeps, by kind, for the memory predictor (trainer/footprint.py's words,
        trainer/scaling/memory.py's arithmetic): by default a replica's, every parameter and its .grad."""
        return replicated(plan)

    def schedule(self) -> Schedule:
        """What one step sends and when, for the scaling model (trainer/comm_schedule.py's words,
        trainer/scaling/predict.py's arithmetic): its buckets or units, each collective and its group.
        No default: a guess would be predicted as if it were the strategy's own algorithm."""
        raise NotImplementedError(f"sync={self.name} does not say what its step sends (SyncStrategy.schedule)")

    def describe(self) -> dict[str, Any]:
        """The sync line: the strategy's name, the keys it was built with (its constructor's
        parameters, read back; a key named after an option of another key, `auto_*` or
        `powersgd_*`, only while that option is chosen), the tuner's trials, the facts of what it built."""
        hints = typing.get_type_hints(type(self).__init__)
        options = {key: _literals(hint) for key, hint in hints.items()}
        values = {k: getattr(self, self.key_attributes.get(k, k)) for k in hints if k != "return"}
        info: dict[str, Any] = {"strategy": self.name}
        for key, value in values.items():
            prefix = key.split("_")[0]
            chooser = next((k for k, choices in options.items() if prefix in choices and k != key), None)
            if chooser is None or values[chooser] == prefix:
                info[key] = value
        if self.tuner is not None:
            info |= self.tuner.describe()
        return info | self.facts()

    def settled(self) -> bool:
        """Whether describe()'s layout is final: the run's `sync:` line waits for it (bucket_cap_mb=auto
        is still trying caps before that)."""
        return self.tuner is None or self.tuner.done


def _literals(hint: Any) -> set[Any]:
    """The values a type hint's Literal parts allow (float | Literal["auto"]: {"auto"})."""
    if typing.get_origin(hint) is Literal:
        return set(typing.get_args(hint))
    return set().union(*(_literals(arg) for arg in typing.get_args(hint)))


@dataclass
class NormLater:
    """A gradient norm left for the host to finish: sqrt((sum of norms² + sum of squares) / copies),
    once `pending` (the squares' agreement across ranks) is waited for."""

    norms: list[torch.Tensor]
    squares: list[torch.Tensor] = field(default_factory=list)
    pending: dist.Work | None = None
    copies: int = 1

    def finish(self, norms: list[float], squares: list[float]) -> float:
        """The norm from the values of `norms` and `squares`, read on the host."""
        if not squares and self.copies == 1:
            return math.hypot(*norms)  # one norm: itself, exactly
        return math.sqrt((sum(n * n for n in norms) + sum(squares)) / self.copies)


def norm_pieces(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-dim tensors whose root-sum-of-squares is the L2 norm of all these tensors together: each
    one's norm, in one foreach call where they share a device (torch's get_total_norm groups them
    in Python first), else the total itself."""
    if len({t.device for t in tensors}) > 1:
        return [torch.nn.utils.get_total_norm(tensors)]
    return list(torch._foreach_norm(tensors))


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all these tensors together, as torch.nn.utils.get_total_norm computes it."""
    pieces = norm_pieces(tensors)
    return pieces[0] if len(pieces) == 1 else torch.linalg.vector_norm(torch.stack(pieces))


def optimizer_grads(optimizer: Optimizer) -> list[torch.Tensor]:
    """The gradients the optimizer reads, as plain tensors (a DTensor's local shard)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    # A DTensor's _local_tensor is what to_local() returns a view of, without its autograd Function (µs each).
    return [g if type(g) is torch.Tensor else getattr(g, "_local_tensor", g) for g in grads]
