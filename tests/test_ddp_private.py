"""The private DDP APIs sync=ddp reads (trainer/sync/ddp_private.py) still answer on this torch:
a release that changes them fails here, naming the API and the version."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.dist_helpers import run_on_ranks
from trainer.sync import ddp_private


def _read(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), bucket_cap_mb=1)
    for _ in range(3):  # DDP rebuilds its buckets after the first iteration, and logs it in the third forward
        F.cross_entropy(ddp(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
    data = ddp_private.logging_data(ddp)
    keys = ("bucket_sizes", "total_parameter_size_bytes")
    return {key: data.get(key) for key in keys} | {"layout": ddp_private.bucket_layout(ddp)}


@pytest.fixture(scope="module")
def read(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_read, 2, tmp_path_factory.mktemp("ddp_private") / "run")


def test_ddps_logging_record_holds_what_sync_ddp_reads(read: list[dict[str, Any]]) -> None:
    params_bytes = (8 * 8 + 8 + 8 * 2 + 2) * 4
    for rank in read:
        assert sum(int(s) for s in str(rank["bucket_sizes"]).split(",")) == params_bytes
        assert int(rank["total_parameter_size_bytes"]) == params_bytes
        sizes, rebuilt = rank["layout"]
        assert rebuilt and sum(sizes) == params_bytes


def test_a_missing_private_api_is_one_line_naming_it_and_the_torch_version() -> None:
    with pytest.raises(
        ddp_private.TorchChanged, match=r"_get_ddp_logging_data\(\).*torch " + re.escape(torch.__version__)
    ):
        ddp_private.logging_data(nn.Linear(1, 1))  # type: ignore[arg-type]  # a module without DDP's API
