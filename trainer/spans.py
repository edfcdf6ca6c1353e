"""The lab's own names in the torch.profiler trace (trainer.profile=true): what each collective is.

A strategy launches each collective inside `named(...)` only while the profiler records
(`recording` is a module flag the profiler sets): the trace then holds a range such as
`bucket 3 all_reduce 4.0 MiB` around the launch (c10d's op), and the timeline tool pairs each
launch with the backend's record of its execution (gloo's thread, or the NCCL kernel) to draw one
span from launch to completion. With the profiler off this costs one global read per collective.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch.profiler import record_function

recording = False  # True only while trainer.profile=true's profiler is active (set by loop/profiling.py)

MIB = 2**20  # sizes in names are binary (MiB, KiB), as bucket_cap_mb is


def mib(nbytes: int) -> str:
    """4.0 MiB; under 0.1 MiB in KiB (12.3 KiB), so that small buckets still tell apart."""
    return f"{nbytes / MIB:.1f} MiB" if nbytes >= MIB / 10 else f"{nbytes / 1024:.1f} KiB"


def collective_name(kind: str, nbytes: int, bucket: int | None = None) -> str:
    """`bucket 3 all_reduce 4.0 MiB`: what the launch is, as the trace and the timeline show it."""
    return f"{'' if bucket is None else f'bucket {bucket} '}{kind} {mib(nbytes)}"


def named(kind: str, nbytes: int, bucket: int | None = None) -> AbstractContextManager[Any]:
    """The range a collective's launch runs in (a no-op unless the profiler records)."""
    if not recording:
        return nullcontext()
    return record_function(collective_name(kind, nbytes, bucket))
