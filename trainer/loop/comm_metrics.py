"""A strategy's communication counts (trainer/sync/comm.py's CommCounters) as a logged row's
per-step comm/* and time/comm* metrics."""

from __future__ import annotations

from trainer.comm_math import bus_factor, overlap_fraction
from trainer.sync.comm import CommCounters


def comm_metrics(
    counts: CommCounters, steps: int, sync_phase_s: float, in_sync_phase: bool, world_size: int
) -> dict[str, float]:
    """Per-step communication metrics for one logged row (an empty dict when nothing was sent).

    `in_sync_phase`: the strategy communicates only inside after_backward (manual), so the timed
    sync phase is its communication time, all of it exposed. Otherwise the strategy's own timing
    is used if it has one (ddp), averaged over the steps it timed, and time is left out when
    nothing measured it in this row's window.
    """
    if counts.bytes == 0 or steps == 0:
        return {}
    metrics = {"comm/bytes_per_step": counts.bytes / steps, "comm/collectives_per_step": counts.collectives / steps}
    for kind, (nbytes, calls) in counts.kinds.items():
        metrics[f"comm/{kind}_bytes_per_step"] = nbytes / steps
        metrics[f"comm/{kind}_per_step"] = calls / steps
    if in_sync_phase:
        seconds, exposed = sync_phase_s, sync_phase_s
    elif counts.timed_steps:
        seconds, exposed = counts.seconds / counts.timed_steps, counts.exposed_seconds / counts.timed_steps
    else:
        return metrics
    metrics["time/comm_s"] = seconds
    metrics["time/comm_exposed_s"] = exposed
    if counts.emulated and counts.timed_steps:  # the ideal beside the measured
        metrics["time/comm_exposed_link_s"] = counts.link_exposed_seconds / counts.timed_steps
    if seconds > 0:
        metrics["comm/overlap_fraction"] = overlap_fraction(seconds, exposed)
        algbw = (counts.bytes / steps) / seconds
        metrics["comm/busbw_GBps"] = algbw * bus_factor("all_reduce", world_size) / 1e9
    return metrics
