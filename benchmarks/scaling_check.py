"""The scaling model against this machine: predictions from 1-rank runs and the collective
benchmark, next to measured 2-rank runs and 4-rank runs on two "nodes" over loopback.

    python benchmarks/scaling_check.py                 # ~10 min on 2 cores; the table in docs/scaling.md
    python benchmarks/scaling_check.py --quick         # a smoke run: mlp, ddp only, 10 steps a run, 2 ranks only

The network is fitted to a 2-rank collective benchmark run first, in the same invocation. For each
model: sync=none on 1 rank (the compute), each strategy on 2 ranks, sync=manual and sync=ddp on 4
ranks (two torchrun "nodes" of 2 ranks meeting through c10d rendezvous), and sync=none on 2 and 4
ranks. Each prediction is what python -m trainer.scaling --no-overlap gives for the measured run's
strategy (on CPU, gloo's collectives need the cores that compute uses, so nothing hides); the
error is predicted / measured - 1 on the step time (each rank's median time/step_s, averaged).

Each run is predicted twice: from the 1-rank compute, as the model is meant to be used, and from
the compute of the sync=none run with as many ranks. The model assumes a device per rank; here N
ranks share 2 cores, which slows compute itself. The second prediction gives the model that
measured compute, so its error is the error of the communication model alone.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from trainer.comm_schedule import Schedule  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402
from trainer.links import Network, Topology  # noqa: E402
from trainer.scaling.networks import fit_network  # noqa: E402
from trainer.scaling.options import schedules  # noqa: E402
from trainer.scaling.predict import predict  # noqa: E402
from trainer.scaling.profile import RunProfile, measured_step_s, read_profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODELS = {  # name -> overrides: latency-bound (0.3 MiB in 6 tensors) and bandwidth-bound (12.6 MiB in 10)
    "mlp": ["model=mlp"],
    "mlp-3m": ["model=mlp", "model.hidden_sizes=[1024,1024,1024,1024]"],
}
STRATEGIES = ("manual", "bucketed", "ddp", "zero", "fsdp")
FOUR_RANKS = ("manual", "ddp")


def train(run_dir: Path, overrides: list[str], nproc: int, steps: int) -> None:
    common = ["logger=none", "trainer.device=cpu", f"trainer.max_steps={steps}", "trainer.log_every_n_steps=10"]
    args = [str(ROOT / "train.py"), *common, "trainer.eval_every_n_steps=0", *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        subprocess.run([sys.executable, *args], check=True, env=env, capture_output=True)
        return
    if nproc == 2:
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", *args]
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        return
    with socket.socket() as sock:  # two "nodes" of 2 ranks: two torchruns meeting through c10d
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    node = [str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d"]
    node += [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=scaling-{port}", *args]
    procs = [subprocess.Popen(node, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    if [p.wait(timeout=600) for p in procs] != [0, 0]:
        raise RuntimeError(f"the 4-rank run in {run_dir} failed")


def predicted_s(profile: RunProfile, network: Network, ranks: int, strategy: str, schedule: Schedule) -> float:
    topo = Topology(ranks, 2, network, network)  # one flat network: loopback between the "nodes" too
    return predict(profile, topo, strategy, schedule, overlap=False).step_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("scaling-check"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--quick", action="store_true", help="mlp only, ddp only, 10 steps, 2 ranks only, collectives to 8 MiB"
    )
    args = parser.parse_args()
    models = {"mlp": MODELS["mlp"]} if args.quick else MODELS
    strategies = ("ddp",) if args.quick else STRATEGIES
    steps = 10 if args.quick else args.steps
    out = args.out.resolve()
    coll = out / "collectives"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "trainer.tools.collectives"]
    # Up to 8 MiB even when quick: below ~1 MiB a busy 2-core machine's noise outgrows the
    # bandwidth term, and the fit finds no bandwidth at all.
    cmd += ["--max-bytes", str((8 if args.quick else 16) * 2**20), "--out", str(coll)]
    cmd += ["--iters", "2"] if args.quick else []
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    try:
        network = fit_network(coll / "collectives.json")
    except ConfigError as err:
        print(f"scaling_check: {err}", file=sys.stderr)
        return 2
    print(f"network: {network.describe()}")
    described, _ = schedules()  # what each strategy's step sends
    lines = [
        "| model | strategy | ranks | measured ms | predicted from 1 rank | error "
        "| from N ranks of sync=none | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, overrides in models.items():
        compute = {}
        four = not args.quick  # the 4-rank jobs (two torchrun "nodes") are the slowest to start
        for ranks in (1, 2, 4) if four else (1, 2):
            train(out / model / f"none-{ranks}", [*overrides, "sync=none"], ranks, steps)
            compute[ranks] = read_profile(out / model / f"none-{ranks}")
        runs = [(s, 2) for s in strategies] + [(s, 4) for s in FOUR_RANKS if s in strategies and four]
        for strategy, ranks in runs:
            run_dir = out / model / f"{strategy}-{ranks}"
            train(run_dir, [*overrides, f"sync={strategy}"], ranks, steps)
            measured = measured_step_s(run_dir)
            row = f"| {model} | {strategy} | {ranks} | {measured * 1e3:.2f} |"
            for profile in (compute[1], compute[ranks]):
                guess = predicted_s(profile, network, ranks, strategy, described[strategy])
                row += f" {guess * 1e3:.2f} | {guess / measured - 1:+.0%} |"
            lines.append(row)
            print(row, flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
