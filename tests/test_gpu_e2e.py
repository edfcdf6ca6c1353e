"""On CUDA under the real torchrun (every test marked `gpu` and `slow`, skipped without CUDA by
conftest): nccl end to end, bf16, phase timing on CUDA events, bit-identical resume, two ranks on two
GPUs, the collective benchmark, and how trainer.device picks a device from the GPU count. The
in-process GPU tests are in test_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli import TORCHRUN, env, jsonl, output, torchrun, train_rows
from tests.compose import REPO
from tests.gpu_helpers import COMM_TIMING, CUDA, QUICK, assert_phases_add_up, gpu_count, initial_model, summary_of
from tests.train_helpers import bit_identical, max_abs_diff
from trainer.reliability.checkpoint import step_files
from trainer.tools.collective_ops import OPS


def train_on_cuda(tmp_path: Path, nproc: int, *overrides: str) -> tuple[Path, dict[str, Any]]:
    """20 steps of train.py on nccl, a row every 5 steps; the run dir and its summary."""
    run_dir = tmp_path / "run"
    args = [CUDA, "trainer.max_steps=20", "trainer.log_every_n_steps=5", f"hydra.run.dir={run_dir}", *QUICK]
    args.append("trainer.sample_max_gap_steps=5")  # every row's step sampled, whatever the budget says
    proc = torchrun([*args, *overrides], cwd=tmp_path, nproc=nproc)
    assert proc.returncode == 0, output(proc)
    return run_dir, summary_of(run_dir)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("sync", ["none", "manual", "ddp"])
def test_nccl_end_to_end_at_world_size_one(tmp_path: Path, sync: str) -> None:
    run_dir, summary = train_on_cuda(tmp_path, 1, f"sync={sync}", "trainer.eval_every_n_steps=10")
    assert (summary["backend"], summary["device"], summary["world_size"], summary["steps"]) == ("nccl", "cuda:0", 1, 20)
    assert summary["ranks"][0]["peak_memory/cuda_max_allocated_mb"] > 0
    rows = train_rows(run_dir / "metrics" / "rank0.jsonl")
    assert [row["step"] for row in rows] == [5, 10, 15, 20]
    expected_bytes = sum(p.numel() * p.element_size() for p in initial_model([]).parameters())
    for row in rows:
        assert row["memory/cuda_max_allocated_mb"] > 0
        assert_phases_add_up(row)
        if sync == "none":
            assert not any(key.startswith("comm/") for key in row)
            continue
        assert row["comm/bytes_per_step"] == expected_bytes  # every gradient, once per step
        if sync == "manual":  # all of its communication is the sync phase
            assert row["time/comm_s"] == row["time/sync_s"] == row["time/comm_exposed_s"]
        # ddp: DDP's runtime statistics time the logged step on CUDA events, even at world size 1.
        assert all(key in row for key in COMM_TIMING), row
        assert 0 <= row["time/comm_exposed_s"] <= row["time/comm_s"] + 1e-9, row
    evals = [row for row in jsonl(run_dir / "metrics" / "rank0.jsonl") if "eval/loss" in row]
    assert [row["step"] for row in evals] == [10, 20]


@pytest.mark.gpu
@pytest.mark.slow
def test_bf16_autocast_trains_on_cuda(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = torchrun(
        [
            CUDA,
            "trainer.precision=bf16",
            "sync=ddp",
            "trainer.max_steps=20",
            "trainer.log_every_n_steps=5",
            f"hydra.run.dir={run_dir}",
            *QUICK,
        ],
        cwd=tmp_path,
        nproc=1,
    )
    assert proc.returncode == 0, output(proc)
    losses = [row["train/loss"] for row in train_rows(run_dir / "metrics" / "rank0.jsonl")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses  # the synthetic task is learnable: 20 steps show it
    assert torch.isfinite(torch.tensor(summary_of(run_dir)["eval/loss"]))
    model = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"]
    assert all(t.dtype == torch.float32 for t in model.values())  # autocast computes in bf16, keeps fp32 weights
    assert max_abs_diff(model, initial_model([]).state_dict()) > 1e-3


@pytest.mark.gpu
@pytest.mark.slow
def test_resume_on_cuda_is_bit_identical(tmp_path: Path) -> None:
    """12 steps with checkpoints every 4 (8 steps per epoch); rewind to step 4, run again: the same final state."""
    run_dir = tmp_path / "run"
    args = [
        CUDA,
        "sync=ddp",
        "model.hidden_sizes=[32,32]",
        "data.num_samples=256",
        "data.num_val_samples=64",
        "data.batch_size=32",
        "trainer.log_every_n_steps=2",
        "schedule=warmup_cosine",
        "schedule.warmup_steps=5",
        "trainer.max_steps=12",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.keep_checkpoints=5",
        "logger=none",
        "trainer.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    first = torchrun(args, cwd=tmp_path, nproc=1)
    assert first.returncode == 0, output(first)
    first_rows = train_rows(run_dir / "metrics" / "rank0.jsonl")
    ckpt = run_dir / "checkpoints"
    straight = torch.load(ckpt / "last.pt", weights_only=True)
    assert [p.name for p in step_files(ckpt)] == ["step-12.pt", "step-8.pt", "step-4.pt"]
    assert "cuda" in torch.load(ckpt / "step-4.pt", weights_only=True)["rng"][0]  # CUDA's generator is saved too
    for name in ("step-12.pt", "step-8.pt", "last.pt"):  # as if the run had died after its step-4 checkpoint
        (ckpt / name).unlink()
    os.link(ckpt / "step-4.pt", ckpt / "last.pt")
    resumed = torchrun(args, cwd=tmp_path, nproc=1)  # the same command: trainer.resume=auto
    assert resumed.returncode == 0, output(resumed)
    assert f"resumed from {ckpt / 'last.pt'} at step 4" in resumed.stdout
    final = torch.load(ckpt / "last.pt", weights_only=True)
    assert final["step"] == straight["step"] == 12
    assert bit_identical(final["model"], straight["model"])
    assert all(
        bit_identical(final["optimizer"]["state"][i], straight["optimizer"]["state"][i])
        for i in straight["optimizer"]["state"]
    )
    rows = train_rows(run_dir / "metrics" / "rank0.jsonl")  # each step once: rows after step 4 were logged again
    assert [r["step"] for r in rows] == [r["step"] for r in first_rows] == [2, 4, 6, 8, 10, 12]
    assert all(r["train/lr"] == f["train/lr"] for r, f in zip(rows, first_rows, strict=True))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["sync=zero", "optim=adamw"],
        ["sync=fsdp"],
        ["sync=fsdp", "trainer.param_dtype=bf16"],
        ["sync=zero", "optim=adamw", "trainer.param_dtype=bf16"],
    ],
    ids=["zero", "fsdp", "fsdp-bf16", "zero-bf16"],
)
def test_sharded_strategies_on_nccl(tmp_path: Path, overrides: list[str]) -> None:
    """zero and fsdp (with 16-bit parameters too) on every visible GPU up to 2: they train, the
    optimizer state is reported, and last.pt holds the full plain model (the checkpoint contract)."""
    nproc = min(gpu_count(), 2)
    run_dir, summary = train_on_cuda(tmp_path, nproc, *overrides, "trainer.checkpoint_every_n_steps=10")
    assert (summary["backend"], summary["world_size"], summary["steps"]) == ("nccl", nproc, 20)
    rows = train_rows(run_dir / "metrics" / "rank0.jsonl")
    assert rows[-1]["train/loss"] < rows[0]["train/loss"], rows
    assert all(row["memory/optimizer_state_mb"] > 0 for row in rows)
    assert nproc == 1 or all(row["comm/bytes_per_step"] > 0 for row in rows)
    saved = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    initial_model([]).load_state_dict(saved["model"])  # strict: the plain model's keys and shapes


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("sync", ["manual", "ddp"])
def test_nccl_two_ranks_on_two_gpus(tmp_path: Path, sync: str) -> None:
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, {gpu_count()} visible")
    run_dir, summary = train_on_cuda(tmp_path, 2, f"sync={sync}")
    assert (summary["backend"], summary["device"], summary["world_size"]) == ("nccl", "cuda:0", 2)
    for rank in (0, 1):
        for row in train_rows(run_dir / "metrics" / f"rank{rank}.jsonl"):
            assert row["memory/cuda_max_allocated_mb"] > 0 and row["comm/bytes_per_step"] > 0
            assert all(key in row for key in COMM_TIMING), row
            assert 0 <= row["time/comm_exposed_s"] <= row["time/comm_s"] + 1e-9 and row["comm/busbw_GBps"] > 0
            assert_phases_add_up(row)


@pytest.mark.gpu
@pytest.mark.slow
def test_collective_benchmark_on_nccl(tmp_path: Path) -> None:
    nproc = min(gpu_count(), 2)
    cmd = [
        TORCHRUN,
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "trainer.tools.collectives",
        "--device",
        "cuda",
        "--max-bytes",
        str(2**20),
        "--iters",
        "5",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, output(proc)
    assert "time us" in proc.stdout and f"{nproc} rank(s), nccl on cuda:0" in proc.stdout
    report = json.loads((tmp_path / "collectives.json").read_text())
    assert (report["world_size"], report["backend"], report["device"]) == (nproc, "nccl", "cuda:0")
    sizes = sorted({r["size_bytes"] for r in report["results"]})
    assert sizes[0] == 4096 and sizes[-1] == 2**20
    assert sorted((r["op"], r["size_bytes"]) for r in report["results"]) == sorted((op, s) for op in OPS for s in sizes)
    for r in report["results"]:
        assert r["seconds"] > 0 and r["algbw_GBps"] > 0, r
        assert (r["busbw_GBps"] > 0) == (nproc > 1), r  # one process moves nothing over any link
    assert (tmp_path / "collectives.png").stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.slow
def test_auto_device_takes_one_gpu_per_rank_or_falls_back_to_cpu(tmp_path: Path) -> None:
    gpus = gpu_count()
    run_dir = tmp_path / "run"
    # trainer.device=auto, the default: nccl with one GPU per rank, else gloo on CPU with a warning.
    proc = torchrun(
        ["trainer.max_steps=4", "trainer.log_every_n_steps=2", f"hydra.run.dir={run_dir}", *QUICK],
        cwd=tmp_path,
        nproc=2,
    )
    text = output(proc)
    assert proc.returncode == 0, text
    summary = summary_of(run_dir)
    warnings = [line for line in text.splitlines() if "GPU" in line]
    if gpus >= 2:
        assert (summary["backend"], summary["device"]) == ("nccl", "cuda:0")
        assert warnings == [], text
        return
    assert (summary["backend"], summary["device"], summary["world_size"]) == ("gloo", "cpu", 2)
    # One line, from rank 0 only, naming both numbers: 2 ranks on this node, `gpus` GPU(s) visible.
    assert len(warnings) == 1 and warnings[0].startswith("[rank0]"), text
    assert "2 rank" in warnings[0] and f"{gpus} GPU" in warnings[0], warnings[0]


@pytest.mark.gpu
@pytest.mark.slow
def test_device_cuda_with_more_ranks_than_gpus_fails_fast_naming_both_numbers(tmp_path: Path) -> None:
    gpus = gpu_count()
    nproc = gpus + 1
    started = time.monotonic()
    proc = torchrun([CUDA, f"hydra.run.dir={tmp_path / 'run'}", *QUICK], cwd=tmp_path, nproc=nproc, timeout_s=120)
    elapsed = time.monotonic() - started
    text = output(proc)
    assert proc.returncode != 0, text
    assert "configuration error" in text and f"{nproc} rank" in text and f"{gpus} GPU" in text, text
    assert "exitcode:2" in text.replace(" ", ""), text  # ConfigError's exit code, in torchrun's failure report
    assert not (tmp_path / "run" / "summary.json").exists()
    assert elapsed < 60, f"took {elapsed:.0f}s"
