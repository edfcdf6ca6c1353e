"""Processes the tests start, forked from a server that has imported torch once.

Importing torch and the trainer takes a fresh interpreter ~2-3 s of CPU here (and the first
optimizer step ~1.5 s more, importing torch._dynamo), and the suite starts hundreds of processes:
the spawned ranks of tests/dist_helpers.py, the torchrun agents of tests/cli.py and the ranks
those agents start. They fork instead from one multiprocessing forkserver per pytest worker that
imported these modules once. The server forks before any process group, thread pool or CUDA
context exists (DataLoader's forked workers rely on the same), so each child still begins clean;
it takes the test's environment and working directory, as a new process would.

The agent is torchrun's own code, started with the command line's arguments. Only where it would
start `python -u script.py args` for each rank, it forks itself instead (torchrun's function
entrypoint with --start-method=fork, `run_script` below) and the rank runs the script as the
interpreter would: as __main__, with its argv and path, unbuffered output, default signal
handlers, OMP_NUM_THREADS applied (torch read the server's at import), atexit handlers at its end
and the exit code of its SystemExit. Where CUDA is available the agent
starts fresh interpreters instead: torchrun's agent has queried the GPU, and CUDA refuses to start in
a process forked from one that has. Two things differ and are left to launches that start fresh
interpreters (`tests/cli.py`'s `fresh=True`, the make-train launcher, the launches a test signals
with Popen): what only a fresh interpreter shows (an import the server happened to have done, an
environment variable torch reads at import), and torchrun's failure report, which for forked
ranks lists only the first failed rank (torch's multiprocessing stops the others itself).
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

PRELOAD = [
    "torch",
    "torch._dynamo",  # what torch's optimizers and DDP import on first use
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.run",
    "tests.train_helpers",
]
context = mp.get_context("forkserver")
context.set_forkserver_preload(PRELOAD)


def here() -> tuple[dict[str, str], str]:
    """This process's environment and directory, for a forked child to take."""
    return dict(os.environ), os.getcwd()


def take(env: dict[str, str], cwd: str) -> None:
    """In a forked child: the environment and directory its starter had, not the server's."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def run_script(script: str, *args: str) -> None:
    """A rank forked by the agent: `python -u script *args`, as that interpreter would run it."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)  # not the agent's handlers: a signal ends the rank as it would
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:  # read by a fresh interpreter's torch at start-up; the server's torch had read its own
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    for fd, name in ((1, "stdout"), (2, "stderr")):  # -u: nothing waits in a buffer
        stream = io.TextIOWrapper(io.FileIO(fd, "wb", closefd=False), write_through=True, errors="backslashreplace")
        setattr(sys, name, stream)
    code: Any = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # what the interpreter prints for an uncaught exception, then exit 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # the interpreter's own shutdown would; multiprocessing's exit does not
    if code not in (0, None):
        raise SystemExit(code)


def _forking_config_from_args(original: Any) -> Any:
    """torchrun's config_from_args, with `python -u script args` replaced by run_script, forked."""

    def config_from_args(args: Any) -> Any:
        config, cmd, cmd_args = original(args)
        import torch

        # torchrun's LaunchConfig asks torch.accelerator whether a GPU is there (for its NUMA default),
        # and CUDA cannot start in a process forked from one that asked: with CUDA, fresh ranks.
        if torch.cuda.is_available():
            return config, cmd, cmd_args
        if cmd == sys.executable and cmd_args[:1] == ["-u"] and cmd_args[1:2] != ["-m"]:
            config.start_method = "fork"
            return config, run_script, cmd_args[1:]
        return config, cmd, cmd_args

    return config_from_args


def _torchrun_main(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, fork_ranks: bool) -> None:
    """torch.distributed.run's main (what the `torchrun` command runs) with argv, its output in files."""
    take(env, cwd)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)  # fd 1 or 2 now holds the file; the agent's workers inherit only those
    import torch.distributed.run as torchrun_module
    from torch.distributed.run import main

    if fork_ranks:
        torchrun_module.config_from_args = _forking_config_from_args(torchrun_module.config_from_args)

    code: int | str | None = 0
    try:
        main(argv)
    except SystemExit as stop:  # argparse's errors, --help
        code = stop.code
    except BaseException:  # what the interpreter would print for the `torchrun` script, and exit 1
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)


def torchrun(
    argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float, fork_ranks: bool = True
) -> subprocess.CompletedProcess[str]:
    """`torchrun *argv`, as subprocess.run(..., capture_output=True, text=True, timeout=timeout_s) would
    run it: its exit code (negative for a signal), its stdout and stderr, TimeoutExpired after killing it.
    fork_ranks=False: the agent starts each rank as a fresh interpreter, as the command does."""
    with tempfile.TemporaryDirectory(prefix="torchrun-output-") as tmp:
        out, err = str(Path(tmp) / "stdout"), str(Path(tmp) / "stderr")
        proc = context.Process(target=_torchrun_main, args=(argv, env, str(cwd), out, err, fork_ranks))
        proc.start()
        proc.join(timeout_s)
        timed_out = proc.is_alive()
        if timed_out:
            proc.kill()
            proc.join()
        stdout, stderr = (Path(p).read_text(errors="replace") if Path(p).exists() else "" for p in (out, err))
    cmd = ["torchrun", *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout_s, stdout, stderr)
    assert proc.exitcode is not None
    return subprocess.CompletedProcess(cmd, proc.exitcode, stdout, stderr)
