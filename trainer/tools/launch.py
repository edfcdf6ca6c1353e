"""torchrun with the command line checked first: `python -m trainer.tools.launch [torchrun options] train.py ...`.

It takes torchrun's own arguments (torch.distributed.run's parser) and runs torchrun's own launch in
this process (torch.distributed.run.run), as `accelerate launch` does, so multi-node rendezvous,
--max-restarts and elastic --nnodes=1:2 are torchrun's. What it adds:

- Before torch is imported, a torch older than the lab's floor is refused in one line (exit 2).
- Before any worker starts, train.py's overrides are composed and validated once, here (the same
  check every rank of a plain `torchrun train.py` makes): bad input is one line and exit 2 in about
  two seconds, instead of every rank starting, importing torch and composing, then torchrun's
  traceback and exit 1.
- When a worker fails anyway (a data root that is missing, a crash in training), torchrun's
  ChildFailedError block becomes one line naming the first rank that failed, and the launcher exits
  with that rank's code (2 bad input, 1 a failure in training, 130 Ctrl-C, 143 SIGTERM), not 1; a
  worker killed by a signal it could not handle (SIGKILL: the OOM killer, `kill -9`) exits 128 + the
  signal, as a shell reports it (137). Where that rank's collective failed, the hang report it left in
  torchrun's error file follows, three lines naming the collective and the rank that never came.
- Ctrl-C or a SIGTERM sent to the launcher (torchrun passes it on to every worker, which stops after
  its current step and flushes its logs) ends with one line and 128 + the signal (130, 143), not
  torchrun's SignalException traceback and exit 1.

Plain `torchrun train.py ...` keeps working as before; `make train` uses this.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from trainer.reliability.exits import ctrl_c_held
from trainer.setup.torch_version import refuse_old_torch

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
BAD_INPUT = 2
BEFORE_WORKERS = "launch: interrupted by Ctrl-C (SIGINT) before any worker started"


def _is_train_py(script: str, is_module: bool) -> bool:
    return not is_module and Path(script).resolve() == TRAIN_PY


def _check(overrides: list[str], world_size: int | None) -> None:
    """train.py's command line, composed and validated once: one line and exit 2 if it is bad."""
    from trainer.setup import precheck  # imported here: --help answers without torch

    precheck.check_command_line(overrides, rank=0, world_size=world_size)


def _world_size(nnodes: str, nproc_per_node: str) -> int | None:
    """The job's world size where torchrun's arguments fix it (--nnodes=2 --nproc_per_node=4: 8), else None
    (an elastic range such as --nnodes=1:2, or nproc_per_node=auto/gpu: known only once workers start)."""
    low, _, high = nnodes.partition(":")  # torchrun's default is "1:1"
    if low.isdigit() and (high in ("", low)) and nproc_per_node.isdigit():
        return int(low) * int(nproc_per_node)
    return None


def _exit_code(code: int) -> int:
    """A worker's exit code as a shell reports it: a signal -N becomes 128 + N."""
    return 128 - code if code < 0 else code


def _failed(rank: int, code: int) -> str:
    """The launcher's line for the first rank that failed, with the code it exits with."""
    if code < 0:  # torchrun's -N: the worker died of signal N without handling it
        name = signal.Signals(-code).name
        return (
            f"launch: rank {rank} was killed by {name} (exit code {_exit_code(code)} = 128 + {-code}): no "
            "handler of its own ran, so its logs end where it was killed"
        )
    return f"launch: rank {rank} exited with code {code}: {_meaning(code)}"


def _hang_report(message: object) -> str | None:
    """The hang report the first failed rank left in torchrun's error file (trainer/reliability/flight.py
    writes it there; the lab writes no other), or None."""
    if not isinstance(message, dict):
        return None
    report = message.get("extraInfo", {}).get("py_callstack")
    return report if isinstance(report, str) and report.startswith("collective failed") else None


def _meaning(code: int) -> str:
    if code == BAD_INPUT:
        return "bad input (its configuration error is above)"
    if code == 1:
        return "a failure in training (its message is above, and in the run dir's train_rank*.log)"
    return "see the lines above"


def _stopped(signum: int) -> str:
    """The launcher's line when a signal stopped the job: what stopped it, and what is left."""
    what = "interrupted by Ctrl-C (SIGINT)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    kept = "what they wrote is kept (each rank's line says whether that includes a checkpoint)"
    return f"launch: {what}: the ranks stopped after their current step; {kept}"


def _quiet_torchrun() -> None:
    """torchrun's warnings after a failure ("Sending process ... closing signal SIGTERM") and its
    "failed (exitcode: ...)" line say what the one line below says; its other errors still print.
    So does its "Received 2 death signal, shutting down workers" (a logger with a level of its own)."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not record.getMessage().startswith("failed (exitcode")
    )
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: "death signal" not in record.getMessage()
    )


def main(argv: list[str] | None = None) -> int:
    refuse_old_torch()  # an older torch than the floor: one line and exit 2, before torch is imported
    # Importing torch and checking the command line (which imports the strategy's modules) take a
    # second or two: a Ctrl-C there is held until both are done, then one line and exit 130. Taken
    # inside an import's C code it could be swallowed (the job started anyway), end the launcher by
    # SIGINT at exit, or break Hydra's composition into a bogus "configuration error".
    with ctrl_c_held(BEFORE_WORKERS):
        from torch.distributed import run as torchrun

        args = _checked_args(torchrun, argv)
    return _launch(torchrun, args)


def _checked_args(torchrun: ModuleType, argv: list[str] | None) -> Any:
    """torchrun's arguments, parsed, with train.py's command line checked."""
    parser = torchrun.get_args_parser()
    parser.prog = "python -m trainer.tools.launch"
    parser.description = (
        "torchrun, with train.py's command line checked once before any worker starts (bad input: "
        "one line, exit 2), and a failed worker reported in one line with its own exit code. "
        "Same arguments as torchrun, e.g. --standalone --nproc_per_node=2 train.py sync=manual."
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun sets this to 1 itself for more than one rank, with a 4-line warning: set it quietly.
    if "OMP_NUM_THREADS" not in os.environ and str(args.nproc_per_node) not in ("1", "auto", "cpu", "gpu", "xpu"):
        os.environ["OMP_NUM_THREADS"] = "1"
    _quiet_torchrun()
    if _is_train_py(args.training_script, args.module):
        _check(list(args.training_script_args), _world_size(str(args.nnodes), str(args.nproc_per_node)))
    return args


def _launch(torchrun: ModuleType, args: Any) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(args)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        print(_failed(rank, failure.exitcode), file=sys.stderr, flush=True)
        report = _hang_report(failure.message)
        if report:  # the collective that failed, as the rank that saw it first said it: the job's last lines
            print(report, file=sys.stderr, flush=True)
        return _exit_code(failure.exitcode)
    except SignalException as stop:
        # torchrun's own handler (SIGINT, SIGTERM, SIGHUP, SIGQUIT) raises this once the workers have
        # been sent the same signal and have exited (SIGKILL after its 30 s grace).
        print(_stopped(stop.sigval), file=sys.stderr, flush=True)
        return 128 + stop.sigval
    except KeyboardInterrupt:  # before torchrun's handler is installed: no worker has started
        print(BEFORE_WORKERS, file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
