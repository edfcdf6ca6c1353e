"""Schemas of conf/sync/*.yaml: one dataclass per option, registered under OPTIONS.

The flags DDP and FSDP receive are typed here, so torch's own constructor errors never reach a user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.setup.schema.spec import key

COLLECTIVES = ("all_reduce", "rs_ag")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
MIXED_PRECISION = ("none", "bf16")
WRAPS = ("auto", "block", "module")


@dataclass
class SyncConfig:
    _target_: str = key(nonempty=True)


@dataclass
class BucketsConfig(SyncConfig):
    """Bucketed all-reduce, by DDP or by hand, and the bucket_cap_mb=auto search."""

    bucket_cap_mb: Any = key(gt=0, number=float, choices=("auto",), note="MiB of gradients per bucket")
    time_every_n_steps: int = key(ge=1)
    auto_candidates_mb: list[float] = key(gt=0, nonempty=True)
    auto_steps_per_trial: int = key(ge=1)
    auto_warmup_steps: int = key(ge=1)


@dataclass
class DDPConfig(BucketsConfig):
    gradient_as_bucket_view: bool = key()
    static_graph: bool = key()
    find_unused_parameters: bool = key()
    broadcast_buffers: bool = key()
    comm_hook: str = key(choices=COMM_HOOKS)
    powersgd_rank: int = key(ge=1)
    powersgd_start_step: int = key(ge=2)
    time_buckets: bool = key()


@dataclass
class BucketedConfig(BucketsConfig):
    collective: str = key(choices=COLLECTIVES)


@dataclass
class ManualConfig(SyncConfig):
    coalesce_mb: float = key(ge=0, note="0: one buffer per gradient tensor")
    collective: str = key(choices=COLLECTIVES)
    find_unused_parameters: bool = key()


@dataclass
class ZeroConfig(SyncConfig):
    stage: int = key(choices=(1, 2), note="1: optimizer state sharded; 2: gradients too; stage 3 is sync=fsdp")
    bucket_cap_mb: float = key(gt=0, note="MiB of gradients per bucket")
    find_unused_parameters: bool = key()
    time_every_n_steps: int = key(ge=1)


@dataclass
class FSDPConfig(SyncConfig):
    reshard_after_forward: bool = key()
    mixed_precision: str = key(choices=MIXED_PRECISION)
    wrap: str = key(choices=WRAPS)


OPTIONS: dict[str, type] = {
    "ddp": DDPConfig,
    "bucketed": BucketedConfig,
    "manual": ManualConfig,
    "fsdp": FSDPConfig,
    "zero": ZeroConfig,
    "none": SyncConfig,
}
