"""Rank 0's progress bar: tqdm on a terminal, one plain line per update anywhere else.

tqdm redraws its bar with carriage returns: a log file or CI console that is not a terminal
gets one endless line. There the bar writes whole lines instead, and less often.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

# Without a terminal nobody watches the bar move: a line every half minute is plenty.
PLAIN_INTERVAL_S = 30.0


class _Lines:
    """A stream that turns tqdm's carriage-return redraws into one line per update."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            self._stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def progress_bar(total: int, done: int, enabled: bool, stream: TextIO | None = None) -> tqdm:
    """A bar over `total` optimizer steps that starts at `done` (a resumed run's step)."""
    out = sys.stderr if stream is None else stream
    common = {"total": total, "initial": done, "disable": not enabled, "desc": "train", "unit": "step"}
    if out.isatty():
        return tqdm(file=out, dynamic_ncols=True, **common)
    return tqdm(file=_Lines(out), mininterval=PLAIN_INTERVAL_S, ncols=100, ascii=True, **common)


@contextmanager
def logging_above(bar: tqdm) -> Iterator[None]:
    """Console log lines printed above the bar instead of through it, at the console's own level.

    tqdm's redirect swaps the console handler for one with no level: without restoring it, the
    other ranks' INFO lines (the console shows them only warnings) would reach the terminal.
    """
    root = logging.getLogger()
    before = list(root.handlers)
    console = [h for h in before if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    with logging_redirect_tqdm(tqdm_class=type(bar)):
        for handler in root.handlers:
            if handler not in before and console:
                handler.setLevel(console[0].level)
        yield
