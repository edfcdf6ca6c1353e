"""python -m trainer.scaling's honesty: tied caps said to tie, a plot that shows every line whole,
and a warning when the measured run is too noisy to be a base for predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.links import Network, Topology
from trainer.scaling.caps import NOISE_BOUND, cap_advice, logged_step_s, noise_warning, tied_caps
from trainer.scaling.options import schedules
from trainer.scaling.predict import Prediction
from trainer.scaling.profile import RunProfile, Tensor
from trainer.scaling.report import plot

MIB = 2**20
NET = Network.uniform("net", 5e-6, 10e9)
PHASES = {"data": 0.001, "forward": 0.01, "backward": 0.02, "optimizer": 0.003}


def profile(sizes: list[int]) -> RunProfile:
    tensors = tuple(Tensor(f"layer{i}.weight", s) for i, s in enumerate(sizes))
    return RunProfile(Path("run"), 1, "cpu", "none", 32, PHASES, tensors)


def test_caps_that_build_the_same_buckets_tie() -> None:
    ddp = schedules()[0]["ddp"]  # its buckets as sync=ddp states them
    # Every tensor (200 MiB) is larger than every cap: one tensor per bucket whatever the cap.
    big = profile([200 * MIB] * 3)
    topos = [Topology(n, 8, NET, NET) for n in (2, 16)]
    line, best = cap_advice(big, topos, "ddp", ddp, [1, 5, 25, 100], overlap=True)
    assert line == "sync.bucket_cap_mb for sync=ddp: all caps give the same buckets (3), so none is best"
    assert best is None
    # Small tensors: 0.25 MiB splits them, 25 and 100 both take all 8 MiB in one bucket (after DDP's 1 MiB first).
    small = profile([MIB] * 8)
    assert tied_caps(small, ddp, [0.25, 25, 100]) == [[0.25], [25, 100]]
    line, best = cap_advice(small, topos, "ddp", ddp, [0.25, 25, 100], overlap=True)
    assert line.startswith("best sync.bucket_cap_mb for sync=ddp: N=2: ") and best is not None
    assert line.endswith("; caps 25 and 100 give the same buckets")


def prediction(strategy: str, ranks: int, efficiency: float) -> Prediction:
    return Prediction(strategy, ranks, 1, 0.01, 0.0, 0.0, 100.0, efficiency)


def test_plot_covers_every_line_and_keeps_coinciding_ones_visible(tmp_path: Path) -> None:
    rows = [prediction("none", n, 1.0) for n in (2, 8)] + [prediction("ddp", n, 1.0) for n in (2, 8)]
    rows += [prediction("zero", 2, 1.4), prediction("zero", 8, 1.1)]  # sharded optimizer step: above 1
    fig = plot(rows, "title", tmp_path / "eff.png")
    (ax,) = fig.axes
    assert ax.get_ylim()[1] >= 1.4
    box = ax.get_legend()
    assert box is not None
    legend = [t.get_text() for t in box.get_texts()]
    assert legend == ["none", "ddp (= none)", "zero"]
    none_line, ddp_line = ax.lines[:2]
    assert none_line.get_marker() != ddp_line.get_marker()
    assert (
        none_line.get_markersize() > ddp_line.get_markersize() and none_line.get_linewidth() > ddp_line.get_linewidth()
    )


def test_noise_warning_when_the_median_step_lies_above_the_bound() -> None:
    quiet = [0.0100, 0.0101, 0.0099, 0.0102, 0.0100, 0.0098]
    assert noise_warning(quiet) is None
    noisy = [0.0014, 0.0110, 0.0020, 0.0090, 0.0050, 0.0016]  # the unpinned 1-rank runs: 1.4 to 11 ms
    warning = noise_warning(noisy)
    assert warning is not None and f"over {NOISE_BOUND:.0%}" in warning and "OMP_NUM_THREADS=1" in warning
    assert "(3.500 ms) is 150% above its fastest (1.400 ms" in warning
    assert noise_warning(noisy[:3]) is None  # too few rows to call it either way
    # Either side of the bound, measured from the fastest step: slow rows alone do not move it.
    fastest = 0.001
    assert noise_warning([fastest] + [fastest * (1 + NOISE_BOUND) * 0.99] * 3 + [0.05] * 2) is None
    assert noise_warning([fastest] + [fastest * (1 + NOISE_BOUND) * 1.01] * 3 + [0.05] * 2) is not None


def test_logged_step_times_are_every_ranks_training_rows(tmp_path: Path) -> None:
    noisy = [0.0014, 0.0110, 0.0020, 0.0090]
    # From the run's files: every rank's training rows, eval rows and a cut-off line skipped.
    (tmp_path / "metrics").mkdir()
    lines = [json.dumps({"train/loss": 1.0, "time/step_s": s}) for s in noisy[:3]] + [json.dumps({"eval/loss": 1.0})]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("\n".join(lines) + '\n{"train/lo')
    (tmp_path / "metrics" / "rank1.jsonl").write_text(json.dumps({"train/loss": 1.0, "time/step_s": noisy[3]}))
    assert logged_step_s(tmp_path) == pytest.approx(noisy[:4])
