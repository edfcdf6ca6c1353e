"""Control collectives (the ranks' agreements of a few bytes) go through the strategy's communication
object: counted apart from gradient traffic, and carried by an emulated link like any other."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_helpers import run_on_ranks
from tests.observe_helpers import sampled, sent
from tests.sync_helpers import from_yaml
from trainer.sync.comm import Comm
from trainer.sync.network import Network

SYNC = Path(__file__).resolve().parents[1] / "trainer" / "sync"
# A collective called on torch.distributed itself (`dist.all_reduce(`, `dist.broadcast(`, ...) or through
# comm.py's flat-tensor forms.
DIRECT = re.compile(
    r"\bdist\.(all_reduce|broadcast|all_gather\w*|reduce_scatter\w*|barrier|all_to_all\w*)\("
    r"|\b(all_gather_tensor|reduce_scatter_tensor)\("
)


def test_no_strategy_module_calls_a_collective_past_the_communication_object() -> None:
    direct = [
        f"{path.name}:{number}"
        for path in sorted(SYNC.glob("*.py"))
        if path.name != "comm.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if DIRECT.search(line.split("#")[0])
    ]
    assert direct == [], f"collectives that bypass the communication object's books: {direct}"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _control(rank: int, world_size: int) -> dict[str, Any]:
    sync = from_yaml("manual", find_unused_parameters=True)
    with sampled(sync) as at_wrap:  # watched as a sampled step is
        model = sync.wrap(_model())
    with sampled(sync) as step:
        F.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 2, (5,))).backward()
        sync.after_backward(model)
    # On an emulated link an agreement is handed on no earlier than the link would deliver it.
    link = Network(preset="1gbe", latency_us=20_000.0).link(world_size)
    assert link is not None
    emulated = Comm(link)
    emulated.observer.every = 1
    emulated.observer.begin_step(1)
    started = time.perf_counter()
    agreed = emulated.agree(torch.tensor([float(rank + 1)]))
    seconds = time.perf_counter() - started
    emulated.observer.end_step()
    # An agreement waited for after the step (the sampled step's gradient norm, read by the row).
    later = Comm()
    later.observer.every = 1
    later.observer.begin_step(1)
    value = torch.tensor([float(rank + 1)])
    work = later.agree_later(value)
    later.observer.end_step()
    assert work is not None
    taken_before_the_wait = later.observer.take()  # the row takes the step once the backend is done
    work.wait()
    return {
        "at_wrap": at_wrap,
        "step": step,
        "agreed": agreed.item(),
        "seconds": seconds,
        "link_s": link.seconds("all_reduce", 4),
        "emulated": emulated.observer.take(),
        "later": taken_before_the_wait,
        "agreed_later": value.item(),
    }


def _alone(rank: int, world_size: int) -> dict[str, Any]:
    comm = Comm()
    comm.observer.every = 1
    comm.observer.begin_step(1)
    value = torch.tensor([5.0])
    comm.agree(value, torch.distributed.ReduceOp.MAX)
    comm.agree_from(value, 0)
    work = comm.agree_later(value)
    comm.observer.end_step()
    return {"row": comm.observer.take(), "value": value.item(), "work": work}


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_control, 2, tmp_path_factory.mktemp("control") / "run")


def test_control_collectives_are_counted_apart_from_gradient_traffic(control: list[dict[str, Any]]) -> None:
    model = _model()
    tensors = [*model.parameters(), *model.buffers()]
    for rank in control:
        # wrap(): one broadcast of rank 0's value per parameter and buffer, none of it gradient bytes
        # (on the wire, 2 ranks: a broadcast sends half its buffer, docs/metrics.md).
        wrap = rank["at_wrap"]
        assert wrap["comm/control_collectives_per_step"] == len(tensors)
        assert wrap["comm/control_bytes_per_step"] == sum(t.numel() * t.element_size() for t in tensors) / 2
        assert "comm/bytes_per_step" not in wrap and sent(wrap) == {}
        # A step under find_unused_parameters=true: the used-flags' one all_reduce (int32 per parameter).
        step = rank["step"]
        assert (step["comm/control_bytes_per_step"], step["comm/control_collectives_per_step"]) == (
            4 * len(list(model.parameters())),
            1,
        )
        assert sum(calls for _, calls in sent(step).values()) >= 1


def test_an_emulated_link_carries_control_collectives(control: list[dict[str, Any]]) -> None:
    for rank in control:
        assert rank["agreed"] == 3.0  # 1 + 2: the real sum
        emulated = rank["emulated"]
        assert (emulated["comm/control_bytes_per_step"], emulated["comm/control_collectives_per_step"]) == (4, 1)
        assert rank["link_s"] >= 0.02 and rank["seconds"] >= rank["link_s"]  # the link's 20 ms latency, at least


def test_an_agreement_waited_for_after_the_step_is_counted_in_it(control: list[dict[str, Any]]) -> None:
    for rank in control:
        assert rank["agreed_later"] == 3.0
        later = rank["later"]
        assert (later["comm/control_bytes_per_step"], later["comm/control_collectives_per_step"]) == (4, 1)
        assert "time/comm_s" not in later  # nothing of a control collective is timed


def test_one_rank_has_nothing_to_agree_and_sends_nothing(tmp_path: Path) -> None:
    (alone,) = run_on_ranks(_alone, 1, tmp_path / "run")
    assert alone["value"] == 5.0 and alone["work"] is None
    assert not any(key.startswith("comm/") for key in alone["row"]), alone["row"]
