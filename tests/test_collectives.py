"""The collective benchmark: its arithmetic, the composed all_reduce and the timer on real gloo ranks,
and the CLI end to end under the real torchrun."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from tests import forks
from tests.cli import TORCHRUN, env, run_torchrun
from tests.compose import REPO
from tests.dist_helpers import run_on_ranks
from trainer.tools.collective_ops import (
    OPS,
    REPEATS,
    all_reduce_floor_s,
    bandwidths,
    bus_factor,
    composed_all_reduce,
    measure,
    sweep_sizes,
)
from trainer.tools.collectives import format_table


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_reduce_composed", 8) == 1.75  # judged as the all_reduce it replaces
    assert bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("all_gather", 8) == 0.875
    assert bus_factor("broadcast", 4) == 1.0
    assert [bus_factor(op, 1) for op in OPS] == [0.0] * len(OPS)  # one process: no link is used
    with pytest.raises(ValueError, match="unknown op 'gather'"):
        bus_factor("gather", 2)


def test_bandwidths_and_all_reduce_floor() -> None:
    # 1 GiB in 0.5 s: algbw 2 GiB/s; an all_reduce on 4 ranks moves 2*3/4 of it per link.
    assert bandwidths("all_reduce", 2**30, 0.5, 4) == (2**31, 1.5 * 2**31)
    assert bandwidths("all_gather", 8_000, 1e-6, 2) == pytest.approx((8e9, 4e9))
    assert bandwidths("broadcast", 1_000, 1e-3, 1) == (1e6, 0.0)
    # 100 MB of gradients on 4 ranks at busbw 10 GB/s: 100e6 * 1.5 / 10e9 = 15 ms.
    assert all_reduce_floor_s(100_000_000, 4, 10e9) == pytest.approx(0.015)
    assert all_reduce_floor_s(100_000_000, 2, 1e9) == pytest.approx(0.1)
    assert all_reduce_floor_s(100_000_000, 1, 0.0) == 0.0
    with pytest.raises(ValueError, match="busbw=0"):
        all_reduce_floor_s(100, 2, 0.0)


def test_the_table_is_one_per_operation_with_the_spread_over_repeats() -> None:
    records = [
        {
            "op": op,
            "size_bytes": size,
            "seconds": 2e-3,
            "seconds_per_repeat": [1e-3, 2e-3, 4e-3],
            "algbw_GBps": size / 2e-3 / 1e9,
            "busbw_GBps": size / 2e-3 / 1e9,
        }
        for op in ("broadcast", "all_reduce")
        for size in (4096, 1 << 20)
    ]
    text = format_table(records)
    broadcast, all_reduce = text.split("\n\n")
    assert broadcast.splitlines()[0] == "broadcast" and all_reduce.splitlines()[0] == "all_reduce"
    row = broadcast.splitlines()[-1].split()
    # 1 MiB: median 2000 us (1000-4000); busbw median 0.524, from the slowest repeat 0.262 to the fastest 1.049
    assert row[:3] == ["1", "MiB", "2000.0"] and row[3] == "(1000.0-4000.0)"
    assert row[4:] == ["0.524", "(0.262-1.049)"]


def test_sweep_sizes_are_whole_elements_divisible_by_world_size() -> None:
    assert sweep_sizes(4096, 65536, 2, 4) == [4096, 8192, 16384, 32768, 65536]
    assert sweep_sizes(4096, 16384, 3, 4) == [4092, 8184, 16380]  # multiples of 3 float32 elements
    assert sweep_sizes(1, 64, 2, 4) == [8, 16, 32, 64]  # 1, 2, 4 and 8 bytes all round up to 2 elements
    assert sweep_sizes(4096, 10000, 2, 8) == [4096, 8192]
    with pytest.raises(ValueError, match="min_bytes"):
        sweep_sizes(8192, 4096, 2, 4)


def _composed_vs_native(rank: int, world_size: int) -> dict[str, Any]:
    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4) * (rank + 1) - 7 * rank  # integer-valued
    generator = torch.Generator().manual_seed(rank)
    noisy = torch.randn(3, 1000, generator=generator, dtype=torch.float32) * 10**rank
    result: dict[str, Any] = {"inputs": (whole.clone(), noisy.clone())}
    result["composed"] = (composed_all_reduce(whole), composed_all_reduce(noisy))
    result["untouched"] = torch.equal(whole, result["inputs"][0]) and torch.equal(noisy, result["inputs"][1])
    for tensor in (whole, noisy):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    result["native"] = (whole, noisy)
    try:
        composed_all_reduce(torch.ones(5))  # 5 elements cannot split into 2 shards: raises before communicating
        result["odd"] = "no error"
    except ValueError as err:
        result["odd"] = str(err)
    return result


def _measure_every_op(iters: int) -> list[tuple[str, float, float]]:
    timings = []
    for op in OPS:
        start = time.monotonic()
        seconds = measure(op, 8192, iters=iters, warmup=1, device=torch.device("cpu"))
        timings.append((op, seconds, time.monotonic() - start))
    return timings


def _on_two_ranks(rank: int, world_size: int, iters: int) -> dict[str, Any]:
    return {"composed": _composed_vs_native(rank, world_size), "measure": _measure_every_op(iters)}


MEASURE_ITERS = 4


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One spawn of 2 gloo ranks for both tests below: starting the processes is most of their cost."""
    return run_on_ranks(_on_two_ranks, 2, tmp_path_factory.mktemp("ranks") / "group", MEASURE_ITERS)


def test_composed_all_reduce_equals_native_all_reduce(two_ranks: list[dict[str, Any]]) -> None:
    results = [r["composed"] for r in two_ranks]
    expected_whole = results[0]["inputs"][0] + results[1]["inputs"][0]
    expected_noisy = results[0]["inputs"][1] + results[1]["inputs"][1]
    for rank, result in enumerate(results):
        (whole, noisy), (native_whole, native_noisy) = result["composed"], result["native"]
        assert whole.shape == (6, 4) and noisy.shape == (3, 1000), f"rank {rank}"
        assert torch.equal(whole, native_whole) and torch.equal(whole, expected_whole), f"rank {rank}"
        assert torch.allclose(noisy, native_noisy, rtol=1e-6, atol=1e-6), f"rank {rank}"
        assert torch.allclose(noisy, expected_noisy, rtol=1e-6, atol=1e-6), f"rank {rank}"
        assert result["untouched"], f"rank {rank}: composed_all_reduce changed its input"
        assert result["odd"] == "5 elements do not split into 2 equal shards"


def test_measure_is_a_positive_time_agreed_by_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    iters = MEASURE_ITERS
    per_rank = [r["measure"] for r in two_ranks]
    for rank, timings in enumerate(per_rank):
        assert [op for op, _, _ in timings] == list(OPS)
        for op, seconds, wall in timings:
            assert math.isfinite(seconds) and seconds > 0, f"rank {rank} {op}: {seconds}"
            # A repeat of `iters` calls ran inside this rank's call to measure (the barrier before it, the
            # max-reduction after it): so the median per-call time fits `iters` times into that wall time.
            assert seconds * iters <= wall, f"rank {rank} {op}: {seconds} s per call, {wall} s for the whole"
    # Each repeat is the slowest rank's time, so both ranks report the same numbers.
    assert [s for _, s, _ in per_rank[0]] == [s for _, s, _ in per_rank[1]]


def _run_cli(cmd: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    """The command (torchrun, or python -m) run from the repo, forked from tests/forks.py's server: what
    it writes and prints is checked here, not how an interpreter starts."""
    cmd = [*cmd, "--iters", "3", "--out", str(out)]
    if cmd[0] == TORCHRUN:
        return run_torchrun(cmd, cwd=REPO, timeout_s=240)
    assert cmd[0] == sys.executable, cmd
    return forks.python(cmd[1:], REPO, env(), 240)


@pytest.mark.slow
def test_cli_under_torchrun_writes_every_op_at_every_size(tmp_path: Path) -> None:
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "trainer.tools.collectives",
        "--device",
        "cpu",
        "--max-bytes",
        "65536",
    ]
    proc = _run_cli(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "collectives.json").read_text())
    assert (report["world_size"], report["backend"], report["device"]) == (2, "gloo", "cpu")
    assert report["torch_version"] == torch.__version__ and report["hostname"]
    sizes = [4096, 8192, 16384, 32768, 65536]
    assert sorted((r["op"], r["size_bytes"]) for r in report["results"]) == sorted((op, s) for op in OPS for s in sizes)
    for r in report["results"]:
        assert r["busbw_GBps"] > 0 and len(r["seconds_per_repeat"]) == REPEATS, r
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["seconds"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], 2))
    lines = proc.stdout.splitlines()  # one table per op: its name, a header, then a row per size
    for op in OPS:
        start = lines.index(op) + 2
        assert all(line.strip().endswith(")") for line in lines[start : start + len(sizes)]), lines
    with Image.open(tmp_path / "collectives.png") as image:
        assert image.format == "PNG" and image.size[0] > 300 and image.size[1] > 200


@pytest.mark.slow
def test_cli_as_one_process_says_it_measures_no_communication(tmp_path: Path) -> None:
    proc = _run_cli([sys.executable, "-m", "trainer.tools.collectives", "--max-bytes", "8192"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "a single process measures no communication" in proc.stdout
    report = json.loads((tmp_path / "collectives.json").read_text())
    assert report["world_size"] == 1 and len(report["results"]) == 2 * len(OPS)
    assert all(r["busbw_GBps"] == 0 and r["algbw_GBps"] > 0 for r in report["results"])
    with Image.open(tmp_path / "collectives.png") as image:
        assert image.format == "PNG"
