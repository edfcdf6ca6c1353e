"""Collective benchmark: latency and bus bandwidth of the four synchronisation operations.

    torchrun --nproc_per_node=2 -m trainer.tools.collectives [--min-bytes 4096] [--max-bytes 67108864]
        [--iters 20] [--warmup 5] [--out DIR] [--device auto|cpu|cuda] [--dtype float32]
    python -m trainer.tools.collectives          # world size 1: runs, but measures no communication

The command line only (arguments, table, plot, results files); what is measured and how, and the
bandwidth formulas (nccl-tests', so numbers compare with theirs and with a link's speed), live in
collective_ops.py, which tests and benchmarks import without argparse or matplotlib.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trainer.core import hostname
from trainer.errors import ConfigError
from trainer.setup import dist as ddist
from trainer.tools.collective_ops import APIS, OPS, REPEATS, Record, run_sweep, sweep_sizes

DEFAULT_MAX_BYTES = 64 * 2**20  # ~1 min on 2 CPU ranks over gloo; up to 256 MiB took 4 min there


def format_bytes(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes} B"


def format_table(records: Sequence[Record]) -> str:
    """One table per operation, sizes as rows: the median over the repeats and its min-max spread.

    busbw's spread comes from the repeats' times (the fastest repeat gives the highest busbw).
    """
    tables = []
    for op in dict.fromkeys(r["op"] for r in records):  # in the order measured
        lines = [
            f"{op}",
            f"  {'size':>10} {'time us':>10} {'(min-max)':>19} {'busbw GB/s':>11} {'(min-max)':>17}",
        ]
        for r in (r for r in records if r["op"] == op):
            times = r.get("seconds_per_repeat") or [r["seconds"]]
            scale = r["busbw_GBps"] * r["seconds"]  # busbw x seconds is the same for every repeat
            lo, hi = min(times), max(times)
            lines.append(
                f"  {format_bytes(r['size_bytes']):>10} {r['seconds'] * 1e6:>10.1f} "
                f"{f'({lo * 1e6:.1f}-{hi * 1e6:.1f})':>19} {r['busbw_GBps']:>11.3f} "
                f"{f'({scale / hi:.3f}-{scale / lo:.3f})':>17}"
            )
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


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
                "hostname": hostname(),
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
