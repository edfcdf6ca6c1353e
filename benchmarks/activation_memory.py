"""Activation checkpointing (model.activation_checkpointing) measured: what a GPT step keeps for
backward with and without it, and what the recomputation costs in step time.

    python benchmarks/activation_memory.py                  # docs/gpt.md's table (CPU, a few minutes)
    python benchmarks/activation_memory.py --quick          # a smoke run
    python benchmarks/activation_memory.py --device cuda    # adds torch.cuda.max_memory_allocated

For each shape, one process trains models.gpt.GPT (built directly, as a leaf: no trainer, no
communication) on random token windows with SGD, plain and checkpointed side by side, from the
same initial weights. Reported:
- saved MiB: the bytes autograd keeps from the forward for the backward, counted on any device
  with torch.autograd.graph.saved_tensors_hooks: every distinct storage packed during one forward
  and its loss, the parameters' own storages left out (they are kept anyway). Checkpointing keeps
  each block's input (checkpoint saves it through the same hooks) and what lies outside the
  blocks: the embeddings' sum, the final LayerNorm, the head and the loss's log-softmax over the
  vocabulary. The count is exact and the same every time: it is not repeated.
- on CUDA, peak MiB: torch.cuda.max_memory_allocated over one step, less what was allocated
  before it (parameters, gradients, the batch), best of the rounds.
- ms/step: forward, loss, backward and the optimizer step, in --rounds interleaved rounds (plain
  first in even rounds, checkpointed first in odd ones) of --steps steps each, after --warmup
  steps of each; medians over rounds, and the median of the per-round ratios with its
  interquartile range: a difference inside it is noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.parts.rounds import iqr  # noqa: E402
from models.gpt import GPT  # noqa: E402

VOCAB = 166  # the default corpus's char vocabulary (docs/gpt.md)


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int

    def build(self, checkpointing: bool, device: torch.device) -> GPT:
        torch.manual_seed(0)  # the same initial weights with and without
        model = GPT(
            self.n_layer,
            self.n_head,
            self.n_embd,
            self.block_size,
            (self.block_size,),
            VOCAB,
            activation_checkpointing=checkpointing,
        )
        return model.to(device)

    def batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        windows = torch.randint(0, VOCAB, (self.batch_size, self.block_size + 1), generator=generator)
        return windows[:, :-1].to(device), windows[:, 1:].to(device)


SHAPES = {
    # experiment=gpt_tiny's model and batch per rank
    "gpt_tiny": Shape(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16),
    # model=gpt's defaults with data=text's default batch
    "gpt": Shape(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32),
    # deeper: what checkpointing saves grows with the blocks, what it keeps does not
    "gpt-12L": Shape(n_layer=12, n_head=4, n_embd=128, block_size=128, batch_size=16),
    # wider and longer: attention's (T x T) scores per head weigh more
    "gpt-wide": Shape(n_layer=4, n_head=6, n_embd=384, block_size=256, batch_size=8),
}
QUICK = {"gpt-quick": Shape(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4)}


def loss_of(model: GPT, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trainer's loss: cross-entropy over every position of every window."""
    return F.cross_entropy(model(inputs).flatten(0, -2), targets.flatten())


def saved_bytes(model: GPT, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd packs for backward in one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(model, inputs, targets)
    loss.backward()  # the recomputation's own saved tensors come and go inside it: not counted
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def peak_step_bytes(model: GPT, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> int:
    """CUDA only: the step's peak allocation above what was allocated when it started."""
    device = batch[0].device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(model, optimizer, batch)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def step(model: GPT, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> None:
    loss_of(model, *batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated, as in the trainer's loop


def timed(model: GPT, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...], steps: int) -> float:
    """Seconds per step over `steps` steps."""
    device = batch[0].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step(model, optimizer, batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / steps


def bench(name: str, shape: Shape, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    batch = shape.batch(device)
    runs = {}
    for checkpointing in (False, True):
        model = shape.build(checkpointing, device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        runs[checkpointing] = (model, optimizer)
    saved = {c: saved_bytes(model, *batch) for c, (model, _) in runs.items()}
    times: dict[bool, list[float]] = {False: [], True: []}
    peaks: dict[bool, list[int]] = {False: [], True: []}
    for model, optimizer in runs.values():
        timed(model, optimizer, batch, args.warmup)
    for round_ in range(args.rounds):
        for c in (False, True) if round_ % 2 == 0 else (True, False):
            model, optimizer = runs[c]
            times[c].append(timed(model, optimizer, batch, args.steps))
            if device.type == "cuda":
                peaks[c].append(peak_step_bytes(model, optimizer, batch))
    ratios = [ckpt / plain for plain, ckpt in zip(times[False], times[True], strict=True)]
    n_params = sum(p.numel() for p in runs[False][0].parameters())
    return {
        "shape": name,
        **vars(shape),
        "params": n_params,
        "saved_mib": saved[False] / 2**20,
        "saved_mib_checkpointed": saved[True] / 2**20,
        "saved_ratio": saved[True] / saved[False],
        "peak_mib": min(peaks[False]) / 2**20 if peaks[False] else None,
        "peak_mib_checkpointed": min(peaks[True]) / 2**20 if peaks[True] else None,
        "ms": statistics.median(times[False]) * 1e3,
        "ms_checkpointed": statistics.median(times[True]) * 1e3,
        "time_ratio": statistics.median(ratios),
        "time_ratio_iqr": iqr(ratios),
    }


def format_table(rows: list[dict[str, Any]], cuda: bool) -> str:
    peak = " | peak MiB | peak MiB ckpt" if cuda else ""
    lines = [
        "| shape | L × d, T, B | params | saved MiB | saved MiB ckpt | ckpt / plain"
        f"{peak} | ms/step | ms/step ckpt | ckpt / plain [IQR] |",
        "|---|---|---|---|---|---|" + ("---|---|" if cuda else "") + "---|---|---|",
    ]
    for r in rows:
        low, high = r["time_ratio_iqr"]
        peaks = f" | {r['peak_mib']:.1f} | {r['peak_mib_checkpointed']:.1f}" if cuda else ""
        lines.append(
            f"| {r['shape']} | {r['n_layer']} × {r['n_embd']}, {r['block_size']}, {r['batch_size']} "
            f"| {r['params'] / 1e6:.2f} M | {r['saved_mib']:.1f} | {r['saved_mib_checkpointed']:.1f} "
            f"| {r['saved_ratio']:.3f}{peaks} | {r['ms']:.1f} | {r['ms_checkpointed']:.1f} "
            f"| {r['time_ratio']:.3f} [{low:.2f}–{high:.2f}] |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help=f"of: {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU); default: torch's")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 2 rounds of 1 step")
    args = parser.parse_args()
    shapes = QUICK if args.quick else {name: SHAPES[name] for name in (args.shapes or ",".join(SHAPES)).split(",")}
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [bench(name, shape, args, device) for name, shape in shapes.items()]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{where}, one process, SGD; {args.rounds} interleaved rounds x {args.steps} steps, medians; "
        "saved MiB: what autograd keeps for backward (parameters excluded), counted"
    )
    print(format_table(rows, device.type == "cuda"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
