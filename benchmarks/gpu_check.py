"""The GPU check: one command that shows ddplab working on this machine's GPUs, with a summary.

    make gpu-check                                    # = .venv/bin/python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --out gpu-check    # every check's log and outputs land in --out
    python benchmarks/gpu_check.py --only demo,collectives

Each check is a subprocess with a timeout, on every visible GPU:
  tests        pytest -m gpu (nccl end to end, bf16, CUDA phase timing, resume, equivalence, device choice)
  demo         torchrun --nproc_per_node=<GPUs> train.py trainer.max_steps=200 trainer.device=cuda logger=none
  fallback     with one GPU only: 2 ranks and trainer.device=auto run on CPU with gloo, rank 0 warning once
  collectives  torchrun -m trainer.tools.collectives --device cuda, 4 KiB to 16 MiB on nccl
  overhead     benchmarks/overhead.py step --device cuda: mlp-tiny, mlp-25M, cnn, one variant per strategy, 1 rank
  pieces       benchmarks/overhead.py pieces --device cuda: the framework's host µs per step, piece by piece
  memory       benchmarks/memory_check.py --device cuda --ranks 1: the predicted total per rank against
               the CUDA allocator's peak, every strategy on the mlp and the gpt (docs/memory.md)
Then one table: each check, pass or FAIL, seconds, key numbers (also in <out>/summary.txt). About
7 minutes on one H200. Exit code: 0 when every check passed, 1 when any failed, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.parts.gpu_check_numbers import (  # noqa: E402
    collectives_numbers,
    demo_numbers,
    fallback_numbers,
    memory_numbers,
    overhead_numbers,
    pieces_numbers,
    tests_numbers,
)

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")  # the venv's, next to its python
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
CHECKS = ("tests", "demo", "fallback", "collectives", "overhead", "pieces")
OVERHEAD = str(REPO / "benchmarks" / "overhead.py")  # its first argument names the section
MEMORY_CHECK = str(REPO / "benchmarks" / "memory_check.py")


@dataclass
class Check:
    name: str
    cmd: list[str]
    timeout_s: float
    numbers: Callable[[Path], str]  # this check's key numbers from its log and outputs, after exit 0


@dataclass
class Outcome:
    name: str
    passed: bool
    status: str
    seconds: float
    numbers: str


def train_cmd(nproc: int, *overrides: str) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "train.py"),
        "logger=none",
        "trainer.progress_bar=false",
        *overrides,
    ]


def plan(out: Path, gpus: int) -> list[Check]:
    """The checks for this machine's GPU count; each writes only under out/<name>/ and out/<name>.log."""
    demo, fallback, coll, overhead = out / "demo", out / "fallback", out / "collectives", out / "overhead"
    checks = [
        Check("tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-q"], 300, tests_numbers),
        Check(
            "demo",
            train_cmd(gpus, "trainer.device=cuda", "trainer.max_steps=200", f"hydra.run.dir={demo}"),
            180,
            lambda _: demo_numbers(demo),
        ),
        # More ranks than GPUs: trainer.device=auto must fall back to CPU, not crash on cuda:1.
        Check(
            "fallback",
            train_cmd(2, "trainer.device=auto", "trainer.max_steps=100", f"hydra.run.dir={fallback}"),
            180,
            lambda log: fallback_numbers(fallback, log),
        ),
        Check(
            "collectives",
            [
                TORCHRUN,
                "--standalone",
                f"--nproc_per_node={gpus}",
                "-m",
                "trainer.tools.collectives",
                "--device",
                "cuda",
                "--max-bytes",
                str(16 * 2**20),
                "--iters",
                "10",
                "--out",
                str(coll),
            ],
            180,
            lambda _: collectives_numbers(coll),
        ),
        Check(
            "overhead",
            [
                TORCHRUN,
                "--standalone",
                "--nproc_per_node=1",
                OVERHEAD,
                "step",
                "--device",
                "cuda",
                "--models",
                "mlp-tiny,mlp-25M,cnn",
                # One variant per strategy: the default list (every knob) would not fit the time limit.
                "--strategies",
                "none,manual,bucketed,ddp,zero,fsdp",
                "--steps",
                "30",
                "--json",
                str(overhead / "overhead.json"),
            ],
            360,
            lambda _: overhead_numbers(overhead / "overhead.json"),
        ),
        Check(
            "pieces",
            [sys.executable, OVERHEAD, "pieces", "--device", "cuda", "--number", "5000"],
            120,
            pieces_numbers,
        ),
        Check(
            "memory",
            [sys.executable, MEMORY_CHECK, "--device", "cuda", "--ranks", "1", "--json", str(out / "memory.json")],
            240,
            lambda _: memory_numbers(out / "memory.json"),
        ),
    ]
    return [check for check in checks if check.name != "fallback" or gpus == 1]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the check's whole process group (torchrun and its workers), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run(check: Check, out: Path) -> Outcome:
    shutil.rmtree(out / check.name, ignore_errors=True)  # no stale outputs from an earlier run can pass
    (out / check.name).mkdir(parents=True)
    log = out / f"{check.name}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        sink.write("$ " + " ".join(check.cmd) + "\n")
        sink.flush()
        # A session of its own, so a timeout stops every process the check started.
        proc = subprocess.Popen(
            check.cmd, cwd=REPO, env=ENV, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=check.timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            code = None
    seconds = time.monotonic() - started
    if code != 0:
        status = f"FAIL (timeout {check.timeout_s:.0f} s)" if code is None else f"FAIL (exit {code})"
        return Outcome(check.name, False, status, seconds, f"see {log}")
    try:
        return Outcome(check.name, True, "pass", seconds, check.numbers(log))
    except (OSError, KeyError, ValueError, IndexError) as err:
        return Outcome(check.name, False, "FAIL (output)", seconds, f"{type(err).__name__}: {err}; see {log}")


def format_table(outcomes: list[Outcome], header: str) -> str:
    lines = [header, f"{'check':<12} {'result':<20} {'seconds':>8}  key numbers"]
    for o in outcomes:
        first, *rest = o.numbers.splitlines() or [""]
        lines.append(f"{o.name:<12} {o.status:<20} {o.seconds:>8.1f}  {first}")
        lines.extend(" " * 44 + line for line in rest)
    failed = [o.name for o in outcomes if not o.passed]
    lines.append(f"FAILED: {', '.join(failed)}" if failed else f"all {len(outcomes)} checks passed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="logs and outputs (default: gpu-check/)")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"a comma-separated subset of: {', '.join(CHECKS)}")
    args = parser.parse_args(argv)
    only = args.only.split(",")
    if unknown := sorted(set(only) - set(CHECKS)):
        parser.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu-check: no CUDA device is visible here (torch {torch.__version__}, {build}; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Run it on a machine with "
            "an NVIDIA GPU and driver; `make test` checks everything else on CPU.",
            file=sys.stderr,
        )
        return 2
    gpus, out = torch.cuda.device_count(), args.out.resolve()
    header = (
        f"gpu-check: {gpus} x {torch.cuda.get_device_name(0)} (torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}); logs in {out}"
    )
    print(header, flush=True)
    checks = [check for check in plan(out, gpus) if check.name in only]
    outcomes = []
    for i, check in enumerate(checks, 1):
        print(f"[{i}/{len(checks)}] {check.name}: {' '.join(check.cmd)}", flush=True)
        outcomes.append(outcome := run(check, out))
        print(f"[{i}/{len(checks)}] {check.name}: {outcome.status} in {outcome.seconds:.1f} s", flush=True)
    table = format_table(outcomes, header)
    (out / "summary.txt").write_text(table + "\n")
    print("\n" + table)
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
