"""Collective benchmark: latency and bus bandwidth of the four synchronisation operations.

    torchrun --nproc_per_node=2 -m trainer.tools.collectives [--min-bytes 4096] [--max-bytes 67108864]
        [--iters 20] [--warmup 5] [--out DIR] [--device auto|cpu|cuda] [--dtype float32]
    python -m trainer.tools.collectives          # world size 1: runs, but measures no communication

Ops: broadcast, all_reduce, all_gather, reduce_scatter, and all_reduce_composed (reduce_scatter
then all_gather: "all_reduce = reduce_scatter + all_gather"). Bandwidths are nccl-tests' (its
doc/PERFORMANCE.md), so numbers compare with theirs and with a link's speed. gloo has both tensor
forms (torch >= 2.3), but runs reduce_scatter as a full all_reduce then keeps this rank's chunk.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trainer.errors import ConfigError
from trainer.setup import dist as ddist

OPS = ("broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_reduce_composed")
REPEATS = 3  # timed runs of `iters` calls each; the median of them is reported
DEFAULT_MAX_BYTES = 64 * 2**20  # ~1 min on 2 CPU ranks over gloo; up to 256 MiB took 4 min there
# torch 2.14 renamed the tensor forms (*_single), deprecating the old names; older torch has only those.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
APIS = {
    "all_gather": f"dist.{_all_gather_tensor.__name__}",
    "reduce_scatter": f"dist.{_reduce_scatter_tensor.__name__}",
}
Record = dict[str, Any]  # one op at one size: op, size_bytes, seconds, seconds_per_repeat, algbw_GBps, busbw_GBps


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw, nccl-tests' factors: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n,
    broadcast 1. Scaled so that busbw compares with a link's speed whatever the op and n; 0 at n = 1.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}")
    if world_size <= 1:
        return 0.0  # one process moves nothing over any link
    share = (world_size - 1) / world_size
    return {"broadcast": 1.0, "all_gather": share, "reduce_scatter": share}.get(op, 2 * share)


def bandwidths(op: str, size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s: algbw = S / t, S the full buffer (all_gather's output, reduce_scatter's input)."""
    algbw = size_bytes / seconds
    return algbw, algbw * bus_factor(op, world_size)


def all_reduce_floor_s(num_bytes: int, world_size: int, busbw: float) -> float:
    """Seconds an all_reduce of num_bytes needs at busbw (bytes/s): the floor for DDP's gradient sync."""
    factor = bus_factor("all_reduce", world_size)
    if factor and busbw <= 0:
        raise ValueError(f"busbw={busbw} must be > 0 bytes/s")
    return num_bytes * factor / busbw if factor else 0.0


def sweep_sizes(min_bytes: int, max_bytes: int, world_size: int, element_size: int) -> list[int]:
    """min_bytes x 2^k up to max_bytes, rounded to whole elements divisible by world_size: every op
    splits S into world_size equal chunks (all_gather's input, reduce_scatter's output)."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    unit = element_size * world_size
    num_steps = (max_bytes // min_bytes).bit_length()  # k = 0 .. floor(log2(max / min))
    return sorted({max(unit, (min_bytes << k) // unit * unit) for k in range(num_steps)})


def _reduce_scatter_all_gather(flat: torch.Tensor, shard: torch.Tensor, out: torch.Tensor) -> None:
    _reduce_scatter_tensor(shard, flat, op=dist.ReduceOp.SUM)
    _all_gather_tensor(out, shard)


def composed_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """all_reduce(SUM) as reduce_scatter then all_gather, into a new tensor: the identity ZeRO and FSDP
    build on (each rank reduces only its 1/n shard, then shares it)."""
    world_size = dist.get_world_size()
    if tensor.numel() % world_size:
        raise ValueError(f"{tensor.numel()} elements do not split into {world_size} equal shards")
    flat = tensor.reshape(-1)
    out = torch.empty_like(flat)
    _reduce_scatter_all_gather(flat, flat.new_empty(flat.numel() // world_size), out)
    return out.view(tensor.shape)


def _make_call(op: str, num_bytes: int, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """One call of op on buffers allocated once, so no timed call allocates S (as with NCCL's own tests)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}")
    world_size = dist.get_world_size()
    numel = num_bytes // torch.empty((), dtype=dtype).element_size()
    if numel == 0 or numel % world_size:
        raise ValueError(f"{num_bytes} bytes of {dtype} do not split into {world_size} equal shards")
    full = torch.zeros(numel, dtype=dtype, device=device)  # zeros: repeated sums stay finite
    shard = torch.zeros(numel // world_size, dtype=dtype, device=device)
    out = torch.empty_like(full) if op == "all_reduce_composed" else full
    return {
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_reduce": lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM),
        "all_gather": lambda: _all_gather_tensor(full, shard),
        "reduce_scatter": lambda: _reduce_scatter_tensor(shard, full, op=dist.ReduceOp.SUM),
        "all_reduce_composed": lambda: _reduce_scatter_all_gather(full, shard, out),
    }[op]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels are asynchronous: the clock must wait for them


def time_repeats(
    op: str,
    num_bytes: int,
    iters: int,
    warmup: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    repeats: int = REPEATS,
) -> list[float]:
    """Seconds per call in each timed repeat, the slowest rank's: a collective ends when its last rank does.
    Every rank of the group must call this with the same arguments, in the same order."""
    call = _make_call(op, num_bytes, device, dtype)
    for _ in range(warmup):
        call()
    per_call = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()  # every rank starts the timed calls together
        _sync(device)
        start = time.monotonic()
        for _ in range(iters):
            call()
        _sync(device)
        per_call.append((time.monotonic() - start) / iters)
    slowest = torch.tensor(per_call, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # outside the timed region; all ranks agree
    return slowest.tolist()


def measure(op: str, num_bytes: int, iters: int, warmup: int, device: torch.device) -> float:
    """Median seconds per call of op on num_bytes of float32, the same on every rank (group initialised)."""
    return statistics.median(time_repeats(op, num_bytes, iters, warmup, device))


def run_sweep(sizes: Sequence[int], iters: int, warmup: int, device: torch.device, dtype: torch.dtype) -> list[Record]:
    """Every op at every size; every rank runs this same sequence of collectives."""
    world_size = dist.get_world_size()
    records = []
    for size in sizes:
        for op in OPS:
            times = time_repeats(op, size, iters, warmup, device, dtype)
            seconds = statistics.median(times)
            algbw, busbw = bandwidths(op, size, seconds, world_size)
            records.append(
                {
                    "op": op,
                    "size_bytes": size,
                    "seconds": seconds,
                    "seconds_per_repeat": times,
                    "algbw_GBps": algbw / 1e9,
                    "busbw_GBps": busbw / 1e9,
                }
            )
    return records


def format_bytes(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes} B"


def format_table(records: Sequence[Record]) -> str:
    lines = [f"{'op':<20} {'size':>10} {'latency us':>12} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in records:
        lines.append(
            f"{r['op']:<20} {format_bytes(r['size_bytes']):>10} {r['seconds'] * 1e6:>12.1f} "
            f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}"
        )
    return "\n".join(lines)


def plot(records: Sequence[Record], title: str) -> Figure:
    """busbw against S, log-log, one line per op; ops with no bandwidth (world size 1) are not drawn."""
    fig = Figure(figsize=(9, 5.5))
    FigureCanvasAgg(fig)  # Agg renders to files only; no pyplot figure stays alive
    ax = fig.subplots()
    ax.set_xscale("log", base=2)
    for i, op in enumerate(OPS):
        points = [(r["size_bytes"], r["busbw_GBps"]) for r in records if r["op"] == op and r["busbw_GBps"] > 0]
        if points:
            ax.plot(*zip(*points, strict=True), "o-", ms=4, color=f"C{i}", label=op)
    if ax.lines:
        ax.set_yscale("log")
        ax.legend(fontsize=9)
    else:
        ax.text(0.5, 0.5, "world size 1: no communication, busbw is 0", ha="center", transform=ax.transAxes)
    sizes = sorted({r["size_bytes"] for r in records})
    ax.set_xticks(sizes, [format_bytes(s) for s in sizes], rotation=45, fontsize=8)
    ax.set(xlabel="message size S (bytes, log scale)", ylabel="bus bandwidth busbw (GB/s = 1e9 B/s, log scale)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m trainer.tools.collectives", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--min-bytes", type=int, default=4096, help="smallest S; sizes double up to --max-bytes")
    parser.add_argument(
        "--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="largest S (~1 min to 64 MiB on 2 CPU ranks)"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per repeat")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before each op and size")
    parser.add_argument("--out", type=Path, default=None, help="default: collectives/<timestamp> under the cwd")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default="float32")
    parser.add_argument("--timeout-s", type=float, default=300, help="a collective waiting longer fails the run")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.min_bytes <= 0 or args.max_bytes < args.min_bytes:
        parser.error(
            "need --iters >= 1, --warmup >= 0 and 0 < --min-bytes <= --max-bytes, got "
            f"{args.iters}, {args.warmup}, {args.min_bytes}, {args.max_bytes}"
        )
    return args


def write_results(out: Path, records: Sequence[Record], meta: dict[str, Any]) -> None:
    """collectives.json (every number, and what produced it) and collectives.png."""
    (out / "collectives.json").write_text(json.dumps({**meta, "results": list(records)}, indent=2) + "\n")
    title = f"busbw: {meta['world_size']} rank(s), {meta['backend']} on {meta['device']}, {meta['dtype']}"
    plot(records, title).savefig(out / "collectives.png", dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    env = ddist.read_launch_env()
    try:
        device = ddist.resolve_device(args.device, env)
    except ConfigError as err:  # the only one left after argparse's choices: too few GPUs for --device=cuda
        print(f"error: --device={args.device}: {err}", file=sys.stderr)
        return 2
    prefix = f"ddplab-collectives/{env.run_id}/attempt-{env.restart_count}/"
    ctx = ddist.init_process_group(env, ddist.job_store(env), device, timeout_s=args.timeout_s, key_prefix=prefix)
    try:
        dtype = getattr(torch, args.dtype)
        sizes = sweep_sizes(args.min_bytes, args.max_bytes, ctx.world_size, torch.empty((), dtype=dtype).element_size())
        out = args.out or Path("collectives") / dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        if ctx.is_main_process:
            out.mkdir(parents=True, exist_ok=True)  # before the sweep: an unwritable --out fails at once
            print(
                f"{ctx.world_size} rank(s), {ctx.backend} on {device}, {args.dtype}, {len(sizes)} sizes "
                f"{format_bytes(sizes[0])}..{format_bytes(sizes[-1])}, {args.warmup} warmup + {REPEATS} x "
                f"{args.iters} timed calls per op and size; " + ", ".join(f"{k}: {v}" for k, v in APIS.items()),
                flush=True,
            )
        records = run_sweep(sizes, args.iters, args.warmup, device, dtype)
        if ctx.is_main_process:
            print(format_table(records))
            if ctx.world_size == 1:
                print("note: a single process measures no communication: every bus factor, so every busbw, is 0")
            meta = {
                "world_size": ctx.world_size,
                "backend": ctx.backend,
                "device": str(device),
                "dtype": args.dtype,
                "torch_version": torch.__version__,
                "hostname": ddist.hostname(),
                "iters": args.iters,
                "warmup": args.warmup,
                "repeats": REPEATS,
                "apis": APIS,
                "units": "seconds: median per call; algbw_GBps = S / seconds, busbw_GBps = algbw x bus factor,"
                " in 1e9 B/s; S = size_bytes",
            }
            write_results(out, records, meta)
            print(f"wrote {out / 'collectives.json'}, {out / 'collectives.png'}")
        dist.barrier()  # every rank must reach this: nobody tears the group down while rank 0 writes
    finally:
        ddist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
