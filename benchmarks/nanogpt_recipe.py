"""nanoGPT's CPU recipe through ddplab and through a nanoGPT-style loop, side by side on 2 ranks.

    torchrun --nproc_per_node=2 benchmarks/nanogpt_recipe.py                  # 2000 steps, nanoGPT's max_iters (~8 min)
    torchrun --nproc_per_node=2 benchmarks/nanogpt_recipe.py --steps 40 --chunk 10   # a smoke run

The recipe is nanoGPT's shakespeare_char CPU one (4 layers, 4 heads, 128 wide, block 64, batch 12
per rank, AdamW lr 1e-3 with beta2 0.99, warmup 100 then cosine to 1e-4, weight decay 0.1 on
matrices only, gradient clipping at 1.0, no dropout, no bias), on the same token file (data=text:
Python's standard library sources by default, or --path). The loop is what nanoGPT's train.py
does, written here: DDP, a random window offset per sample (get_batch), its decay groups, its
get_lr, clip_grad_norm_. ddplab runs `sync=ddp` with the same keys. The two alternate in chunks
of steps (each chunk timed after a barrier, the slower rank's time), so a noisy machine slows both
alike; at the end both are evaluated on the same validation windows. Reported: the step-time ratio
(median and IQR over chunks) and both validation losses.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.parts.overhead_loops import Framework  # noqa: E402
from benchmarks.parts.rounds import iqr, timed  # noqa: E402
from data.text import Windows  # noqa: E402
from trainer.setup import dist as ddist  # noqa: E402
from trainer.setup.build import build_parts, prepare_data  # noqa: E402
from trainer.setup.config import compose_config  # noqa: E402

LR, MIN_LR, WARMUP, BETAS, DECAY, CLIP, BATCH = 1e-3, 1e-4, 100, (0.9, 0.99), 0.1, 1.0, 12


def recipe(steps: int, path: str | None) -> list[str]:
    return [
        "model=gpt",
        "model.n_layer=4",
        "model.n_head=4",
        "model.n_embd=128",
        "model.block_size=64",
        "model.dropout=0.0",
        "model.bias=false",
        "data=text",
        f"data.batch_size={BATCH}",
        *([f"data.path={path}"] if path else []),
        "optim=adamw",
        f"optim.lr={LR}",
        f"optim.betas=[{BETAS[0]},{BETAS[1]}]",
        f"optim.weight_decay={DECAY}",
        "optim.weight_decay_on=matrices",
        "schedule=warmup_cosine",
        f"schedule.warmup_steps={WARMUP}",
        f"schedule.min_lr_ratio={MIN_LR / LR}",
        f"trainer.max_grad_norm={CLIP}",
        f"trainer.max_steps={steps}",
        "sync=ddp",
    ]


class NanoGPTLoop:
    """nanoGPT's train.py loop, reduced to what this recipe uses."""

    def __init__(self, overrides: list[str], steps: int, ctx: ddist.DistContext) -> None:
        cfg = compose_config(overrides)
        parts = build_parts(cfg)  # the same model and token file
        prepare_data(parts.data, ctx)
        train, _ = parts.data.build_datasets()
        assert isinstance(train, Windows)
        self.tokens = torch.from_numpy(train.tokens.astype("int64"))
        self.block, self.steps, self.step, self.ctx = train.block_size, steps, 0, ctx
        self.model = DistributedDataParallel(parts.model)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": DECAY}, {"params": rest, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS)
        self.generator = torch.Generator().manual_seed(1337 + ctx.rank)  # nanoGPT: seed + rank offset

    def lr(self, it: int) -> float:  # nanoGPT's get_lr, decaying to MIN_LR at the last step
        if it < WARMUP:
            return LR * (it + 1) / (WARMUP + 1)
        ratio = (it - WARMUP) / max(1, self.steps - WARMUP)
        return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (LR - MIN_LR)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr(self.step)
            ix = torch.randint(len(self.tokens) - self.block - 1, (BATCH,), generator=self.generator)
            rows = torch.stack([self.tokens[i : i + self.block + 1] for i in ix.tolist()])
            logits = self.model(rows[:, :-1])
            F.cross_entropy(logits.flatten(0, -2), rows[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: Windows, windows: int) -> float:
    """Mean loss per token over the validation split's first `windows` windows (the same for both)."""
    model.eval()
    inputs, targets = val.batch(torch.arange(min(windows, len(val))).numpy())
    loss = F.cross_entropy(model(inputs).flatten(0, -2), targets.flatten()).item()
    model.train()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=25, help="steps per timed chunk of each implementation")
    parser.add_argument("--path", help="the text (data.path); default: Python's standard library sources")
    parser.add_argument("--val-windows", type=int, default=256)
    args = parser.parse_args()
    env = ddist.read_launch_env()
    ctx = ddist.init_process_group(env, ddist.job_store(env), torch.device("cpu"), 600, "ddplab/nanogpt/")
    try:
        overrides = recipe(args.steps, args.path)
        with tempfile.TemporaryDirectory() as tmp:
            # The schedule spans the run: Framework's own trainer.max_steps (unbounded) is overridden.
            framework = Framework(overrides, "ddp", ctx, Path(tmp) / "ddplab", [f"trainer.max_steps={args.steps}"])
            loop = NanoGPTLoop(overrides, args.steps, ctx)
            ours: list[float] = []
            theirs: list[float] = []
            for chunk in range(args.steps // args.chunk):
                pair = [(ours, framework.run), (theirs, loop.run)]
                for times, run in pair if chunk % 2 == 0 else pair[::-1]:
                    times.append(timed(run, args.chunk, ctx.device))
            _, val = framework.trainer.data.build_datasets()
            assert isinstance(val, Windows)
            losses = (
                val_loss(framework.trainer.model, val, args.val_windows),
                val_loss(loop.model.module, val, args.val_windows),
            )
        if ctx.is_main_process:
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            low, high = iqr(ratios)
            print(f"{ctx.world_size} ranks, {args.steps} steps in chunks of {args.chunk}, nanoGPT's CPU recipe")
            print("| | ddplab | nanoGPT-style loop | ddplab / loop [IQR] |")
            print("|---|---|---|---|")
            print(
                f"| ms/step | {statistics.median(ours) * 1e3:.1f} | {statistics.median(theirs) * 1e3:.1f} "
                f"| {statistics.median(ratios):.3f} [{low:.2f}–{high:.2f}] |"
            )
            gap = losses[0] - losses[1]
            print(f"| val loss at step {args.steps} | {losses[0]:.4f} | {losses[1]:.4f} | {gap:+.4f} nats |")
    finally:
        ddist.destroy_process_group()


if __name__ == "__main__":
    main()
