"""PyTorch's DistributedDataParallel with every knob taken from config."""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.errors import check, is_number
from trainer.sync.base import SyncStrategy

# torch 2.14 renamed the per-forward buffer broadcast to forward_sync_buffers (the old name warns).
# The new flag always syncs buffers at construction, which we want anyway: replicas start equal.
_BUFFER_FLAG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else "broadcast_buffers"
)


class DDPSync(SyncStrategy):
    """Gradients are all-reduced in buckets during backward, overlapping communication with compute."""

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        check(is_number(bucket_cap_mb) and bucket_cap_mb > 0, "sync.bucket_cap_mb", bucket_cap_mb,
              "must be a number > 0 (MiB per gradient bucket; DDP's default is 25)")
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._ddp: DistributedDataParallel | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        device = next(model.parameters()).device
        # DDP broadcasts rank 0's parameters and buffers itself when it is constructed.
        self._ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            find_unused_parameters=self.find_unused_parameters,
            **{_BUFFER_FLAG: self.broadcast_buffers},
        )
        return self._ddp

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        assert isinstance(model, DistributedDataParallel), "no_sync needs the module wrap() returned"
        return model.no_sync()

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "strategy": "ddp",
            "bucket_cap_mb": self.bucket_cap_mb,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
            "find_unused_parameters": self.find_unused_parameters,
            "broadcast_buffers": self.broadcast_buffers,
        }
        if self._ddp is not None:
            # DDP's own logging record (a prototype API). DDP rebuilds its buckets once, after the
            # first iteration, in the order gradients became ready: report that layout once it exists.
            data = self._ddp._get_ddp_logging_data()
            rebuilt = bool(data.get("has_rebuilt_buckets")) and bool(data.get("rebuilt_bucket_sizes"))
            layout = data.get("rebuilt_bucket_sizes") if rebuilt else data.get("bucket_sizes", "")
            sizes = [int(s) for s in str(layout).split(",") if s.strip()]
            info["num_buckets"] = len(sizes)
            info["bucket_sizes_bytes"] = sizes
            info["buckets_rebuilt"] = rebuilt
            info["total_parameter_bytes"] = int(data.get("total_parameter_size_bytes", 0))
        return info
