"""Schema of conf/network/*.yaml: every option is a preset of one schema (network.preset says which).

The choices are declared here, the one place they are checked; trainer/scaling/networks.py's
EMULATED names the same presets (tests/test_network.py compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from omegaconf import MISSING
from pydantic import Field

from trainer.setup.schema.declare import NonEmpty, Schema

Link = Literal["nvlink", "ib-ndr400", "100gbe", "10gbe", "1gbe"]


@dataclass
class NetworkConfig(Schema):
    _target_: NonEmpty = MISSING
    preset: Annotated[Literal["none"] | Link, Field(description="the link between nodes; none: no emulation")] = MISSING
    latency_us: Annotated[float | None, Field(ge=0, description="per ring step; null: the preset's")] = MISSING
    bandwidth_gbps: Annotated[
        float | None, Field(gt=0, description="per rank and direction, in Gb/s (bits); null: the preset's")
    ] = MISSING
    gpus_per_node: Annotated[
        int, Field(ge=1, description="ranks per emulated node, a divisor of the world size; 1: every rank a node")
    ] = MISSING
    intra: Annotated[Link, Field(description="the link inside a node (gpus_per_node > 1)")] = MISSING
    intra_latency_us: Annotated[float | None, Field(ge=0, description="null: the intra preset's")] = MISSING
    intra_bandwidth_gbps: Annotated[float | None, Field(gt=0, description="Gb/s; null: the intra preset's")] = MISSING
    time_scale: Annotated[float, Field(gt=0, description="every link time is multiplied by it")] = MISSING


OPTIONS: dict[str, type[Schema]] = dict.fromkeys(
    ("none", "nvlink", "ib-ndr400", "100gbe", "10gbe", "1gbe"), NetworkConfig
)
