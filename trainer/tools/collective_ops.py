"""Collective measurement: bus-bandwidth arithmetic, the composed all_reduce, and the timed calls.

Kept apart from the CLI (collectives.py) so that tests, benchmarks/overhead.py and the CLI share one
timer, importing no argparse or plotting; nccl-tests' bus factors are trainer/comm_math.py's. Ops:
broadcast, all_reduce, all_gather, reduce_scatter, and all_reduce_composed (reduce_scatter then
all_gather: "all_reduce = reduce_scatter + all_gather"). gloo has both tensor
forms (torch >= 2.3), but runs reduce_scatter as a full all_reduce then keeps this rank's chunk.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainer import comm_math
from trainer.sync.comm import all_gather_tensor, reduce_scatter_tensor

OPS = ("broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_reduce_composed")
REPEATS = 3  # timed runs of `iters` calls each; the median of them is reported
APIS = {  # which name this torch has (torch 2.14 renamed the tensor forms *_single)
    "all_gather": f"dist.{all_gather_tensor.__name__}",
    "reduce_scatter": f"dist.{reduce_scatter_tensor.__name__}",
}
Record = dict[str, Any]  # one op at one size: op, size_bytes, seconds, seconds_per_repeat, algbw_GBps, busbw_GBps


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for one of OPS (trainer/comm_math.py's nccl-tests factors): all_reduce_composed is
    judged as the all_reduce it replaces."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}")
    return comm_math.bus_factor("all_reduce" if op == "all_reduce_composed" else op, world_size)


def bandwidths(op: str, size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s: algbw = S / t, S the full buffer (all_gather's output, reduce_scatter's input)."""
    algbw = size_bytes / seconds
    return algbw, algbw * bus_factor(op, world_size)


def all_reduce_floor_s(num_bytes: int, world_size: int, busbw: float) -> float:
    """Seconds an all_reduce of num_bytes needs at busbw (bytes/s): the floor for DDP's gradient sync."""
    factor = bus_factor("all_reduce", world_size)
    if factor and busbw <= 0:
        raise ValueError(f"busbw={busbw} must be > 0 bytes/s")
    return num_bytes * factor / busbw if factor else 0.0


def sweep_sizes(min_bytes: int, max_bytes: int, world_size: int, element_size: int) -> list[int]:
    """min_bytes x 2^k up to max_bytes, rounded to whole elements divisible by world_size: every op
    splits S into world_size equal chunks (all_gather's input, reduce_scatter's output)."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    unit = element_size * world_size
    num_steps = (max_bytes // min_bytes).bit_length()  # k = 0 .. floor(log2(max / min))
    return sorted({max(unit, (min_bytes << k) // unit * unit) for k in range(num_steps)})


def _reduce_scatter_all_gather(flat: torch.Tensor, shard: torch.Tensor, out: torch.Tensor) -> None:
    reduce_scatter_tensor(shard, flat, op=dist.ReduceOp.SUM)
    all_gather_tensor(out, shard)


def composed_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """all_reduce(SUM) as reduce_scatter then all_gather, into a new tensor: the identity ZeRO and FSDP
    build on (each rank reduces only its 1/n shard, then shares it)."""
    world_size = dist.get_world_size()
    if tensor.numel() % world_size:
        raise ValueError(f"{tensor.numel()} elements do not split into {world_size} equal shards")
    flat = tensor.reshape(-1)
    out = torch.empty_like(flat)
    _reduce_scatter_all_gather(flat, flat.new_empty(flat.numel() // world_size), out)
    return out.view(tensor.shape)


def _make_call(op: str, num_bytes: int, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """One call of op on buffers allocated once, so no timed call allocates S (as with NCCL's own tests)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}")
    world_size = dist.get_world_size()
    numel = num_bytes // torch.empty((), dtype=dtype).element_size()
    if numel == 0 or numel % world_size:
        raise ValueError(f"{num_bytes} bytes of {dtype} do not split into {world_size} equal shards")
    full = torch.zeros(numel, dtype=dtype, device=device)  # zeros: repeated sums stay finite
    shard = torch.zeros(numel // world_size, dtype=dtype, device=device)
    out = torch.empty_like(full) if op == "all_reduce_composed" else full
    return {
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_reduce": lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM),
        "all_gather": lambda: all_gather_tensor(full, shard),
        "reduce_scatter": lambda: reduce_scatter_tensor(shard, full, op=dist.ReduceOp.SUM),
        "all_reduce_composed": lambda: _reduce_scatter_all_gather(full, shard, out),
    }[op]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels are asynchronous: the clock must wait for them


def time_repeats(
    op: str,
    num_bytes: int,
    iters: int,
    warmup: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    repeats: int = REPEATS,
) -> list[float]:
    """Seconds per call in each timed repeat, the slowest rank's: a collective ends when its last rank does.
    Every rank of the group must call this with the same arguments, in the same order."""
    call = _make_call(op, num_bytes, device, dtype)
    for _ in range(warmup):
        call()
    per_call = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()  # every rank starts the timed calls together
        _sync(device)
        start = time.monotonic()
        for _ in range(iters):
            call()
        _sync(device)
        per_call.append((time.monotonic() - start) / iters)
    slowest = torch.tensor(per_call, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # outside the timed region; all ranks agree
    return slowest.tolist()


def measure(op: str, num_bytes: int, iters: int, warmup: int, device: torch.device) -> float:
    """Median seconds per call of op on num_bytes of float32, the same on every rank (group initialised)."""
    return statistics.median(time_repeats(op, num_bytes, iters, warmup, device))


def run_sweep(sizes: Sequence[int], iters: int, warmup: int, device: torch.device, dtype: torch.dtype) -> list[Record]:
    """Every op at every size; every rank runs this same sequence of collectives."""
    world_size = dist.get_world_size()
    records = []
    for size in sizes:
        for op in OPS:
            times = time_repeats(op, size, iters, warmup, device, dtype)
            seconds = statistics.median(times)
            algbw, busbw = bandwidths(op, size, seconds, world_size)
            records.append(
                {
                    "op": op,
                    "size_bytes": size,
                    "seconds": seconds,
                    "seconds_per_repeat": times,
                    "algbw_GBps": algbw / 1e9,
                    "busbw_GBps": busbw / 1e9,
                }
            )
    return records
