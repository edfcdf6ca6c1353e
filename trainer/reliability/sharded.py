"""trainer.checkpoint_format=sharded: every rank writes its own part of the state, with
torch.distributed.checkpoint (DCP), and no rank gathers the whole.

Layout in <run dir>/checkpoints/: step-<n>/ (DCP's .metadata and one __<rank>_0.distcp file per
rank, plus meta.pt from rank 0: step, schedule, RNG states, config, ...), `last`, a symlink to the
newest, and the newest trainer.keep_checkpoints of them. A save is written into .step-<n>.partial/
and renamed when every rank has finished: a crash half-way leaves the previous step-<n>/ the one
resume finds.

The tensors are keyed `model/<name>` and `optim/<name>/<key>` (<name> the parameter's in the
model), each this rank's part: a DTensor's local shard (fsdp), the blocks of the parameter that its
shard's range covers, as torch's CheckpointableTensor (zero, trainer/sync/zero_checkpoint.py), or
the whole tensor where every rank holds it alike (the replicated strategies, zero's model under
stages 1 and 2: each such tensor written by one rank, split by size in mine_to_write). Every
tensor's global shape is the model's (a parameter's, or its optimizer entry's, as a plain
optimizer's state_dict holds it): the keys and the shapes depend on neither the world size nor the
strategy, so DCP reads each rank's new part from whatever parts were written (a sharded checkpoint
resumes at another N), and load_model, like torch's own dcp_to_torch_save, reads a state_dict that
loads into the model.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer.reliability.checkpoint import FORMAT, CheckpointError
from trainer.sync.checkpointing import Checkpointing

META = "meta.pt"  # rank 0's: everything of a checkpoint but the model's and optimizer's tensors
LAST = "last"
_STEP_DIR = re.compile(r"step-(\d+)$")

# DCP and DTensor are imported where a sharded checkpoint is written or read, not with this module:
# importing them takes ~1 s of every rank's start, and the trainer imports this module on every run.


@contextmanager
def quiet_one_process() -> Iterator[None]:
    """DCP warns every time it reads with no process group; load_model() does so on purpose (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def saved_tensors(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's tensor keys with their metadata (global size, dtype): from .metadata alone."""
    import torch.distributed.checkpoint as dcp

    return dict(dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)


def mine_to_write(tensors: dict[str, Any], rank: int, world_size: int, trains_one_model: bool) -> dict[str, Any]:
    """The parts this rank writes: its own shards, and its share of the tensors every rank holds alike.

    DCP would de-duplicate those itself, but only in its plan, after an async save has copied every
    one of them on every rank; split here (largest first, each to the rank with the fewest bytes so
    far: the same answer on every rank), each rank copies and writes about 1/N of them. Ranks that
    each train their own model (sync=none) do not hold them alike: rank 0 writes its own, as a full
    checkpoint holds rank 0's."""
    from torch.distributed.checkpoint import CheckpointableTensor

    # Not a DTensor's shard, nor a plain tensor that says which blocks of a larger one it holds (zero's).
    whole = [k for k, v in tensors.items() if type(v) is torch.Tensor and not isinstance(v, CheckpointableTensor)]
    owner: dict[str, int] = {}
    load = [0] * world_size
    for key in sorted(whole, key=lambda k: (-tensors[k].numel() * tensors[k].element_size(), k)):
        owner[key] = load.index(min(load)) if trains_one_model else 0
        load[owner[key]] += tensors[key].numel() * tensors[key].element_size()
    return {k: v for k, v in tensors.items() if owner.get(k, rank) == rank}


def step_dirs(directory: Path) -> list[Path]:
    """Complete step-<n>/ checkpoints (their .metadata and meta.pt written), newest first."""
    found = [
        (int(m.group(1)), p)
        for p in directory.glob("step-*")
        if p.is_dir() and (m := _STEP_DIR.search(p.name)) and (p / META).is_file() and (p / ".metadata").is_file()
    ]
    return [p for _, p in sorted(found, reverse=True)]


def _cpu_copy(value: Any) -> Any:
    """A copy in CPU memory that training cannot change: a tensor, a DTensor's local part, or a
    CheckpointableTensor (zero's parts) with what it says of its blocks (its attributes)."""
    from torch.distributed.checkpoint import CheckpointableTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, torch.Tensor) and isinstance(value, CheckpointableTensor):
        # The memory it spans, copied once, viewed alike: zero's parts are views whose rows overlap,
        # which a plain copy would write out whole, the shared elements once per row.
        shape, strides = value.shape, value.stride()
        spans = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if value.numel() else 0
        copy = value.detach().as_strided((spans,), (1,)).to("cpu", copy=True).as_strided(shape, strides)
        for name in ("global_shape", "global_offsets", "local_offsets", "local_sizes"):
            setattr(copy, name, getattr(value, name))
        return copy
    if isinstance(value, DTensor):
        local = value.to_local().to("cpu", copy=True)
        return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


class CpuCopy:
    """dcp.async_save's stager: copies this rank's parts to CPU memory, in the step (what it waits for)."""

    _synchronize_after_execute = False  # staged synchronously by stage() itself
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {key: _cpu_copy(value) for key, value in state_dict.items()}

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def checkpoint_group(timeout: dt.timedelta) -> dist.ProcessGroup:
    """A gloo group of every rank, for the background save's collectives (a collective: every rank calls it)."""
    group = dist.new_group(backend="gloo", timeout=timeout)
    assert isinstance(group, dist.ProcessGroup), "every rank is a member"
    return group


class InFlight:
    """trainer.checkpoint_async: the save being written in the background (one at a time).

    DCP's async_save copies this rank's part to CPU memory (the step waits only for that copy),
    then writes it from a thread, its collectives on a gloo group of their own so they never race
    the training step's. Rank 0's write ends after every rank's (it writes .metadata last): rank 0
    then publishes the checkpoint alone, with no collective, at the next step boundary that finds
    it done (poll), or when a save, the end of training or a SIGTERM waits for it (wait).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._pending: tuple[Future[Any], Callable[[], None]] | None = None

    def start(self, written: Future[Any], publish: Callable[[], None]) -> None:
        self._pending = (written, publish)

    def poll(self) -> None:
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Until the save in flight is written and published (its error, if it failed, raised here)."""
        if self._pending is not None:
            written, publish = self._pending
            self._pending = None
            written.result()
            publish()


def save(
    in_flight: InFlight | None,
    is_main: bool,
    directory: Path,
    keep: int,
    checkpointing: Checkpointing,
    model: nn.Module,
    optimizer: Optimizer,
    meta: dict[str, Any],
    before_publish: Callable[[], None] | None = None,
) -> Path:
    """Every rank writes its part into .step-<n>.partial/; rank 0 adds meta.pt, renames it step-<n>/,
    points `last` at it and prunes to the newest `keep`. Returns step-<n>/. With `in_flight`
    (async), the previous save is waited for first and this one is left writing. before_publish
    (trainer.fault.kind=kill_in_save) runs on this rank between its part written and the publish."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    group = None if in_flight is None else in_flight.group
    if in_flight is not None:
        in_flight.wait()  # one save at a time
    final = directory / f"step-{meta['step']}"
    partial = directory / f".step-{meta['step']}.partial"
    if is_main:
        shutil.rmtree(partial, ignore_errors=True)  # a save that died half-way
        partial.mkdir(parents=True)
    dist.barrier(group)
    tensors, groups = checkpointing.sharded_state(model, optimizer)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    tensors = mine_to_write(tensors, rank, world_size, checkpointing.trains_one_model)
    meta = {"format": FORMAT, "sharded": True, **meta, "param_groups": groups}

    def publish() -> None:
        if before_publish is not None:
            before_publish()
        if is_main:
            _write_meta(partial / META, meta)
            _publish(partial, final, directory, keep)

    if in_flight is not None:
        staged = CpuCopy()  # the copy the step waits for
        written = dcp.async_save(tensors, checkpoint_id=str(partial), process_group=group, async_stager=staged)
        in_flight.start(written.upload_completion if isinstance(written, AsyncSaveResponse) else written, publish)
        return final
    dcp.save(tensors, checkpoint_id=str(partial), process_group=group)  # rank 0 writes .metadata last
    publish()
    dist.barrier(group)  # nobody reads (or resumes from) it before it is complete
    return final


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    with path.open("wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())


def _publish(partial: Path, final: Path, directory: Path, keep: int) -> None:
    """partial -> final (a re-save of the same step replaces it), `last` -> final, then prune."""
    old = directory / f".{final.name}.old"
    if final.exists():  # a finished run re-run: its final step saved again
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    shutil.rmtree(old, ignore_errors=True)
    link = directory / f".{LAST}.tmp"
    link.unlink(missing_ok=True)
    os.symlink(final.name, link)
    os.replace(link, directory / LAST)
    for stale in step_dirs(directory)[max(keep, 1) :]:
        shutil.rmtree(stale, ignore_errors=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames survive a power cut
    finally:
        os.close(fd)


def load_meta(checkpoint: Path) -> dict[str, Any]:
    """A step-<n>/ directory's meta.pt (weights_only=True), or CheckpointError naming what is missing."""
    if not (checkpoint / ".metadata").is_file() or not (checkpoint / META).is_file():
        raise CheckpointError(f"checkpoint {checkpoint} is incomplete: it lacks .metadata or {META}")
    try:
        meta = torch.load(checkpoint / META, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, corrupt, or not plain data
        raise CheckpointError(f"checkpoint {checkpoint / META} cannot be read: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not meta.get("sharded"):
        raise CheckpointError(f"checkpoint {checkpoint} is not a ddplab sharded checkpoint (format {FORMAT})")
    return meta


def load_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The whole model's state from a sharded checkpoint, in this one process (no process group)."""
    import torch.distributed.checkpoint as dcp

    template = {
        flat: torch.empty(meta.size, dtype=meta.properties.dtype)
        for flat, meta in saved_tensors(checkpoint).items()
        if flat.startswith("model/")
    }
    with quiet_one_process():
        dcp.load(template, checkpoint_id=str(checkpoint), no_dist=True)
    return {flat.removeprefix("model/"): value for flat, value in template.items()}


def load(
    checkpointing: Checkpointing, model: nn.Module, optimizer: Optimizer, checkpoint: Path, groups: list[Any]
) -> None:
    """Read this rank's new part of a step-<n>/ checkpoint into the model and optimizer (a collective):
    the strategy lays out what it holds (sharded_state's template), DCP fills it."""
    import torch.distributed.checkpoint as dcp

    def read(template: dict[str, Any]) -> None:
        dcp.load(template, checkpoint_id=str(checkpoint))

    checkpointing.load_sharded_state(model, optimizer, saved_tensors(checkpoint), read, groups)
