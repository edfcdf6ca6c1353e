"""Schemas of conf/sync/*.yaml: one dataclass per option, registered under OPTIONS.

The flags DDP and FSDP receive are typed here, so torch's own constructor errors never reach a user.
The choices are declared here rather than imported from trainer/sync/ (which would load torch's
FSDP on every run); the strategies' own tuples must list the same (tests/test_config_schema.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from omegaconf import MISSING
from pydantic import Field

from trainer.setup.schema.declare import NonEmpty, Schema

Collective = Literal["all_reduce", "rs_ag"]  # trainer/sync/averaging.py's COLLECTIVES
CommHook = Literal["none", "fp16", "bf16", "powersgd"]  # trainer/sync/ddp_hooks.py's COMM_HOOKS
MixedPrecision = Literal["none", "bf16"]  # trainer/sync/fsdp.py's MIXED_PRECISION
Wrap = Literal["auto", "block", "module"]  # trainer/sync/fsdp_units.py's WRAPS


@dataclass
class SyncConfig(Schema):
    _target_: NonEmpty = MISSING


@dataclass
class BucketsConfig(SyncConfig):
    """Bucketed all-reduce, by DDP or by hand, and the bucket_cap_mb=auto search."""

    bucket_cap_mb: Annotated[
        Annotated[float, Field(gt=0, strict=True)] | Literal["auto"], Field(description="MiB of gradients per bucket")
    ] = MISSING
    time_every_n_steps: Annotated[int, Field(ge=1)] = MISSING
    auto_candidates_mb: Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=1)] = MISSING
    auto_steps_per_trial: Annotated[int, Field(ge=1)] = MISSING
    auto_warmup_steps: Annotated[int, Field(ge=1)] = MISSING


@dataclass
class DDPConfig(BucketsConfig):
    gradient_as_bucket_view: bool = MISSING
    static_graph: bool = MISSING
    find_unused_parameters: bool = MISSING
    broadcast_buffers: bool = MISSING
    comm_hook: CommHook = MISSING
    powersgd_rank: Annotated[int, Field(ge=1)] = MISSING
    powersgd_start_step: Annotated[int, Field(ge=2)] = MISSING
    time_buckets: bool = MISSING


@dataclass
class BucketedConfig(BucketsConfig):
    collective: Collective = MISSING


@dataclass
class ManualConfig(SyncConfig):
    coalesce_mb: Annotated[float, Field(ge=0, description="0: one buffer per gradient tensor")] = MISSING
    collective: Collective = MISSING
    find_unused_parameters: bool = MISSING


@dataclass
class ZeroConfig(SyncConfig):
    stage: Annotated[
        Literal[1, 2],
        Field(description="1: optimizer state sharded; 2: gradients too; stage 3 is sync=fsdp"),
    ] = MISSING
    bucket_cap_mb: Annotated[float, Field(gt=0, description="MiB of gradients per bucket")] = MISSING
    find_unused_parameters: bool = MISSING
    time_every_n_steps: Annotated[int, Field(ge=1)] = MISSING


@dataclass
class FSDPConfig(SyncConfig):
    reshard_after_forward: bool = MISSING
    mixed_precision: MixedPrecision = MISSING
    wrap: Wrap = MISSING


OPTIONS: dict[str, type] = {
    "ddp": DDPConfig,
    "bucketed": BucketedConfig,
    "manual": ManualConfig,
    "fsdp": FSDPConfig,
    "zero": ZeroConfig,
    "none": SyncConfig,
}
