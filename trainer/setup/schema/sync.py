"""Schemas of conf/sync/*.yaml: one dataclass per option, registered under OPTIONS.

The flags DDP and FSDP receive are typed here, so torch's own constructor errors never reach a user.
The choices are declared here, the one place they are checked, rather than imported from
trainer/sync/ (which would load torch's FSDP on every run); the strategies' constructors name the
same values in their annotations (tests/test_config_schema.py compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from omegaconf import MISSING
from pydantic import Field

from trainer.setup.schema.declare import NonEmpty, Schema

Collective = Literal["all_reduce", "rs_ag"]
CommHook = Literal["none", "fp16", "bf16", "powersgd"]
MixedPrecision = Literal["none", "bf16"]
Wrap = Literal["auto", "block", "module"]


@dataclass
class SyncConfig(Schema):
    _target_: NonEmpty = MISSING


@dataclass
class BucketsConfig(SyncConfig):
    """Bucketed all-reduce, by DDP or by hand, and the bucket_cap_mb=auto search."""

    bucket_cap_mb: Annotated[
        Annotated[float, Field(gt=0, strict=True)] | Literal["auto"],
        Field(
            description="MiB of gradients per bucket, DDP's default 25; auto: time sync.auto_candidates_mb "
            "on the first steps, keep the fastest"
        ),
    ] = MISSING
    auto_candidates_mb: Annotated[
        list[Annotated[float, Field(gt=0)]],
        Field(min_length=1, description="the bucket caps in MiB that bucket_cap_mb=auto tries"),
    ] = MISSING
    auto_steps_per_trial: Annotated[int, Field(ge=1, description="timed steps per candidate cap")] = MISSING
    auto_warmup_steps: Annotated[
        int, Field(ge=1, description="untimed steps per candidate, after its buckets are built")
    ] = MISSING


@dataclass
class DDPConfig(BucketsConfig):
    gradient_as_bucket_view: bool = MISSING
    static_graph: bool = MISSING
    find_unused_parameters: bool = MISSING
    broadcast_buffers: bool = MISSING
    comm_hook: CommHook = MISSING
    powersgd_rank: Annotated[int, Field(ge=1, description="PowerSGD's matrix_approximation_rank")] = MISSING
    # PowerSGDState refuses start_powerSGD_iter <= 1 with error feedback or warm start (both on here):
    # DDP rebuilds its buckets after the first step, which would invalidate their per-bucket state.
    powersgd_start_step: Annotated[
        int,
        Field(
            ge=2,
            description="PowerSGD's start_powerSGD_iter: steps of plain all-reduce before compressing; "
            "with error feedback and warm start it needs at least 2",
        ),
    ] = MISSING
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
        Field(
            description="1: optimizer state sharded; 2: gradients too; stage 3 (parameters sharded too) is "
            "sync=fsdp, stage 0 (nothing sharded) is sync=ddp or sync=bucketed"
        ),
    ] = MISSING
    bucket_cap_mb: Annotated[float, Field(gt=0, description="MiB of gradients per bucket")] = MISSING
    find_unused_parameters: bool = MISSING


@dataclass
class FSDPConfig(SyncConfig):
    reshard_after_forward: Annotated[
        bool,
        Field(
            description="true: free each unit's gathered parameters after its forward, gather again in backward; "
            "false: keep them until backward (less communication, more memory)"
        ),
    ] = MISSING
    mixed_precision: MixedPrecision = MISSING
    wrap: Annotated[
        Wrap,
        Field(
            description="auto: block if the model has an nn.ModuleList of blocks, else module; block: one FSDP "
            "unit per nn.ModuleList element, the rest in the root; module: one unit per module owning parameters"
        ),
    ] = MISSING


OPTIONS: dict[str, type] = {
    "ddp": DDPConfig,
    "bucketed": BucketedConfig,
    "manual": ManualConfig,
    "fsdp": FSDPConfig,
    "zero": ZeroConfig,
    "none": SyncConfig,
}
