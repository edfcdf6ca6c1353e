"""overhead.py link: what network=<preset> (trainer/sync/network.py) costs, per collective and per step.

    torchrun --nproc_per_node=1 benchmarks/overhead.py link            # 31 rounds (~30 s)
    torchrun --nproc_per_node=1 benchmarks/overhead.py link --quick    # a smoke run

One small all_reduce launched and waited for along each route network=<preset> can put it on, and
the framework's step with network=none against an emulated link that takes no time. One rank is
enough: a gloo group of 1 still runs every collective on gloo's thread with its Work and future,
and the links are built for 2 ranks (routes() says why); on 2 ranks sharing 2 cores the loopback's
latency noise buries microseconds.

network=none has nothing of the emulation to time: build_trainer (trainer/setup/build.py) gives the
strategy's communication object (trainer/sync/comm.py) no link, so each collective pays one `is not
None`, and DDP registers no hook without a link. The routes measure what a link costs: one of ~0
time (latency 0, 1e9 Gb/s) shows the emulation's own work alone (the deadline, the delayed Work,
the timer's future); one of BOUND_US per all_reduce shows how late the sleep (wait()) or the timer
thread (a future) hands a collective on after its deadline, and the timer slack each of those
threads runs with.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.parts.overhead_loops import MODELS, Framework
from benchmarks.parts.rounds import iqr, timed
from trainer.setup import dist as ddist
from trainer.sync.comm import Comm
from trainer.sync.network import EmulatedLink, Network

CALLS = 200  # collectives per route and round (--quick: 10)
NUMEL = 256  # a 1 KiB fp32 all_reduce: the launch and the wait, not the bytes
FREE = {"latency_us": 0.0, "bandwidth_gbps": 1e9}  # an emulated link whose time is ~0
BOUND_US = 500.0  # the bound link's time per all_reduce: well above gloo's own on 2 ranks
# The framework's step, network=none against the ~0 link, where a per-collective cost could show:
# mlp-tiny's sub-millisecond step (manual: one coalesced all_reduce; ddp: one bucket, reached through
# torch's allreduce_hook once a link is set), and mlp-deep's 102 gradients one all_reduce each.
STEP_PAIRS = (("mlp-tiny", "manual"), ("mlp-tiny", "ddp"), ("mlp-deep", "manual:coalesce_mb=0"))
FREE_OVERRIDES = ["network=100gbe", *(f"network.{key}={value:g}" for key, value in FREE.items())]
NO_BRANCH = (
    "network=none: the communication object without a link (one `is not None` per collective); nothing "
    "of the emulation runs, nothing to time"
)


@dataclass(frozen=True)
class Route:
    """One way to send and wait for the all_reduce, and the route its extra is measured against."""

    name: str
    floor: str  # the route whose per-round time this one's extra is measured against; "": a floor
    call: Callable[[], object]
    link_s: float = 0.0  # the emulated link's own time per collective (the bound link's)
    late: list[float] | None = None  # the bound link's: each call's µs from its deadline to its hand-on


@dataclass
class CostReport:
    """The section's results: one row per route, one per step pair."""

    calls: int  # collectives per route and round
    timer_slack_us: dict[str, float | None]  # per thread that hands a bound link's collectives on
    collectives: list[dict[str, object]]
    steps: list[dict[str, object]]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="overhead.py link", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round of each step pair")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for the framework"
    )
    parser.add_argument("--quick", action="store_true", help=f"2 rounds of 10 collectives and 3 steps (not {CALLS})")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 2
    # CPU only: network=<preset> times collectives with host clocks (gloo).
    env = ddist.read_launch_env()
    ctx = ddist.init_process_group(env, ddist.job_store(env), torch.device("cpu"), 600, "ddplab/overhead/link/")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report = collective_cost(args, ctx, Path(tmp))
        if ctx.is_main_process:
            print(
                f"{ctx.world_size} rank(s), {ctx.backend} on {ctx.device}, {args.rounds} rounds x "
                f"{report.calls} collectives per route and {args.steps} steps per pair, interleaved; "
                "medians over rounds, each round's time the slowest rank's"
            )
            print(format_cost(report))
            if args.json:
                args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    finally:
        ddist.destroy_process_group()


def routes(world_size: int) -> tuple[list[Route], EmulatedLink]:
    """Each route all-reduces the same zeros (a SUM that stays 0) and waits for the result; also
    the bound link, for the timer-slack probe.

    The links are built for at least 2 ranks whatever the group's size: a ring of one rank takes no
    time and its arithmetic returns at once, so on 1 rank the emulation would skip work it does on
    more; built for 2, it does all of it (what it computes is a time, not a value)."""
    ranks = max(2, world_size)
    tensor = torch.zeros(NUMEL)
    nbytes = tensor.numel() * tensor.element_size()
    free = Network(preset="100gbe", latency_us=FREE["latency_us"], bandwidth_gbps=FREE["bandwidth_gbps"]).link(ranks)
    alpha_us = BOUND_US / (2 * (ranks - 1))  # a ring all_reduce is 2(n-1) latencies
    bound = Network(preset="100gbe", latency_us=alpha_us, bandwidth_gbps=FREE["bandwidth_gbps"]).link(ranks)
    assert free is not None and bound is not None
    plain, emulated, bounded = Comm(), Comm(free), Comm(bound)
    bound_s = bound.seconds("all_reduce", nbytes)
    late_wait: list[float] = []
    late_future: list[float] = []

    def bound_call(future: bool, late: list[float]) -> None:
        work = bounded.all_reduce(tensor)
        deadline = time.perf_counter() + bound_s  # the link's, give or take the Delayed's constructor
        work.get_future().wait() if future else work.wait()
        late.append((time.perf_counter() - deadline) * 1e6)

    def launch() -> dist.Work:
        work = dist.all_reduce(tensor, async_op=True)
        assert work is not None
        return work

    torch_wait, torch_future = "torch: launch + wait()", "torch: get_future().wait()"
    none_wait, none_future = "Comm (network=none): wait()", "Comm (network=none): get_future().wait()"
    return [
        Route(torch_wait, "", lambda: launch().wait()),
        Route(none_wait, torch_wait, lambda: plain.all_reduce(tensor).wait()),
        Route("Comm on a ~0 link: wait()", none_wait, lambda: emulated.all_reduce(tensor).wait()),
        Route(torch_future, "", lambda: launch().get_future().wait()),
        Route(none_future, torch_future, lambda: plain.all_reduce(tensor).get_future().wait()),
        Route(
            "Comm on a ~0 link: get_future().wait()",
            none_future,
            lambda: emulated.all_reduce(tensor).get_future().wait(),
        ),
        Route(
            "DDP hook's future, ~0 link: delayed_future",
            torch_future,
            lambda: free.delayed_future(launch().get_future(), "all_reduce", nbytes).wait(),
        ),
        Route(f"{BOUND_US:g} µs link: wait() (sleeps)", "", lambda: bound_call(False, late_wait), bound_s, late_wait),
        Route(
            f"{BOUND_US:g} µs link: get_future().wait() (timer thread)",
            "",
            lambda: bound_call(True, late_future),
            bound_s,
            late_future,
        ),
    ], bound


def timer_slack_us(link: EmulatedLink) -> dict[str, float | None]:
    """The timer slack (prctl's, per thread) of this thread, which sleeps in a Delayed wait(), and of
    the thread that completes the link's futures: a callback on a future whose deadline is far
    ahead (100 of the link's collectives) runs where the future is set. None off Linux."""
    seen: dict[str, float | None] = {"waiting thread": _slack_us()}

    def where(_: torch.futures.Future[object]) -> None:
        seen[f"future's thread ({threading.current_thread().name})"] = _slack_us()

    work = dist.all_reduce(torch.zeros(NUMEL), async_op=True)
    assert work is not None
    future = link.delayed_future(work.get_future(), "all_reduce", NUMEL * 4, calls=100)
    future.add_done_callback(where)
    future.wait()
    return seen


def _slack_us() -> float | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None).prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) / 1e3  # ns


_PR_GET_TIMERSLACK = 30


def repeated(call: Callable[[], object]) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            call()

    return run


def collective_cost(args: argparse.Namespace, ctx: ddist.DistContext, out: Path) -> CostReport:
    """The routes' µs per collective, interleaved (the order reversed every other round), then the step pairs."""
    calls = 10 if args.quick else CALLS
    all_routes, bound = routes(ctx.world_size)
    times: dict[str, list[float]] = {route.name: [] for route in all_routes}
    late: dict[str, list[float]] = {route.name: [] for route in all_routes}  # per round, the median call's
    for route in all_routes:  # warm: gloo's buffers, the timer threads started
        repeated(route.call)(calls)
    for round_ in range(args.rounds):
        for route in all_routes if round_ % 2 == 0 else reversed(all_routes):
            if route.late is not None:
                route.late.clear()
            times[route.name].append(timed(repeated(route.call), calls, ctx.device))
            if route.late:
                late[route.name].append(statistics.median(route.late))
    rows: list[dict[str, object]] = []
    for route in all_routes:
        mine = [t * 1e6 for t in times[route.name]]
        if route.link_s:  # a bound link: how late after each collective's deadline it is handed on
            extra: list[float] | None = late[route.name]
            against = f"its deadline (launched + the link's {route.link_s * 1e6:.0f} µs)"
        elif route.floor:  # per round, against the route it builds on, timed in the same round
            extra = [m - f * 1e6 for m, f in zip(mine, times[route.floor], strict=True)]
            against = route.floor
        else:  # a floor itself
            extra, against = None, "(the floor)"
        rows.append(
            {
                "route": route.name,
                "against": against,
                "us": statistics.median(mine),
                "us_iqr": iqr(mine),
                "extra_us": statistics.median(extra) if extra else None,
                "extra_us_iqr": iqr(extra) if extra else None,
            }
        )
    slack = timer_slack_us(bound)
    steps = [step_pair(model, strategy, args, ctx, out) for model, strategy in STEP_PAIRS]
    return CostReport(calls, slack, rows, steps)


def step_pair(
    model: str, strategy: str, args: argparse.Namespace, ctx: ddist.DistContext, out: Path
) -> dict[str, object]:
    """The framework's step with network=none and with the ~0 link, interleaved in the same rounds."""
    where = out / f"cost-{model}-{strategy.replace(':', '-')}"
    none = Framework(MODELS[model], strategy, ctx, where / "none", args.set)
    free = Framework(MODELS[model], strategy, ctx, where / "free", [*FREE_OVERRIDES, *args.set])
    impls: list[tuple[list[float], Framework]] = [([], none), ([], free)]
    for _, impl in impls:
        impl.run(args.warmup)
    for round_ in range(args.rounds):
        for times, impl in impls if round_ % 2 == 0 else reversed(impls):
            times.append(timed(impl.run, args.steps, ctx.device))
    (none_s, _), (free_s, _) = impls
    extra = [(f - n) * 1e6 for f, n in zip(free_s, none_s, strict=True)]
    ratios = [f / n for f, n in zip(free_s, none_s, strict=True)]
    rows = [json.loads(line) for line in none.jsonl.read_text().splitlines()] if none.jsonl.exists() else []
    counted = [row["comm/collectives_per_step"] for row in rows if "comm/collectives_per_step" in row]
    per_step = counted[-1] if counted else None
    return {
        "model": model,
        "sync": strategy,
        "none_ms": statistics.median(none_s) * 1e3,
        "free_ms": statistics.median(free_s) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_iqr": iqr(ratios),
        "extra_us": statistics.median(extra),
        "extra_us_iqr": iqr(extra),
        "collectives_per_step": per_step,
        "extra_us_per_collective": statistics.median(extra) / per_step if per_step else None,
    }


def format_cost(report: CostReport) -> str:
    def spread(value: object, bounds: object, spec: str) -> str:
        assert isinstance(bounds, (tuple, list))
        return f"{value:{spec}} [{bounds[0]:{spec}} – {bounds[1]:{spec}}]"

    slack = ", ".join(f"{thread} {'-' if us is None else f'{us:g}'} µs" for thread, us in report.timer_slack_us.items())
    lines = [
        NO_BRANCH,
        f"timer slack: {slack}",
        "",
        "| route (a 1 KiB all_reduce, launched and waited for) | µs/collective [IQR] | extra µs [IQR] | against |",
        "|---|---|---|---|",
    ]
    for r in report.collectives:
        lines.append(
            f"| {r['route']} | {spread(r['us'], r['us_iqr'], '.1f')} "
            f"| {'-' if r['extra_us'] is None else spread(r['extra_us'], r['extra_us_iqr'], '.1f')} "
            f"| {r['against']} |"
        )
    lines += [
        "",
        "| model | sync | network=none ms/step | ~0 link ms/step | ~0 link / none [IQR] | extra µs/step [IQR] "
        "| collectives/step | extra µs/collective |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report.steps:
        per_step, per_call = r["collectives_per_step"], r["extra_us_per_collective"]
        lines.append(
            f"| {r['model']} | {r['sync']} | {r['none_ms']:.2f} | {r['free_ms']:.2f} "
            f"| {spread(r['ratio'], r['ratio_iqr'], '.3f')} | {spread(r['extra_us'], r['extra_us_iqr'], '.0f')} "
            f"| {'-' if per_step is None else f'{per_step:g}'} | {'-' if per_call is None else f'{per_call:.1f}'} |"
        )
    return "\n".join(lines)
