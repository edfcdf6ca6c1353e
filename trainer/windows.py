"""Which rows a logged key comes from, and over which steps a number on screen or in a file is.

A metric row is one of three kinds, named by its `row` key: a training row (the steps since the
previous one), an evaluation row, a checkpoint's row. A number printed from rows is one of a few
windows, each named once here and in docs/metrics.md's table ("Which steps a number is over"), and
printed with its name everywhere (`train/loss 0.2275 (last row)`), so the same name and window is
the same number on the console, in summary.json, in the sweep report and in the W&B reader:

- last row: each rank's last training row (its keys' own window: for the loss and samples/s the
  steps since the row before it, for time/* the row's sampled step); the job's loss is the mean
  over ranks.
- median row: each rank's median over its training rows, rows that held profiled steps left out
  (unless every row did); the job's step time the median over ranks, its samples/s their sum.
- whole-run mean: each rank's samples over its training time (evaluation and checkpoints excluded) over
  every step it trained in this process; the job's samples/s is the sum over ranks.
- last eval: the last evaluation (the end of the run's, on the whole validation split).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

ROW = "row"  # the key naming a row's kind; W&B, which merges a step's rows, names them all: train+eval
TRAIN, EVAL, CHECKPOINT = "train", "eval", "checkpoint"
JOINED = "+"  # between the kinds of one W&B history row
PROFILED_KEY = "trainer/profiled_steps"  # the row's window held steps the profiler recorded

LAST_ROW = "last row"
MEDIAN_ROW = "median row"
RUN_MEAN = "whole-run mean"
LAST_EVAL = "last eval"


# summary.json's numbers and the window each is over (summary.json's `windows` says it too); the
# rank records' median_* and peak_* keys are a median row and the peak over every row.
SUMMARY_WINDOWS = {
    "train/loss": LAST_ROW,
    "train/accuracy": LAST_ROW,
    "eval/loss": LAST_EVAL,
    "eval/accuracy": LAST_EVAL,
    "eval/perplexity": LAST_EVAL,
    "throughput/global_samples_per_s": RUN_MEAN,
    "throughput/global_tokens_per_s": RUN_MEAN,
    "perf/mfu": RUN_MEAN,
}


def labelled(name: str, window: str) -> str:
    """`train/loss (last row)`: a name as a table's header prints it, with its window."""
    return f"{name} ({window})"


def grouped(parts: Iterable[tuple[str, str]], sep: str = "   ", scope: str = "") -> str:
    """`train/loss 0.2275   train/accuracy 0.871 (last row)   eval/loss ... (last eval)`: printed
    numbers, each run of them over one window followed by its name (and `scope`, e.g. all ranks)."""
    runs: list[tuple[str, list[str]]] = []
    for window, text in parts:
        if runs and runs[-1][0] == window:
            runs[-1][1].append(text)
        else:
            runs.append((window, [text]))
    where = f"{scope}, " if scope else ""
    return sep.join(f"{sep.join(texts)} ({where}{window})" for window, texts in runs)


def kinds_of(row: dict[str, Any]) -> set[str]:
    """The kinds of row this is: its `row` key's (several for a W&B history row that merged a step's
    rows); for a row written before that key existed, the kind its keys imply."""
    named = row.get(ROW)
    if isinstance(named, str):
        return set(named.split(JOINED))
    if "eval/loss" in row:
        return {EVAL}
    return {CHECKPOINT} if "checkpoint/blocked_s" in row else {TRAIN}


def of_kind(rows: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [row for row in rows if kind in kinds_of(row)]


def timed_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training rows a median row is over: those that held profiled steps left out (the profiler
    slows their steps and their window), unless every one did."""
    trained = of_kind(rows, TRAIN)
    return [row for row in trained if PROFILED_KEY not in row] or trained


def values(rows: Iterable[dict[str, Any]], key: str) -> list[float]:
    """One key's numbers, from the rows that carry it."""
    return [float(row[key]) for row in rows if isinstance(row.get(key), int | float) and not isinstance(row[key], bool)]


def median_row(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """A rank's median row of `key` (None where no timed row carries it)."""
    found = values(timed_rows(rows), key)
    return statistics.median(found) if found else None


def last_row(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """`key` of a rank's last training row (None where that row does not carry it)."""
    trained = of_kind(rows, TRAIN)
    found = values(trained[-1:], key)
    return found[0] if found else None
