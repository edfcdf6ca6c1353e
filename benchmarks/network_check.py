"""The scaling model against the emulated network: python -m trainer.scaling's prediction for a
strategy on a link, next to the same strategy run on that link emulated in the loop (network=...).

    python benchmarks/network_check.py                 # ~8 min on 2 cores; its tables in benchmarks/results/
    python benchmarks/network_check.py --rounds 1 --steps 10 --strategies manual,ddp   # a quick look

Each round runs, one after another: a profile run without emulation (sync=none, network=none, on
the same 2 ranks as the others: with 2 ranks sharing 2 cores, its compute is what each emulated
rank computes, which a 1-rank run would understate), then each strategy twice: on loopback
(network=none), and on the emulated link. Each emulated run is predicted by trainer.scaling for the
same link, every time multiplied by the same network.time_scale, with overlap (the emulated link
waits on a timer, so what it hides costs no cores), from two profiles of that round:
- sync=none's: the model's compute alone, so the prediction leaves out the strategy's own work
  (DDP's bucket copies, zero's sharded step) and what the real collectives take from compute;
- the strategy's own loopback run: its compute with those in, its waits for communication taken
  out (trainer/scaling/profile.py), under the same real traffic as the emulated run's.
Rounds interleave, so the machine's drift reaches every strategy alike; the table gives each
number's median over rounds and its spread (min-max). A ratio is predicted / measured step time
(each rank's median time/step_s, averaged over ranks); the model's assumptions are listed in
trainer/scaling/predict.py, and the columns after them say which one a miss comes from: the
communication model (exposed ms, predicted against measured) or the compute (the emulated run's
compute, its step less its exposed communication, against each profile's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from trainer.links import (  # noqa: E402
    PRESETS,  # noqa: E402
    Network,
    Topology,
)
from trainer.scaling.options import schedules  # noqa: E402
from trainer.scaling.predict import Prediction, predict  # noqa: E402
from trainer.scaling.profile import measured_step_s, read_profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
# experiment=network_strategies's model and batch: 46.4 MB of gradients, 2 buckets at the default cap
MODEL = ["model=mlp", f"model.hidden_sizes=[{','.join(['1024'] * 12)}]", "data.batch_size=64"]
STRATEGIES = ("manual", "bucketed", "ddp", "zero")


def train(run_dir: Path, overrides: list[str], steps: int) -> None:
    """One 2-rank run; its output goes to run_dir/torchrun.log (the table is what this prints)."""
    common = ["logger=none", "trainer.device=cpu", "trainer.progress_bar=false", f"trainer.max_steps={steps}"]
    common += ["trainer.log_every_n_steps=5", "trainer.eval_every_n_steps=0", f"hydra.run.dir={run_dir}"]
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), *common, *MODEL, *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "torchrun.log", "w") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=log)


@dataclass(frozen=True)
class Row:
    """One emulated run of a strategy and its two predictions (seconds)."""

    measured: float  # its step
    exposed: float  # its communication the step waited for
    model: Prediction  # from sync=none's profile
    own: Prediction  # from the strategy's own loopback run
    compute: float  # sync=none's profile's compute
    own_compute: float  # the loopback run's compute, its waits taken out


def scaled(preset: str, time_scale: float) -> Network:
    """The preset as network=<preset> network.time_scale=<s> emulates it: every time x s, i.e. alpha
    x s and beta / s (the ring's time is linear in alpha and 1/beta)."""
    link = PRESETS[preset].link("all_reduce")
    return Network.uniform(f"{preset} x{time_scale:g}", link.alpha_s * time_scale, link.beta_Bps / time_scale)


def rank_mean(run_dir: Path, key: str) -> float:
    """The mean over ranks of each rank's median of a metric (0 when no rank logged it)."""
    ranks = json.loads((run_dir / "summary.json").read_text())["ranks"]
    values = [r[key] for r in ranks if r.get(key) is not None]
    return sum(values) / len(values) if values else 0.0


def spread(values: list[float], scale: float = 1e3, fmt: str = ".1f") -> str:
    return f"{statistics.median(values) * scale:{fmt}} ({min(values) * scale:{fmt}}-{max(values) * scale:{fmt}})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("network-check"))
    parser.add_argument("--network", default="100gbe", choices=[p for p in PRESETS if p != "loopback"])
    parser.add_argument("--time-scale", type=float, default=25.0, help="network.time_scale (default 25)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    network = scaled(args.network, args.time_scale)
    topo = Topology(2, 1, network, network)  # network.gpus_per_node=1: every rank its own node
    link = [f"network={args.network}", f"network.time_scale={args.time_scale:g}"]
    print(f"link: {network.describe()}; {args.rounds} rounds of {args.steps} steps, 2 ranks", flush=True)
    rows: dict[str, list[Row]] = {s: [] for s in strategies}
    described, _ = schedules()  # what each strategy's step sends
    sharded = {name for name, schedule in described.items() if schedule.optimizer_shard is not None}
    computes: list[float] = []
    out = args.out.resolve()
    for round_ in range(1, args.rounds + 1):
        profile_dir = out / f"round{round_}" / "profile"
        train(profile_dir, ["sync=none", "network=none"], args.steps)
        profile = read_profile(profile_dir)
        computes.append(profile.compute_s)
        for strategy in strategies:  # every strategy once per round: the rounds interleave
            own_dir = out / f"round{round_}" / f"{strategy}-loopback"
            train(own_dir, [f"sync={strategy}", "network=none"], args.steps)
            own = read_profile(own_dir, sharded)
            run_dir = out / f"round{round_}" / strategy
            train(run_dir, [f"sync={strategy}", *link], args.steps)
            row = Row(
                measured=measured_step_s(run_dir),
                exposed=rank_mean(run_dir, "median_time/comm_exposed_s"),
                model=predict(profile, topo, strategy, described[strategy], overlap=True),
                own=predict(own, topo, strategy, described[strategy], overlap=True),
                compute=profile.compute_s,
                own_compute=own.compute_s,
            )
            rows[strategy].append(row)
            print(
                f"round {round_} {strategy}: measured {row.measured * 1e3:.1f} ms, predicted from sync=none "
                f"{row.model.step_s * 1e3:.1f} ms ({row.model.step_s / row.measured:.3f}), from its loopback run "
                f"{row.own.step_s * 1e3:.1f} ms ({row.own.step_s / row.measured:.3f}); exposed "
                f"{row.exposed * 1e3:.1f} against {row.model.exposed_s * 1e3:.1f} ms",
                flush=True,
            )
    lines = [
        f"profile (sync=none, no emulation): compute {spread(computes)} ms per step",
        "| strategy | measured step ms | predicted from sync=none ms | predicted / measured "
        "| predicted from its loopback run ms | predicted / measured | measured exposed ms | predicted exposed ms "
        "| measured compute ms | sync=none's compute ms | its loopback run's compute ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy, runs in rows.items():
        ratios = [spread([r.model.step_s / r.measured for r in runs], 1, ".3f")]
        own_ratios = [spread([r.own.step_s / r.measured for r in runs], 1, ".3f")]
        cells = [
            spread([r.measured for r in runs]),
            spread([r.model.step_s for r in runs]),
            *ratios,
            spread([r.own.step_s for r in runs]),
            *own_ratios,
            spread([r.exposed for r in runs]),
            spread([r.model.exposed_s for r in runs]),
            spread([r.measured - r.exposed for r in runs]),
            spread([r.compute for r in runs]),
            spread([r.own_compute for r in runs]),
        ]
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
