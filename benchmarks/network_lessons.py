"""What a slow emulated link shows, end to end: overlap hides communication, an all_reduce after
backward hides none, and the communication a step waits for is U-shaped in DDP's bucket cap.

    python benchmarks/network_lessons.py              # 8 steps a run (~75 s here); run it unloaded
    python benchmarks/network_lessons.py --quick      # a smoke run: 4 steps a run at batch 512
    python benchmarks/network_lessons.py --out lessons   # keep the runs' directories

Three launches of train.py under torchrun (2 ranks, CPU): a sweep of sync=ddp over three bucket
caps, sync=bucketed at the middle cap, sync=manual. The link is 1gbe with its latency raised to
2 ms a ring step (network.latency_us) and every time x3 (network.time_scale), on an MLP of 48
layers of 256 (98 gradient tensors, 12.4 MB) at batch 2048: one all_reduce of the model takes
~345 ms, a little more than backward, so a mid-sized cap hides about backward's time of it; 48
buckets of 0.25 MiB pay 12 ms of latency each; one bucket of 25 MiB leaves only after backward.

Reported per run: the medians, over the rows after the first (warm-up: DDP rebuilds its buckets),
of the step, the communication (time/comm_s), the part of it the step waited for
(time/comm_exposed_s), the overlap fraction, and the link's floor for the step's bytes (its
bandwidth term, latency left out: the least any bucketing pays). Then each lesson, with whether it
held in this run. They hold on an unloaded machine; on 2 shared cores under other load the real
gloo collectives that run during backward take compute from it, and the step times (then the
exposed times) lose their shape first: compare runs on a quiet machine, not these numbers with a
loaded machine's.
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

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from trainer.links import PRESETS, Link, ring_s  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
TIME_SCALE = 3.0
LINK = ["network=1gbe", "network.latency_us=2000", f"network.time_scale={TIME_SCALE:g}"]
MODEL = [f"model.hidden_sizes=[{','.join(['256'] * 48)}]", "data.batch_size=2048"]
RUN = ["trainer.device=cpu", "logger=none", "trainer.progress_bar=false", "trainer.eval_every_n_steps=0"]
RUN += ["trainer.log_every_n_steps=2", *MODEL, *LINK]
CAPS = (0.25, 2.0, 25.0)
MIDDLE = CAPS[1]


def train(args: list[str], log: Path) -> None:
    """One launch of train.py on 2 ranks; its output goes to log (the table is what this prints)."""
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=sink, stderr=sink)
    if proc.returncode != 0:
        raise SystemExit(f"network_lessons: {' '.join(cmd)} exited {proc.returncode}; its output is in {log}")


def medians(run_dir: Path) -> dict[str, float]:
    """Rank 0's median step, communication, exposed communication and overlap over the rows after the
    first, and the step's gradient bytes."""
    lines = (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()
    rows = [row for row in map(json.loads, lines) if "train/loss" in row][1:]
    if not rows:
        raise SystemExit(f"network_lessons: {run_dir} logged no row after the first: run more steps")
    return {
        "step": statistics.median(r["time/step_s"] for r in rows),
        "comm": statistics.median(r["time/comm_s"] for r in rows),
        "exposed": statistics.median(r["time/comm_exposed_s"] for r in rows),
        "overlap": statistics.median(r["comm/overlap_fraction"] for r in rows),
        "bytes": rows[-1]["comm/bytes_per_step"],
    }


def link_floor_s(nbytes: float) -> float:
    """The least the link takes for a step's gradients however they are bucketed: its bandwidth term
    (2 ranks: a ring all_reduce moves the buffer once each way), latency left out."""
    beta = PRESETS["1gbe"].link("all_reduce").beta_Bps
    return TIME_SCALE * ring_s("all_reduce", nbytes, 2, Link(alpha_s=0.0, beta_Bps=beta))


def measure(out: Path, overrides: list[str]) -> dict[tuple[str, float | None], dict[str, float]]:
    """(sync, cap) -> the run's medians; manual's cap is None (it has no buckets)."""
    run = [*RUN, *overrides]
    caps = ",".join(f"{cap:g}" for cap in CAPS)
    train(["-m", *run, "sync=ddp", f"sync.bucket_cap_mb={caps}", f"hydra.sweep.dir={out}/ddp"], out / "ddp.log")
    found: dict[tuple[str, float | None], dict[str, float]] = {}
    for job in sorted(p for p in (out / "ddp").iterdir() if p.name.isdigit()):
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        (cap,) = [float(o.split("=", 1)[1]) for o in overrides if o.startswith("sync.bucket_cap_mb=")]
        found[("ddp", cap)] = medians(job)
    bucketed = ["sync=bucketed", f"sync.bucket_cap_mb={MIDDLE:g}"]
    train([*run, *bucketed, f"hydra.run.dir={out}/bucketed"], out / "bucketed.log")
    found[("bucketed", MIDDLE)] = medians(out / "bucketed")
    train([*run, "sync=manual", f"hydra.run.dir={out}/manual"], out / "manual.log")
    found[("manual", None)] = medians(out / "manual")
    return found


def table(found: dict[tuple[str, float | None], dict[str, float]]) -> str:
    lines = [
        "| sync | bucket_cap_mb | step ms | comm ms | exposed ms | overlap | link floor ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for (sync, cap), m in found.items():
        cells = [m["step"] * 1e3, m["comm"] * 1e3, m["exposed"] * 1e3]
        lines.append(
            f"| {sync} | {'-' if cap is None else f'{cap:g}'} | "
            + " | ".join(f"{c:.1f}" for c in cells)
            + f" | {m['overlap']:.2f} | {link_floor_s(m['bytes']) * 1e3:.1f} |"
        )
    return "\n".join(lines)


def lessons(found: dict[tuple[str, float | None], dict[str, float]]) -> list[tuple[str, bool, str]]:
    """(lesson, held in this run, the numbers it rests on)."""
    tiny, mid, huge = (found[("ddp", cap)] for cap in CAPS)
    manual = found[("manual", None)]
    ms = [f"{m['exposed'] * 1e3:.0f}" for m in (tiny, mid, huge)]
    floor = link_floor_s(huge["bytes"])
    overlapped = [(sync, found[(sync, MIDDLE)]) for sync in ("ddp", "bucketed")]
    return [
        (
            "the exposed communication is U-shaped in the cap: latency per bucket on the left, no overlap on the right",
            mid["exposed"] < tiny["exposed"] and mid["exposed"] < huge["exposed"],
            f"exposed ms at caps {', '.join(f'{c:g}' for c in CAPS)}: {', '.join(ms)}",
        ),
        (
            "one 25 MiB bucket leaves after backward and waits for the whole link",
            huge["overlap"] <= 0.1 and huge["exposed"] >= 0.8 * floor,
            f"overlap {huge['overlap']:.2f}, exposed {huge['exposed'] * 1e3:.0f} ms, link floor {floor * 1e3:.0f} ms",
        ),
        (
            f"overlap hides the link: ddp and bucketed at {MIDDLE:g} MiB expose under half of manual's",
            all(m["exposed"] < 0.5 * manual["exposed"] for _, m in overlapped),
            ", ".join(f"{sync} {m['exposed'] / manual['exposed']:.2f} of manual's" for sync, m in overlapped),
        ),
        (
            "the link, not loopback, sets the communication: every run's is at least its link floor",
            all(m["comm"] >= 0.95 * link_floor_s(m["bytes"]) for m in found.values()),
            f"comm / link floor {min(m['comm'] / link_floor_s(m['bytes']) for m in found.values()):.2f} at least",
        ),
        (
            "manual's all_reduce after backward hides none of it",
            manual["overlap"] <= 0.05,
            f"overlap {manual['overlap']:.2f}",
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per run (a row every 2; the first row dropped)")
    parser.add_argument(
        "--quick", action="store_true", help="4 steps per run at batch 512: a smoke run, not the lessons' shape"
    )
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    steps, extra = (4, ["data.batch_size=512"]) if args.quick else (args.steps, [])
    print(
        f"link: {' '.join(LINK)}; 2 ranks, gloo on cpu, {steps} steps a run{''.join(f', {e}' for e in extra)}; "
        "medians of rank 0's rows",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        found = measure((args.out or Path(tmp)).resolve(), [f"trainer.max_steps={steps}", *extra])
    print(table(found))
    print()
    for lesson, held, numbers in lessons(found):
        print(f"- {lesson}: {'holds' if held else 'DOES NOT HOLD'} ({numbers})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
