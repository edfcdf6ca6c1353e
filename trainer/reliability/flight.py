"""What every rank leaves behind when a collective fails: torch's Flight Recorder, where it was,
and which of the lab's collectives each record was; the failing rank then says what happened.

torch's Flight Recorder keeps, in each process, a ring of the last `TORCH_FR_BUFFER_SIZE`
collectives of every process group (its sequence number, kind, sizes, group), on gloo as on nccl.
It only records when that variable is set before the group is made: train.py sets it from
`trainer.flight_recorder` (record()). The lab adds two small rings of its own, because a record
of torch's says "all_reduce of 2,346 floats" and a reader wants "step 3, bucket 0": the step each
rank started when (step_started(), once a step) and each collective the communication object
launched with its bucket or unit (Comm.launches). Both cost a tuple append (docs/performance.md).

When a step fails (a collective timed out, a peer vanished), the rank snapshots all of it and
hands it to the job's store. The first rank to fail wakes the others' watchers (a thread blocked
on the store, which costs nothing until then): each snapshots itself at once, wherever its main
thread is, even stuck outside any collective. The first rank waits up to WAIT_S for the
snapshots, writes them to `<run dir>/hang/rank<r>.pkl` and reads them (trainer/reliability/hang.py)
into at most three lines, which end its failure's log record. A rank that died (SIGKILL, gloo's
abort on a size it did not expect) leaves none; the report says so.
"""

from __future__ import annotations

import atexit
import datetime as dt
import faulthandler
import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from trainer.reliability import hang
from trainer.reliability.exits import STOP_SIGNALS, Terminated

log = logging.getLogger(__name__)

ENV = "TORCH_FR_BUFFER_SIZE"  # torch's: how many collectives its Flight Recorder keeps per process
WAIT_S = 5.0  # how long the first rank to fail waits for the others' snapshots (they take ~50 ms)
STEPS = 64  # step starts kept: enough to place every record the recorder still holds of recent steps
_FOREVER = dt.timedelta(days=7)  # a watcher's wait: woken by a key, never by a timeout (which logs)


AUTO = 2000  # trainer.flight_recorder=auto on CPU: what torch's recorder keeps when turned on for nccl


def entries(setting: int | str, device_type: str) -> int:
    """trainer.flight_recorder: a number, or `auto`: on with gloo, where its cost is measured (about
    8 µs a collective here, under 1 % of the benchmark's CPU steps: docs/performance.md), off on CUDA
    until a GPU measures it (a number turns it on there)."""
    if setting == "auto":
        return AUTO if device_type == "cpu" else 0
    return int(setting)


def record(entries: int) -> None:
    """Turn torch's Flight Recorder on for the groups made after this (0: off). A value the user
    exported already is theirs and stays."""
    if entries > 0:
        os.environ.setdefault(ENV, str(entries))


def recorded() -> int:
    """How many collectives the recorder keeps in this process (0: off)."""
    return int(os.environ.get(ENV, "0") or 0)


class Flight:
    """One rank's side: the rings, its snapshot, its watcher, and the report when it fails first."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int, run_dir: Path, launches: int) -> None:
        self.rank, self.world_size, self.run_dir = rank, world_size, run_dir
        self.steps: deque[tuple[int, int]] = deque(maxlen=STEPS)  # (step, time.time_ns() at its start)
        self.launches: deque[tuple[Any, ...]] = deque(maxlen=launches)  # the communication object's (Comm)
        self._store = store
        self._lock = threading.Lock()
        self._snapshot_sent = False
        self._failed = False
        self._watcher: threading.Thread | None = None
        if store is not None and world_size > 1:
            # A store of its own: a blocked wait on the trainer's would stall every store call of the rank.
            self._watcher = threading.Thread(target=self._watch, args=(store.clone(),), name="ddplab-hang", daemon=True)
            self._watcher.start()
            # A thread still blocked in the store's C++ wait when the interpreter ends aborts the
            # process ("terminate called"): whatever the way out, it is woken first.
            atexit.register(self.close)
            _last_words_into_log_file()

    def step_started(self, step: int) -> None:
        self.steps.append((step, time.time_ns()))

    # The watcher: a thread blocked on this rank's wake key until a failing rank (or the end) sets it.

    def _watch(self, store: dist.Store) -> None:
        key = f"hang/wake{self.rank}"
        try:
            store.wait([key], _FOREVER)
            if store.get(key) != b"dump":
                return  # the job ended without a failure
            main = sys._current_frames().get(threading.main_thread().ident or 0)
            self._send(None, traceback.extract_stack(main) if main is not None else [])
        except Exception as err:  # the store went with the job: nothing left to report to
            log.debug("hang watcher on rank %d ended: %s", self.rank, err)

    def close(self) -> None:
        """The job is past its collectives: the watcher stops (this rank's key only; a wake that
        came first stands). Idempotent."""
        watcher, self._watcher = self._watcher, None
        if watcher is None or self._store is None:
            return
        try:
            self._store.compare_set(f"hang/wake{self.rank}", "", "done")
        except Exception as err:  # the store's server (rank 0's agent) may already be gone
            log.debug("hang watcher on rank %d not told to stop: %s", self.rank, err)
        watcher.join(timeout=WAIT_S)

    # A failure.

    def snapshot(self, error: BaseException | None, stack: list[traceback.FrameSummary]) -> dict[str, Any]:
        """This rank now: its Flight Recorder (without stacks: 20 ms where stacks take seconds), the
        step it was in, its error, where it was, and the lab's rings."""
        while error is not None and error.__cause__ is not None:  # what StepFailed wraps
            error = error.__cause__
        fr: dict[str, Any] = {}
        if recorded():
            dump_fr_trace = getattr(torch._C._distributed_c10d, "_dump_fr_trace")  # noqa: B009 (not in torch's stubs)
            fr = pickle.loads(dump_fr_trace(includeStackTraces=False))
        launches = [(t, kind, numel, bucket, hang.group_name(group)) for t, kind, numel, bucket, group in self.launches]
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "step": self.steps[-1][0] if self.steps else 0,
            "error": None if error is None else f"{type(error).__name__}: {' '.join(str(error).split())[:300]}",
            "stack": [(f.filename, f.lineno, f.name) for f in stack],
            "steps": list(self.steps),
            "launches": launches,
            "groups": hang.groups_here(),
            "fr": fr,
        }

    def _send(self, error: BaseException | None, stack: list[traceback.FrameSummary]) -> None:
        """Snapshot once (the main thread's failure or the watcher's wake, whichever comes first)."""
        with self._lock:
            if self._snapshot_sent or self._store is None:
                return
            self._snapshot_sent = True
            # torch's binding takes bytes as well as the str its stub names
            blob = cast(str, pickle.dumps(self.snapshot(error, stack)))
            self._store.set(f"hang/dump{self.rank}", blob)

    def failed(self, error: BaseException) -> None:
        """This rank failed: snapshot; if a collective failed and it is the first rank to say so, log
        the report (the job's console).

        A SIGTERM or Ctrl-C meanwhile waits for the report (torchrun stops the others as soon as one
        rank exits, and one that died first makes it stop this one at once), then stops the rank."""
        if self._store is None or self.world_size == 1 or self._failed:
            return
        self._failed = True  # once: the loop and fit() can both see the same failure
        held: list[int] = []
        previous = {s: signal.signal(s, lambda signum, _: held.append(signum)) for s in STOP_SIGNALS}
        began = int(time.time())
        try:
            self._send(error, _frames_of(error))  # whatever the failure: the report may need where this rank was
            if not _in_a_collective(error):
                return  # its own error (a crash, a bad value): its peers' collectives fail next, and report
            store = self._store
            first = store.compare_set("hang/first", "", str(self.rank)) == str(self.rank).encode()
            if not first:  # the first rank reports; this one lets it finish before going
                _wait_for(store, ["hang/said"], WAIT_S + 5)
                return
            for rank in range(self.world_size):
                if rank != self.rank:
                    store.set(f"hang/wake{rank}", "dump")
            dumps = self._collect(store)
            where = write(self.run_dir, dumps)
            lines = hang.explain(dumps, self.world_size, logs=self.run_dir, dumps_dir=where)
            log.error("%s", "\n".join(lines))  # one record: another rank's output cannot come between its lines
            store.set("hang/said", "1")
            _tell_torchrun(lines, began)
        except Exception as err:  # the report must never hide the failure it reports on
            log.warning("no hang report: %s: %s", type(err).__name__, err)
        finally:
            for stop, handler in previous.items():
                signal.signal(stop, handler)
            if held:
                raise Terminated(128 + held[0])

    def _collect(self, store: dist.Store) -> dict[int, dict[str, Any] | None]:
        """Every rank's snapshot that arrives within WAIT_S; None for a rank that sent none."""
        keys = {rank: f"hang/dump{rank}" for rank in range(self.world_size)}
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not store.check(list(keys.values())):
            time.sleep(0.1)
        return {rank: pickle.loads(store.get(key)) if store.check([key]) else None for rank, key in keys.items()}


def write(run_dir: Path, dumps: dict[int, dict[str, Any] | None]) -> Path:
    """The snapshots, one file a rank, for `python -m trainer.tools.hang RUN_DIR`."""
    where = run_dir / "hang"
    where.mkdir(parents=True, exist_ok=True)
    for rank, dump in dumps.items():
        if dump is not None:
            (where / f"rank{rank}.pkl").write_bytes(pickle.dumps(dump))
    return where


def _tell_torchrun(lines: list[str], began: int) -> None:
    """The report as torchrun's root cause: the error file it reads for each failed worker (the one
    its `record` decorator writes), stamped when this rank failed, so that its summary, the job's
    very last lines, names the collective rather than "exitcode: 1". The other ranks write none:
    torchrun stamps them when it sees them exit, later."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    report = {"message": lines[0], "extraInfo": {"py_callstack": "\n".join(lines), "timestamp": str(began)}}
    try:
        Path(path).write_text(json.dumps({"message": report}), encoding="utf-8")
    except OSError as err:
        log.debug("torchrun's error file %s not written: %s", path, err)


# How a collective's failure reads where torch raises it as a plain RuntimeError (gloo's timeouts and
# lost peers); nccl's are torch.distributed.DistError.
_COLLECTIVE_WORDS = ("timed out", "timeout", "connection", "closed", "reset by peer", "pair")


def _in_a_collective(error: BaseException) -> bool:
    """Whether the failure is a collective's (its timeout, a peer gone) rather than this rank's own."""
    while error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, dist.DistError):
        return True
    return type(error) is RuntimeError and any(w in str(error).lower() for w in _COLLECTIVE_WORDS)


def _frames_of(error: BaseException) -> list[traceback.FrameSummary]:
    """Where the error was raised: the innermost cause's frames (StepFailed wraps the collective's error)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return list(traceback.extract_tb(error.__traceback__))


def _wait_for(store: dist.Store, keys: list[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not store.check(keys):
        time.sleep(0.1)


def _last_words_into_log_file() -> None:
    """A rank killed by a fatal signal (gloo's abort on a size it did not expect, a segfault) writes
    its Python stacks into its own log file, where the report looks for them (hang.last_words)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            faulthandler.enable(handler.stream, all_threads=True)
            return
