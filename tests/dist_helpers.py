"""Run a function on N real gloo ranks: processes of their own (forked from tests/forks.py's server)
meeting through a FileStore."""

from __future__ import annotations

import datetime as dt
import gc
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import forks

# Generous: under `make test`'s two workers a rank can wait long for a peer that shares its core
# with another worker's torchrun job; a real hang still fails, within run_on_ranks' timeout_s.
TIMEOUT = dt.timedelta(seconds=240)

# Set on every rank once the ranks no longer agree on where they are (a case failed on some rank
# only): they may be at different collectives, so none issues another, not even the final barrier.
_stopped: str | None = None
_store: dist.Store | None = None  # the group's FileStore: a channel that a collective out of step cannot jam
STOP = "dist_helpers/stop"
GRACE_S = 90.0  # how long a rank that raised waits to hear from its peers (tests/test_harness.py shortens it)


def stop_collectives(reason: str) -> None:
    global _stopped
    _stopped = _stopped or reason


def collectives_stopped() -> str | None:
    """Why this rank must issue no more collectives, or None while its group is in step."""
    return _stopped


def still_in_step(key: str, raised: bool, rank: int, world_size: int) -> bool:
    """After a piece of work that may have raised: whether the ranks are still in step, the same
    answer on every rank, through the store (which a collective out of step cannot jam).

    They are if every rank raised (bad input refused alike) or none did. A rank that raised and
    hears nothing from a peer within GRACE_S takes that peer to be stuck in a collective waiting
    for it: it says stop and leaves, and its closed connections end the peer's wait at once.
    """
    assert _store is not None, "inside run_on_ranks only"
    _store.set(f"{key}/{rank}", "raised" if raised else "passed")
    keys = [f"{key}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + (GRACE_S if raised else 2 * TIMEOUT.total_seconds())
    while not _store.check(keys):
        if _store.check([STOP]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    words = [_store.get(k).decode() for k in keys] if _store.check(keys) else []
    if _store.check([STOP]) or len(set(words)) != 1:
        failed = [r for r, w in enumerate(words) if w == "raised"]
        silent = f"raised on rank {rank}, a peer silent for {GRACE_S:g} s"
        why = f"raised on rank(s) {failed} only" if words else silent
        _store.set(STOP, f"{key}: {why}")
        stop_collectives(f"{key} raised on some ranks only, so the ranks are out of step")
        return False
    return True


def _run_rank(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    args: tuple[Any, ...],
    env: dict[str, str],
    cwd: str,
) -> None:
    global _store
    forks.take(env, cwd)
    torch.set_num_threads(1)
    store = _store = dist.FileStore(str(Path(workdir) / "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        torch.save(fn(rank, world_size, *args), Path(workdir) / f"result{rank}.pt")
        # fn may return from an error path (e.g. a check that raised on every rank) with its last
        # collective's bytes still in flight to a peer: no rank closes its connections before all
        # are done. Once, in a full run, a rank aborted in C++ at teardown without this.
        if collectives_stopped() is None:
            dist.barrier()
    except BaseException:
        (Path(workdir) / f"error{rank}.txt").write_text(traceback.format_exc())  # for the failing test's message
        raise
    finally:
        gc.collect()  # what still holds the group (a DDP reducer, pending work) goes before the group does
        dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, workdir: Path, *args: Any, timeout_s: float = 180
) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the results in rank order. fn must be importable."""
    workdir.mkdir(parents=True, exist_ok=False)  # a FileStore file must be new for every group
    procs = [
        forks.context.Process(target=_run_rank, args=(fn, r, world_size, str(workdir), args, *forks.here()))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout_s)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    codes = [proc.exitcode for proc in procs]
    errors = "".join(f"\n--- rank {p.stem[5:]} ---\n{p.read_text()}" for p in sorted(workdir.glob("error*.txt")))
    assert codes == [0] * world_size, f"ranks exited with {codes}{errors}"
    return [torch.load(workdir / f"result{r}.pt", weights_only=False) for r in range(world_size)]
