"""Overhead benchmark: ddplab's trainer against a minimal hand-written loop, side by side.

    torchrun --nproc_per_node=2 benchmarks/overhead.py            # docs/performance.md's table (~10 min on 2 cores)
    torchrun --nproc_per_node=2 benchmarks/overhead.py --quick    # a smoke run
    torchrun --nproc_per_node=2 benchmarks/overhead.py --models mlp-wide,mlp-deep   # the shapes below
    torchrun --nproc_per_node=1 benchmarks/overhead.py --device cuda   # one GPU (make gpu-check runs this)
    torchrun --nproc_per_node=1 benchmarks/overhead.py --collective-cost   # network=<preset>'s cost (~1 min)

For each model (by default: an MLP of ~25 M parameters, where communication is heavy; the cnn, where
compute is; a tiny MLP whose sub-millisecond step shows any per-step bookkeeping; with --models also
mlp-wide, a few huge tensors, and mlp-deep, 102 small ones: the shapes where an optimisation of
communication could lose) and each strategy (none, manual, bucketed, ddp, zero, fsdp and their
variants in STRATEGIES), both implementations train the same model on the same data with the same
per-rank batch and optimizer. The hand-written loop is what a PyTorch DDP tutorial writes, plain
torch and no logging, except that it gathers each batch from the in-memory tensors with one index,
as the framework's loader does: the ratio then measures the framework's bookkeeping, not two ways of
loading data. A second hand-written loop logs a row as torchtitan does: every
trainer.log_every_n_steps steps (10, as the framework) the loss is all-reduced and read on the host;
"/ hand-written that logs" compares the framework with that, a loop that reports what it trains.
Rounds interleave the implementations (the framework first, then the loops first, ...); each round
times a fixed number of steps after a barrier, and a job's time is its slowest rank's. Reported:
medians over rounds, the ratio framework / loop, and the framework's communication time per step
against the floor of one all_reduce of the same bytes measured in the same run (sync efficiency =
floor / communication time). The loop has no knobs: for manual it all-reduces each gradient, for ddp
and bucketed it wraps the model in PyTorch's DistributedDataParallel (bucket_cap_mb=25), so
bucketed's ratio reads "the framework's hand-built DDP / PyTorch's DDP"; for zero (both stages) it
uses DDP with torch's ZeroRedundancyOptimizer (so zero's ratio reads "ZeRO by hand / torch's sharded
optimizer"), for fsdp the same fully_shard calls. grad MB: the gradient memory a rank holds right
after after_backward, for ddp, zero and fsdp (one extra step, untimed; from the .grad tensors'
storages: DDP's reducer buckets are not a .grad and not counted). --baseline STRATEGY times the
framework under that strategy too, in the same rounds (the three interleaved, the order reversed
every other round), and adds "/ baseline": the median of the per-round ratios framework / baseline,
with their interquartile range (the sharding table's "zero against ddp's own step").

--collective-cost measures instead what network=<preset> (trainer/sync/network.py) costs: µs per
collective of one small all_reduce along each route it can take (plain torch, the strategy's
Collectives as network=none runs them, EmulatedCollectives on a link of ~0 time, a DDP hook's
delayed future, and a link that binds, to see how late its deadline is kept), then the framework's
step with network=none against the ~0 link; the routes, the rounds and the tables are in
benchmarks/overhead_network.py. One rank is enough (a gloo group of 1 still runs every collective on
gloo's thread, and the links are built for 2 ranks): on 2 ranks sharing 2 cores the loopback's
latency noise buries microseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks import overhead_network as network  # noqa: E402
from benchmarks.overhead_loops import Framework, HandWritten  # noqa: E402
from trainer.setup import dist as ddist  # noqa: E402
from trainer.tools.collective_ops import measure  # noqa: E402

MODELS = {
    "mlp-25M": ["model=mlp", "model.hidden_sizes=[3584,3584,3584]", "data=synthetic", "data.batch_size=64"],
    "cnn": ["model=cnn", "data=fake", "data.batch_size=64", "data.num_samples=4096"],
    # A step of well under a millisecond, where per-step bookkeeping shows.
    "mlp-tiny": ["model=mlp", "model.hidden_sizes=[64]", "data=synthetic", "data.batch_size=64"],
    # Where an optimisation of communication could lose. A few huge tensors (17 M parameters, 64 MiB
    # of them in one 4096x4096 weight, larger than any bucket): bucketing and splitting have little to group.
    "mlp-wide": ["model=mlp", "model.hidden_sizes=[4096,4096]", "data=synthetic", "data.batch_size=64"],
    # Many small tensors (50 hidden layers of 64: 102 gradient tensors, 0.2 M parameters): per-tensor
    # and per-bucket overheads dominate.
    # A transformer with a tied head (nanoGPT's shape, 0.8 M parameters, 52 gradient tensors) on
    # char-level text: the loop fetches windows as nanoGPT's get_batch does, one gather per batch.
    "gpt": [
        "model=gpt",
        "model.n_layer=4",
        "model.n_head=4",
        "model.n_embd=128",
        "model.block_size=64",
        "data=text",
        "data.batch_size=16",
    ],
    "mlp-deep": ["model=mlp", f"model.hidden_sizes=[{','.join(['64'] * 50)}]", "data=synthetic", "data.batch_size=64"],
}
DEFAULT_MODELS = ("mlp-25M", "cnn", "mlp-tiny")
# manual's default flattens gradients into all_reduces of up to 25 MiB; coalesce_mb=0 is the
# textbook one call per gradient, as the hand-written loop does. ddp:time_buckets=true (CPU only)
# times every bucket through a Python hook instead of DDP's sampled runtime statistics. bucketed is
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
    "fsdp",
)
# The strategies whose gradient memory after backward the table shows (the sharding comparison).
GRAD_MEMORY = ("ddp", "zero", "fsdp")
CUDA_STRATEGIES = tuple(s for s in STRATEGIES if s != "ddp:time_buckets=true")


def timed(run: object, steps: int, device: torch.device) -> float:
    """Seconds per step of the slowest rank for `steps` steps started together."""
    dist.barrier()
    started = time.perf_counter()
    run(steps)  # type: ignore[operator]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - started) / steps], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


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
    impls = [(result.framework_s, framework), (result.loop_s, loop), (result.logging_loop_s, logging_loop)]
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
        # The floor's buffer splits into world_size fp32 shards (the collective benchmark's rule):
        # rounded up by a few bytes where a strategy's count does not (fsdp's halves, odd layers).
        grain = 4 * ctx.world_size
        floor_bytes = -(-int(result.bytes_per_step) // grain) * grain
        result.floor_s = measure("all_reduce", floor_bytes, iters=10, warmup=3, device=ctx.device)
        if framework.trainer.sync.comm_in_sync_phase:  # ddp communicates inside backward: no "alone"
            result.alone_s = framework.sync_alone(repeats=11)
    if strategy.split(":")[0] in GRAD_MEMORY:
        result.grad_mb = framework.gradient_mb()
    return result


def iqr(values: list[float]) -> tuple[float, float]:
    """The interquartile range: a difference inside it is noise."""
    if len(values) < 2:
        return (values[0], values[0])
    q = statistics.quantiles(values, n=4)
    return (q[0], q[2])


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="default 15 (--collective-cost: 31)")
    parser.add_argument("--steps", type=int, help="timed steps per round and implementation (default 6; 20)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--models", help=f"of: {', '.join(MODELS)} (default: {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--strategies", help=f"default: {','.join(STRATEGIES)} (on CUDA without time_buckets)")
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
    parser.add_argument(
        "--collective-cost", action="store_true", help="what network=<preset> costs per collective and per step"
    )
    args = parser.parse_args()
    cost = args.collective_cost
    args.rounds, args.steps = args.rounds or (31 if cost else 15), args.steps or (20 if cost else 6)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 2
        args.models = args.models or "mlp-tiny"
    args.models = args.models or ",".join(DEFAULT_MODELS)
    env = ddist.read_launch_env()
    if args.collective_cost and args.device == "cuda":
        parser.error("--collective-cost runs on CPU: network=<preset> times collectives with host clocks (gloo)")
    device = ddist.resolve_device("cpu" if args.collective_cost else args.device, env)
    args.strategies = args.strategies or ",".join(CUDA_STRATEGIES if device.type == "cuda" else STRATEGIES)
    ctx = ddist.init_process_group(env, ddist.job_store(env), device, 600, "ddplab/overhead/")
    try:
        if args.collective_cost:
            network.run(args, ctx, MODELS, timed, iqr)
            return
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


if __name__ == "__main__":
    main()
