"""Two small pieces around torch's DistributedDataParallel object that DDPSync (ddp.py) holds:
DDP's own runtime statistics, read at logged rows, and the module that lets bucket_cap_mb=auto swap
one DDP for another behind the trainer's back."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel


class RuntimeStats:
    """DDP's own timing of a step's backward communication, read at logged rows.

    DDP's reducer times one step in `sample_rate` (and each of the first 10) with its C++ timers:
    CUDA events on the GPU, host clocks on CPU. It reads them back, synchronising on them, at the
    start of the next step's forward. With the sample rate equal to the logging interval, the
    timed step is the logged one, whose events the trainer has already waited for: reading them
    here, at the row, costs no extra synchronisation and no Python on the per-bucket path.
    """

    def __init__(self, ddp: DistributedDataParallel, sample_rate: int) -> None:
        self._ddp = ddp
        ddp._set_ddp_runtime_logging_sample_rate(sample_rate)
        self._last_iteration = 0

    def take(self) -> tuple[float, float] | None:
        """(communication, exposed) seconds of the newest timed step, or None if none is new since the last call."""
        assert self._ddp.logger is not None
        self._ddp.logger.set_runtime_stats_and_log()  # measures the current step if it is a timed one
        data = self._ddp._get_ddp_logging_data()
        iteration = int(data.get("iteration", 0))
        if iteration <= self._last_iteration or "backward_comm_time" not in data:
            return None
        self._last_iteration = iteration
        # comm: first bucket launched -> last bucket reduced; overlap: first launch -> backward's end.
        comm_s = int(data["backward_comm_time"]) / 1e9
        overlap_s = int(data.get("backward_compute_comm_overlap_time", 0)) / 1e9
        return comm_s, max(0.0, comm_s - overlap_s)


class SwappableDDP(nn.Module):
    """What wrap() returns with bucket_cap_mb=auto: its forward runs the current DDP, which the
    strategy replaces (a DDP's bucket cap is fixed at construction) while the trainer keeps this."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        super().__init__()
        self.ddp = ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)
