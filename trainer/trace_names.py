"""The names the lab writes into a profiler trace, and reads back: one home for both sides.

The communication object (trainer/sync/comm.py) names each collective's launch and the emulated
link marks each completion; the timeline (trainer/logger/timeline_trace.py) reads those ranges
back. A leaf: the standard library only.
"""

from __future__ import annotations

MIB = 2**20  # sizes in names are binary (MiB, KiB), as bucket_cap_mb is
MARK = "emulated link: done +"  # a completion mark: MARK, then milliseconds after the mark, then " ms"


def mib(nbytes: int) -> str:
    """4.0 MiB; under 0.1 MiB in KiB (12.3 KiB), so that small buckets still tell apart; under
    1 KiB in bytes (a gradient norm's 4 B), which 0.0 KiB would show as nothing."""
    if nbytes >= MIB / 10:
        return f"{nbytes / MIB:.1f} MiB"
    return f"{nbytes / 1024:.1f} KiB" if nbytes >= 1024 else f"{nbytes} B"


def collective(kind: str, nbytes: int, where: int | str | None = None) -> str:
    """What a launch is, as the trace and the timeline show it: `bucket 3 all_reduce 4.0 MiB` (a
    bucket's index), `all_gather 1.0 MiB (fsdp unit blocks.2)` (a label), `all_reduce 4.0 KiB`."""
    if isinstance(where, str):
        return f"{kind} {mib(nbytes)} ({where})"
    return f"{'' if where is None else f'bucket {where} '}{kind} {mib(nbytes)}"


def completion_mark(after_ms: float) -> str:
    """The range an emulated link leaves right after a launch: its completion, `after_ms` later."""
    return f"{MARK}{after_ms:.6f} ms"


def completion_after_us(name: str) -> float | None:
    """A completion mark's distance to its emulated completion, in µs; None for any other range."""
    if not name.startswith(MARK) or not name.endswith(" ms"):
        return None
    return float(name[len(MARK) : -len(" ms")]) * 1e3
