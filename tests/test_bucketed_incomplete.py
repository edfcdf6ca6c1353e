"""sync=bucketed after step 1: a parameter that stops getting its gradient leaves its bucket
incomplete, and after_backward refuses it (trainer/sync/bucketed.py `_refuse_incomplete`).

Here that parameter lies in the LAST bucket: buckets are filled in reverse registration order, so
the first layer's parameters are the last bucket, the one backward completes last. In step 2 the
first layer is cut off from the output (its activations detached) on every rank: every bucket
before it has started during backward, the last never completes, and each rank must refuse, naming
the first layer's parameters, with the same words, in step, without a hang.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_helpers import run_on_ranks
from tests.sync_helpers import from_yaml
from trainer.errors import ConfigError
from trainer.sync.flat import names_of

STEM = ["stem.bias", "stem.weight"]  # the first layer, in the order its bucket holds them


class StemCut(nn.Module):
    """stem -> hidden -> head; with `cut`, the stem's output is detached: it gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.cut = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if self.cut:
            h = h.detach()
        return self.head(torch.tanh(self.hidden(h)))


# float64 bytes: head 24 + 192 and hidden.bias 64 (280), hidden.weight 512, stem 64 + 384 (448). A cap
# of 448 B gives three buckets, the stem's two tensors together the last; 25 MB gives one bucket.
CASES: dict[str, dict[str, Any]] = {
    "three-buckets": {"bucket_cap_mb": 448 / 2**20},
    "three-buckets-rs_ag": {"bucket_cap_mb": 448 / 2**20, "collective": "rs_ag"},
    "one-bucket": {"bucket_cap_mb": 25.0},
}


def _train(rank: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Three steps, the stem cut from step 2 on: the bucket layout and the refusal (or its absence)."""
    torch.manual_seed(0)
    model = StemCut().double()
    sync = from_yaml("bucketed", **kwargs)
    module = sync.wrap(model)
    optimizer = sync.build_optimizer(model, lambda params: torch.optim.SGD(params, lr=0.1))
    assert sync._flat is not None
    layout = [names_of(model, bucket.params) for bucket in sync._flat.buckets]
    for step in (1, 2, 3):
        model.cut = step >= 2
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 6, generator=gen, dtype=torch.float64), torch.randint(3, (4,), generator=gen)
        try:
            F.cross_entropy(module(x), y).backward()
            sync.after_backward(module)
        except ConfigError as err:
            return {"layout": layout, "step": step, "error": str(err)}
        sync.optimizer_step(optimizer)
        sync.zero_grad(optimizer)
    return {"layout": layout, "step": 3, "error": None}


def _every_case(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {name: _train(rank, kwargs) for name, kwargs in CASES.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    # A hang (a rank waiting for a bucket its peer never sends) fails here, within the timeout.
    return run_on_ranks(_every_case, 2, tmp_path_factory.mktemp("bucketed-incomplete") / "run", timeout_s=120)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_last_bucket_left_incomplete_after_step_1_is_refused_on_every_rank_naming_it(
    results: list[dict[str, dict[str, Any]]], name: str
) -> None:
    r0, r1 = (rank[name] for rank in results)
    # The premise: the stem's parameters are in the last bucket, and only there.
    assert len(r0["layout"]) == (1 if name == "one-bucket" else 3), r0["layout"]
    assert r0["layout"][-1][-2:] == STEM and not set(STEM) & {p for b in r0["layout"][:-1] for p in b}, r0["layout"]
    assert r0["error"] is not None, f"{name}: trained 3 steps with the stem's bucket never complete"
    assert (r0["step"], r0["error"]) == (r1["step"], r1["error"]), (r0, r1)  # alike, and in step 2
    assert r0["step"] == 2
    assert "sync=bucketed" in r0["error"] and "got fewer gradients than in the first step" in r0["error"], r0["error"]
    assert all(f"'{param}'" in r0["error"] for param in STEM), r0["error"]
