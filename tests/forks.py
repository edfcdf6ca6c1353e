"""Processes the tests start, forked from a server that has imported torch once.

Importing torch and the trainer takes a fresh interpreter ~2-3 s of CPU here (and the first
optimizer step ~1.5 s more, importing torch._dynamo; a rank's first wandb.init ~0.7 s more, importing
W&B's modules), and the suite starts hundreds of processes:
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
and the exit code of its SystemExit (`python -u -m module` alike). Where CUDA is available the agent
starts fresh interpreters instead: torchrun's agent has queried the GPU, and CUDA refuses to start in
a process forked from one that has. Two things differ and are left to launches that start fresh
interpreters (`tests/cli.py`'s `fresh=True`, the make-train launcher, the launches a test signals
with Popen): what only a fresh interpreter shows (an import the server happened to have done, an
environment variable torch reads at import), and torchrun's failure report, which for forked
ranks lists only the first failed rank (torch's multiprocessing stops the others itself).

Scripts whose output a test reads (the benchmarks' smoke runs, one-process runs, tools) fork one
level up (`python`): the script itself is forked from the server, and the `torchrun ...` and
`python script ...` commands it runs through subprocess.run are forked from it in turn
(`_forked_run`; where CUDA is available they start fresh, as the agent's ranks do), with the
output, working directory, environment, exit code and errors that subprocess.run would give. A
forked child starts without its parent's exit handlers, as a new interpreter would.
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
import weakref
from pathlib import Path
from typing import Any

PRELOAD = [
    "torch",
    "torch._dynamo",  # what torch's optimizers and DDP import on first use
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.run",
    "tests.train_helpers",
    # W&B's logger: wandb.init imports these on every rank's first run (about 0.7 s of CPU a rank)
    "wandb",
    "wandb.apis.public",
    "wandb.sdk.launch",
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
    _run_main(script, None, *args)


def run_module(module: str, *args: str) -> None:
    """A rank forked by the agent: `python -u -m module *args`, as that interpreter would run it."""
    _run_main(None, module, *args)


def _run_main(script: str | None, module: str | None, *args: str) -> None:
    # A new interpreter starts with no exit handlers: the forking process's (a benchmark's
    # TemporaryDirectory, say) are its own, and must not run again at this child's end.
    atexit._clear()
    weakref.finalize._registry.clear()  # type: ignore[attr-defined]
    weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)  # not the agent's handlers: a signal ends the rank as it would
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:  # read by a fresh interpreter's torch at start-up; the server's torch had read its own
        import torch

        torch.set_num_threads(int(threads))
    # sys.path[0] as the interpreter sets it: the script's directory, or the working directory for -m
    sys.argv = [script or module or "", *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script)) if script else os.getcwd()
    for fd, name in ((1, "stdout"), (2, "stderr")):  # -u: nothing waits in a buffer
        stream = io.TextIOWrapper(io.FileIO(fd, "wb", closefd=False), write_through=True, errors="backslashreplace")
        setattr(sys, name, stream)
    code: Any = 0
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            assert module
            runpy.run_module(module, run_name="__main__", alter_sys=True)
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
        if cmd == sys.executable and cmd_args[:1] == ["-u"]:
            config.start_method = "fork"
            if cmd_args[1:2] == ["-m"]:
                return config, run_module, cmd_args[2:]
            return config, run_script, cmd_args[1:]
        return config, cmd, cmd_args

    return config_from_args


def _redirect(out: str | int | None, err: str | int | None) -> None:
    """fd 1 and 2 to a file (a path, truncated) or to an open descriptor; None keeps the inherited one."""
    for fd, target in ((1, out), (2, err)):
        if target is None:
            continue
        opened = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if isinstance(target, str) else target
        os.dup2(opened, fd)
        if isinstance(target, str):
            os.close(opened)  # fd 1 or 2 now holds the file; the agent's workers inherit only those


def _torchrun_main(
    argv: list[str], env: dict[str, str], cwd: str, out: str | int | None, err: str | int | None, fork_ranks: bool
) -> None:
    """torch.distributed.run's main (what the `torchrun` command runs) with argv, its output in files."""
    take(env, cwd)
    _redirect(out, err)
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
    return _captured(["torchrun", *argv], _torchrun_main, (argv, env, str(cwd)), (fork_ranks,), timeout_s)


def _captured(
    cmd: list[str], target: Any, head: tuple[Any, ...], tail: tuple[Any, ...], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """target(*head, stdout_path, stderr_path, *tail) in a child forked from the server, returned as
    subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s) would return it."""
    with tempfile.TemporaryDirectory(prefix="forked-output-") as tmp:
        out, err = str(Path(tmp) / "stdout"), str(Path(tmp) / "stderr")
        proc = context.Process(target=target, args=(*head, out, err, *tail))
        proc.start()
        proc.join(timeout_s)
        timed_out = proc.is_alive()
        if timed_out:
            proc.kill()
            proc.join()
        stdout, stderr = (Path(p).read_text(errors="replace") if Path(p).exists() else "" for p in (out, err))
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout_s, stdout, stderr)
    assert proc.exitcode is not None
    return subprocess.CompletedProcess(cmd, proc.exitcode, stdout, stderr)


def _child(argv: list[str], env: dict[str, str], cwd: str, out: str | int | None, err: str | int | None) -> None:
    """`python script args` or `python -m module args` in a forked child, its output where asked."""
    take(env, cwd)
    _redirect(out, err)
    if argv[:1] == ["-m"]:
        run_module(argv[1], *argv[2:])
    else:
        run_script(argv[0], *argv[1:])


def _forked_run(cmd: Any, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """subprocess.run inside a benchmark that `python` below started: `torchrun ...` runs torchrun's main
    (its ranks forked, as tests/cli.py's launches) and `python script ...` or `python -m module ...` the
    script, each in a child forked from this process, which imported torch already. Any other command,
    or a keyword this does not handle, goes to the real subprocess.run."""
    known = {"cwd", "env", "stdout", "stderr", "capture_output", "check", "text", "timeout"}
    argv = [str(part) for part in cmd] if isinstance(cmd, (list, tuple)) else []
    torchrun_cmd = bool(argv) and Path(argv[0]).name == "torchrun"
    python_cmd = len(argv) > 1 and argv[0] == sys.executable and (argv[1] == "-m" or argv[1].endswith(".py"))
    if not (torchrun_cmd or python_cmd) or set(kwargs) - known or _cuda_here():
        return _real_run(cmd, **kwargs)
    env, cwd = kwargs.get("env") or dict(os.environ), str(kwargs.get("cwd") or os.getcwd())
    capture = kwargs.get("capture_output", False)
    with tempfile.TemporaryDirectory(prefix="forked-run-") as tmp:
        targets: list[str | int | None] = []
        devnull: int | None = None
        for name, path in (("stdout", Path(tmp) / "stdout"), ("stderr", Path(tmp) / "stderr")):
            spec = kwargs.get(name)
            if capture or spec == subprocess.PIPE:
                targets.append(str(path))
            elif spec == subprocess.DEVNULL:
                devnull = devnull if devnull is not None else os.open(os.devnull, os.O_WRONLY)
                targets.append(devnull)
            elif spec == subprocess.STDOUT:
                targets.append(targets[0] if targets[0] is not None else 1)
            elif spec is None:
                targets.append(None)
            else:  # an open file object, or a descriptor
                if not isinstance(spec, int):
                    spec.flush()  # what the script wrote to it before comes first
                    spec = spec.fileno()
                targets.append(spec)
        if torchrun_cmd:
            target, args = _torchrun_main, (argv[1:], env, cwd, targets[0], targets[1], True)
        else:
            target, args = _child, (argv[1:], env, cwd, targets[0], targets[1])
        proc = mp.get_context("fork").Process(target=target, args=args)
        proc.start()
        proc.join(kwargs.get("timeout"))
        timed_out = proc.is_alive()
        if timed_out:
            proc.kill()
            proc.join()
        captured: list[Any] = [None, None]
        for i, target_ in enumerate(targets):
            if isinstance(target_, str):
                data = Path(target_).read_bytes() if Path(target_).exists() else b""
                captured[i] = data.decode(errors="replace") if kwargs.get("text") else data
        if devnull is not None:
            os.close(devnull)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], captured[0], captured[1])
    assert proc.exitcode is not None
    if kwargs.get("check") and proc.exitcode != 0:
        raise subprocess.CalledProcessError(proc.exitcode, cmd, captured[0], captured[1])
    return subprocess.CompletedProcess(cmd, proc.exitcode, captured[0], captured[1])


_real_run = subprocess.run


def _cuda_here() -> bool:
    """Where CUDA is available the commands start fresh: the script may have started CUDA, and a
    process forked from one that has cannot (torchrun's agent queries the GPU at start)."""
    import torch

    return torch.cuda.is_available()


def _benchmark_main(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    subprocess.run = _forked_run  # type: ignore[assignment]  # only in this forked child and what it forks
    _child(argv, env, cwd, out, err)


def python(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`python *argv` (a script and its arguments) as subprocess.run(..., capture_output=True, text=True)
    would run it, forked from the server, and with the `torchrun` and `python` commands that the script
    runs through subprocess.run forked in turn (`_forked_run`): for runs whose output a test reads (a
    benchmark's smoke run, which starts train.py several times; a one-process run; a tool), not how an
    interpreter starts."""
    return _captured(["python", *argv], _benchmark_main, (argv, env, str(cwd)), (), timeout_s)
