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
    width = max([len("strategy"), *(len(p.strategy) for p in predictions)])  # hierarchical is 12 letters
    lines = [
        f"{'strategy':<{width}} {'ranks':>6} {'nodes':>5} {'step ms':>9} {'comm ms':>9} {'exposed ms':>10} "
        f"{'samples/s':>11} {'efficiency':>10}"
    ]
    for p in predictions:
        lines.append(
            f"{p.strategy:<{width}} {p.ranks:>6} {p.nodes:>5} {p.step_s * 1e3:>9.3f} {p.comm_s * 1e3:>9.3f} "
            f"{p.exposed_s * 1e3:>10.3f} {p.samples_per_s:>11.0f} {p.efficiency:>10.3f}"
        )
    return "\n".join(lines)


def above_one_note(predictions: Sequence[Prediction]) -> str | None:
    """The line that explains an efficiency above 1 in the table, or None when the table shows none.

    Only a sharded strategy's step can undercut the 1-rank compute: each rank steps the optimizer
    on its 1/N of the parameters. Unexplained on screen, such a value reads as a bug.
    """
    # As the table rounds: an efficiency that prints as 1.000 needs no explaining.
    above = list(dict.fromkeys(p.strategy for p in predictions if round(p.efficiency, 3) > 1))
    if not above:
        return None
    return f"efficiency > 1 ({', '.join(above)}): each rank's optimizer steps 1/N of the parameters (docs/scaling.md)"


def rows(predictions: Sequence[Prediction]) -> list[dict[str, object]]:
    return [dataclasses.asdict(p) for p in predictions]


def write_json(path: Path, predictions: Sequence[Prediction], meta: dict[str, object]) -> None:
    """A list of rows (strategy, ranks, nodes, step_s, samples_per_s, efficiency, ...) under "rows",
    with what produced them under "meta"."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows(predictions)}, indent=2) + "\n")


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot(predictions: Sequence[Prediction], title: str, path: Path) -> Figure:
    """Efficiency against N (log scale), one line per strategy.

    The y range covers every point (sharded strategies can pass 1); a strategy whose curve is
    another's is drawn with its own marker and named in the legend as equal to it, so it stays visible.
    """
    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    strategies = list(dict.fromkeys(p.strategy for p in predictions))
    drawn: dict[str, list[tuple[int, float]]] = {}
    for i, strategy in enumerate(strategies):
        points = sorted((p.ranks, p.efficiency) for p in predictions if p.strategy == strategy)
        same = next((name for name, other in drawn.items() if _coincide(points, other)), None)
        drawn[strategy] = points
        label = strategy if same is None else f"{strategy} (= {same})"
        # Later lines are thinner with smaller hollow markers: one drawn over another leaves both in sight.
        later = i / max(1, len(strategies) - 1)  # 0 for the first strategy, 1 for the last
        ax.plot(
            *zip(*points, strict=True),
            marker=MARKERS[i % len(MARKERS)],
            ms=9 - 4 * later,
            mfc="none",
            lw=2.2 - 1.2 * later,
            color=f"C{i}",
            label=label,
        )
    top = max((p.efficiency for p in predictions), default=1.0)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="ranks N (log scale)", ylabel="scaling efficiency (1 = no communication cost)")
    ax.set_ylim(0, 1.08 * max(1.0, top))
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return fig


def _coincide(a: Sequence[tuple[int, float]], b: Sequence[tuple[int, float]]) -> bool:
    """Two curves at the same N within 0.5 % of each other: one would hide the other."""
    return [n for n, _ in a] == [n for n, _ in b] and all(
        abs(x - y) <= 0.005 * max(abs(y), 1e-12) for (_, x), (_, y) in zip(a, b, strict=True)
    )
