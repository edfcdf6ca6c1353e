"""Pure functions of the trainer, and the manual gradient average on real ranks."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

from tests.dist_helpers import run_on_ranks
from trainer.comm_math import busy_time
from trainer.errors import ConfigError
from trainer.loop.metrics import Window
from trainer.loop.schedule import WarmupCosine, warmup_cosine
from trainer.loop.step_math import (
    epoch_of,
    global_batch_size,
    is_due,
    steps_per_epoch,
    total_steps,
)
from trainer.loop.summary import format_report, job_throughput, rank_timing
from trainer.measures import PHASES, Collective, comm_row, link_ideal, wire_bytes
from trainer.observer import Observer
from trainer.reliability.save_cost import ResidentMemory
from trainer.setup.dist import choose_device
from trainer.setup.precheck import check_overrides
from trainer.sync.comm import Comm
from trainer.sync.flat import FlatGrads
from trainer.sync.flat import group_by_size as plan


def test_warmup_cosine_shape() -> None:
    assert warmup_cosine(0, 10, 110, 0.0) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 110, 0.0) == pytest.approx(1.0)
    assert warmup_cosine(10, 10, 110, 0.0) == pytest.approx(1.0)
    assert warmup_cosine(60, 10, 110, 0.0) == pytest.approx(0.5)
    assert warmup_cosine(110, 10, 110, 0.1) == pytest.approx(0.1)
    assert WarmupCosine(total_steps=110, warmup_steps=10)(60) == pytest.approx(0.5)


def test_batch_and_step_arithmetic() -> None:
    assert global_batch_size(batch_size=32, grad_accum_steps=4, world_size=2) == 256
    assert steps_per_epoch(num_batches=10, grad_accum_steps=3) == 3
    with pytest.raises(ConfigError, match="trainer.grad_accum_steps=4"):
        steps_per_epoch(num_batches=3, grad_accum_steps=4)
    assert total_steps(max_steps=100, num_epochs=None, steps_in_epoch=30) == 100
    assert total_steps(max_steps=None, num_epochs=2, steps_in_epoch=30) == 60
    assert total_steps(max_steps=100, num_epochs=2, steps_in_epoch=30) == 60
    assert [s for s in range(1, 26) if is_due(s, 10, 25)] == [10, 20, 25]
    assert [epoch_of(s, 4) for s in (0, 1, 4, 5, 8)] == [0, 0, 0, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_steps": -1}, "trainer.max_steps=-1"),
        ({"max_steps": None, "num_epochs": None}, "both null"),
        ({"grad_accum_steps": 0}, "trainer.grad_accum_steps=0"),
        ({"precision": "fp8"}, "trainer.precision='fp8'.*fp32, bf16, fp16"),
        ({"device": "tpu"}, "trainer.device='tpu'.*auto, cpu, cuda"),
        ({"log_every_n_steps": 0}, "trainer.log_every_n_steps=0"),
        ({"collective_timeout_s": 0}, "trainer.collective_timeout_s=0"),
    ],
)
def test_settings_name_the_bad_value(kwargs: dict, message: str) -> None:
    # TrainSettings is the trainer's schema (trainer/core.py): its values are checked before it is built.
    overrides = [f"trainer.{k}={'null' if v is None else v}" for k, v in kwargs.items()]
    with pytest.raises(ConfigError, match=message):
        check_overrides(overrides)


def test_the_sampled_steps_phases_add_up_and_other_steps_are_not_timed() -> None:
    observer = Observer(torch.device("cpu"), every=2)  # steps 1 and 3 sampled (the step before each 2nd)
    for step, pause in ((1, 0.003), (2, 0.001)):  # each phase pausing `pause`
        observer.begin_step(step)
        for phase in PHASES:
            time.sleep(pause)
            observer.mark(phase)
        observer.end_step()
    phases = observer.take()
    assert phases["observer/sampled_step"] == 1
    assert all(0.003 <= phases[f"time/{p}_s"] < 0.03 for p in PHASES)  # step 1's 3 ms, not step 2's 1 ms
    assert math.isclose(sum(phases[f"time/{p}_s"] for p in PHASES), phases["time/step_s"], rel_tol=1e-9)
    assert observer.take() == {}  # a sample is taken once


@pytest.mark.parametrize(
    ("requested", "ranks", "gpus", "device", "warns"),
    [
        ("auto", 2, 0, "cpu", False),  # no GPU: CPU, nothing to explain
        ("auto", 1, 1, "cuda", False),
        ("auto", 2, 2, "cuda", False),
        ("auto", 2, 8, "cuda", False),  # fewer ranks than GPUs: each rank still gets its own
        ("auto", 2, 1, "cpu", True),  # the one-GPU workstation: CPU for every rank, and why
        ("auto", 8, 4, "cpu", True),
        ("cpu", 4, 8, "cpu", False),
        ("cuda", 2, 2, "cuda", False),
    ],
)
def test_device_choice_is_a_function_of_the_counts(
    requested: str, ranks: int, gpus: int, device: str, warns: bool
) -> None:
    choice = choose_device(requested, ranks_per_node=ranks, gpus_visible=gpus)
    assert choice.type == device and (choice.warning is not None) == warns
    if warns:  # one line naming both counts
        assert f"{ranks} ranks on this node" in choice.warning and f"{gpus} GPU(s) visible" in choice.warning
        assert "\n" not in choice.warning


@pytest.mark.parametrize(("ranks", "gpus"), [(2, 1), (1, 0), (8, 4)])
def test_device_cuda_with_too_few_gpus_names_both_numbers(ranks: int, gpus: int) -> None:
    with pytest.raises(ConfigError, match=rf"trainer.device=cuda .*{ranks} rank\(s\) on this node but {gpus} GPU"):
        choose_device("cuda", ranks_per_node=ranks, gpus_visible=gpus)
    with pytest.raises(ConfigError, match="trainer.device='tpu' is not one of: auto, cpu, cuda"):
        choose_device("tpu", ranks_per_node=1, gpus_visible=1)


def test_window_sums_and_finds_the_first_nonfinite_step() -> None:
    window = Window(torch.device("cpu"))
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])  # predicts 0, 1, 0
    window.add(torch.tensor(0.5), 1, torch.tensor([0, 1, 1]), logits)
    window.add(torch.tensor(0.25), 2, torch.tensor([0, 0, 0]), logits)
    assert window.totals() == (0.75, 4, -1) and window.samples == 6
    window.add(torch.tensor(float("inf")), 3, torch.tensor([0, 1, 0]), logits)
    window.add(torch.tensor(float("nan")), 4, torch.tensor([0, 1, 0]), logits)
    loss_sum, correct, first_bad = window.totals()
    assert math.isnan(loss_sum) and correct == 10 and first_bad == 3
    window.reset()
    assert window.totals() == (0.0, 0, -1)


def test_summary_helpers() -> None:
    rows = [
        {
            "time/step_s": s,
            "throughput/samples_per_s": 10.0 * s,
            "memory/rss_mb": 100 * s,
            "comm/busbw_GBps": s,
            "train/loss": 1.0,
        }
        for s in (1.0, 3.0, 2.0)
    ]
    timing = rank_timing(rows)
    assert timing["median_time/step_s"] == 2.0 and timing["median_comm/busbw_GBps"] == 2.0
    assert timing["peak_memory/rss_mb"] == 300.0 and "median_train/loss" not in timing
    assert job_throughput([100.0, 150.0]) == 250.0
    summary = {
        "sync": {"strategy": "ddp"},
        "steps": 5,
        "epochs": 0.5,
        "world_size": 2,
        "backend": "gloo",
        "device": "cpu",
        "global_batch_size": 16,
        "train/loss": 0.5,
        "train/accuracy": 0.9,
        "throughput/global_samples_per_s": 250.0,
        "run_dir": "/r",
        "ranks": [{"rank": 0, "outputs": ["/r/metrics/rank0.jsonl", "/r/wandb/offline-run-x"]}],
    }
    report = format_report(summary)
    assert "W&B run rank-0: /r/wandb/offline-run-x" in report and "wandb sync /r/wandb/offline-run-*" in report


def _average(rank: int, world_size: int, cap_bytes: int, collective: str) -> list[torch.Tensor]:
    """Three parameters with rank-dependent gradients, averaged through their flat buffers."""
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(5))]
    grads = [torch.full((3,), float(rank + 1)), torch.full((2, 2), float(10 * (rank + 1))), torch.arange(5.0) * rank]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    flat = FlatGrads(list(plan(params, cap_bytes)), world_size)  # keeps the gradients, now views into buffers
    net = Comm()
    net.observer.every = 1
    net.observer.begin_step(1)  # watched: the observer counts what went
    for bucket in flat.buckets:  # as manual.py averages its buffers
        if collective == "all_reduce":
            net.all_reduce(bucket.grads).wait()
            bucket.grads.div_(world_size)
        else:
            net.reduce_scatter(bucket.shard, bucket.buffer).wait()
            bucket.shard.div_(world_size)
            net.all_gather(bucket.buffer, bucket.shard).wait()
    net.observer.end_step()
    row = net.observer.take()
    views = all(p.grad is v for b in flat.buckets for p, v in zip(b.params, b.views, strict=True))
    padded = sum(b.padded_nbytes for b in flat.buckets)
    made = [len(flat.buckets), row["comm/collectives_per_step"], row["comm/bytes_per_step"], views, padded]
    return [*(p.grad for p in params), torch.tensor(made)]


AVERAGE_CASES = [
    (cap, buffers, collective)
    for cap, buffers in ((0, 3), (28, 2), (1 << 20, 1))
    for collective in ("all_reduce", "rs_ag")
]


def _average_all(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    """Every case of the test below on one pair of ranks (a spawn costs more than all of them)."""
    return [_average(rank, world_size, cap, collective) for cap, _, collective in AVERAGE_CASES]


def test_flat_buffers_average_is_sum_over_world_size(tmp_path: Path) -> None:
    # per tensor, two buffers, one buffer; each with all_reduce and with reduce_scatter + all_gather
    for results in run_on_ranks(_average_all, 2, tmp_path / "avg"):
        for (_, buffers, collective), (*grads, made) in zip(AVERAGE_CASES, results, strict=True):
            assert torch.equal(grads[0], torch.full((3,), 1.5))
            assert torch.equal(grads[1], torch.full((2, 2), 15.0))
            assert torch.equal(grads[2], torch.arange(5.0) / 2)
            calls = buffers * (1 if collective == "all_reduce" else 2)
            # On the wire, 2 ranks: an all_reduce sends the 12 gradient floats; a reduce_scatter and an
            # all_gather half of each buffer, padded to a multiple of 2 (docs/metrics.md).
            wire = (3 + 4 + 5) * 4 if collective == "all_reduce" else made.tolist()[4]
            assert made.tolist()[:4] == [buffers, calls, wire, 1]


def test_plan_groups_consecutive_parameters_up_to_the_cap() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (4, 4, 100, 2)]  # 16, 16, 400, 8 bytes
    assert [[p.numel() for p in group] for group in plan(params, 32)] == [[4, 4], [100], [2]]
    assert [[p.numel() for p in group] for group in plan(params, 0)] == [[4], [4], [100], [2]]
    # Buffers padded to a multiple of 3: 8 -> 9, 100 -> 102, 2 -> 3.
    flat = FlatGrads(list(plan(params, 32)), world_size=3)
    assert [b.buffer.numel() for b in flat.buckets] == [9, 102, 3] and flat.sizes() == [32, 400, 8]
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in params)
    params[2].grad.add_(1.0)  # type: ignore[union-attr]
    assert flat.buckets[1].buffer[:100].sum() == 100  # the .grad is the buffer
    flat.zero()
    assert flat.buckets[1].buffer.sum() == 0 and params[2].grad is flat.buckets[1].views[0]


def test_comm_metrics_arithmetic() -> None:
    # Two collectives in flight 0-4 s and 2-6 s: busy 6 s; the last left at 2 s and came back at 6 s.
    assert busy_time([(0.0, 4.0), (2.0, 6.0), (7.0, 8.0)]) == 7.0

    # The link's ideal: a link carrying one at a time, launched at 0 and 1, 3 s each -> done at 3 and 6.
    def ar(launched: float, needed: float, resumed: float) -> Collective:
        return Collective("all_reduce", 8, 2, False, launched, resumed, needed, link_s=3.0, resumed=resumed)

    # Waited for together from 2 (torch's one wait for DDP's buckets): 2..6 = 4 s.
    assert link_ideal([ar(0.0, 2.0, 10.0), ar(1.0, 2.0, 10.0)]) == 4.0
    # Waited for one after the other (bucketed's after_backward), the first wait slow for real (2..8):
    # replayed, the second wait moves 5 s earlier (to 3.1), so the same 4 s less the 0.1 s between them.
    assert link_ideal([ar(0.0, 2.0, 8.0), ar(1.0, 8.1, 10.0)]) == pytest.approx(3.9)
    # Launched late enough, nothing waits; compute between waits keeps its length (fsdp's units).
    assert link_ideal([ar(0.0, 5.0, 5.0)]) == 0.0
    unit = lambda launched, needed, resumed: Collective(  # noqa: E731
        "all_gather", 8, 2, False, launched, resumed, needed, link_s=1.0, resumed=resumed
    )
    assert link_ideal([unit(0.0, 0.5, 2.0), unit(4.0, 4.5, 6.0)]) == pytest.approx(1.0)
    # The one definition (trainer/measures.py): two all_reduces of 1e9 bytes on 2 ranks, in flight 0-4
    # and 2-6 s, waited for from 3 s; a control agreement apart, never in the bytes or the times.
    data = [
        Collective("all_reduce", 1_000_000_000, 2, False, launched=0.0, completed=4.0, needed=3.0),
        Collective("all_reduce", 1_000_000_000, 2, False, launched=2.0, completed=6.0, needed=3.0),
    ]
    control = Collective("all_reduce", 4, 2, True, launched=6.0, completed=9.0, needed=6.0)
    m = comm_row([*data, control], emulated=False)
    assert m["comm/bytes_per_step"] == 2e9 and m["comm/collectives_per_step"] == 2  # 2(2-1)/2 of each buffer
    assert m["comm/control_bytes_per_step"] == 4 and m["comm/control_collectives_per_step"] == 1
    assert m["time/comm_s"] == 6.0 and m["time/comm_exposed_s"] == 3.0 and m["comm/overlap_fraction"] == 0.5
    assert m["comm/busbw_GBps"] == pytest.approx(2e9 / 6 / 1e9) and "time/comm_exposed_link_s" not in m
    # The same data by other collectives, the same bytes: an all_gather of S, or a broadcast of S/N from each rank.
    gather = [Collective("all_gather", 4000, 4, False, 0.0, 1.0, 0.0)]
    broadcasts = [Collective("broadcast", 1000, 4, False, 0.0, 1.0, 0.0) for _ in range(4)]
    assert comm_row(gather, False)["comm/bytes_per_step"] == comm_row(broadcasts, False)["comm/bytes_per_step"] == 3000
    # busbw is nccl-tests' (trainer/comm_math.py's bus factors): the gather's busiest link carries 3/4 of
    # its S in the second, each broadcast's the whole of its slice.
    assert comm_row(gather, False)["comm/busbw_GBps"] == pytest.approx(3000 / 1e9)
    assert comm_row(broadcasts, False)["comm/busbw_GBps"] == pytest.approx(4000 / 1e9)
    assert wire_bytes("reduce_scatter", 4000, 4) == 3000 and wire_bytes("all_reduce", 4000, 4) == 6000
    assert wire_bytes("all_reduce", 4000, 1) == 0  # one rank sends nothing
    assert comm_row([control], False) == {"comm/control_bytes_per_step": 4, "comm/control_collectives_per_step": 1}
    assert comm_row([], False) == {}
    # Bytes across nodes: of the same bytes, those of collectives whose group spans emulated nodes; the
    # key only where the link has nodes (across_nodes None: it has none).
    inside = Collective("reduce_scatter", 4000, 2, False, 0.0, 1.0, 0.0, across_nodes=False)
    across = Collective("all_reduce", 2000, 2, False, 1.0, 2.0, 1.0, across_nodes=True)
    two_tier = comm_row([inside, across, control], True)
    assert two_tier["comm/inter_node_bytes_per_step"] == 2000 and two_tier["comm/bytes_per_step"] == 4000
    assert "comm/inter_node_bytes_per_step" not in comm_row(data, True)


def _agree(rank: int, world_size: int, values: list) -> str:
    from trainer.setup.dist import check_ranks_agree

    try:
        check_ranks_agree("the job", values[rank])
    except RuntimeError as err:
        return str(err)
    return "agreed"


def _agree_twice(rank: int, world_size: int) -> tuple[str, str]:
    """The same job on both ranks, then drifted ones, on one pair of ranks (a spawn costs more than both)."""
    same = _agree(rank, world_size, [(0, ("a=1",)), (0, ("a=1",))])
    return same, _agree(rank, world_size, [(0, ("a=1",)), (1, ("a=5",))])


def test_ranks_that_drift_into_different_jobs_are_stopped(tmp_path: Path) -> None:
    same, messages = zip(*run_on_ranks(_agree_twice, 2, tmp_path / "agree"), strict=True)
    assert list(same) == ["agreed", "agreed"]
    assert messages[0] == messages[1]
    assert "ranks disagree on the job" in messages[0] and "rank 1: (1, ('a=5',))" in messages[0]


@pytest.mark.parametrize("sync", ["ddp", "bucketed"])
def test_sample_every_n_steps_must_be_a_whole_number(sync: str) -> None:
    for bad in ("-1", "1.5"):
        with pytest.raises(
            ConfigError, match=r"trainer\.sample_every_n_steps=.* is invalid: (must be|accepted:) an integer >= 0"
        ):
            check_overrides([f"sync={sync}", f"trainer.sample_every_n_steps={bad}"])


@pytest.mark.slow  # forks a process
def test_resident_memory_reads_this_process_as_psutil_does_also_after_a_fork() -> None:
    rss = ResidentMemory()
    assert abs(rss.bytes() - psutil.Process().memory_info().rss) < 16 * 2**20  # the same number, read ~together
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child grows by 128 MiB: the instance opened in the parent must see the child's own
        try:
            first = rss.bytes()
            ballast = bytearray(128 * 2**20)
            ballast[::4096] = b"x" * len(ballast[::4096])  # every page touched
            os.write(write, f"{first} {rss.bytes()} {psutil.Process().memory_info().rss}".encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    first, grown, by_psutil = (int(n) for n in os.read(read, 128).split())
    assert grown - first >= 120 * 2**20 and abs(grown - by_psutil) < 16 * 2**20
    assert abs(rss.bytes() - psutil.Process().memory_info().rss) < 16 * 2**20  # the parent still reads its own
