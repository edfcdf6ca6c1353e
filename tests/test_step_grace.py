"""trainer.step_grace_s's timer ends with the step (trainer/reliability/exits.py `StepBoundary`).

A SIGTERM arriving inside a step waits for the step to end, then the rank stops there; a timer
started at the signal stops the rank anyway if the step does not end within step_grace_s. When the
step does end in time, that timer must go with it: left running, it would fire later into whatever
the rank does next (the checkpoint on the way out, the loggers' flush, a further step) and cut it.
On 2 real gloo ranks each rank signals itself at the start of step 3 (trainer.fault.kind=sigterm,
under train.py's own handlers, exit_cleanly): both stop after step 3 with exit code 143 and write
the checkpoint there (trainer.checkpoint_on_sigterm); then no timer is left, and a later step
longer than the grace runs to its end. The hung rank stopped after the grace is test_restarts.py's.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks, stop_collectives
from tests.test_reliability import BASE
from trainer.core import DistContext
from trainer.reliability.exits import Terminated, exit_cleanly
from trainer.setup.build import build_parts, build_trainer, prepare_data
from trainer.setup.config import plain_config

GRACE_S = 2.0  # far above a step of this model: the signalled step always ends in time
SIGNALLED_AT = 3


def _stop_then_a_long_step(rank: int, world_size: int, root: str) -> dict[str, Any]:
    overrides = [
        *BASE,
        "sync=manual",
        "trainer.max_steps=8",
        f"trainer.step_grace_s={GRACE_S}",
        "trainer.checkpoint_on_sigterm=true",
        "trainer.fault.kind=sigterm",
        f"trainer.fault.rank={rank}",  # every rank signals itself: as a launcher stopping the job
        f"trainer.fault.at_step={SIGNALLED_AT}",
    ]
    cfg = compose_config(overrides)
    parts = build_parts(cfg, world_size)
    # The job's store, through which the stopping ranks agree on the step to checkpoint (train.py's is torchrun's).
    store = dist.FileStore(str(Path(root) / "job-store"), world_size)
    ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo", store=store)
    prepare_data(parts.data, ctx)
    trainer = build_trainer(parts, ctx, [], Path(root) / "run", plain_config(cfg))
    try:
        with exit_cleanly([]):  # train.py's SIGTERM / Ctrl-C handlers, as around its fit()
            trainer.fit()
        code: int | str | None = 0
    except SystemExit as stop:  # Terminated, or exit_cleanly's exit 1 for any other failure
        code = stop.code
    stopped_at, timer_left = trainer.step, signal.getitimer(signal.ITIMER_REAL)[0]
    # A later step longer than the grace, its forward slowed: an old timer would fire inside it.
    slow = trainer.model.register_forward_pre_hook(lambda *_: time.sleep(GRACE_S + 1.0))
    try:
        trainer.train(trainer.step + 1)
        later = f"step {trainer.step} ran to its end"
    except Terminated as cut:
        later = f"step {trainer.step + 1} cut by a signal (exit code {cut.code})"
    finally:
        slow.remove()
        signal.setitimer(signal.ITIMER_REAL, 0)  # nothing left behind for the harness
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    return {"code": code, "stopped_at": stopped_at, "timer_left": timer_left, "later": later}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("step-grace")
    (root / "job").mkdir()
    return root / "job", run_on_ranks(_stop_then_a_long_step, 2, root / "ranks", str(root / "job"), timeout_s=180)


def test_a_step_that_ends_in_time_stops_at_the_boundary_and_takes_its_timer_with_it(
    ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = ranks
    for rank, result in enumerate(results):
        assert result["code"] == 128 + signal.SIGTERM and result["stopped_at"] == SIGNALLED_AT, (rank, result)
        assert result["timer_left"] == 0.0, f"rank {rank}: the grace timer still runs after its step ended: {result}"
        assert result["later"] == f"step {SIGNALLED_AT + 1} ran to its end", (rank, result)
    checkpoint = torch.load(root / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] == SIGNALLED_AT  # written on the way out, at the step the signal's step ended


def test_a_step_that_raises_after_the_signal_takes_its_timer_with_it() -> None:
    """A SIGTERM inside a step, then the step fails (a peer gone, a collective error): the rank stops
    as the signal said, and the grace timer does not outlive the step to fire into the loggers' flush."""
    from trainer.reliability.exits import StepBoundary

    boundary = StepBoundary(grace_s=5.0)
    previous = {stop: signal.signal(stop, signal.getsignal(stop)) for stop in (signal.SIGTERM, signal.SIGINT)}
    try:
        with exit_cleanly([]):
            with pytest.raises(Terminated) as stopped, boundary:
                signal.raise_signal(signal.SIGTERM)  # inside the step: it waits for the step's end
                raise RuntimeError("the step failed")
            assert stopped.value.code == 128 + signal.SIGTERM
            left = signal.getitimer(signal.ITIMER_REAL)[0]
    except SystemExit:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for stop, handler in previous.items():
            signal.signal(stop, handler)
    assert left == 0.0, f"the grace timer still runs after its step raised: {left:.2f} s left"


def _stopped_a_step_apart(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Rank 0 is told to stop in step 3, rank 1 in step 4, as ranks told at once can be a step apart."""
    overrides = [
        *BASE,
        "sync=ddp",
        "trainer.max_steps=8",
        "trainer.fault.kind=sigterm",
        f"trainer.fault.rank={rank}",
        f"trainer.fault.at_step={SIGNALLED_AT + rank}",
    ]
    cfg = compose_config(overrides)
    parts = build_parts(cfg, world_size)
    ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
    prepare_data(parts.data, ctx)
    trainer = build_trainer(parts, ctx, [], Path(root) / "run", plain_config(cfg))
    try:
        with exit_cleanly([]):
            trainer.fit()
        code: int | str | None = 0
    except SystemExit as stop:  # Terminated, or exit_cleanly's exit 1 for a failure
        code = stop.code
    # Rank 1 is inside step 4's all_reduce, which rank 0 never joins: no final barrier; rank 0's
    # group closing ends rank 1's wait ("Connection closed by peer").
    stop_collectives("the ranks stopped a step apart")
    return {"code": code, "stopped_at": trainer.step}


def test_a_rank_whose_peer_stopped_a_step_earlier_stops_as_told_not_as_a_failure(tmp_path: Path) -> None:
    """Rank 1's step 4 fails because rank 0, told to stop in step 3, has gone: that is the stop, not a
    failure (no "training failed", no exit 1): both ranks exit 143 at the last step they finished."""
    results = run_on_ranks(_stopped_a_step_apart, 2, tmp_path / "ranks", str(tmp_path), timeout_s=180)
    assert [r["code"] for r in results] == [128 + signal.SIGTERM] * 2, results
    assert [r["stopped_at"] for r in results] == [SIGNALLED_AT] * 2, results
