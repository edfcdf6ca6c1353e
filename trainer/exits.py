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


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    # Ignore repeats: a second SIGTERM must not interrupt the flush the first one started.
    signal.signal(signum, signal.SIG_IGN)
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
