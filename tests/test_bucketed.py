"""sync=bucketed's mechanism on real gloo ranks: buckets start during backward, views, no_sync, timing."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_helpers import run_on_ranks
from tests.observe_helpers import sampled
from tests.sync_helpers import from_yaml
from trainer.measures import KINDS
from trainer.sync.describe import describe


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _backward(model: nn.Module, rank: int) -> None:
    torch.manual_seed(100 + rank)  # each rank its own data
    F.cross_entropy(model(torch.randn(6, 8)), torch.randint(0, 4, (6,))).backward()


def _mechanism(rank: int, world_size: int, collective: str, timed: bool = True) -> dict[str, Any]:
    sync = from_yaml("bucketed", bucket_cap_mb=300 / 2**20, collective=collective)  # ~300 B buckets
    model = sync.wrap(_model(seed=rank))  # rank 1's different draw is replaced by rank 0's
    buckets = describe(sync)["num_buckets"]
    # Step 1 learns each parameter's hook calls per backward: its buckets start in after_backward.
    _backward(model, rank)
    learning = len(sync._works)
    sync.after_backward(model)
    sync.zero_grad(torch.optim.SGD(model.parameters(), lr=0.1))
    reference = _model(seed=0)  # rank 0's weights, no sync: this rank's own gradients
    for _ in range(2):
        _backward(reference, rank)
    # Accumulation: inside no_sync the hooks start nothing.
    with sync.no_sync(model):
        _backward(model, rank)
    started_in_no_sync = len(sync._works)
    # How many buckets are already on their way when backward reaches the first layer (before any
    # of its gradients): buckets built last layer first leave while the earlier layers compute.
    in_flight_at_first_layer: list[int] = []
    probe = model[0].register_full_backward_pre_hook(lambda *_: in_flight_at_first_layer.append(len(sync._works)))
    # The observer samples this step (the loop samples 1 step in trainer.sample_every_n_steps), or none.
    with sampled(sync) if timed else nullcontext({}) as counts:
        _backward(model, rank)
        probe.remove()
        # Before after_backward: every bucket was launched while backward ran (and may already be
        # reduced in place by gloo's thread, so the buffers are not read here).
        started_by_hooks = len(sync._works)
        sync.after_backward(model)
    views = all(p.grad is v for b in sync._flat.buckets for p, v in zip(b.params, b.views, strict=True))  # type: ignore[union-attr]
    averaged = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    sync.zero_grad(torch.optim.SGD(model.parameters(), lr=0.1))
    return {
        "buckets": buckets,
        "learning": learning,
        "started_in_no_sync": started_in_no_sync,
        "started_by_hooks": started_by_hooks,
        "in_flight_at_first_layer": in_flight_at_first_layer[0],
        "local": [p.grad for p in reference.parameters()],
        "averaged": averaged,
        "views": views,
        "zeroed": all(p.grad is not None and not p.grad.any() for p in model.parameters()),
        "counts": counts,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _both(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """_mechanism with each collective on one pair of ranks (a spawn costs more than all three), and
    all_reduce once more untimed."""
    runs = {collective: _mechanism(rank, world_size, collective) for collective in ("all_reduce", "rs_ag")}
    return {**runs, "untimed": _mechanism(rank, world_size, "all_reduce", timed=False)}


@pytest.fixture(scope="module")
def mechanism(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    return run_on_ranks(_both, 2, tmp_path_factory.mktemp("bucketed") / "run")


def test_buckets_start_during_backward_and_average_in_place(mechanism: list[dict[str, dict[str, Any]]]) -> None:
    rank0, rank1 = (by_collective["all_reduce"] for by_collective in mechanism)
    for rank in (rank0, rank1):
        assert rank["buckets"] >= 3  # 5 of 6 gradient tensors are over 300 bytes: several buckets
        assert rank["learning"] == 0 and rank["started_in_no_sync"] == 0
        assert rank["started_by_hooks"] == rank["buckets"]  # every bucket left before after_backward
        assert rank["views"] and rank["zeroed"]
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"], strict=True))  # broadcast
    # Both micro-batches accumulated into the buffers, then the ranks' sums were averaged.
    for a, b, avg0, avg1 in zip(rank0["local"], rank1["local"], rank0["averaged"], rank1["averaged"], strict=True):
        assert torch.allclose(avg0, (a + b) / 2, atol=1e-6) and torch.equal(avg0, avg1)
    row = rank0["counts"]
    grad_bytes = sum(p.numel() * 4 for p in rank0["params"])  # on 2 ranks an all_reduce sends 2(2-1)/2 of it
    assert row["comm/bytes_per_step"] == grad_bytes == row["comm/all_reduce_bytes_per_step"]
    assert row["comm/all_reduce_per_step"] == rank0["buckets"]
    assert row["time/comm_s"] > 0 and 0 <= row["time/comm_exposed_s"] <= row["time/comm_s"] + 1e-3


def test_untimed_the_same_buckets_leave_and_nothing_is_timed(
    mechanism: list[dict[str, dict[str, Any]]],
) -> None:
    # An unsampled step: the communication object starts each bucket as it is, and reports nothing
    # (the observer counts and times the sampled step only: docs/metrics.md).
    for by_collective in mechanism:
        timed, untimed = by_collective["all_reduce"], by_collective["untimed"]
        assert untimed["started_by_hooks"] == untimed["buckets"] == timed["buckets"]
        assert untimed["in_flight_at_first_layer"] == timed["in_flight_at_first_layer"]
        assert all(torch.equal(a, b) for a, b in zip(untimed["averaged"], timed["averaged"], strict=True))
        assert untimed["counts"] == {} and timed["counts"]["comm/all_reduce_per_step"] == timed["buckets"]


def test_last_layers_buckets_leave_before_the_first_layer_has_its_gradients(
    mechanism: list[dict[str, dict[str, Any]]],
) -> None:
    """The overlap itself ("layer 10 syncs while layer 9 computes"): buckets in forward order would
    all leave at the end of backward, with the same averages, so only the launch order shows it."""
    for by_collective in mechanism:
        for rank in by_collective.values():
            # ~300 B buckets, last layer first: [4.bias, 4.weight], [2.bias], [2.weight] are out
            # before backward reaches layer 0, whose gradients make the last two buckets.
            assert rank["in_flight_at_first_layer"] == rank["buckets"] - 2


def test_rs_ag_gives_the_same_bits_as_all_reduce(mechanism: list[dict[str, dict[str, Any]]]) -> None:
    all_reduce = [by_collective["all_reduce"] for by_collective in mechanism]
    rs_ag = [by_collective["rs_ag"] for by_collective in mechanism]
    for a, b in zip(all_reduce, rs_ag, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["averaged"], b["averaged"], strict=True))
        assert b["started_by_hooks"] == b["buckets"]
        row = b["counts"]
        sent = {kind for kind in KINDS if f"comm/{kind}_per_step" in row}
        assert sent == {"reduce_scatter", "all_gather"} and row["comm/all_gather_per_step"] == b["buckets"]


class Reordered(nn.Module):
    """Layers registered last-first but applied first-first: reverse registration order is forward order."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(16, 4)
        self.b = nn.Linear(16, 16)
        self.a = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _reordered(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    sync = from_yaml("bucketed", bucket_cap_mb=300 / 2**20)
    model = sync.wrap(Reordered())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    in_flight: list[int] = []
    probe = model.a.register_full_backward_pre_hook(lambda *_: in_flight.append(len(sync._works)))
    for _ in range(3):  # step 1 learns the order gradients come in; the buckets are rebuilt in it
        _backward(model, rank)
        sync.after_backward(model)
        optimizer.step()
        sync.zero_grad(optimizer)
    probe.remove()
    return {
        "in_flight": in_flight,
        "buckets": len(sync._flat.buckets),
        "params": [p.detach() for p in model.parameters()],
    }  # type: ignore[union-attr]


def test_buckets_are_rebuilt_in_the_order_gradients_arrive(tmp_path: Path) -> None:
    """Reverse registration order puts the first layer's gradients (the last to come) in the first
    bucket: nothing could leave before backward ends. After step 1 the buckets follow the arrival
    order (rank 0's, so every rank builds the same), and the last layers' buckets leave while the
    first layer still computes; the replicas stay equal."""
    rank0, rank1 = run_on_ranks(_reordered, 2, tmp_path / "run")
    for rank in (rank0, rank1):
        assert rank["buckets"] >= 3
        assert rank["in_flight"][0] == 0  # step 1 sends every bucket after backward (counts unknown)
        assert rank["in_flight"][1:] == [rank["buckets"] - 2] * 2, rank["in_flight"]  # a's two buckets wait
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"], strict=True))
