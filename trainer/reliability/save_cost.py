"""What a checkpoint costs each rank: how long the step was blocked, and the peak memory while saving.

A full checkpoint gathers the whole model and optimizer state (zero and fsdp undo their 1/N
saving for its duration), so its peak is the number to watch as models grow. RSS is sampled by a
thread every SAMPLE_S while the save runs (a peak shorter than that can be missed; a save that
matters lasts far longer); on CUDA the allocator's peak is reset at the start of the save and read
at its end, and the peak it held before is carried, so `memory/cuda_max_allocated_mb` in the rows
stays the peak since the start of the run.
"""

from __future__ import annotations

import io
import os
import threading
import time
from types import TracebackType

import psutil
import torch

from trainer.measures import reset_cuda_peak

SAMPLE_S = 0.002


class ResidentMemory:
    """This process's resident set size in bytes, read where it is cheap.

    Read at every logged row and by the save's sampling thread: on Linux from /proc/self/statm, kept
    open and re-read with one pread, where psutil opens and parses the file at every call (what
    each costs: docs/performance.md); elsewhere from psutil. The file is reopened in a process
    forked after it was opened: /proc/self was the parent's then.
    """

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
        self._statm: io.FileIO | None = None
        self._process: psutil.Process | None = None
        self._pid = 0  # the process the file (or psutil's handle) was opened in

    def bytes(self) -> int:
        if self._pid != os.getpid():
            self._open()
        if self._statm is None:
            assert self._process is not None
            return int(self._process.memory_info().rss)
        return int(os.pread(self._statm.fileno(), 64, 0).split()[1]) * self._page  # size, resident, ...

    def _open(self) -> None:
        self._pid = os.getpid()
        self._process = psutil.Process(self._pid)
        try:
            self._statm = open("/proc/self/statm", "rb", buffering=0)  # noqa: SIM115  # kept open on purpose
        except OSError:  # not Linux
            self._statm = None


class SaveCost:
    """`with SaveCost(device) as cost:` around a save; then cost.metrics() for its row."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._rss = ResidentMemory()
        self._stop = threading.Event()
        self._peak_rss = 0
        self._seconds = 0.0
        self._cuda_peak: int | None = None

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._peak_rss = max(self._peak_rss, self._rss.bytes())

    def __enter__(self) -> SaveCost:
        self._peak_rss = self._rss.bytes()
        if self._device.type == "cuda":
            reset_cuda_peak(self._device)
        self._thread = threading.Thread(target=self._sample, name="ddplab-save-rss", daemon=True)
        self._thread.start()
        self._started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._seconds = time.perf_counter() - self._started
        self._stop.set()
        self._thread.join()
        self._peak_rss = max(self._peak_rss, self._rss.bytes())
        if self._device.type == "cuda":
            self._cuda_peak = torch.cuda.max_memory_allocated(self._device)

    def metrics(self) -> dict[str, float]:
        """The save's row: the time the step waited for it, this rank's peak RSS (and CUDA) during it."""
        row = {"checkpoint/blocked_s": self._seconds, "checkpoint/peak_rss_mb": self._peak_rss / 2**20}
        if self._cuda_peak is not None:
            row["checkpoint/peak_cuda_mb"] = self._cuda_peak / 2**20
        return row
