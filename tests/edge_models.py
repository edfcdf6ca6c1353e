"""Small models at the edges of the equivalence promise (float64), and the 2-rank case runner.

Tied: an nn.ModuleList of blocks between an embedding and a head that share one weight (a GPT's
shape). Reused: a layer applied twice under checkpointing, and once more outside it. Branchy: a
branch that some ranks (or none) use. Gated: the branch inside a block that every rank runs. Each
case trains 3 AdamW steps (weight decay 0.1) on 2 gloo ranks x 4 samples; the reference trains one
process on the same 8 samples, its loss the mean of the ranks' losses (what averaging the ranks'
gradients computes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.errors import ConfigError
from trainer.sync.base import SyncStrategy

STEPS, PER_RANK, WORLD = 3, 4, 2
VOCAB, DIM, LEN = 11, 8, 5


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h)).flatten(0, 1)


class Reused(nn.Module):
    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(6, DIM)
        self.shared = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 3)
        self.reentrant = reentrant
        self.extra = False  # one more checkpointed use of the shared layer: the graph changed

    def _layer(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = checkpoint(self._layer, h, use_reentrant=self.reentrant)
        h = checkpoint(self._layer, h, use_reentrant=self.reentrant)
        if self.extra:
            h = checkpoint(self._layer, h, use_reentrant=self.reentrant)
        return self.out(self._layer(h))  # the same weight outside a checkpoint too


class Branchy(nn.Module):
    def __init__(self, last: bool = False) -> None:
        super().__init__()
        self.last = last  # the branch after the output layer: the last unit a rank runs
        self.trunk = nn.Linear(6, DIM)
        self.branch = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 3)
        self.use_branch = False  # set per rank by the case

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if self.last:
            y = self.out(h)
            return y + self.out(self.branch(h)) if self.use_branch else y
        if self.use_branch:
            h = h + self.branch(h.to(self.branch.weight.dtype)).to(h.dtype)
        return self.out(h)


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(DIM, DIM)
        self.branch = nn.Linear(DIM, DIM)
        self.use_branch = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.main(h))
        return y + self.branch(h) if self.use_branch else y


class Gated(nn.Module):
    """Four blocks (zero stage 3's units under wrap=block) that every rank runs; block `gated` is
    gated: a rank that does not use the branch leaves out the block's branch layer (some of the
    block's parameters get a gradient), or with `discard` drops the whole block's output (none does).
    Two blocks before it: backward gathers one while reducing the next (prefetch 1)."""

    def __init__(self, discard: bool = False, gated: int = 2) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, DIM)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(4))
        self.out = nn.Linear(DIM, 3)
        self.discard, self.gated = discard, gated
        self.use_branch = False  # set per rank by the case

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        for i, block in enumerate(self.blocks):
            gated = i == self.gated and not self.use_branch
            block.use_branch = not gated or self.discard
            y = block(h)
            h = h if gated and self.discard else h + y
        return self.out(h)


class Frozen(nn.Module):
    """A frozen layer run twice without grad inside the training forward (a teacher's features)."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(6, 6).requires_grad_(False)
        self.student = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.teacher(torch.tanh(self.teacher(x)))
        return self.student(features)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "tied": Tied,
    "reused": Reused,
    "reused-nonreentrant": partial(Reused, reentrant=False),
    "branchy": Branchy,
    "branchy-mixed": Branchy,
    "branchy-last": partial(Branchy, last=True),
    "gated": Gated,
    "gated-discard": partial(Gated, discard=True),
    "gated-first-discard": partial(Gated, discard=True, gated=0),  # the last unit backward reaches
    "frozen": Frozen,  # a dtype boundary: the branch is float32 in a float64 model
}


@dataclass
class Case:
    model: str
    strategy: Callable[[], SyncStrategy]
    branch_ranks: tuple[int, ...] = ()  # the ranks whose forward uses Branchy's branch
    plain_zero_grad: bool = False  # optimizer.zero_grad() instead of sync.zero_grad
    replicas: bool = True  # every rank ends with the same parameters
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Per step (0-based), the ranks that use the branch: steps not listed use branch_ranks. A branch
    # unused by every rank in some steps (a mixture of experts' idle expert), or by some ranks.
    branch_steps: dict[int, tuple[int, ...]] = field(default_factory=dict)
    optimizer: str = "adamw"  # or "sgd" (momentum 0.9, weight decay 0.1)
    steps: int = STEPS

    def uses_branch(self, rank: int, step: int) -> bool:
        return rank in self.branch_steps.get(step, self.branch_ranks)


def make(model: str) -> nn.Module:
    torch.manual_seed(0)
    module = MODELS[model]().double()
    if isinstance(module, Branchy) and model.endswith("mixed"):
        module.branch.float()
    return module


def batch(model: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's 4 of the step's 8 samples."""
    gen = torch.Generator().manual_seed(100 + step)
    lo, hi = rank * PER_RANK, (rank + 1) * PER_RANK
    if model == "tied":
        x = torch.randint(VOCAB, (WORLD * PER_RANK, LEN), generator=gen)
        y = torch.randint(VOCAB, (WORLD * PER_RANK, LEN), generator=gen)
        return x[lo:hi], y[lo:hi].flatten()
    x = torch.randn(WORLD * PER_RANK, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(3, (WORLD * PER_RANK,), generator=gen)
    return x[lo:hi], y[lo:hi]


def optimizer_for(params: Any, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def reference(case: Case, ranks: tuple[int, ...] = (0, 1)) -> dict[str, torch.Tensor]:
    """One process, the ranks' samples together: each rank's loss with its own branch flag, averaged."""
    model = make(case.model)
    optimizer = optimizer_for(model.parameters(), case.optimizer)
    for step in range(case.steps):
        losses = []
        for rank in ranks:
            if isinstance(model, (Branchy, Gated)):
                model.use_branch = case.uses_branch(rank, step)
            x, y = batch(case.model, step, rank)
            losses.append(F.cross_entropy(model(x), y))
        (sum(losses) / len(losses)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank: int, case: Case, alone: bool = False) -> dict[str, Any]:
    """One case on this rank: its full parameters at the end (rank 0 for sharded ones), or the refusal.
    alone: a refusal may come on this rank only (its peers wait in a collective): no barrier after it."""
    model = make(case.model)
    sync = case.strategy()
    step = -1  # a refusal in wrap() or build_optimizer(): before the first step
    try:
        module = sync.wrap(model)
        optimizer = sync.build_optimizer(model, partial(optimizer_for, kind=case.optimizer))
        for step in range(case.steps):
            if isinstance(model, (Branchy, Gated)):
                model.use_branch = case.uses_branch(rank, step)
            x, y = batch(case.model, step, rank)
            F.cross_entropy(module(x), y).backward()
            sync.after_backward(module)
            sync.optimizer_step(optimizer)
            if case.plain_zero_grad:
                optimizer.zero_grad()
            else:
                sync.zero_grad(optimizer)
        state, _ = sync.checkpointing.state_dicts(model, optimizer)
    except ConfigError as err:
        if not alone:
            dist.barrier()
        return {"error": str(err), "step": step}
    return {"params": {k: v.detach().clone() for k, v in state.items()}}
