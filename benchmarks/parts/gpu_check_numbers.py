"""The key numbers of each check of `make gpu-check`, read from its log and outputs.

Apart from benchmarks/gpu_check.py (what runs, and the table) because each reader knows one
check's output format; a reader raising means the check's output was not what it should be.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

PYTEST_FINAL = re.compile(r"^=*\s*\d+ (passed|failed|skipped|deselected|error).* in [\d.]+s")


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def tests_numbers(log: Path) -> str:
    """pytest's last line, e.g. "12 passed, 3 skipped, 140 deselected in 95.21s"."""
    final = [line for line in log.read_text().splitlines() if PYTEST_FINAL.match(line)]
    return final[-1].strip("= ")


def demo_numbers(run_dir: Path) -> str:
    s = summary(run_dir)
    if s["backend"] != "nccl":
        raise ValueError(f"the demo ran on {s['backend']}/{s['device']}, not nccl")
    return (
        f"{s['world_size']} rank(s) nccl: {s['steps']} steps, train/loss {s['train/loss']:.4f}, eval/accuracy "
        f"{s['eval/accuracy']:.3f}, {s['throughput/global_samples_per_s']:.0f} samples/s"
    )


def fallback_numbers(run_dir: Path, log: Path) -> str:
    s = summary(run_dir)
    warnings = [line for line in log.read_text().splitlines() if "GPU" in line and line.startswith("[rank")]
    if (s["backend"], s["device"]) != ("gloo", "cpu") or len(warnings) != 1 or not warnings[0].startswith("[rank0]"):
        raise ValueError(
            f"expected gloo on cpu and one warning from rank 0, got {s['backend']}/{s['device']}, "
            f"{len(warnings)} warning line(s)"
        )
    rate = s["throughput/global_samples_per_s"]
    return f"{s['world_size']} ranks gloo on cpu, {rate:.0f} samples/s; rank 0 warned once: {warnings[0][8:90]}..."


def collectives_numbers(out: Path) -> str:
    report = json.loads((out / "collectives.json").read_text())
    largest = max(r["size_bytes"] for r in report["results"])
    (r,) = [r for r in report["results"] if r["op"] == "all_reduce" and r["size_bytes"] == largest]
    size = f"all_reduce {largest / 2**20:g} MiB {r['seconds'] * 1e6:.1f} us"
    if report["world_size"] == 1:
        return f"{size}, algbw {r['algbw_GBps']:.1f} GB/s; world size 1: no link used, busbw 0"
    return f"{size}, busbw {r['busbw_GBps']:.1f} GB/s on {report['world_size']} ranks"


def overhead_cell(row: dict[str, Any]) -> str:
    extra = f" ({row['extra_us']:+.0f} us)" if row.get("extra_us") is not None else ""
    return f"{row['sync']} {row['ratio']:.3f}{extra}"


def overhead_numbers(path: Path) -> str:
    rows = json.loads(path.read_text())
    models = dict.fromkeys(row["model"] for row in rows)
    lines = [f"{model}: " + ", ".join(overhead_cell(r) for r in rows if r["model"] == model) for model in models]
    return "framework / hand-written time per step (extra per step):\n" + "\n".join(lines)


def pieces_numbers(log: Path) -> str:
    """The pieces and total of `benchmarks/overhead.py pieces`'s table, one line."""
    cells = [line.strip("| ").replace("*", "").split(" | ") for line in log.read_text().splitlines()]
    pieces = [f"{name} {us}" for name, us in (c for c in cells if len(c) == 2) if us.replace(".", "").isdigit()]
    return "host us per step: " + ", ".join(pieces)


def memory_numbers(path: Path) -> str:
    """benchmarks/memory_check.py's JSON, one line: the largest error of the predicted total against
    the measured one (on CUDA the allocator's peak), and its case."""
    import json

    cases = json.loads(path.read_text())
    errors = []
    for case in cases:
        predicted, measured = case["predicted"]["memory/peak_mb"], case["measured"]["memory/peak_mb"]
        errors.append(((predicted - measured) / measured, f"{case['case']} x{case['ranks']}"))
    worst, where = max(errors, key=lambda e: abs(e[0]))
    return f"{len(cases)} cases; total predicted vs measured: worst {worst:+.1%} ({where})"
