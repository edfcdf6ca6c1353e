"""The predictions as a table, a JSON list of rows, and a plot of efficiency against N."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trainer.scaling.predict import Prediction


def format_table(predictions: Sequence[Prediction]) -> str:
    lines = [
        f"{'strategy':<9} {'ranks':>6} {'nodes':>5} {'step ms':>9} {'comm ms':>9} {'exposed ms':>10} "
        f"{'samples/s':>11} {'efficiency':>10}"
    ]
    for p in predictions:
        lines.append(
            f"{p.strategy:<9} {p.ranks:>6} {p.nodes:>5} {p.step_s * 1e3:>9.3f} {p.comm_s * 1e3:>9.3f} "
            f"{p.exposed_s * 1e3:>10.3f} {p.samples_per_s:>11.0f} {p.efficiency:>10.3f}"
        )
    return "\n".join(lines)


def rows(predictions: Sequence[Prediction]) -> list[dict[str, object]]:
    return [dataclasses.asdict(p) for p in predictions]


def write_json(path: Path, predictions: Sequence[Prediction], meta: dict[str, object]) -> None:
    """A list of rows (strategy, ranks, nodes, step_s, samples_per_s, efficiency, ...) under "rows",
    with what produced them under "meta"."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows(predictions)}, indent=2) + "\n")


def plot(predictions: Sequence[Prediction], title: str, path: Path) -> None:
    """Efficiency against N (log scale), one line per strategy."""
    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    strategies = list(dict.fromkeys(p.strategy for p in predictions))
    for i, strategy in enumerate(strategies):
        points = sorted((p.ranks, p.efficiency) for p in predictions if p.strategy == strategy)
        ax.plot(*zip(*points, strict=True), "o-", ms=4, color=f"C{i}", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="ranks N (log scale)", ylabel="scaling efficiency (1 = no communication cost)", ylim=(0, 1.05))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
