"""The collectives of zero stage 3 and fsdp, pinned on a model whose root unit holds parameters.

The counts elsewhere are pinned on a model whose root unit holds nothing, where an extra gather of
the root, or a prefetch that no longer runs, changes nothing that is counted. Here the tied model
(tests/edge_models.py: an embedding shared with the head, and a norm, in the root; two blocks as
units, wrap=block): per sampled step, the root is gathered once (FSDP2 and zero keep it gathered
from its forward to its backward), each block twice (forward and backward), every unit reduced
once; and with zero's prefetch, each block's gather is already in flight when the unit before it
starts, in forward and in backward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch.nn.functional as F

from tests.dist_helpers import run_on_ranks
from tests.edge_models import batch, make, optimizer_for
from tests.observe_helpers import sampled, sent
from tests.sync_helpers import from_yaml
from trainer.sync.zero3 import Zero3Sync

BLOCKS = 2  # Tied's blocks: the units besides the root
STRATEGIES = {
    "fsdp": partial(from_yaml, "fsdp", wrap="block"),
    "zero3": partial(from_yaml, "zero", stage=3, wrap="block"),
    "zero3-no-prefetch": partial(from_yaml, "zero", stage=3, wrap="block", prefetch=0),
}


def _steps(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, strategy in STRATEGIES.items():
        model = make("tied")
        sync = strategy()
        module = sync.wrap(model)
        optimizer = sync.build_optimizer(model, optimizer_for)
        ahead: list[tuple[str, int, bool]] = []  # (pass, block, the next unit's gather in flight when it starts)
        if isinstance(sync, Zero3Sync):
            units = sync._units
            for b in range(BLOCKS):  # after zero's own pre-hook: has it started the next unit's gather?
                nxt = b + 1 if b + 1 < BLOCKS else None
                units[b].register_forward_pre_hook(partial(_forward_probe, sync, ahead, b, nxt))
            sync._before_backward = partial(_backward_probe, sync, sync._before_backward, ahead)  # type: ignore[method-assign]
        rows = []
        for step in range(3):
            if step == 2:  # the third step watched (steps 1-2 learn the order)
                ahead.clear()
            with sampled(sync) as row:
                x, y = batch("tied", step, rank)
                F.cross_entropy(module(x), y).backward()
                sync.after_backward(module)
                sync.optimizer_step(optimizer)
                sync.zero_grad(optimizer)
            rows.append(row)
        out[name] = {"rows": rows, "ahead": ahead, "units": len(getattr(sync, "_units", []))}
    return out


def _started(sync: Zero3Sync, unit: int) -> bool:
    return unit in sync._gathers or unit in sync._gathered


def _forward_probe(sync: Zero3Sync, ahead: list[tuple[str, int, bool]], b: int, nxt: int | None, *_: Any) -> None:
    ahead.append(("forward", b, nxt is None or _started(sync, nxt)))


def _backward_probe(sync: Zero3Sync, before_backward: Any, ahead: list[tuple[str, int, bool]], u: int) -> None:
    """zero's own _before_backward, then: is the unit backward meets next already on its way?"""
    fresh = u not in sync._in_backward
    before_backward(u)
    order = sync._backward_gathers
    if fresh and u in order and order.index(u) + 1 < len(order):
        ahead.append(("backward", u, _started(sync, order[order.index(u) + 1])))


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_steps, 2, tmp_path_factory.mktemp("root_unit") / "run")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_root_is_gathered_once_and_each_block_twice(steps: list[dict[str, Any]], name: str) -> None:
    for rank in steps:
        row = rank[name]["rows"][-1]
        kinds = sent(row)
        gathers = BLOCKS * 2 + 1  # each block in forward and backward, the root once
        if name == "fsdp":
            assert kinds["all_gather"][1] == gathers and kinds["reduce_scatter"][1] == BLOCKS + 1, kinds
        else:  # gloo: a gather is a broadcast per rank, a reduction an all_reduce
            assert kinds["broadcast"][1] == 2 * gathers and kinds["all_reduce"][1] == BLOCKS + 1, kinds


def test_zeros_prefetch_starts_the_next_block_before_it_is_needed(steps: list[dict[str, Any]]) -> None:
    for rank in steps:
        with_prefetch = rank["zero3"]["ahead"]
        assert {kind for kind, _, _ in with_prefetch} == {"forward", "backward"}, with_prefetch
        assert all(started for _, _, started in with_prefetch), with_prefetch
        without = rank["zero3-no-prefetch"]["ahead"]
        assert not all(started for _, _, started in without), without  # the probe sees the difference
