"""How a job ends: exit codes, a flushed logger on every path, and SIGTERM / SIGINT as an exception.

torchrun stops the surviving ranks with SIGTERM when one fails (Slurm does the same on
preemption). Python's default action kills the process on the spot, and W&B's offline run,
written only by finish(), would be lost; raising instead lets every `finally` run. Ctrl-C is the
same event from a person: the terminal sends SIGINT to torchrun and every rank (and torchrun
passes its own SIGINT on), so it takes the same path, exit code 130, and no KeyboardInterrupt
traceback from deep inside backward.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from trainer.errors import ConfigError
from trainer.logger.base import MetricLogger

log = logging.getLogger(__name__)

CONFIG_ERROR_EXIT = 2


class Terminated(SystemExit):
    """A launcher or a person asked this rank to stop; the exit code is 128 + the signal, as a shell says."""

    reported = False  # the trainer already said at which step it stopped

    @property
    def interrupted(self) -> bool:
        """Ctrl-C (SIGINT) rather than a launcher's SIGTERM."""
        return self.code == 128 + signal.SIGINT


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


# Inside a step: how long a SIGTERM waits for it to end (trainer.step_grace_s); None between steps.
_step_grace_s: float | None = None
_pending: int | None = None


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    global _pending
    # Ignore repeats of either: a second signal must not interrupt the flush the first one started
    # (a Ctrl-C reaches each rank twice: from the terminal, then forwarded by torchrun).
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)
    if _step_grace_s is not None and signum in STOP_SIGNALS:
        _pending = signum  # stop at the end of this step, with a consistent state...
        signal.signal(signal.SIGALRM, _raise_terminated)
        signal.setitimer(signal.ITIMER_REAL, _step_grace_s)  # ...unless it does not end in time
        return
    raise Terminated(128 + (_pending or signum))


class StepBoundary:
    """A SIGTERM arriving inside waits for the step to end, then raises Terminated.

    Parameters, optimizer and schedule then all belong to the same step, so a checkpoint written
    on the way out is one an uninterrupted run also passes through. A step stuck in a collective
    still ends: the collective fails (peer gone) or times out (trainer.collective_timeout_s).
    A step that does not end within grace_s seconds of the signal is left: the rank stops anyway,
    with the time its launcher leaves before SIGKILL (torchrun: 30 s) to flush its logs.
    A step that fails while a signal waits stops the rank as that signal, not as a failure: ranks
    told at once can be a step apart, and the one ahead loses its peer inside the next step's
    collective ("Connection closed by peer") because that peer stopped, as it was told to.
    A class, not a generator context manager: it is entered every step, and a class's __enter__ and
    __exit__ are plain calls, where a generator context manager builds a generator each time.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s

    def __enter__(self) -> None:
        global _step_grace_s
        _step_grace_s = self.grace_s

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, *_: object) -> None:
        global _step_grace_s, _pending
        _step_grace_s = None
        if _pending is None:
            return
        # The step is over: its grace timer goes with it, whether it ended or raised (a timer left
        # running would fire later, in whatever runs then: closing the loggers on the way out).
        signal.setitimer(signal.ITIMER_REAL, 0)
        signum, _pending = _pending, None
        if kind is None:
            raise Terminated(128 + signum)
        if isinstance(error, Exception):  # the shutdown's doing, kept in the log file only
            why = f"the step failed after {signal.Signals(signum).name} (a peer had stopped)"
            _to_log_files(logging.INFO, f"{why}: {type(error).__name__}: {error}")
            raise Terminated(128 + signum) from None


def _to_log_files(level: int, message: str) -> None:
    """A record for the rank's log files only (train_rank*.log), not its console."""
    record = log.makeRecord(log.name, level, __file__, 0, message, (), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


@contextmanager
def exit_cleanly(loggers: Sequence[MetricLogger], speaks: Callable[[], bool] | None = None) -> Iterator[None]:
    """Run a job; on the way out close every logger with the job's exit code.

    `speaks()` says whether this rank prints a ConfigError on the console (one rank for the job).
    A ConfigError becomes a one-line message and exit code 2 (no traceback: the message says
    what to change); any other failure is logged with its traceback and exits 1, so a failed
    job always ends its process and the launcher sees it.
    """
    code = 0
    previous = {stop: signal.signal(stop, _raise_terminated) for stop in STOP_SIGNALS}
    try:
        yield
    except ConfigError as err:
        code = CONFIG_ERROR_EXIT
        # Every rank finds the same bad input: one of them says it on the console, all in their files.
        loud = speaks is None or speaks()
        if loud:  # the line the command line's own check prints, to stderr: the same on every path
            print(f"configuration error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        _to_log_files(logging.ERROR if loud else logging.INFO, f"configuration error: {err}")
        raise SystemExit(code) from None
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc, Terminated) and not exc.reported:
            if exc.interrupted:  # Ctrl-C outside the training loop (set-up, evaluation): rank 0 says so once
                log.info("interrupted (exit code %d): flushing logs and finishing the W&B run", code)
            else:
                log.warning("terminated by signal (exit code %d): flushing logs and finishing the W&B run", code)
        raise
    except KeyboardInterrupt:
        code = 130
        raise
    except BaseException as err:
        code = 1
        # The first line names the error: launchers and sweeps quote it as the root cause.
        log.exception("training failed: %s: %s", type(err).__name__, err)
        raise SystemExit(code) from None
    finally:
        for stop in STOP_SIGNALS:  # a late signal must not cut the flush short
            signal.signal(stop, signal.SIG_IGN)
        for logger in loggers:
            logger.close(code)
        for stop, handler in previous.items():
            signal.signal(stop, handler)


@contextmanager
def ctrl_c_held(says: str | None) -> Iterator[None]:
    """Ctrl-C held while the block runs (SIGINT blocked), then taken: `says` on stderr (None: nothing)
    and exit 130, the code a shell gives Ctrl-C.

    For start-up's imports: torch's take a second or two, and a SIGINT that lands in its C code may
    be swallowed there (the job then starts anyway) or leave Python set to kill itself by SIGINT
    at exit, after a KeyboardInterrupt traceback from wherever the import was. Held, it is raised
    where the block ends (CPython's pthread_sigmask raises a pending signal's exception itself).
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        with stopped_by_ctrl_c(says):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextmanager
def stopped_by_ctrl_c(says: str | None) -> Iterator[None]:
    """A Ctrl-C in the block, where no training runs (exit_cleanly handles the job's own): `says`
    on stderr (None: nothing), exit 130, no traceback."""
    try:
        yield
    except KeyboardInterrupt:
        if says is not None:
            print(says, file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
