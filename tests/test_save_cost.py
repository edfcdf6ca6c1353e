"""trainer/reliability/save_cost.py: a save's blocking time and this rank's peak memory during it."""

from __future__ import annotations

import time

import numpy as np
import psutil
import torch

from trainer.reliability.save_cost import SaveCost


def test_the_peak_during_a_save_is_seen_after_the_memory_is_given_back() -> None:
    before = psutil.Process().memory_info().rss / 2**20
    with SaveCost(torch.device("cpu")) as cost:
        held = np.ones(200 * 2**20 // 8)  # 200 MiB, touched, held for a while, then freed before the end
        time.sleep(0.05)
        del held
        time.sleep(0.02)
    metrics = cost.metrics()
    assert metrics["checkpoint/peak_rss_mb"] >= before + 150, (before, metrics)
    assert psutil.Process().memory_info().rss / 2**20 < metrics["checkpoint/peak_rss_mb"] - 100
    assert 0.07 <= metrics["checkpoint/blocked_s"] < 60 and "checkpoint/peak_cuda_mb" not in metrics  # no CUDA here
