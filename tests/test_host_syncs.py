"""An unsampled step reads nothing on the host: every strategy, fp32, fp16, on_nonfinite=skip and 16-bit
parameters, the clip on and off, with the default optimizer (SGD with momentum).

trainer/tools/host_syncs.py counts every host read (item, tolist, bool/float/int of a tensor,
cpu(), numpy(), a device tensor's to("cpu")) and every CUDA synchronisation in the steps the
observer does not sample; here it runs on 2 gloo ranks for each case. On CPU nothing
synchronises, but the same calls would on a GPU: the count is the same. fp16 and on_nonfinite=skip
skip a non-finite step on the device: SGD's step is undone there where the flag is set
(trainer/loop/device_skip.py), a fused AdamW skips it itself (one case). The tool's own tests show
what a read of the flag costs. The gpu-marked test runs the same steps under
torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_on_ranks
from tests.train_helpers import build, case_results, train_each
from trainer.loop.device_skip import DeviceSkip
from trainer.tools import host_syncs

STRATEGIES = {
    "none": ["sync=none"],
    "manual": ["sync=manual"],
    "manual-rs_ag": ["sync=manual", "sync.collective=rs_ag"],
    "bucketed": ["sync=bucketed", "sync.bucket_cap_mb=0.01"],
    "ddp": ["sync=ddp", "sync.bucket_cap_mb=0.01"],
    "ddp-hook": ["sync=ddp", "sync.time_buckets=true"],
    "zero-1": ["sync=zero", "sync.stage=1"],
    "zero-2": ["sync=zero"],
    "zero-3": ["sync=zero", "sync.stage=3"],
    "fsdp": ["sync=fsdp"],
    "hierarchical": ["sync=hierarchical", "sync.shard=2"],  # one node of 2: every collective of its three
    "hsdp": ["sync=hsdp"],  # 2 nodes of 1: each unit's shard all-reduced through FSDP2's hook
}
# fp16-params: 16-bit parameters with fp32 master copies, an fp32 reduction (a cast copy per bucket);
# skip: on_nonfinite=skip over those copies (what the device's skip puts back, and they are refreshed from)
PRECISIONS = {
    "fp32": [],
    "fp16": ["trainer.precision=fp16"],
    "fp16-params": ["trainer.param_dtype=fp16"],
    "skip": ["trainer.on_nonfinite=skip", "trainer.param_dtype=fp16"],
}
CLIPS = {"noclip": [], "clip": ["trainer.max_grad_norm=1.0"]}
ONE_CLIP = {"fp16-params": "clip", "skip": "noclip"}  # the path with every piece; the clip changes no skip
COMMON = ["model.hidden_sizes=[32,32]"]  # the default optimizer: SGD with momentum, which cannot skip itself
CASES = {
    f"{s}-{p}-{c}": [*COMMON, *host_syncs.OVERRIDES, *so, *po, *co]
    for s, so in STRATEGIES.items()
    for p, po in PRECISIONS.items()
    for c, co in CLIPS.items()
    if ONE_CLIP.get(p, c) == c
}
# torch's own skip on the device (found_inf handed to a fused AdamW)
CASES["zero-2-fp16-clip-fused"] = [*CASES["zero-2-fp16-clip"], "optim=adamw", "optim.fused=true"]
CASES["ddp-skip-noclip-fused"] = [*CASES["ddp-skip-noclip"], "optim=adamw", "optim.fused=true"]


def _count(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[int, list[str]]:
    return host_syncs.unsampled_reads(build(rank, world_size, overrides, run_dir))


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("host_syncs")
    return run_on_ranks(train_each, 2, root / "ranks", _count, CASES, str(root / "runs"), timeout_s=600)


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_unsampled_step_reads_nothing_on_the_host(counted: list[dict[str, Any]], case: str) -> None:
    for found in case_results(counted, case):
        assert len(found) == host_syncs.STEPS - 4, found  # steps 2-4 and 6-10: sampled are 5, 11, 12 (and 1)
        assert {step: reads for step, reads in found.items() if reads} == {}


def _host_flag(rank: int, world_size: int, run_dir: str) -> dict[int, list[str]]:
    trainer = build(rank, world_size, [*host_syncs.OVERRIDES, "sync=ddp", "trainer.precision=fp16"], run_dir)
    trainer.runner.device_skip = None  # as for an optimizer whose state only the host can put back
    return host_syncs.unsampled_reads(trainer)


def test_a_skip_decided_on_the_host_reads_one_flag_a_step(tmp_path: Path) -> None:
    """What the tool exists for: a host read in the step is found and named (here the overflow flag,
    read before the step as torch's GradScaler does, where the device cannot undo the step)."""
    for found in run_on_ranks(_host_flag, 2, tmp_path / "ranks", str(tmp_path / "run")):
        assert all(len(reads) == 1 and reads[0].startswith("__bool__ from step.py") for reads in found.values())


def test_the_command_exits_1_naming_the_read_and_0_without(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_syncs.main(["sync=none", "trainer.precision=fp16"]) == 0
    assert capsys.readouterr().out.strip() == "8 unsampled step(s), 0 host read(s) in them"
    monkeypatch.setattr(DeviceSkip, "undoable", lambda self: False)  # state only the host can put back
    assert host_syncs.main(["sync=none", "trainer.precision=fp16"]) == 1
    out = capsys.readouterr().out
    assert "host read(s): __bool__ from step.py" in out and "8 unsampled step(s), 8 host read(s) in them" in out
    assert host_syncs.main(["sync=nope"]) == 2
    assert "sync=nope" in capsys.readouterr().err


def _on_cuda(rank: int, world_size: int, root: str) -> dict[str, dict[int, list[str]]]:
    found = {}
    for case in ("zero-2-fp16-clip", "fsdp-fp32-clip", "ddp-fp16-noclip", "bucketed-fp32-clip", "manual-skip-noclip"):
        trainer = build(rank, world_size, CASES[case], f"{root}/{case}", device="cuda")
        found[case] = host_syncs.unsampled_reads(trainer, sync_debug=True)
        torch.cuda.synchronize()
    return found


@pytest.mark.gpu
def test_an_unsampled_cuda_step_makes_no_synchronisation(tmp_path: Path) -> None:
    """The same count on one GPU (one rank, gloo), with torch's own sync detector raising on any
    synchronisation it sees."""
    (found,) = run_on_ranks(_on_cuda, 1, tmp_path / "rank", str(tmp_path / "runs"))
    for case, steps in found.items():
        assert {step: reads for step, reads in steps.items() if reads} == {}, case
