"""The buckets each job of a sweep really built, and which jobs built the same ones.

A bucket cap is a request; the layout is what the strategy made of it for this model (DDP cannot
split a tensor, so every cap below the largest gradient gives one tensor per bucket). The report
shows the layout beside the cap, marks jobs whose layouts are identical, and warns when the swept
cap changed nothing, so that noise between identical configurations is not read as a finding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class HasLayout(Protocol):
    status: str
    sync: str
    model: str
    bucket_setting: str
    bucket_sizes: tuple[int, ...] | None
    same_buckets_as: str
    context: str
    units: Units | None


def bucket_layout(summary: dict[str, Any] | None) -> tuple[int, ...] | None:
    """Bucket sizes in bytes from summary.json's `sync` facts; None when the strategy has no buckets.

    DDP, `bucketed` and `zero` list theirs (`bucket_sizes_bytes`, DDP's after its first-iteration
    rebuild); a `zero` summary from before its buckets has one flat buffer, padded to a multiple of
    the world size (`padded_numel` elements of the model's parameter bytes per element).
    """
    facts = (summary or {}).get("sync") or {}
    sizes = facts.get("bucket_sizes_bytes")
    if isinstance(sizes, list) and sizes:
        return tuple(int(s) for s in sizes)
    model = (summary or {}).get("model") or {}
    if facts.get("padded_numel") and facts.get("numel") and model.get("parameter_bytes"):
        bytes_per_element = int(model["parameter_bytes"]) // int(facts["numel"])
        return (int(facts["padded_numel"]) * bytes_per_element,)
    return None


def cap_in_use(summary: dict[str, Any] | None) -> float | None:
    """The cap `bucket_cap_mb=auto` built the buckets with (summary.json's `sync.bucket_cap_mb_in_use`):
    its choice, or a trial's cap when the run ended before it chose; None for a fixed cap.

    Each run chooses for itself from its own timed trials, so repeats of one configuration can differ.
    """
    facts = (summary or {}).get("sync") or {}
    value = facts.get("bucket_cap_mb_in_use", facts.get("auto_chosen_mb"))
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def cap_cell(setting: str, in_use: Sequence[float | None]) -> str:
    """`25` as configured; `auto (5)`: the cap auto chose; `auto (5|1)`: runs that chose differently, in job order."""
    chosen = list(dict.fromkeys(format(c, "g") for c in in_use if c is not None))
    return f"{setting} ({'|'.join(chosen)})" if chosen else setting


def format_layout(sizes: tuple[int, ...] | None, limit: int = 4, word: str = "") -> str:
    """`3: 36.13 36.01 0.39 MB`; past `limit` buckets the range and total instead of every size.

    `word` names what the count counts when it is not the column's buckets (`1 buffer: 12.77 MB`).
    """
    if sizes is None:
        return ""
    count = f"{len(sizes)} {word}{'s' * (len(sizes) != 1)}" if word else str(len(sizes))
    mb = [s / 1e6 for s in sizes]
    if len(sizes) <= limit:
        return f"{count}: " + " ".join(f"{m:.2f}" for m in mb) + " MB"
    return f"{count}: {min(mb):.2f}-{max(mb):.2f} MB, {sum(mb):.2f} in all"


def bucket_count(sizes: tuple[int, ...]) -> str:
    """`4 buckets`: the layout without its sizes (the printed table, the plot's ticks)."""
    return f"{len(sizes)} bucket{'s' * (len(sizes) != 1)}"


@dataclass(frozen=True)
class Units:
    """What a strategy without gradient buckets sends its gradients in, from summary.json's `sync`.

    manual: its flat buffers (`buffer_sizes_bytes`), and the gradients it all-reduces alone, where
    autograd put them (`num_reduced_in_place`); fsdp: its wrapped units (`unit_bytes`, each unit's
    parameters as gathered). Not buckets: no cap makes them, so the report never compares them
    across caps.
    """

    word: str
    sizes: tuple[int, ...]
    in_place: int = 0

    def cell(self) -> str:
        """`1 buffer: 12.77 MB`, `2 buffers: 0.39 0.20 MB + 3 grads in place`, `5 units: 0.14-4.20 MB, ...`."""
        if not self.sizes:
            return f"no {self.word}: {self.in_place} grads in place"
        alone = f" + {self.in_place} grads in place" if self.in_place else ""
        return format_layout(self.sizes, word=self.word) + alone

    def count(self) -> str:
        """`1 buffer`, `5 units` (for the plot's tick labels)."""
        return f"{len(self.sizes)} {self.word}{'s' * (len(self.sizes) != 1)}"

    def short(self) -> str:
        """`2 buffers +3 in place`: the count without the sizes (for the printed table)."""
        return self.count() + (f" +{self.in_place} in place" if self.in_place else "")


def other_units(summary: dict[str, Any] | None) -> Units | None:
    """manual's buffers or fsdp's units (Units); None for a strategy with buckets, or without either."""
    facts = (summary or {}).get("sync") or {}
    if isinstance(facts.get("buffer_sizes_bytes"), list):
        sizes = tuple(int(s) for s in facts["buffer_sizes_bytes"])
        return Units("buffer", sizes, int(facts.get("num_reduced_in_place") or 0))
    if isinstance(facts.get("unit_bytes"), list):
        return Units("unit", tuple(int(s) for s in facts["unit_bytes"]))
    return None


def layout_cell(row: HasLayout) -> str:
    """The buckets column: the buckets built, else what the strategy has instead, else why none."""
    if row.bucket_sizes is not None:
        return format_layout(row.bucket_sizes)
    if row.units is not None:
        return row.units.cell()
    if row.sync == "none":  # the one strategy without communication (its MB/step is `-` too)
        return "- (sends nothing)"
    return ""


def short_layout(row: HasLayout) -> str:
    """The buckets column on screen: what was built, without its sizes (`4 buckets`, `1 buffer`)."""
    if row.bucket_sizes is not None:
        return bucket_count(row.bucket_sizes)
    if row.units is not None:
        return row.units.short()
    return "-" if row.sync == "none" else ""


def cap_label(setting: str) -> str:
    return f"cap {setting}" if setting else "no cap"


def mark_same_layouts(rows: Sequence[HasLayout]) -> None:
    """Set `same_buckets_as` on each finished job whose layout an earlier cap (in sweep order) already built.

    Only jobs that differ in nothing but the cap (and the repeat) are compared: the same layout
    under another strategy or model is a different experiment.
    """
    first: dict[tuple[str, str, str, tuple[int, ...]], str] = {}
    for row in rows:
        if row.status != "ok" or row.bucket_sizes is None or not row.bucket_setting:
            continue
        key = (row.sync, row.model, row.context, row.bucket_sizes)
        setting = first.setdefault(key, row.bucket_setting)
        row.same_buckets_as = "" if setting == row.bucket_setting else cap_label(setting)


def _comparable(rows: Sequence[HasLayout]) -> list[list[HasLayout]]:
    """Finished jobs with buckets and a cap, grouped by all they differ in but the cap and the repeat."""
    groups: dict[tuple[str, str, str], list[HasLayout]] = {}
    for row in rows:
        if row.status == "ok" and row.bucket_sizes is not None and row.bucket_setting:
            groups.setdefault((row.sync, row.model, row.context), []).append(row)
    return list(groups.values())


def _caps(settings: Sequence[str]) -> str:
    return ", ".join(settings[:-1]) + f" and {settings[-1]}"


def tie_sentences(rows: Sequence[HasLayout]) -> list[str]:
    """The caps that built one layout, for jobs that differ in nothing else: the warning when every cap
    of such a set did (the swept axis changed nothing), else a note per layout two or more caps built.
    The terminal, report.md and the plot all say these same sentences."""
    lines = []
    for members in _comparable(rows):
        by_layout: dict[tuple[int, ...] | None, list[str]] = {}
        for r in members:
            caps = by_layout.setdefault(r.bucket_sizes, [])
            if r.bucket_setting not in caps:
                caps.append(r.bucket_setting)
        if len(by_layout) == 1:
            ((layout, settings),) = by_layout.items()
            if len(settings) > 1:
                lines.append(
                    f"warning: bucket_cap_mb {_caps(settings)} all give the same buckets ({format_layout(layout)}): "
                    f"the swept axis changed nothing {members[0].sync} does, so any difference between these jobs "
                    "is noise"
                )
            continue
        lines += [
            f"note: bucket_cap_mb {_caps(settings)} give the same buckets ({format_layout(layout)}): one "
            "configuration, so any difference between these jobs is noise"
            for layout, settings in by_layout.items()
            if len(settings) > 1
        ]
    return lines


def axis_warning(rows: Sequence[HasLayout]) -> str | None:
    """One line when the swept cap gave every job of a comparable set the same buckets, else None."""
    return next((line for line in tie_sentences(rows) if line.startswith("warning:")), None)
