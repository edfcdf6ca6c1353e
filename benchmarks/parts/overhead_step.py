"""overhead.py step: ddplab's whole step against a minimal hand-written loop, side by side.

    torchrun --nproc_per_node=2 benchmarks/overhead.py                  # = step: the default models and strategies
    torchrun --nproc_per_node=2 benchmarks/overhead.py step --quick     # a smoke run (mlp-tiny, 2 rounds x 3 steps)
    torchrun --nproc_per_node=2 benchmarks/overhead.py step --models mlp-wide,mlp-deep --baseline ddp
    torchrun --nproc_per_node=1 benchmarks/overhead.py step --device cuda   # one GPU (make gpu-check runs this)

For each model (by default: an MLP of ~25 M parameters, where communication is heavy; the cnn, where
compute is; a tiny MLP whose sub-millisecond step shows any per-step bookkeeping; with --models also
mlp-wide, a few huge tensors, mlp-deep, 102 small ones, and the gpt) and each strategy (STRATEGIES
below), both implementations train the same model on the same data with the same per-rank batch
and optimizer. The hand-written loop is what a PyTorch DDP tutorial writes, plain torch and no
logging, except that it gathers each batch from the in-memory tensors with one index, as the
framework's loader does: the ratio then measures the framework's bookkeeping, not two ways of
loading data. A second hand-written loop logs a row as torchtitan does: every
trainer.log_every_n_steps steps (10, as the framework) the loss is all-reduced and read on the host;
"/ hand-written that logs" compares the framework with that, a loop that reports what it trains.
Rounds interleave the implementations (the framework first, then the loops first, ...); each round
times a fixed number of steps after a barrier, and a job's time is its slowest rank's. Reported:
medians over rounds, the ratio framework / loop, and the framework's communication time per step
against the floor of one all_reduce of the same bytes measured in the same run (sync efficiency =
floor / communication time). The loop has no knobs: for manual it all-reduces each gradient, for ddp
and bucketed it wraps the model in PyTorch's DistributedDataParallel (bucket_cap_mb=25), so
bucketed's ratio reads "the framework's hand-built DDP / PyTorch's DDP"; for zero stages 1 and 2 it
uses DDP with torch's ZeroRedundancyOptimizer (zero's ratio reads "ZeRO by hand / torch's sharded
optimizer"), for zero:stage=3 and fsdp fully_shard per block or layer (FSDP2, what PyTorch offers
for sharded parameters). grad MB: the gradient memory a rank holds right after after_backward, for
ddp, zero and fsdp (one extra step, untimed; from the .grad tensors' storages: DDP's reducer
buckets are not a .grad and not counted). --baseline STRATEGY times the framework under that
strategy too, in the same rounds (the three interleaved, the order reversed every other round), and
adds "/ baseline": the median of the per-round ratios framework / baseline, with their
interquartile range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.parts.overhead_loops import MODELS, Framework, HandWritten
from benchmarks.parts.rounds import iqr, timed
from trainer.comm_math import wire_factor
from trainer.setup import dist as ddist
from trainer.tools.collective_ops import measure

DEFAULT_MODELS = ("mlp-25M", "cnn", "mlp-tiny")
# manual's default flattens gradients into all_reduces of up to 25 MiB; coalesce_mb=0 is the
# textbook one call per gradient, as the hand-written loop does. ddp:time_buckets=true writes DDP's
# all-reduce as a Python hook through the lab's communication object (what network= needs). bucketed is
# DDP built by hand; collective=rs_ag does each all_reduce as reduce_scatter + all_gather.
STRATEGIES = (
    "none",
    "manual:coalesce_mb=0",
    "manual",
    "manual:collective=rs_ag",
    "bucketed",
    "bucketed:collective=rs_ag",
    "ddp",
    "ddp:time_buckets=true",
    "zero:stage=1",
    "zero",
    "zero:stage=3",
    "fsdp",
)
# The strategies that communicate only inside after_backward: their "sync alone" is their communication.
SYNC_PHASE_ONLY = ("manual",)
# The strategies whose gradient memory after backward the table shows (the sharding comparison).
GRAD_MEMORY = ("ddp", "zero", "fsdp")
CUDA_STRATEGIES = STRATEGIES


@dataclass
class Result:
    model: str
    strategy: str
    framework_s: list[float] = field(default_factory=list)
    loop_s: list[float] = field(default_factory=list)
    logging_loop_s: list[float] = field(default_factory=list)  # the loop that logs a row as torchtitan does
    comm_s: float = 0.0
    exposed_s: float = 0.0
    bytes_per_step: float = 0.0
    floor_s: float = 0.0
    alone_s: float | None = None
    grad_mb: float | None = None  # gradient MiB a rank holds after backward (sharding strategies and ddp)
    baseline_s: list[float] = field(default_factory=list)  # the framework under --baseline, same rounds

    def row(self) -> dict[str, object]:
        fw, hw = statistics.median(self.framework_s), statistics.median(self.loop_s)
        ratios = [f / h for f, h in zip(self.framework_s, self.loop_s, strict=True)]
        efficiency = self.floor_s / self.alone_s if self.alone_s else None
        extra_us = statistics.median(f - h for f, h in zip(self.framework_s, self.loop_s, strict=True)) * 1e6
        against = [f / b for f, b in zip(self.framework_s, self.baseline_s, strict=True)] if self.baseline_s else []
        logging = [f / h for f, h in zip(self.framework_s, self.logging_loop_s, strict=True)]
        return {
            "model": self.model,
            "sync": self.strategy,
            "framework_ms": fw * 1e3,
            "loop_ms": hw * 1e3,
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "ratio_iqr": iqr(ratios),
            "vs_logging_loop": statistics.median(logging),
            "vs_logging_loop_iqr": iqr(logging),
            "vs_baseline": statistics.median(against) if against else None,
            "vs_baseline_iqr": iqr(against) if against else None,
            "extra_us": extra_us,
            "mb_per_step": self.bytes_per_step / 2**20,
            "comm_in_step_ms": self.comm_s * 1e3 if self.comm_s else None,
            "exposed_ms": self.exposed_s * 1e3 if self.comm_s else None,
            "sync_alone_ms": self.alone_s * 1e3 if self.alone_s else None,
            "floor_ms": self.floor_s * 1e3 if self.floor_s else None,
            "sync_efficiency": efficiency,
            "grad_mb": self.grad_mb,
        }


def bench(model: str, strategy: str, args: argparse.Namespace, ctx: ddist.DistContext, out: Path) -> Result:
    overrides = MODELS[model]
    framework = Framework(overrides, strategy, ctx, out / f"{model}-{strategy.replace(':', '-')}", args.set)
    loop = HandWritten(overrides, strategy, ctx)
    every = int(next((s.split("=")[1] for s in args.set if s.startswith("trainer.log_every_n_steps=")), 10))
    logging_loop = HandWritten(overrides, strategy, ctx, log_every=every)
    result = Result(model, strategy)
    impls: list[tuple[list[float], Framework | HandWritten]] = [
        (result.framework_s, framework),
        (result.loop_s, loop),
        (result.logging_loop_s, logging_loop),
    ]
    if args.baseline and args.baseline != strategy:
        base_out = out / f"{model}-baseline-{args.baseline.replace(':', '-')}"
        base = Framework(overrides, args.baseline, ctx, base_out, args.set)
        impls.append((result.baseline_s, base))
    for _, impl in impls:
        impl.run(args.warmup)
    for round_ in range(args.rounds):
        for times, impl in impls if round_ % 2 == 0 else reversed(impls):
            times.append(timed(impl.run, args.steps, ctx.device))
    warmup_rows = max(1, args.warmup // 10)
    result.comm_s, result.exposed_s, result.bytes_per_step = framework.comm(skip_rows=warmup_rows)
    if result.bytes_per_step and ctx.world_size > 1:
        # The floor: one all_reduce that puts the step's bytes on the wire (a buffer of bytes / 2(N-1)/N),
        # split into world_size fp32 shards (the collective benchmark's rule), rounded up by a few bytes.
        grain = 4 * ctx.world_size
        buffer = result.bytes_per_step / wire_factor("all_reduce", ctx.world_size)
        floor_bytes = -(-int(buffer) // grain) * grain
        result.floor_s = measure("all_reduce", floor_bytes, iters=10, warmup=3, device=ctx.device)
        if strategy.split(":")[0] in SYNC_PHASE_ONLY:  # others communicate during backward: no "alone"
            result.alone_s = framework.sync_alone(repeats=11)
    if strategy.split(":")[0] in GRAD_MEMORY:
        result.grad_mb = framework.gradient_mb()
    return result


def format_table(rows: list[dict[str, object]], baseline: str | None = None) -> str:
    def cell(value: object, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    def spread(value: object, bounds: object) -> str:
        if value is None or not isinstance(bounds, (tuple, list)):
            return "-"
        return f"{value:.3f} [{bounds[0]:.2f}–{bounds[1]:.2f}]"

    against = f" | / {baseline} [IQR]" if baseline else ""
    lines = [
        "| model | sync | framework ms/step | hand-written ms/step | framework / hand-written [IQR] "
        f"| / hand-written that logs [IQR]{against} | extra µs/step "
        "| MB/step | comm in step ms | exposed ms | sync alone ms | floor ms | floor / sync alone | grad MB |",
        "|---|---|---|---|---|---|" + ("---|" if baseline else "") + "---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        versus = f" | {spread(r['vs_baseline'], r['vs_baseline_iqr'])}" if baseline else ""
        lines.append(
            f"| {r['model']} | {r['sync']} | {r['framework_ms']:.2f} | {r['loop_ms']:.2f} "
            f"| {spread(r['ratio'], r['ratio_iqr'])} "
            f"| {spread(r['vs_logging_loop'], r['vs_logging_loop_iqr'])}{versus} "
            f"| {r['extra_us']:.0f} "
            f"| {r['mb_per_step']:.1f} | {cell(r['comm_in_step_ms'], '.1f')} | {cell(r['exposed_ms'], '.1f')} "
            f"| {cell(r['sync_alone_ms'], '.1f')} "
            f"| {cell(r['floor_ms'], '.1f')} | {cell(r['sync_efficiency'], '.2f')} | {cell(r['grad_mb'], '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="overhead.py step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round and implementation")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--models", help=f"of: {', '.join(MODELS)} (default: {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--strategies", help=f"default: {','.join(STRATEGIES)}")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="as trainer.device")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--baseline", help="also time the framework under this strategy in the same rounds")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the framework only, e.g. trainer.log_every_n_steps=100 (repeatable)",
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 steps (on mlp-tiny unless --models)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 2
        args.models = args.models or "mlp-tiny"
    args.models = args.models or ",".join(DEFAULT_MODELS)
    if unknown := sorted(set(args.models.split(",")) - set(MODELS)):
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    env = ddist.read_launch_env()
    device = ddist.resolve_device(args.device, env)
    args.strategies = args.strategies or ",".join(CUDA_STRATEGIES if device.type == "cuda" else STRATEGIES)
    ctx = ddist.init_process_group(env, ddist.job_store(env), device, 600, "ddplab/overhead/")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = [
                bench(m, s, args, ctx, Path(tmp)).row()
                for m in args.models.split(",")
                for s in args.strategies.split(",")
            ]
        if ctx.is_main_process:
            print(
                f"{ctx.world_size} ranks, {ctx.backend} on {ctx.device}, {args.rounds} rounds x {args.steps} steps, "
                "medians over rounds; the job's time per step is its slowest rank's"
                + (f"; the framework with {' '.join(args.set)}" if args.set else "")
            )
            print(format_table(results, args.baseline))
            if args.json:
                args.json.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        ddist.destroy_process_group()
