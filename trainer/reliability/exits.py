"""How a job ends: exit codes, a flushed logger on every path, and SIGTERM as an exception.

torchrun stops the surviving ranks with SIGTERM when one fails (Slurm does the same on
preemption). Python's default action kills the process on the spot, and W&B's offline run,
written only by finish(), would be lost; raising instead lets every `finally` run.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from trainer.errors import ConfigError
from trainer.logger.base import MetricLogger

log = logging.getLogger(__name__)

CONFIG_ERROR_EXIT = 2


class Terminated(SystemExit):
    """The launcher asked this rank to stop; the exit code is 128 + the signal number, as a shell reports it."""


# How long a SIGTERM waits for the current step to end. torchrun kills a worker 30 s after its
# SIGTERM; a step that is stuck must not cost the logs that the remaining time can still flush.
STEP_GRACE_S = 15.0

_in_step = False
_pending: int | None = None


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    global _pending
    # Ignore repeats: a second SIGTERM must not interrupt the flush the first one started.
    signal.signal(signum, signal.SIG_IGN)
    if _in_step and signum == signal.SIGTERM:
        _pending = signum  # stop at the end of this step, with a consistent state...
        signal.signal(signal.SIGALRM, _raise_terminated)
        signal.setitimer(signal.ITIMER_REAL, STEP_GRACE_S)  # ...unless it does not end in time
        return
    raise Terminated(128 + (_pending or signum))


class StepBoundary:
    """A SIGTERM arriving inside waits for the step to end, then raises Terminated.

    Parameters, optimizer and schedule then all belong to the same step, so a checkpoint written
    on the way out is one an uninterrupted run also passes through. A step stuck in a collective
    still ends: the collective fails (peer gone) or times out (trainer.collective_timeout_s).
    A class, not a generator context manager: it is entered every step, and costs a third as much.
    """

    def __enter__(self) -> None:
        global _in_step
        _in_step = True

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        global _in_step, _pending
        _in_step = False
        if _pending is not None and kind is None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signum, _pending = _pending, None
            raise Terminated(128 + signum)


@contextmanager
def exit_cleanly(loggers: Sequence[MetricLogger]) -> Iterator[None]:
    """Run a job; on the way out close every logger with the job's exit code.

    A ConfigError becomes a one-line message and exit code 2 (no traceback: the message says
    what to change); any other failure is logged with its traceback and exits 1, so a failed
    job always ends its process and the launcher sees it.
    """
    code = 0
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except ConfigError as err:
        code = CONFIG_ERROR_EXIT
        log.error("configuration error: %s", err)
        raise SystemExit(code) from None
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc, Terminated):
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
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a late SIGTERM must not cut the flush short
        for logger in loggers:
            logger.close(code)
        signal.signal(signal.SIGTERM, previous)
