"""Turning per-rank metric rows into the numbers of summary.json (pure functions, and the one gather)."""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from trainer import arrivals
from trainer.core import DistContext
from trainer.sync.fsdp_units import blocks_of
from trainer.windows import LAST_EVAL, LAST_ROW, RUN_MEAN, SUMMARY_WINDOWS, grouped

MEDIAN_PREFIXES = ("time/", "comm/", "throughput/", "perf/")  # a rank's typical step
PEAK_PREFIXES = ("memory/",)  # a rank's worst moment


def rank_timing(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """A rank's step anatomy over its logged training rows: medians of times, comms and throughput,
    peaks of memory."""
    stats: dict[str, float] = {}
    keys = sorted({key for row in rows for key in row})
    for key in keys:
        values = [row[key] for row in rows if key in row]
        if key.startswith(MEDIAN_PREFIXES):
            stats[f"median_{key}"] = statistics.median(values)
        elif key.startswith(PEAK_PREFIXES):
            stats[f"peak_{key}"] = max(values)
    return stats


def job_throughput(per_rank_samples_per_s: Sequence[float]) -> float:
    """Ranks process their shards at the same time, so the job's rate is the sum of theirs."""
    return float(sum(per_rank_samples_per_s))


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _token_throughput(ranks: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Token data: the job's whole-run tokens/s (the sum over ranks) and MFU (their mean), where measured."""
    found: dict[str, float] = {}
    if all("tokens_per_s" in r for r in ranks):
        found["throughput/global_tokens_per_s"] = job_throughput([r["tokens_per_s"] for r in ranks])
    if all("mfu" in r for r in ranks):
        found["perf/mfu"] = sum(r["mfu"] for r in ranks) / len(ranks)
    return found


def job_summary(ranks: Sequence[dict[str, Any]], **facts: Any) -> dict[str, Any]:
    """summary.json: the job's facts, the ranks' final numbers combined, and every rank's own."""
    numbers = {
        "train/loss": _mean([r["train/loss"] for r in ranks]),  # mean of the ranks' last windows
        "train/accuracy": _mean([r["train/accuracy"] for r in ranks]),
        "throughput/global_samples_per_s": job_throughput([r["samples_per_s"] for r in ranks]),
        **_token_throughput(ranks),
    }
    # Which steps each number is over (trainer/windows.py), the final evaluation's included.
    windows = {key: window for key, window in SUMMARY_WINDOWS.items() if key in numbers or key in facts}
    late = {"straggler": ranks[0]["straggler"]} if ranks and "straggler" in ranks[0] else {}  # the same on every rank
    return {**facts, **numbers, **late, "windows": windows, "ranks": list(ranks)}


def parameter_layout(model: nn.Module) -> dict[str, Any]:
    """The trainable parameters in registration order (name, bytes): what gradient sync moves, for
    tools that predict communication without the model (python -m trainer.scaling). Sizes are the
    full tensors' even where a strategy shards them (a DTensor's numel is its global one). `block`
    names the nn.ModuleList element holding it (sync=fsdp's unit under sync.wrap=block), or null."""
    block_of = {id(p): name for name, block in blocks_of(model) for p in block.parameters()}
    tensors = [
        {"name": name, "bytes": p.numel() * p.element_size(), "block": block_of.get(id(p))}
        for name, p in model.named_parameters()
        if p.requires_grad
    ]
    return {"parameter_bytes": sum(t["bytes"] for t in tensors), "parameter_tensors": tensors}


def gather_summary(mine: dict[str, Any], ctx: DistContext, run_dir: str, facts: dict[str, Any]) -> dict[str, Any]:
    """Every rank: contribute this rank's record; returns the job's summary, the same on every rank."""
    ranks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, mine)
    where = {"run_dir": run_dir, "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device)}
    return job_summary(ranks, **where, **facts)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_report(summary: dict[str, Any]) -> str:
    """The end-of-run message: results, where everything is, and how to upload the W&B runs."""
    sync = summary["sync"].get("strategy", "?")
    lines = [
        f"done: {summary['steps']} steps ({summary['epochs']:.2f} epochs), {summary['world_size']} rank(s), "
        f"{summary['backend']} on {summary['device']}, sync={sync}, global batch {summary['global_batch_size']}",
        # Each number followed by its window (trainer/windows.py): the report's samples/s is a
        # median row, the throughput here the whole-run mean; they can differ.
        "  "
        + grouped(
            [
                (LAST_ROW, f"train/loss {_fmt(summary['train/loss'], '.4f')}"),
                (LAST_ROW, f"train/accuracy {_fmt(summary['train/accuracy'], '.3f')}"),
                (LAST_EVAL, f"eval/loss {_fmt(summary.get('eval/loss'), '.4f')}"),
                (LAST_EVAL, f"eval/accuracy {_fmt(summary.get('eval/accuracy'), '.3f')}"),
            ]
        ),
        "  "
        + grouped(
            [(RUN_MEAN, f"throughput {summary['throughput/global_samples_per_s']:.0f} samples/s{_tokens(summary)}")],
            scope="all ranks",
        ),
        *_language_model_lines(summary),
        *_link_lines(summary),
        *([line] if (line := arrivals.straggler_line(summary.get("straggler", {}))) else []),
        f"  run dir  {summary['run_dir']}   "
        f"(summary.json, {_checkpoints(summary)}metrics/rank*.jsonl, train_rank*.log)",
    ]
    if (Path(summary["run_dir"]) / "profiler").is_dir():  # trainer.profile=true
        lines.append(
            f"  profiler/ holds each rank's trace; draw them: python -m trainer.tools.timeline {summary['run_dir']}"
        )
    offline = [(r["rank"], loc) for r in summary["ranks"] for loc in r.get("outputs", []) if "offline-run-" in loc]
    for rank, location in offline:
        lines.append(f"  W&B run rank-{rank}: {location}")
    if offline:
        lines.append(f"  upload with: wandb sync {summary['run_dir']}/wandb/offline-run-*")
    return "\n".join(lines)


def _checkpoints(summary: dict[str, Any]) -> str:
    """The run dir's checkpoints/, where the run wrote one (trainer.checkpoint=false writes none)."""
    return "checkpoints/, " if (Path(summary["run_dir"]) / "checkpoints").is_dir() else ""


def _tokens(summary: dict[str, Any]) -> str:
    """Token data: the throughput line's tokens/s and MFU, the same whole-run mean as its samples/s."""
    if "throughput/global_tokens_per_s" not in summary:
        return ""
    mfu = f", MFU {100 * summary['perf/mfu']:.1f} %" if "perf/mfu" in summary else ""
    return f", {summary['throughput/global_tokens_per_s']:.0f} tokens/s{mfu}"


def _language_model_lines(summary: dict[str, Any]) -> list[str]:
    """A language model's extras: perplexity where measured, and the sample."""
    lines = []
    if "eval/perplexity" in summary:
        lines.append(f"  eval/perplexity {summary['eval/perplexity']:.2f} ({LAST_EVAL}; eval/loss in nats per token)")
    if "sample" in summary:
        text = summary["sample"].replace("\n", "\n    ")
        lines.append(f"  sample (temperature 0.8, top-k 40):\n    {text}")
    return lines


def _ranks_mean(summary: dict[str, Any], key: str) -> float | None:
    return _mean([r.get(key) for r in summary["ranks"]])


def _link_lines(summary: dict[str, Any]) -> list[str]:
    """network=<preset>: what the emulated link cost, so the run does not read like one without it.

    The measured exposure beside the link-alone one (time/comm_exposed_link_s: what the step would
    have waited if only the link's time counted) says how much of the cost is the link itself and
    how much the strategy's own queueing and host work around it.
    """
    network = summary["sync"].get("network")
    if network is None:
        return []
    step = _ranks_mean(summary, "median_time/step_s")
    exposed = _ranks_mean(summary, "median_time/comm_exposed_s")
    alone = _ranks_mean(summary, "median_time/comm_exposed_link_s")
    line = f"  link {network}: median step {_ms(step)}"  # the median row's (trainer/windows.py)
    if exposed is None:
        return [line + ", communication not measured in any row (trainer.sample_every_n_steps)"]
    line += f", of it communication waited for {_ms(exposed)}"
    if alone is not None:
        line += f" (the link alone: {_ms(alone)})"
    return [line]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.2f} ms"


def log_final_report(summary: dict[str, Any]) -> None:
    logging.getLogger("trainer").info("%s", format_report(summary))
