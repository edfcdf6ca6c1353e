"""The private corners of torch's DistributedDataParallel that sync=ddp reads, in one place.

DDP keeps its bucket layout in a logging record (`_get_ddp_logging_data`) that it fills from its
C++ reducer; there is no public API for it. Every read goes through the functions below, so that a
torch release that renames or drops it fails here, in one line naming the API and the torch
version, not as a KeyError in the sync line.
tests/test_ddp_private.py calls each on a real DDP (planned_buckets: tests/test_autotune.py, against the
layout DDP then built), so such a release fails the suite first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
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


def bucket_layout(ddp: DistributedDataParallel) -> tuple[list[int], bool]:
    """Bucket sizes in bytes, and whether DDP has rebuilt them yet (it does once, after the first
    iteration, in the order gradients became ready): that layout once it exists."""
    data = logging_data(ddp)
    rebuilt = bool(data.get("has_rebuilt_buckets")) and bool(data.get("rebuilt_bucket_sizes"))
    layout = data.get("rebuilt_bucket_sizes") if rebuilt else data.get("bucket_sizes", "")
    return [int(s) for s in str(layout).split(",") if s.strip()], rebuilt


def planned_buckets(model: nn.Module, cap_mb: float) -> list[list[nn.Parameter]]:
    """The buckets DDP will make of `model`'s trainable parameters with this cap once it has rebuilt
    them after its first iteration, if the gradients arrive in reverse registration order (the
    usual order, and the one DDP assumes before it knows): torch's own assignment, the function its
    reducer calls then, with the cap for the first bucket too (as DDP does for an explicit cap)."""
    assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if assign is None:
        raise TorchChanged(
            f"sync=ddp reads torch's private torch.distributed._compute_bucket_assignment_by_size, which torch "
            f"{torch.__version__} does not have; ddplab was written against torch 2.14 (trainer/sync/ddp_private.py)"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    order = list(reversed(range(len(params))))
    cap_bytes = int(cap_mb * 2**20)
    buckets, _ = assign([params[i] for i in order], [cap_bytes, cap_bytes], [False] * len(order), order)
    return [[params[i] for i in bucket] for bucket in buckets]
