"""On CUDA the timeline's lanes are GPU kernels, and its overlap is Holistic Trace Analysis' own.

Marked `gpu` (skipped without CUDA by conftest) and skipped without HTA (`pip install
HolisticTraceAnalysis`): a 1-GPU run (2 where there are 2) of `ddp` with trainer.profile=true
under torchrun, then HTA's communication-computation overlap against ours, per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compose import REPO
from tests.gpu_helpers import CUDA, QUICK, gpu_count
from trainer.tools import timeline


@pytest.mark.gpu
def test_gpu_lanes_and_hta_overlap_agree(tmp_path: Path) -> None:
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis is not installed")
    ranks = min(2, gpu_count())
    run_dir = tmp_path / "run"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "train.py"),
        *(CUDA, *QUICK, "sync=ddp", "sync.bucket_cap_mb=1", "experiment=bucket_sweep"),
        *("trainer.profile=true", "trainer.max_steps=8", "trainer.log_every_n_steps=4", f"hydra.run.dir={run_dir}"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=REPO, env=env, check=True, timeout=600)
    assert timeline.main([str(run_dir)]) == 0
    summary = json.loads((run_dir / "timeline_summary.json").read_text())
    for figures in summary["ranks"].values():
        assert figures["lanes"].startswith("GPU kernels") and figures["collectives"] > 0
    theirs = hta.TraceAnalysis(trace_dir=str(run_dir / "profiler")).get_comm_comp_overlap(visualize=False)
    for _, row in theirs.iterrows():
        ours = summary["ranks"][str(int(row["rank"]))]["overlap"]
        assert abs(100 * ours - float(row["comp_comm_overlap_pctg"])) <= 5.0, (ours, row)
