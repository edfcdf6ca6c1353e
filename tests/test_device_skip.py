"""A non-finite step skipped on the device (trainer/loop/device_skip.py) trains as torch's skip does.

torch's GradScaler reads the overflow on the host and does not call the optimizer: parameters and
state stay as they were, and a skipped first step leaves no state at all. DeviceSkip runs the step
and puts back what it changed where the flag is set. Here, for each optimizer, a run whose bad
steps are undone on the device is compared with a run that never steps on them: after every step
the parameters and the state are bit-identical (a state entry the device run holds and torch's has
not yet made must be all zeros), a bad step changes nothing, and nothing is read on the host
unless DeviceSkip says it must (SGD with dampening, on a step that would create its buffer). Then
the same through the trainer, on 2 gloo ranks, for every kind of strategy: fp16 and
trainer.on_nonfinite=skip, with the device's skip against the host's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_on_ranks
from tests.train_helpers import build, case_results, params_of, train_each
from trainer.loop.device_skip import DeviceSkip
from trainer.tools.host_syncs import counting

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
    "sgd-nesterov-decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
    "rmsprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),  # state starts at one: read until a real step
}
NUM_STEPS = 6
BAD_STEPS = {"first": {1}, "later": {3}, "first-two-and-later": {1, 2, 5}}
UNUSED_AT = 4  # the bias has no gradient in this step (the optimizer leaves it alone)


def _states(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state.get(p, {}).items()}
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def _same_state(device: list[dict[str, Any]], host: list[dict[str, Any]]) -> bool:
    """Bit-identical; an entry only the device's run holds (created by a skipped first step) is zero."""
    for mine, torchs in zip(device, host, strict=True):
        for key, value in mine.items():
            if key not in torchs:
                if torch.count_nonzero(value) != 0:
                    return False
            elif not torch.equal(value, torchs[key]):
                return False
        if set(torchs) - set(mine):
            return False
    return True


def _gradients(step: int, bad: bool) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(step)
    weight, bias = torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)
    if bad:
        weight[1, 2] = float("inf") if step % 2 else float("nan")
    return [weight, None if step == UNUSED_AT else bias]


@pytest.mark.parametrize("bad", sorted(BAD_STEPS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_skipped_step_on_the_device_trains_as_torchs_skip(name: str, bad: str) -> None:
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]
    mine = [torch.nn.Parameter(t.clone()) for t in start]
    torchs = [torch.nn.Parameter(t.clone()) for t in start]
    optimizer, reference = OPTIMIZERS[name](mine), OPTIMIZERS[name](torchs)
    skip = DeviceSkip(optimizer, torch.device("cpu"))
    for step in range(1, NUM_STEPS + 1):
        grads = _gradients(step, step in BAD_STEPS[bad])
        nonfinite = ~torch.isfinite(torch.stack([g.norm() for g in grads if g is not None]).norm())
        for param, ref, grad in zip(mine, torchs, grads, strict=True):
            param.grad = None if grad is None else grad.clone()
            ref.grad = None if grad is None else grad.clone()
        before, state_before = [p.detach().clone() for p in mine], _states(optimizer)
        reads: list[str] = []
        with counting(reads):
            undoable = skip.undoable()
        if undoable:
            with counting(reads), skip.skipping(nonfinite):
                optimizer.step()
        elif not bool(nonfinite):
            optimizer.step()
        if step not in BAD_STEPS[bad]:  # torch's GradScaler: the optimizer is not called at all
            reference.step()
        # Nothing read by DeviceSkip (non-fused Adam's own count is a host tensor torch reads itself)
        assert not [read for read in reads if "from device_skip.py" in read], reads
        # Host reads only where DeviceSkip cannot undo: state the optimizer creates not from zero
        assert undoable or (name in ("sgd-dampening", "nadam") and not state_before[0]), (name, step)
        if step in BAD_STEPS[bad]:
            assert all(torch.equal(p, b) for p, b in zip(mine, before, strict=True)), (name, step)
            assert _same_state(_states(optimizer), state_before), (name, step)
        assert all(torch.equal(p, r) for p, r in zip(mine, torchs, strict=True)), (name, step)
        assert _same_state(_states(optimizer), _states(reference)), (name, step)


def test_state_kept_on_the_host_is_left_to_a_read() -> None:
    """A Python number in the state (a count a custom optimizer keeps on the host), or a CPU tensor in
    a CUDA run, cannot be put back on the device: undoable() says so, and the caller reads the flag."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    skip = DeviceSkip(optimizer, torch.device("cpu"))
    param.grad = torch.ones(3)
    assert skip.undoable()
    optimizer.state[param]["count"] = 1
    assert not skip.undoable()
    # A CUDA run: a plain Adam keeps its step count on the CPU (a read decides it); capturable, on the device
    for capturable in (False, True):
        adam = torch.optim.Adam([param], capturable=capturable)
        assert DeviceSkip(adam, torch.device("cuda")).undoable() == capturable


# Through the trainer: the device's skip (DeviceSkip) against the host's (the flag read, the
# optimizer not called), on 2 ranks, with the inf put into the gradient the optimizer reads, on
# every rank, at steps 1 (state not made yet) and 3.
COMMON = [
    "logger=none",
    "trainer.progress_bar=false",
    "model.hidden_sizes=[16,16]",
    "trainer.max_steps=5",
    "trainer.log_every_n_steps=5",
    "trainer.eval_every_n_steps=0",
    "trainer.check_replicas_every_n_steps=0",
]
POISONED = (1, 3)
FP16, SKIP = ["trainer.precision=fp16"], ["trainer.on_nonfinite=skip"]
CASES = {
    "none-sgd-skip": ["sync=none", *SKIP],
    "manual-adamw-fp16params": ["sync=manual", "optim=adamw", "trainer.param_dtype=fp16", *SKIP],
    "bucketed-sgd-fp16": ["sync=bucketed", "sync.bucket_cap_mb=0.001", *FP16],
    "ddp-sgd-fp16-clip": ["sync=ddp", "trainer.max_grad_norm=1.0", *FP16],
    "ddp-sgd-dampening-skip": ["sync=ddp", "optim.dampening=0.5", *SKIP],
    "hierarchical-sgd-skip": ["sync=hierarchical", "sync.shard=2", *SKIP],
    "zero1-sgd-fp16": ["sync=zero", "sync.stage=1", *FP16],
    "zero2-adamw-skip": ["sync=zero", "optim=adamw", *SKIP],
    "zero3-sgd-fp16params": ["sync=zero", "sync.stage=3", "trainer.param_dtype=fp16", *FP16],
    "fsdp-sgd-fp16": ["sync=fsdp", *FP16],
    "fsdp-adamw-fp16params": ["sync=fsdp", "optim=adamw", "trainer.param_dtype=fp16", *SKIP],
    "hsdp-sgd-skip": ["sync=hsdp", *SKIP],
}


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _optimizer_tensors(trainer: Any) -> dict[str, torch.Tensor]:
    """What this rank's optimizer steps and holds: its parameters (shards) and every state tensor."""
    out = {}
    for i, p in enumerate(p for group in trainer.optimizer.param_groups for p in group["params"]):
        out[f"{i}"] = _local(p)
        state = trainer.optimizer.state.get(p, {})
        out |= {f"{i}/{k}": _local(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def _poisoned(rank: int, world_size: int, overrides: list[str], run_dir: str, on_device: bool) -> dict[str, Any]:
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir)
    runner = trainer.runner
    if not on_device:  # the host's skip: the flag read before the step, as torch's GradScaler does
        runner.device_skip = None
    optimize, undone = runner.optimize, {}

    def poison(step: int, sampled: bool) -> None:
        if step not in POISONED:
            return optimize(step, sampled)
        grads = [p.grad for group in trainer.optimizer.param_groups for p in group["params"] if p.grad is not None]
        (grads[0].to_local() if hasattr(grads[0], "to_local") else grads[0]).view(-1)[0] = float("inf")
        trainer.sync.wait_for_parameters()
        model, held, reads = params_of(trainer), _optimizer_tensors(trainer), list[str]()
        with counting(reads):
            optimize(step, sampled)
        trainer.sync.wait_for_parameters()
        after = _optimizer_tensors(trainer)
        undone[step] = {
            "model": all(torch.equal(a, b) for a, b in zip(model.values(), params_of(trainer).values(), strict=True)),
            # state the skipped first step created is zero, as if absent
            "optimizer": set(held) <= set(after)
            and all(torch.equal(held[k], t) if k in held else torch.count_nonzero(t) == 0 for k, t in after.items()),
            "read": any(read.startswith("__bool__ from step.py") for read in reads),
        }

    runner.optimize = poison  # type: ignore[method-assign]
    trainer.train(trainer.total_steps)
    trainer.sync.wait_for_parameters()
    scale = runner.scale()
    return {
        "undone": undone,
        "params": params_of(trainer),
        "optimizer": _optimizer_tensors(trainer),
        "scale": None if scale is None else scale.item(),
    }


def _both(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    return {
        "device": _poisoned(rank, world_size, overrides, f"{run_dir}/device", True),
        "host": _poisoned(rank, world_size, overrides, f"{run_dir}/host", False),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("device_skip")
    return run_on_ranks(train_each, 2, root / "ranks", _both, CASES, str(root / "runs"), timeout_s=600)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_strategy_skips_on_the_device_as_on_the_host(runs: list[dict[str, Any]], case: str) -> None:
    for rank in case_results(runs, case):
        device, host = rank["device"], rank["host"]
        # Read on the host only where SGD with dampening would create its buffer (step 1)
        read = {step: "dampening" in case and step == 1 for step in POISONED}
        assert device["undone"] == {step: {"model": True, "optimizer": True, "read": read[step]} for step in POISONED}
        assert all(torch.equal(device["params"][k], host["params"][k]) for k in host["params"])
        assert device["optimizer"].keys() == host["optimizer"].keys()
        assert all(torch.equal(t, host["optimizer"][k]) for k, t in device["optimizer"].items())
        assert device["scale"] == host["scale"]
