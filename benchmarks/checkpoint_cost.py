"""What a checkpoint costs each rank, full against sharded: the step's wait and the peak memory of a save.

    python benchmarks/checkpoint_cost.py                    # zero, fsdp, ddp x full, sharded, async; 3 rounds
    python benchmarks/checkpoint_cost.py --rounds 5 --syncs zero fsdp
    python benchmarks/checkpoint_cost.py --quick            # a smoke run: ddp, one round of one save a job

Each round runs train.py under torchrun (2 ranks, CPU) once per (strategy, format), in an order
that rotates every round, on an MLP whose state is over 100 MB (8.5 M parameters: 34 MB of fp32
weights and 68 MB of AdamW moments), saving every 2 steps (--steps 6: at 2, 4 and 6). From every save's row
(checkpoint/blocked_s, checkpoint/peak_rss_mb) and the training row logged just before it at the
same step (memory/rss_mb): the step's wait (the slower rank), the peak RSS during the save (the
larger rank), and for the first save of a run its rise over the RSS of the row before it (later
saves reuse pages the first one freed, so their rise says little). Reported: medians with their
interquartile range over rounds (and saves), and each format's over full's per strategy ("async":
sharded with trainer.checkpoint_async=true, where the step waits only for the copy to CPU memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from benchmarks.parts.rounds import iqr  # noqa: E402

MODEL = ["model.hidden_sizes=[2048,2048,2048]", "optim=adamw", "data.num_samples=2048"]
RUN = ["trainer.device=cpu", "logger=none", "trainer.progress_bar=false", "trainer.eval_every_n_steps=0"]
RUN += ["trainer.log_every_n_steps=2", "trainer.checkpoint_every_n_steps=2"]
RUN += ["trainer.check_replicas_every_n_steps=0", "data.num_val_samples=64"]


def run_once(sync: str, layout: str, out: Path, steps: int) -> list[tuple[float, float, float]]:
    """One job; per save, (the slower rank's wait, the larger rank's peak RSS, and its rise) in s, MiB."""
    form = ["trainer.checkpoint_format=sharded", "trainer.checkpoint_async=true"] if layout == "async" else []
    form = form or [f"trainer.checkpoint_format={layout}"]
    args = [*MODEL, *RUN, f"trainer.max_steps={steps}", f"sync={sync}", *form, f"hydra.run.dir={out}"]
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2", "train.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{sync}/{layout} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    per_rank = []
    for rank in (0, 1):
        rows = [json.loads(line) for line in (out / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]
        rss = {r["step"]: r["memory/rss_mb"] for r in rows if "memory/rss_mb" in r}
        saves = [r for r in rows if "checkpoint/blocked_s" in r]
        per_rank.append(
            [
                (r["checkpoint/blocked_s"], r["checkpoint/peak_rss_mb"], r["checkpoint/peak_rss_mb"] - rss[r["step"]])
                for r in saves
            ]
        )
    return [(max(a[0], b[0]), max(a[1], b[1]), max(a[2], b[2])) for a, b in zip(*per_rank, strict=True)]


def spread(values: list[float], spec: str) -> str:
    low, high = iqr(values)
    return f"{statistics.median(values):{spec}} [{low:{spec}}-{high:{spec}}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--syncs", nargs="+", help="default: zero fsdp ddp (--quick: ddp)")
    parser.add_argument("--steps", type=int, default=6, help="steps per job, a save every 2")
    parser.add_argument("--quick", action="store_true", help="ddp only (unless --syncs), 1 round, 2 steps: one save")
    opts = parser.parse_args()
    if opts.quick:
        opts.rounds, opts.steps = 1, 2
    opts.syncs = opts.syncs or (["ddp"] if opts.quick else ["zero", "fsdp", "ddp"])
    jobs = [(sync, layout) for sync in opts.syncs for layout in ("full", "sharded", "async")]
    found: dict[tuple[str, str], list[list[tuple[float, float, float]]]] = {job: [] for job in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opts.rounds):
            for i, job in enumerate(jobs[r % len(jobs) :] + jobs[: r % len(jobs)]):
                found[job].append(run_once(*job, Path(tmp) / f"{r}-{i}", opts.steps))
    per_job = opts.steps // 2
    print(
        f"checkpoint cost, 2 ranks, 102 MB of state ({opts.rounds} rounds x {per_job} saves, interleaved; median [IQR])"
    )
    header = (
        f"{'sync':6} {'format':8} {'step blocked ms':>20} {'peak RSS in a save MiB':>24} {'1st save: rise MiB':>20}"
    )
    print(header + f" {'/ full: ms, rise':>24}")
    for sync, layout in jobs:
        saves = [save for run in found[(sync, layout)] for save in run]
        ms, peak = [1000 * s for s, _, _ in saves], [p for _, p, _ in saves]
        rise = [run[0][2] for run in found[(sync, layout)]]  # the first save: no earlier save's pages to reuse
        ratio = ""
        if layout != "full":
            full = [save for run in found[(sync, "full")] for save in run]
            full_rise = statistics.median(run[0][2] for run in found[(sync, "full")])
            ratio = f"{statistics.median(ms) / statistics.median(1000 * s for s, _, _ in full):.2f}, "
            ratio += f"{statistics.median(rise) / full_rise:.2f}" if full_rise > 1 else "-"
        cells = f"{spread(ms, '.0f'):>20} {spread(peak, '.0f'):>24} {spread(rise, '.1f'):>20}"
        print(f"{sync:6} {layout:8} {cells} {ratio:>24}")


if __name__ == "__main__":
    main()
