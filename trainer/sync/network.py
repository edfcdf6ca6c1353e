"""An emulated network (network=<preset>): each collective a strategy sends completes no earlier than
a real link would have finished it, so overlap, bucket size, compression and sharding pay here as
they do on a cluster.

The link's time is the scaling model's alpha-beta model (trainer/links.py: ring all_reduce
2(n-1) steps, reduce_scatter and all_gather n-1, each alpha + S/(n beta)), charged by the group a
collective runs on: a group inside one emulated node (network.gpus_per_node ranks) pays the intra
link, a group that spans nodes (every rank's, or one rank per node) the inter link; on the same
presets (trainer/links.py: one table for both), stretched by network.time_scale. The link carries
one collective at a time, as NCCL's stream or gloo's thread does: a collective launched while
another is on the link starts when that one is done. So its
emulated completion is max(launch, link free) + its time, and it is handed on at the later of that
and the real completion: by a timer thread that sleeps until the next deadline (a timer, not a
spin: compute running meanwhile has the cores), or, for a plain wait(), by sleeping after the real
wait. Values are the real collective's, untouched: every strategy still equals one process.

What reaches the link: every collective a strategy sends through its communication object
(trainer/sync/comm.py, the only user of this module's link), control collectives included, the
collectives of torch's DDP hooks and FSDP2's all-gathers and reduce-scatters.

In a trainer.profile=true trace: while the profiler records, each emulated collective leaves an
empty range right after its launch on the launching thread, naming its emulated completion
(`emulated link: done +12.345678 ms`, trainer/trace_names.py); the timeline ends the launch's span
there when that is after the backend's end. With network=none nothing here runs.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch.profiler import record_function

from trainer.errors import ConfigError
from trainer.links import EMULATED, PRESETS, Topology
from trainer.links import Network as Preset
from trainer.links import Preset as PresetName
from trainer.trace_names import completion_mark


@dataclass(frozen=True)
class Network:
    """What conf/network/<option>.yaml builds: a preset between emulated nodes, optionally overridden,
    and the link inside a node when gpus_per_node > 1. preset `none`: no emulation at all."""

    preset: Annotated[Literal["none"] | PresetName, Field(description="the link between nodes; none: no emulation")] = (
        "none"
    )
    latency_us: Annotated[float | None, Field(ge=0, description="per ring step; null: the preset's")] = None
    bandwidth_gbps: Annotated[
        float | None, Field(gt=0, description="per rank and direction, Gb/s; null: the preset's")
    ] = None
    # network=none's YAML gives the launcher's ranks per node instead (${ddplab.local_world_size:})
    gpus_per_node: Annotated[int, Field(ge=1, description="ranks per emulated node, a divisor of the world size")] = 1
    intra: Annotated[PresetName, Field(description="the link inside a node (gpus_per_node > 1)")] = "nvlink"
    intra_latency_us: Annotated[float | None, Field(ge=0, description="null: the intra preset's")] = None
    intra_bandwidth_gbps: Annotated[float | None, Field(gt=0, description="Gb/s; null: the intra preset's")] = None
    # docs/network.md, choosing time_scale
    time_scale: Annotated[float, Field(gt=0, description="every link time is multiplied by it")] = 1.0

    def link(self, world_size: int) -> EmulatedLink | None:
        """The job's link at this world size, or None for network=none; bad combinations refused."""
        if self.preset == "none":
            overridden = [k for k in _OVERRIDES if getattr(self, k) is not None]
            if overridden:
                raise ConfigError(
                    f"network.{overridden[0]}={getattr(self, overridden[0])!r} is invalid with network=none: "
                    f"accepted: pick a link to override with network=<preset> ({', '.join(EMULATED)})"
                )
            return None
        if world_size % self.gpus_per_node:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ConfigError(
                f"network.gpus_per_node={self.gpus_per_node} is invalid on {world_size} rank(s): "
                f"accepted: a divisor of the world size ({', '.join(map(str, divisors))})"
            )
        inter = _tier(self.preset, self.latency_us, self.bandwidth_gbps)
        intra = _tier(self.intra, self.intra_latency_us, self.intra_bandwidth_gbps) if self.gpus_per_node > 1 else inter
        topology = Topology(world_size, self.gpus_per_node, intra, inter)
        where = (
            inter.describe()
            if self.gpus_per_node == 1
            else f"{inter.describe()}; {intra.describe()} in nodes of {self.gpus_per_node}"
        )
        scale = "" if self.time_scale == 1 else f" x{self.time_scale:g}"
        return EmulatedLink(topology, self.time_scale, f"{where}{scale}")


_OVERRIDES = ("latency_us", "bandwidth_gbps", "intra_latency_us", "intra_bandwidth_gbps")


def _tier(name: str, latency_us: float | None, bandwidth_gbps: float | None) -> Preset:
    """A preset, its alpha or beta replaced where given (bandwidth in Gb/s: bits, as links are sold)."""
    if latency_us is None and bandwidth_gbps is None:
        return PRESETS[name]
    base = PRESETS[name].link("all_reduce")
    alpha = base.alpha_s if latency_us is None else latency_us * 1e-6
    beta = base.beta_Bps if bandwidth_gbps is None else bandwidth_gbps * 1e9 / 8
    return Preset.uniform(f"{name}*", alpha, beta)  # the star: a preset overridden


class EmulatedLink:
    """One rank's view of the emulated link: each collective's deadline, and its delayed result."""

    def __init__(self, topology: Topology, time_scale: float, name: str) -> None:
        self.topology, self.time_scale, self.name = topology, time_scale, name
        self._lock = threading.Lock()
        self._free_at = 0.0  # perf_counter time the link finishes what it carries now
        self._timer = _Timer()
        self._seconds: dict[
            tuple[str, int, int, tuple[int, ...] | None], float
        ] = {}  # a step sends the same sizes again and again
        _tighten_timer_slack()

    def describe(self) -> str:
        return self.name

    def seconds(self, kind: str, nbytes: int, calls: int = 1, ranks: tuple[int, ...] | None = None) -> float:
        """The link's time for `calls` collectives of `kind` moving nbytes between them (equal parts),
        on the group of these global ranks (None: every rank): inside one node the intra link, across
        nodes the inter link (trainer/links.py's Topology.group_s)."""
        key = (kind, nbytes, calls, ranks)
        if key not in self._seconds:
            self._seconds[key] = self._cost(kind, nbytes, calls, self._group(ranks))
        return self._seconds[key]

    def _group(self, ranks: tuple[int, ...] | None) -> list[int]:
        return list(range(self.topology.ranks)) if ranks is None else list(ranks)

    def across_nodes(self, ranks: tuple[int, ...] | None) -> bool | None:
        """Whether a group of these ranks spans emulated nodes; None when the link has no nodes."""
        if self.topology.per_node == 1:
            return None
        return len({r // self.topology.ranks_per_node for r in self._group(ranks)}) > 1

    def _cost(self, kind: str, nbytes: int, calls: int, group: list[int]) -> float:
        if kind == "broadcast":  # a pipelined ring broadcast: n-1 latencies, the buffer once
            network = self.topology.intra if self.across_nodes(tuple(group)) is False else self.topology.inter
            link = network.link("all_gather")
            one = (len(group) - 1) * link.alpha_s + nbytes / calls / link.beta_Bps
            return self.time_scale * calls * (one if len(group) > 1 else 0.0)
        return self.time_scale * calls * self.topology.group_s(kind, nbytes / calls, group)

    def deadline(self, seconds: float, recording: bool = False) -> float:
        """Launched now and taking `seconds` on the link: when it is done (after what is on it now).
        `recording`: the profiler records, and the timeline's span ends at the mark left here."""
        with self._lock:
            self._free_at = max(time.perf_counter(), self._free_at) + seconds
            done = self._free_at
        if recording:
            mark_completion(done)
        return done

    def delayed(
        self, work: dist.Work, kind: str, nbytes: int, recording: bool = False, ranks: tuple[int, ...] | None = None
    ) -> dist.Work:
        """A launched collective's Work, done no earlier than its link time."""
        return Delayed(work, self.deadline(self.seconds(kind, nbytes, 1, ranks), recording), self._timer)

    def delayed_future(
        self, future: torch.futures.Future[Any], kind: str, nbytes: int, calls: int = 1, recording: bool = False
    ) -> torch.futures.Future[Any]:
        """A collective's future (a DDP hook's), completed no earlier than its link time."""
        return self._timer.after(future, self.deadline(self.seconds(kind, nbytes, calls), recording))


def _tighten_timer_slack() -> None:
    """Linux wakes a sleeping thread up to 50 µs late by default (its timer slack); the link's
    sleeps and timer waits then hand collectives on late. 1 µs of slack for this process, where the
    call exists (Linux's prctl); elsewhere the default stays, and docs/network.md says what it costs."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # nanoseconds
    except (OSError, AttributeError):
        pass


_PR_SET_TIMERSLACK = 29


def mark_completion(deadline: float) -> None:
    """An empty range in the profiler's trace, on this thread just after the launch, naming
    the launch's emulated completion relative to itself (no clock to convert, nothing to pair by
    order: the reader takes this thread's last launch before it)."""
    with record_function(completion_mark((deadline - time.perf_counter()) * 1e3)):
        pass


class Delayed(dist.Work):
    """A Work that is done at the later of the real collective's end and its emulated deadline."""

    def __init__(self, work: dist.Work, deadline: float, timer: _Timer) -> None:
        super().__init__()
        self._work, self._deadline, self._timer = work, deadline, timer

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait()
        left = self._deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)  # a timer, not a spin: the cores stay free for compute
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed() and time.perf_counter() >= self._deadline

    def get_future(self) -> torch.futures.Future[Any]:
        return self._timer.after(self._work.get_future(), self._deadline)  # gloo's reduce_scatter: raises


class _Timer:
    """Completes futures at their deadlines from one thread that sleeps until the next one."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def after(self, real: torch.futures.Future[Any], deadline: float) -> torch.futures.Future[Any]:
        """A future with real's value (or error), set no earlier than deadline."""
        out: torch.futures.Future[Any] = torch.futures.Future()

        def arrived(done: torch.futures.Future[Any]) -> None:  # on the backend's thread
            try:
                value = done.value()
            except Exception as err:  # the collective failed: no reason to wait for the link
                out.set_exception(err)
                return
            if time.perf_counter() >= deadline:
                out.set_result(value)
            else:
                self._at(deadline, lambda: out.set_result(value))

        real.add_done_callback(arrived)
        return out

    def _at(self, deadline: float, action: Callable[[], None]) -> None:
        with self._wake:
            heapq.heappush(self._due, (deadline, next(self._order), action))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ddplab-link", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        _tighten_timer_slack()  # per thread, inherited from the starter: gloo's callback thread keeps 50 µs
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.perf_counter():
                    self._wake.wait(None if not self._due else max(0.0, self._due[0][0] - time.perf_counter()))
                _, _, action = heapq.heappop(self._due)
            action()
