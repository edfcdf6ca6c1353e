"""Each strategy's step at N ranks: the run's compute, plus its collectives laid over it.

What a strategy sends is what its schedule() says (trainer/comm_schedule.py: buckets, units or
nothing, each collective a hop on a group of ranks); this module prices the hops on a Topology and
lays them over the compute, and never looks at a strategy's name.

Assumptions (docs/scaling.md, "Scaling beyond this machine", discusses each):
- Weak scaling: every rank keeps the run's per-rank batch, so compute per step does not change
  with N, except the optimizer step of a strategy whose schedule shards it, which updates 1/n of
  the parameters (n: the ranks of its optimizer_shard group).
- Backward produces gradients in reverse registration order, at a rate proportional to their
  bytes; forward and backward spend time on a module in proportion to its parameter bytes.
- Collectives run one at a time on their own channel (one NCCL stream, gloo's thread), next to
  compute; compute never slows down because communication runs. With overlap=False nothing hides:
  every collective adds its whole time to the step (CPU ranks that fill the machine's cores, where
  gloo's copies and sums take the cores that compute needs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

from trainer.comm_schedule import Buckets, Hop, Schedule, ShardedUnits
from trainer.errors import ConfigError
from trainer.links import Topology
from trainer.scaling.profile import RunProfile

# sync.wrap's values (trainer/setup/schema/sync.py's Wrap; a test keeps them equal): the step's
# model does not import torch.
FSDP_WRAPS = ("auto", "block", "module")
MIB = 2**20


@dataclass(frozen=True)
class Prediction:
    strategy: str
    ranks: int
    nodes: int
    step_s: float
    comm_s: float  # every collective's cost, hidden or not
    exposed_s: float  # what the step waits for beyond compute
    samples_per_s: float
    efficiency: float  # samples/s per rank against the 1-rank compute alone
    bucket_cap_mb: float | None = None


def buckets(sizes: Sequence[int], cap_mb: float, first_cap_mb: float | None = None, *, ddp: bool = False) -> list[int]:
    """Consecutive groups of sizes, as bytes per group. ddp=True: DDP's rule (add a tensor, close the
    bucket once it reaches the cap, the first bucket's cap being first_cap_mb); else ddplab's flat
    buffers' rule (close before a tensor would overflow the cap; a larger one goes alone)."""
    out: list[int] = []
    current = 0
    for size in sizes:
        cap = (first_cap_mb if first_cap_mb is not None and not out else cap_mb) * MIB
        if not ddp and current and current + size > cap:
            out.append(current)
            current = 0
        current += size
        if ddp and current >= cap:
            out.append(current)
            current = 0
    return out + ([current] if current else [])


def overlapped(groups: Sequence[int], backward_s: float, cost: Callable[[int], float]) -> tuple[float, float]:
    """(comm, exposed) seconds of buckets reduced during backward, in gradient order: a bucket's
    collective starts when its last gradient is ready and the previous collective is done."""
    total, done, free, busy = sum(groups), 0, 0.0, 0.0
    for size in groups:
        done += size
        seconds = cost(size)
        free = max(free, backward_s * done / total) + seconds
        busy += seconds
    return busy, max(0.0, free - backward_s)


Cost = Callable[[int], float]


def layered(units: Sequence[int], compute_s: float, gather: Cost | None, scatter: Cost | None) -> tuple[float, float]:
    """(seconds, comm) of one FSDP pass over units in order: each unit's compute waits for its
    all_gather, which is issued as the previous unit starts (one unit prefetched; None: the
    parameters are already there); after a unit's backward its reduce_scatter (scatter) queues on
    the same channel; the pass ends when both are done."""
    total = sum(units)
    free, now, busy = 0.0, 0.0, 0.0
    arrived = [0.0] * len(units)

    def issue(index: int, at: float) -> None:
        nonlocal free, busy
        if gather is None:
            return
        seconds = gather(units[index])
        free = max(free, at) + seconds
        busy += seconds
        arrived[index] = free

    issue(0, 0.0)
    for i, size in enumerate(units):
        start = max(now, arrived[i])
        if i + 1 < len(units):
            issue(i + 1, start)
        now = start + compute_s * size / total
        if scatter is not None:
            seconds = scatter(size)
            free = max(free, now) + seconds
            busy += seconds
    return max(now, free), busy


def fsdp_units(profile: RunProfile, wrap: str) -> list[int]:
    """Bytes per FSDP unit in forward order, as sync.wrap groups them (trainer/sync/fsdp_units.py):
    module, one unit per module owning parameters; block, the root's parameters (everything outside
    the model's nn.ModuleList blocks, gathered first) and then one unit per block; auto, block if the
    run recorded blocks. A summary written before blocks were recorded has none."""
    if wrap not in FSDP_WRAPS:
        raise ConfigError(f"--fsdp-wrap={wrap!r} is invalid; accepted: {', '.join(FSDP_WRAPS)}")
    blocks = any(t.block is not None for t in profile.tensors)
    if wrap == "module" or (wrap == "auto" and not blocks):
        return [sum(t.nbytes for t in ts) for _, ts in groupby(profile.tensors, key=lambda t: t.module)]
    root = sum(t.nbytes for t in profile.tensors if t.block is None)
    inner = [sum(t.nbytes for t in ts) for b, ts in groupby(profile.tensors, key=lambda t: t.block) if b is not None]
    return [root, *inner] if root else inner


def layout(profile: RunProfile, sends: Buckets) -> list[int]:
    """The buckets' bytes, in the order they are sent."""
    sizes = [t.nbytes for t in profile.tensors]  # registration order
    if sends.order == "reverse":  # gradient-ready order
        sizes.reverse()
    return buckets(sizes, sends.cap_mb, sends.first_cap_mb, ddp=sends.rule == "ddp")


def hops_s(topo: Topology, hops: Sequence[Hop]) -> Cost:
    """Seconds of these hops, one after the other, on a bucket or unit of the given bytes: each on its
    span's group, on the whole piece or (share=node) on its 1/G."""

    def cost(size: int) -> float:
        return sum(topo.collective_s(h.kind, size / topo.per_node if h.share == "node" else size, h.span) for h in hops)

    return cost


def _comm(profile: RunProfile, topo: Topology, schedule: Schedule) -> tuple[float, float]:
    """(comm, exposed) seconds of one step's collectives."""
    p, sends = profile.phase_s, schedule.sends
    if isinstance(sends, Buckets):
        sizes = layout(profile, sends)
        during = hops_s(topo, sends.hops)
        if sends.overlap:
            comm, exposed = overlapped(sizes, p["backward"], during)
        else:
            comm = exposed = sum(during(s) for s in sizes)
        after = sum(hops_s(topo, sends.after)(s) for s in sizes)  # nothing hides them
        return comm + after, exposed + after
    if isinstance(sends, ShardedUnits):
        units = fsdp_units(profile, sends.wrap)
        gather = hops_s(topo, (sends.gather,))
        regather = gather if sends.reshard_after_forward else None  # else the forward's gathered units stay
        forward, comm_f = layered(units, p["forward"], gather, None)
        backward, comm_b = layered(units[::-1], p["backward"], regather, hops_s(topo, sends.scatter))
        return comm_f + comm_b, forward - p["forward"] + backward - p["backward"]
    return 0.0, 0.0


def predict(
    profile: RunProfile, topo: Topology, strategy: str, schedule: Schedule, *, overlap: bool = True
) -> Prediction:
    """The step of the strategy named `strategy`, which sends what `schedule` says."""
    comm, exposed = _comm(profile, topo, schedule)
    if not overlap:
        exposed = comm
    optimizer = profile.phase_s["optimizer"]
    if schedule.optimizer_shard is not None:  # each rank updates its 1/n of the parameters
        optimizer /= len(topo.span(schedule.optimizer_shard))
    step = profile.compute_s - profile.phase_s["optimizer"] + optimizer + exposed
    return Prediction(
        strategy=strategy,
        ranks=topo.ranks,
        nodes=topo.nodes,
        step_s=step,
        comm_s=comm,
        exposed_s=exposed,
        samples_per_s=topo.ranks * profile.batch_per_rank / step,
        efficiency=profile.compute_s / step,
        bucket_cap_mb=schedule.sends.cap_mb if isinstance(schedule.sends, Buckets) else None,
    )


def best_cap(
    profile: RunProfile,
    topo: Topology,
    strategy: str,
    schedule: Schedule,
    caps_mb: Sequence[float],
    *,
    overlap: bool = True,
) -> Prediction:
    """The strategy's fastest predicted step over the bucket caps; a tie (the same buckets) goes to the
    larger cap, whose buckets will stay fewer when the model grows."""
    options = [predict(profile, topo, strategy, schedule.with_cap(cap), overlap=overlap) for cap in caps_mb]
    return min(options, key=lambda p: (p.step_s, -(p.bucket_cap_mb or 0.0)))
