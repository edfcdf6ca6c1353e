"""The private corners of torch's DistributedDataParallel that sync=ddp reads, in one place.

DDP keeps its bucket layout and its own timing of backward's communication in a logging record
(`_get_ddp_logging_data`) that it fills from its C++ reducer; there is no public API for either.
Every read goes through the three functions below, so that a torch release that renames or drops
one fails here, in one line naming the API and the torch version, not as a KeyError in a row.
tests/test_ddp_private.py calls each on a real DDP, so such a release fails the suite first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


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
