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

Three more make a collective go wrong, for the hang report (trainer/reliability/flight.py): kill
SIGKILLs the rank between its forward and backward (the others wait in the step's first collective);
desync makes it skip the step's first collective the lab launches (the others wait in it while this
rank is in the next one); size makes it send that collective one element longer per rank. The last
two act through the strategy's communication object (trainer/sync/comm.py), so on the strategies
whose collectives the lab launches; ddp's and fsdp's are torch's own, and are refused at start.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.futures import Future

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


def kill(fault: Fault, rank: int, step: int, attempt: int) -> None:
    """kind=kill: called between forward and backward; SIGKILL, no handler runs (as the OOM killer)."""
    if fault.kind == "kill" and fault.due(rank, step, attempt):
        log.warning("trainer.fault: kill on rank %d at step %d, mid-step (a testing aid)", rank, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


LAUNCHES = ("desync", "size")  # the kinds that act on a collective the communication object launches


def wrong_launch(fault: Fault, rank: int, step: int, attempt: int, comm: Any) -> None:
    """kind=desync or size: the next collective `comm` launches that is not a control agreement is
    skipped (a completed Work stands in) or sent one element longer per rank; then `comm` is as before.
    Set per instance, so the class's launch path carries nothing for it."""
    if fault.kind not in LAUNCHES or not fault.due(rank, step, attempt):
        return
    launch = comm._launch

    def once(kind: str, buffer: torch.Tensor, bucket: Any, group: Any, collective: Any, *args: Any, **kw: Any) -> Any:
        if kw.get("control"):
            return launch(kind, buffer, bucket, group, collective, *args, **kw)
        del comm._launch  # the class's own again
        what = f"{kind} of bucket {bucket}" if bucket is not None else kind
        log.warning("trainer.fault: %s on rank %d at step %d: %s (a testing aid)", fault.kind, rank, step, what)
        if fault.kind == "desync":
            done: Future[Any] = Future()
            done.set_result([buffer])
            return torch._C._distributed_c10d._create_work_from_future(done)
        longer = [_longer(a, kind, i) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        return launch(kind, longer[-1], bucket, group, collective, *longer, **kw)

    comm._launch = once


def _longer(tensor: torch.Tensor, kind: str, position: int) -> torch.Tensor:
    """`tensor` flat with more elements: one more per rank for a full buffer, one more for a shard
    (reduce_scatter's output and all_gather's input, the first and second argument)."""
    world = torch.distributed.get_world_size()
    shard = (kind == "reduce_scatter" and position == 0) or (kind == "all_gather" and position == 1)
    extra = 1 if shard or kind in ("all_reduce", "broadcast") else world
    return torch.cat([tensor.detach().reshape(-1), tensor.new_zeros(extra)])


def maybe_fire(fault: Fault, rank: int, step: int, attempt: int, model: nn.Module) -> None:
    """Called at the start of every step (1-based) on every rank."""
    if not fault.due(rank, step, attempt) or fault.kind in ("nan_loss", "kill_in_save", "kill", *LAUNCHES):
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
