"""Processes the tests start, forked from a server that has imported torch once.

Importing torch and the trainer takes a fresh interpreter ~2-3 s of CPU here, and the suite starts
hundreds of processes: the spawned ranks of tests/dist_helpers.py and the torchrun agents of
tests/cli.py. They fork instead from one multiprocessing forkserver per pytest worker that
imported these modules once. The server forks before any process group, thread pool or CUDA
context exists (DataLoader's forked workers rely on the same), so each child still begins clean;
it takes the test's environment and working directory, as a new process would. What torchrun
starts (train.py's ranks) are fresh interpreters, as they are for a user.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.run", "tests.train_helpers"]
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


def _torchrun_main(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """torch.distributed.run's main (what the `torchrun` command runs) with argv, its output in files."""
    take(env, cwd)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)  # fd 1 or 2 now holds the file; the agent's workers inherit only those
    from torch.distributed.run import main

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


def torchrun(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`torchrun *argv`, as subprocess.run(..., capture_output=True, text=True, timeout=timeout_s) would
    run it: its exit code (negative for a signal), its stdout and stderr, TimeoutExpired after killing it."""
    with tempfile.TemporaryDirectory(prefix="torchrun-output-") as tmp:
        out, err = str(Path(tmp) / "stdout"), str(Path(tmp) / "stderr")
        proc = context.Process(target=_torchrun_main, args=(argv, env, str(cwd), out, err))
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
