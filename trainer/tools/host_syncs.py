"""Counts the host synchronisations of the steps the observer does not sample: there must be none.

    python -m trainer.tools.host_syncs sync=zero trainer.precision=fp16 trainer.max_grad_norm=1.0
    torchrun --nproc_per_node=2 -m trainer.tools.host_syncs sync=fsdp trainer.max_grad_norm=1.0

An unsampled step should run ahead of the GPU: every read of a tensor's value on the host (`item`,
`tolist`, `bool`, `float`, `int` of a tensor, `cpu()`, `numpy()`, a device tensor's `to("cpu")`) and every CUDA
synchronisation (`torch.cuda.synchronize`, an event's or a stream's `synchronize` or `query`,
`elapsed_time`) makes the host wait for the device. This tool builds the trainer train.py builds
(same overrides), runs a few steps and lists, for each unsampled step, every such call made in the
step itself and between steps (evaluation, checkpoints and the replica check are switched off; the
rows' one read is allowed: a row is due at the same cadence as a hand-written loop's log line).
On CPU nothing synchronises, but the same calls would on a GPU: they are counted all the same,
except the ones the data loader makes when an epoch begins (its order, drawn on the host). Step 1
is not counted: there the strategies agree once on what each rank used and refuse a model they
cannot train, a decision taken on the host before any gradient is sent. fp16 and
trainer.on_nonfinite=skip skip a non-finite step on the device, whatever the optimizer
(trainer/loop/device_skip.py); where only the host can put a step back (state the optimizer keeps
on the host, or makes on a first step from something other than zero), the step reads the flag,
which this tool shows.
On CUDA, `--sync-debug` also runs the unsampled steps under torch.cuda.set_sync_debug_mode("error").
Prints one line per step with a read, and exits 1 if any unsampled step has one.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}
CUDA_SYNCS = (
    (torch.cuda, "synchronize"),
    (torch.cuda.Event, "synchronize"),
    (torch.cuda.Event, "query"),
    (torch.cuda.Event, "elapsed_time"),
    (torch.cuda.Stream, "synchronize"),
    (torch.cuda.Stream, "query"),
)
STEPS = 12  # with a row every 6 steps: steps 5 and 11 sampled (and the last two), the others not
OVERRIDES = [
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=6",
    f"trainer.max_steps={STEPS}",
    "trainer.eval_every_n_steps=0",
    "trainer.check_replicas_every_n_steps=0",
]


def _caller() -> str:
    """file:line of the first frame outside torch and this module: who asked for the value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_syncs.py"):
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


def _to_host(args: Any, kwargs: Any) -> bool:
    """A device tensor's `.to(...)` that lands on the host (on a CPU run every tensor is there already)."""
    tensor, targets = args[0], [*args[1:], *kwargs.values()]
    on_device = isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu"
    return on_device and any(str(t).startswith("cpu") for t in targets if isinstance(t, (str, torch.device)))


class HostReads(TorchFunctionMode):
    """Notes every call that reads a tensor's value on the host while it is active."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in READS or (func is torch.Tensor.to and _to_host(args, kwargs)):
            self.seen.append(f"{getattr(func, '__name__', func)} from {_caller()}")
        return func(*args, **kwargs)


@contextmanager
def counting(seen: list[str]) -> Iterator[None]:
    """Every host read and CUDA synchronisation inside the block lands in `seen`."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in CUDA_SYNCS]

    def noted(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen.append(f"cuda {name} from {_caller()}")
            return call(*args, **kwargs)

        return wrapper

    for owner, name, call in originals:
        setattr(owner, name, noted(name, call))
    try:
        with HostReads(seen):
            yield
    finally:
        for owner, name, call in originals:
            setattr(owner, name, call)


def unsampled_reads(trainer: Any, sync_debug: bool = False) -> dict[int, list[str]]:
    """Runs the trainer to its last step; per unsampled step, the host reads in it and after it."""
    from trainer.loop.step_math import is_due

    found: dict[int, list[str]] = {}
    observer, runner, settings = trainer.observer, trainer.runner, trainer.settings
    run, after = runner.run, trainer._after_step

    def watched_run(batches: Iterator[Any], step: int) -> None:
        sampled = observer.every > 0 and (
            (step + 1) % observer.every == 0 or (observer.last_step is not None and step + 1 >= observer.last_step)
        )
        if sampled or step == 1:  # step 1: the strategies' one-time agreements (module docstring)
            run(batches, step)
            return
        found[step] = []
        debug = torch.cuda.get_sync_debug_mode() if sync_debug else 0
        if sync_debug:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with counting(found[step]):
                run(batches, step)
        finally:
            if sync_debug:
                torch.cuda.set_sync_debug_mode(debug)

    def watched_after(bar: Any) -> None:
        step = trainer.step
        if step not in found or is_due(step, settings.log_every_n_steps, trainer.total_steps):
            after(bar)  # a row is due: its one read is the row's
            return
        with counting(found[step]):
            after(bar)

    runner.run, trainer._after_step = watched_run, watched_after
    try:
        trainer.train(trainer.total_steps)
    finally:
        runner.run, trainer._after_step = run, after
    return found


def build(overrides: list[str], run_dir: Path) -> Any:
    """The trainer train.py would build (on this process's group), the tool's settings first."""
    from trainer.setup import config as conf
    from trainer.setup import dist
    from trainer.setup.build import build_parts, build_trainer, check_device, prepare_data
    from trainer.setup.precheck import explain_compose_error

    launch = dist.read_launch_env()
    try:
        cfg = conf.compose_config([*OVERRIDES, *overrides])
    except Exception as err:
        raise explain_compose_error(err, overrides) from None
    parts = build_parts(cfg, launch.world_size)
    device = dist.resolve_device(parts.settings.device, launch)
    check_device(parts, device)
    ctx = dist.init_process_group(launch, dist.job_store(launch), device, 300, "ddplab/host_syncs/")
    prepare_data(parts.data, ctx)
    return build_trainer(parts, ctx, [], run_dir, conf.plain_config(cfg))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.host_syncs", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as train.py takes them")
    parser.add_argument("--sync-debug", action="store_true", help="CUDA: also torch.cuda.set_sync_debug_mode('error')")
    args = parser.parse_args(argv)
    from trainer.errors import ConfigError
    from trainer.setup import dist

    try:
        with TemporaryDirectory() as tmp:
            try:
                trainer = build(list(args.overrides), Path(tmp))
                found = unsampled_reads(trainer, args.sync_debug)
            finally:
                dist.destroy_process_group()
    except ConfigError as err:
        print(f"configuration error: {err}", file=sys.stderr)
        return 2
    rank = f"rank {trainer.ctx.rank}: " if trainer.ctx.world_size > 1 else ""
    bad = {step: reads for step, reads in found.items() if reads}
    for step, reads in sorted(bad.items()):
        print(f"{rank}step {step}: {len(reads)} host read(s): " + "; ".join(reads))
    print(f"{rank}{len(found)} unsampled step(s), {sum(map(len, bad.values()))} host read(s) in them")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
