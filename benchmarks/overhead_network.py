"""What the collective-cost mode (benchmarks/overhead.py --collective-cost) times: one small
all_reduce launched and waited for along each path network=<preset> can put it on, and the
framework's step with and without an emulated link that takes no time.

Apart from benchmarks/overhead.py (the rounds, the tables), as benchmarks/overhead_loops.py is.
An emulated link of ~0 time (latency 0, 1e9 Gb/s) shows the emulation's own work alone: the
deadline, the Delayed wrapper, the timer's future. A link of BOUND_US per all_reduce shows how late
the sleep or the timer thread hands a collective on after its deadline.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.sync.collectives import Collectives
from trainer.sync.network import Network

CALLS = 200  # collectives per route and round (--quick: 10)
NUMEL = 256  # a 1 KiB fp32 all_reduce: the launch and the wait, not the bytes
FREE = {"latency_us": 0.0, "bandwidth_gbps": 1e9}  # an emulated link whose time is ~0
BOUND_US = 500.0  # the bound link's time per all_reduce: well above gloo's own on 2 ranks
# The framework's step, network=none against the ~0 link, where a per-collective cost could show:
# mlp-tiny's sub-millisecond step (manual: one coalesced all_reduce; ddp: one bucket, reached through
# torch's allreduce_hook once a link is set), and mlp-deep's 102 gradients one all_reduce each.
STEP_PAIRS = (("mlp-tiny", "manual"), ("mlp-tiny", "ddp"), ("mlp-deep", "manual:coalesce_mb=0"))
FREE_OVERRIDES = ["network=100gbe", *(f"network.{key}={value:g}" for key, value in FREE.items())]


@dataclass(frozen=True)
class Route:
    """One way to send and wait for the all_reduce, and the plain torch path it is compared with."""

    name: str
    floor: str  # the route whose per-round time this one's extra is measured against; "": a floor
    call: Callable[[], object]
    link_s: float = 0.0  # the emulated link's own time per collective (the bound link's)


def routes(world_size: int) -> list[Route]:
    """Each route all-reduces the same zeros (a SUM that stays 0) and waits for the result.

    The links are built for at least 2 ranks whatever the group's size: a ring of one rank takes no
    time and its arithmetic returns at once, so on 1 rank the emulation would skip work it does on
    more; built for 2, it does all of it (what it computes is a time, not a value)."""
    ranks = max(2, world_size)
    tensor = torch.zeros(NUMEL)
    nbytes = tensor.numel() * tensor.element_size()
    plain, emulated, bound = Collectives(), Collectives(), Collectives()
    link = Network(preset="100gbe", **FREE).link(ranks)
    assert link is not None
    emulated.link = link
    alpha_us = BOUND_US / (2 * (ranks - 1))  # a ring all_reduce is 2(n-1) latencies
    bound.link = Network(preset="100gbe", latency_us=alpha_us, bandwidth_gbps=FREE["bandwidth_gbps"]).link(ranks)
    assert bound.link is not None
    bound_s = bound.link.seconds("all_reduce", nbytes)

    def launch() -> dist.Work:
        work = dist.all_reduce(tensor, async_op=True)
        assert work is not None
        return work

    return [
        Route("torch: launch + wait()", "", lambda: launch().wait()),
        Route(
            "Collectives, link None (network=none)", "torch: launch + wait()", lambda: plain.all_reduce(tensor).wait()
        ),
        Route("Collectives, ~0 link: wait()", "torch: launch + wait()", lambda: emulated.all_reduce(tensor).wait()),
        Route("torch: get_future().wait()", "", lambda: launch().get_future().wait()),
        Route(
            "Collectives, ~0 link: get_future().wait()",
            "torch: get_future().wait()",
            lambda: emulated.all_reduce(tensor).get_future().wait(),
        ),
        Route(
            "DDP hook's future, ~0 link: delayed_future",
            "torch: get_future().wait()",
            lambda: link.delayed_future(launch().get_future(), "all_reduce", nbytes).wait(),
        ),
        Route(f"{BOUND_US:g} µs link: wait() (sleeps)", "", lambda: bound.all_reduce(tensor).wait(), bound_s),
        Route(
            f"{BOUND_US:g} µs link: get_future().wait() (timer thread)",
            "",
            lambda: bound.all_reduce(tensor).get_future().wait(),
            bound_s,
        ),
    ]


def branch_ns(number: int = 20_000, repeat: int = 201) -> float:
    """ns per collective of network=none's branch alone: Collectives' `work if self.link is None
    else ...` against the bare `work`, each timeit's inlined loop (no call around it), the two
    interleaved and each the best of `repeat` short runs: the least disturbed (long runs of 10^6
    read 2-3x higher and less repeatably on a shared CPU)."""
    setup = "from trainer.sync.collectives import Collectives; net, work = Collectives(), object()"
    branch = timeit.Timer("work if net.link is None else None", setup)
    bare = timeit.Timer("work", setup)
    best_branch, best_bare = float("inf"), float("inf")
    for _ in range(repeat):
        best_branch = min(best_branch, branch.timeit(number))
        best_bare = min(best_bare, bare.timeit(number))
    return max(0.0, best_branch - best_bare) / number * 1e9
