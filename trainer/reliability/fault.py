"""What trainer.fault does (trainer/core.py's Fault): make one rank fail on purpose, a testing aid
for the failure paths.

`trainer.fault.rank=1 trainer.fault.at_step=3 trainer.fault.kind=crash` makes rank 1 fail at the
start of step 3, so tests (and users checking their cluster) can watch a real job lose a rank and
stop, restart or resume. It acts in torchrun's first attempt only, so an elastic restart runs clean.
kind=slow makes the rank a straggler instead: it sleeps `delay_ms` at the start of every step from
at_step on, so the rows can be checked to name it (trainer/arrivals.py). kind=kill_in_save acts in
the checkpoint save at the end of step at_step instead: once the rank has written its part and
before the checkpoint is published, it SIGKILLs itself (no handler, no cleanup: as the OOM killer or
a lost node would), so tests can watch a save die half-way.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import torch
from torch import nn

from trainer.core import Fault

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by the fault switch; never by anything else."""


def in_save(fault: Fault, rank: int, step: int, attempt: int) -> Callable[[], None] | None:
    """kind=kill_in_save: what the save of this step calls between writing and publishing, or None."""
    if fault.kind != "kill_in_save" or not fault.due(rank, step, attempt):
        return None

    def kill() -> None:
        log.warning("trainer.fault: kill_in_save on rank %d at step %d (a testing aid)", rank, step)
        logging.shutdown()  # the warning reaches the log; then nothing else runs
        os.kill(os.getpid(), signal.SIGKILL)

    return kill


def maybe_fire(fault: Fault, rank: int, step: int, attempt: int, model: nn.Module) -> None:
    """Called at the start of every step (1-based) on every rank."""
    if not fault.due(rank, step, attempt) or fault.kind in ("nan_loss", "kill_in_save"):
        return
    if fault.kind == "slow":  # every step from at_step: said once
        if step == fault.at_step:
            log.warning(
                "trainer.fault: slow on rank %d from step %d, %g ms a step (a testing aid)", rank, step, fault.delay_ms
            )
        time.sleep(fault.delay_ms / 1e3)
        return
    log.warning("trainer.fault: %s on rank %d at step %d (a testing aid; first attempt only)", fault.kind, rank, step)
    if fault.kind == "crash":
        raise InjectedFault(f"injected fault (trainer.fault.kind=crash) on rank {rank} at step {step}")
    if fault.kind == "hang":
        while True:  # as if stuck outside any collective: the others' next collective times out
            time.sleep(3600)
    if fault.kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)  # as if the launcher or Slurm stopped this rank
    if fault.kind == "perturb":
        with torch.no_grad():  # this replica alone drifts: the replica check must notice
            next(model.parameters()).view(-1)[0] += 1e-3
