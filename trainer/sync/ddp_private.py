"""The private corners of torch's DistributedDataParallel that sync=ddp reads, in one place.

DDP keeps its bucket layout and its own timing of backward's communication in a logging record
(`_get_ddp_logging_data`) that it fills from its C++ reducer; there is no public API for either.
Every read goes through the three functions below, so that a torch release that renames or drops
one fails here, in one line naming the API and the torch version, not as a KeyError in a row;
`ReducerBooks` turns what they say into the rows' comm/* counts.
tests/test_ddp_private.py calls each on a real DDP, so such a release fails the suite first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer.sync.comm import CommCounters


class TorchChanged(RuntimeError):
    """A private DDP API that sync=ddp reads is not what it was on the torch it was written for."""


def _missing(api: str, detail: str) -> TorchChanged:
    return TorchChanged(
        f"sync=ddp reads torch's private DistributedDataParallel.{api}, which torch {torch.__version__} "
        f"{detail}; ddplab was written against torch 2.14 (trainer/sync/ddp_private.py)"
    )


def logging_data(ddp: DistributedDataParallel) -> dict[str, Any]:
    """DDP's logging record: bucket sizes, whether they were rebuilt, and its timing of a sampled step."""
    read = getattr(ddp, "_get_ddp_logging_data", None)
    if read is None:
        raise _missing("_get_ddp_logging_data()", "does not have")
    data = read()
    if "bucket_sizes" not in data:
        raise _missing("_get_ddp_logging_data()", "returns without 'bucket_sizes'")
    return data


def set_sample_rate(ddp: DistributedDataParallel, every_n_steps: int) -> None:
    """Have DDP's reducer time one step in `every_n_steps` (and each of the first 10) itself."""
    set_rate = getattr(ddp, "_set_ddp_runtime_logging_sample_rate", None)
    if set_rate is None:
        raise _missing("_set_ddp_runtime_logging_sample_rate()", "does not have")
    set_rate(every_n_steps)


def record_runtime_stats(ddp: DistributedDataParallel) -> None:
    """Make DDP fold the current step's timing into its logging record (if the step was a timed one)."""
    logger = getattr(ddp, "logger", None)
    if logger is None or not hasattr(logger, "set_runtime_stats_and_log"):
        raise _missing("logger.set_runtime_stats_and_log()", "does not have")
    logger.set_runtime_stats_and_log()


class ReducerBooks:
    """What DDP's C++ reducer sends and how long it takes, without a hook on its per-bucket path:
    one all_reduce per bucket per step, every gradient once, and its own timing of one step in n
    (its runtime statistics: CUDA events on a GPU, host clocks on CPU), all read at logged rows.

    DDP reads its timers back at the start of the next step's forward; with the sample rate equal
    to the logging interval, the timed step is the logged one, whose events the loop has already
    waited for: reading them at the row costs no extra synchronisation.
    """

    def __init__(self, ddp: DistributedDataParallel, grad_bytes: int, every_n_steps: int) -> None:
        self.ddp, self.grad_bytes = ddp, grad_bytes
        self.steps = 0  # reduced since the last row
        self._last_iteration = 0
        self._rebuilt: list[int] | None = None
        set_sample_rate(ddp, every_n_steps)

    def add_to(self, counts: CommCounters) -> None:
        """The steps since the last row: their bytes and calls, and the newest timed step's times."""
        counts.bytes += self.steps * self.grad_bytes
        sizes, _ = self.layout()
        counts.add_many("all_reduce", self.steps * sum(sizes), self.steps * len(sizes))
        self.steps = 0
        record_runtime_stats(self.ddp)  # measures the current step if it is a timed one
        data = logging_data(self.ddp)
        iteration = int(data.get("iteration", 0))
        if iteration <= self._last_iteration or "backward_comm_time" not in data:
            return
        self._last_iteration = iteration
        # comm: first bucket launched -> last bucket reduced; overlap: first launch -> backward's end.
        comm_s = int(data["backward_comm_time"]) / 1e9
        overlap_s = int(data.get("backward_compute_comm_overlap_time", 0)) / 1e9
        counts.seconds, counts.exposed_seconds, counts.timed_steps = comm_s, max(0.0, comm_s - overlap_s), 1

    def layout(self) -> tuple[list[int], bool]:
        """bucket_layout(), read from DDP's record only until the rebuilt layout is fixed."""
        if self._rebuilt is not None:
            return self._rebuilt, True
        sizes, rebuilt = bucket_layout(self.ddp)
        if rebuilt:
            self._rebuilt = sizes
        return sizes, rebuilt


def bucket_layout(ddp: DistributedDataParallel) -> tuple[list[int], bool]:
    """Bucket sizes in bytes, and whether DDP has rebuilt them yet (it does once, after the first
    iteration, in the order gradients became ready): that layout once it exists."""
    data = logging_data(ddp)
    rebuilt = bool(data.get("has_rebuilt_buckets")) and bool(data.get("rebuilt_bucket_sizes"))
    layout = data.get("rebuilt_bucket_sizes") if rebuilt else data.get("bucket_sizes", "")
    return [int(s) for s in str(layout).split(",") if s.strip()], rebuilt
