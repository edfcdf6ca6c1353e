"""GPU tests that need no launcher: the observer's phases on CUDA events, and the equivalence promise
with two ranks sharing one GPU through gloo (both marked `gpu`, skipped without CUDA by conftest); plus
`make gpu-check` without CUDA, which runs everywhere. The torchrun end-to-end runs on CUDA are in
test_gpu_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.cli import output
from tests.compose import REPO
from tests.test_equivalence import initial_params, trained
from tests.train_helpers import bit_identical, max_abs_diff
from trainer.measures import PHASES
from trainer.observer import Observer


@pytest.mark.gpu
def test_step_timer_phases_tile_the_step_on_cuda_events() -> None:
    """Phase i runs i+1 matmuls: CUDA events see GPU time, in proportion, adding up to the sampled step."""
    device = torch.device("cuda", torch.cuda.current_device())
    timer = Observer(device, every=1)
    x = torch.randn(2048, 2048, device=device)
    weights = torch.randn(2048, 2048, device=device) / 2048**0.5
    x = torch.tanh(x @ weights)  # cuBLAS's one-time set-up, outside the timed steps
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for step in range(1, 4):
        timer.begin_step(step)
        for i, phase in enumerate(PHASES):
            for _ in range(4 * (i + 1)):
                x = torch.tanh(x @ weights)
            timer.mark(phase)
        timer.end_step()
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    row = timer.take()  # the newest sampled step
    phases = {p: row[f"time/{p}_s"] for p in PHASES}
    assert sum(phases.values()) == pytest.approx(row["time/step_s"], rel=0.01)
    assert 0 < row["time/step_s"] * 3 <= wall * 1.05  # GPU time, not more than what the host waited for
    assert phases["optimizer"] > 2 * phases["data"]  # 20 matmuls against 4
    assert timer.take() == {}  # the steps were consumed


@pytest.fixture(scope="module")
def cuda_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """One process on the GPU with batch 16: what two ranks with batch 8 must reproduce."""
    (params,) = trained(tmp_path_factory.mktemp("cuda-single"), "ref", 1, ["sync=none", "data.batch_size=16"], "cuda:0")
    return params


@pytest.mark.gpu
@pytest.mark.parametrize("sync", ["manual", "ddp"])
def test_two_ranks_sharing_one_gpu_equal_one_process(
    tmp_path: Path, cuda_reference: dict[str, torch.Tensor], sync: str
) -> None:
    """Both ranks on cuda:0 through gloo (nccl refuses two ranks on one device): the CPU promise on CUDA kernels."""
    rank0, rank1 = trained(tmp_path, "pair", 2, [f"sync={sync}", "data.batch_size=8"], "cuda:0")
    assert bit_identical(rank0, rank1), "replicas differ after training"
    assert max_abs_diff(rank0, initial_params()) > 1e-3, "nothing was trained"
    assert max_abs_diff(rank0, cuda_reference) <= 1e-5


def test_gpu_check_without_cuda_says_so_and_exits_2(tmp_path: Path) -> None:
    """Runs anywhere: with no GPU visible, `make gpu-check` refuses at once instead of failing every check."""
    script = REPO / "benchmarks" / "gpu_check.py"
    environ = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path / "out")],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, output(proc)
    assert "no CUDA device" in proc.stderr, output(proc)
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.gpu
def test_sync_batchnorm_two_ranks_sharing_one_gpu_equal_one_process_with_plain_batchnorm(tmp_path: Path) -> None:
    """The promise with BatchNorm on: SyncBatchNorm normalises each rank's 8 samples with the statistics of all 16.

    Both ranks on cuda:0 through gloo (SyncBatchNorm all_gathers its statistics with gloo too);
    parameters and running statistics must match one process training the same cnn with plain
    BatchNorm on the 16 samples. Without SyncBatchNorm they do not: see test_syncbn.py.
    """
    from functools import partial

    from tests.dist_helpers import run_on_ranks
    from tests.test_syncbn import initial_cnn_params, train_cnn, weights
    from tests.train_helpers import assert_same_model, case_results, train_each

    on_gpu = partial(train_cnn, device="cuda:0")
    (single,) = run_on_ranks(on_gpu, 1, tmp_path / "single", ["sync=none", "data.batch_size=16"], str(tmp_path / "ref"))
    cases = {s: [f"sync={s}", "data.batch_size=8", "model.sync_batchnorm=true"] for s in ("manual", "ddp", "bucketed")}
    pairs = run_on_ranks(train_each, 2, tmp_path / "pair", on_gpu, cases, str(tmp_path / "runs"), timeout_s=600)
    for sync in cases:
        rank0, rank1 = case_results(pairs, sync)
        assert max_abs_diff(weights(rank0), weights(initial_cnn_params())) > 1e-3, f"{sync}: nothing was trained"
        assert_same_model([rank0, rank1], single)  # replicas bit-identical, running statistics included
