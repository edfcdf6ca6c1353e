"""What a slow emulated link shows, end to end under torchrun (slow): overlap hides communication
and a hand-written all_reduce after backward hides none; the exposed communication is U-shaped in the cap.

Three launches: a route-1 sweep of ddp over three caps, bucketed at the middle cap, manual. The
link is 1gbe with its latency raised to 2 ms a ring step (network.latency_us) and every time x3
(network.time_scale), on an MLP of 48 layers of 256 (98 gradient tensors, 12.4 MB) at batch 2048:
one all_reduce of the model takes ~345 ms, a little more than backward, so a mid-sized cap hides
about backward's time of it; 48 buckets of 0.25 MiB pay 12 ms of latency each; one bucket of
25 MiB leaves only after backward. Measured here, unloaded (median step, s): ddp 1.12 / 0.68 / 0.84
at caps 0.25 / 2 / 25, bucketed 0.66 at 2, manual 0.95; overlap 0.74 and 0.66 at cap 2, manual's
0. What is asserted is the communication the step waits for (time/comm_exposed_s): U-shaped in
the cap, and at the middle cap well under manual's (under 0.75 of it). The step times themselves are measured
with their spread in docs/network.md's experiments, not asserted here: on 2 shared cores the real
gloo collectives that run during backward take compute from it, and under the suite's load that
ate the step's right arm once (cap 2 and cap 25 within 1 ms) while the exposed communication kept
its U; in a fourth it ate the left arm too (cap 0.25 at 1.29 s against cap 2's 1.42).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.cli import CPU, output, torchrun
from trainer.links import PRESETS, Link, ring_s

TIME_SCALE = 3.0
LINK = ["network=1gbe", "network.latency_us=2000", f"network.time_scale={TIME_SCALE:g}"]
RUN = [
    CPU,
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.max_steps=8",
    "trainer.log_every_n_steps=2",
    "trainer.eval_every_n_steps=0",
    f"model.hidden_sizes=[{','.join(['256'] * 48)}]",
    "data.batch_size=2048",
    *LINK,
]
CAPS = (0.25, 2.0, 25.0)


def medians(run_dir: Path) -> dict[str, float]:
    """The median step, overlap and communication of the rows after the first (warm-up: buckets rebuilt)."""
    rows = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r][1:]
    return {
        "step": statistics.median(r["time/step_s"] for r in rows),
        "overlap": statistics.median(r["comm/overlap_fraction"] for r in rows),
        "comm": statistics.median(r["time/comm_s"] for r in rows),
        "exposed": statistics.median(r["time/comm_exposed_s"] for r in rows),
        "bytes": rows[-1]["comm/bytes_per_step"],
    }


def link_floor_s(nbytes: float) -> float:
    """The least the link takes for a step's gradients however they are bucketed: its bandwidth term
    (2 ranks: a ring all_reduce moves the buffer once each way), latency left out."""
    beta = PRESETS["1gbe"].link("all_reduce").beta_Bps
    return TIME_SCALE * ring_s("all_reduce", nbytes, 2, Link(alpha_s=0.0, beta_Bps=beta))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, dict[str, float]]:
    root = tmp_path_factory.mktemp("lessons")
    caps = ",".join(map(str, CAPS))
    swept = torchrun(["-m", *RUN, "sync=ddp", f"sync.bucket_cap_mb={caps}", f"hydra.sweep.dir={root}/sweep"], root)
    assert swept.returncode == 0, output(swept)
    found: dict[Any, dict[str, float]] = {}
    for job in sorted(p for p in (root / "sweep").iterdir() if p.name.isdigit()):
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        found[("ddp", next(c for c in CAPS if f"sync.bucket_cap_mb={c}" in overrides))] = medians(job)
    for name, sync in (("bucketed", ["sync=bucketed", "sync.bucket_cap_mb=2"]), ("manual", ["sync=manual"])):
        alone = torchrun([*RUN, *sync, f"hydra.run.dir={root}/{name}"], cwd=root)
        assert alone.returncode == 0, output(alone)
        found[name if name == "manual" else (name, 2.0)] = medians(root / name)
    assert 'network="1gbe* (alpha 2000 us, beta 0.11 GB/s) x3"' in output(alone), output(alone)
    return found


def test_the_bucket_caps_exposed_communication_is_u_shaped_on_a_slow_link(jobs: dict[Any, dict[str, float]]) -> None:
    tiny, mid, huge = (jobs[("ddp", cap)]["exposed"] for cap in CAPS)
    assert mid < tiny and mid < huge, (tiny, mid, huge)  # latency per bucket; no overlap
    # the link's U, not loopback's (which has one too): one bucket after backward waits for all of it
    assert huge >= 0.8 * link_floor_s(jobs[("ddp", 25.0)]["bytes"]), huge
    assert jobs[("ddp", 25.0)]["overlap"] <= 0.1  # one bucket leaves after backward: nothing to hide behind


@pytest.mark.parametrize("sync", ["bucketed", "ddp"])
def test_overlap_hides_the_link_and_manual_hides_none(jobs: dict[Any, dict[str, float]], sync: str) -> None:
    manual, overlapped = jobs["manual"], jobs[(sync, 2.0)]
    for job in (manual, overlapped):  # the link's time, not loopback's (~30 ms here for these 12.4 MB)
        assert job["comm"] >= 0.95 * link_floor_s(job["bytes"]), job
    assert manual["overlap"] <= 0.05, manual
    assert overlapped["overlap"] >= 0.5, overlapped
    # Under half of manual's alone; under the suite's load 0.55 of it twice (its buckets' real gloo
    # traffic stretched past their emulated deadlines while the other worker ran). Without the
    # overlap (every bucket sent after backward) it is manual's, which 0.75 still tells apart.
    assert overlapped["exposed"] < 0.75 * manual["exposed"], (overlapped, manual)
