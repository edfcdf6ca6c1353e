"""The interface every gradient-sync strategy implements: the calls the trainer makes, in its order.

Before any process group exists (the launcher's check and every rank's):

    sync.check_world_size(world_size)          # a layout this many ranks cannot form: ConfigError
    sync.refuses(settings)                     # trainer settings it cannot train with: why, or None

Set-up, then each step (k = grad_accum_steps):

    model = sync.wrap(model)                   # every replica starts equal
    optimizer = sync.build_optimizer(model, factory)   # a sharded strategy's steps its shard
    for each of the first k-1 micro-batches:  with sync.no_sync(model): forward; backward
    last micro-batch:                          forward; backward
    sync.after_backward(model)                 # the gradients the optimizer reads are averaged
    sync.optimizer_step(optimizer)             # optimizer.step(), plus what sharding needs after it
    sync.zero_grad(optimizer)
    sync.after_step()                          # bucket_cap_mb=auto's trials
    sync.wait_for_parameters()                 # only before reading the parameters outside a forward

Each method exists because the trainer cannot derive it: it is where the algorithms differ. What
follows from a strategy's flags is not asked of it: the global gradient norm and the clip
(trainer/sync/grads.py), the sync line (trainer/sync/describe.py). Checkpoints are an object beside
the strategy, `sync.checkpointing` (trainer/sync/checkpointing.py): they speak in the full,
unsharded model's terms, so a checkpoint looks the same whichever strategy wrote it, and only the
trainer's reliability code reads them. What a strategy holds beyond the model's and the
optimizer's tensors it declares where it allocates it, in one line (`self.comm.holds(...)`, read
by the memory probe). Beyond the step's calls, three say what the algorithm is to the tools that
compare strategies: `facts()` (what it built, for the sync line), `footprint()` and `schedule()`
(what it would hold and send at any world size, for the memory predictor and the scaling model).
The last two describe the algorithm a second time, beside its code: nothing yet derives them
from running it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer

from trainer.comm_schedule import Schedule
from trainer.core import TrainSettings
from trainer.footprint import Footprint, Plan, replicated
from trainer.sync.autotune import CapTuner
from trainer.sync.checkpointing import Checkpointing
from trainer.sync.comm import Comm
from trainer.sync.master import Masters

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
    nothing: the observer (trainer/observer.py) watches its collectives. Its flags are what the
    trainer needs to know of its layout and cannot see from the outside:
    `keeps_replicas_equal`: every rank holds the same full parameters after each step (the replica
    check compares them; sync=none, and a strategy whose ranks hold parameter shards, set it False);
    `grads_sharded`: the gradients its optimizer reads are this rank's shard of the averaged
    gradient (zero, fsdp), so their global norm needs a reduction across ranks (`norm_copies`: the
    ranks holding each shard, which that reduction counts so often; hsdp's nodes);
    `gathers_parameters`: the model's parameters are full copies gathered per unit from the
    optimizer's shard (zero stage 3), which the memory probe counts as communication buffers.
    What it holds beyond the model's and the optimizer's tensors, and whether torch launches some of
    its collectives itself (DDP's reducer), it declares to `self.comm` where it allocates or builds
    them (`holds`, `torch_launches`).
    """

    name = ""  # its option in conf/sync/, for the sync line
    key_attributes: dict[str, str] = {}  # a key stored under another name (`wrap`, which is a method here)
    keeps_replicas_equal: bool = True  # the trainer's replica check applies
    grads_sharded: bool = False  # each rank's optimizer reads its own disjoint shard of the gradient
    norm_copies: int = 1  # grads_sharded: ranks holding each shard (the world's sum of squares counts it so often)
    gathers_parameters: bool = False  # the model's parameters are full copies gathered per unit, not the optimizer's
    tuner: CapTuner | None = None  # bucket_cap_mb=auto: tries caps, then rebuild() with the fastest

    def __init__(self) -> None:
        self.comm = Comm()  # the builder gives it the link and the observer before wrap()
        # 16-bit parameters (trainer.param_dtype): the fp32 copies build_optimizer() has the optimizer
        # step, for a strategy whose optimizer steps the model's parameters (trainer/sync/master.py)
        self.masters = Masters()
        # How its state goes into checkpoints and comes back (trainer/sync/checkpointing.py): read by
        # trainer/reliability/, never by the step. A sharding strategy replaces it with its own.
        self.checkpointing = Checkpointing(self.masters)

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Return the module the forward pass runs; every replica must start equal after this."""

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

    def zero_grad(self, optimizer: Optimizer) -> None:
        """After optimizer.step(): clear the gradients for the next step.

        Strategies whose gradients are views into persistent flat buffers zero the buffers instead,
        so that autograd keeps accumulating into them (set_to_none would drop the views).
        """
        optimizer.zero_grad(set_to_none=True)
        self.masters.zero_grad()

    def after_step(self) -> None:
        """The loop ends a step (every rank at the same point): bucket_cap_mb=auto's trials run here."""
        if self.tuner is not None:
            self.tuner.after_step()  # rebuilds the strategy's buckets when the cap changes

    def facts(self) -> dict[str, Any]:
        """What the algorithm built, for the sync line and summary.json (its buckets, its units)."""
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
