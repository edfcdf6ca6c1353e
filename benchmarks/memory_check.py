"""The memory predictor checked: each rank's memory predicted beside what the same run measured, per kind.

    python benchmarks/memory_check.py            # every case (~2 min on 2 CPU cores)
    python benchmarks/memory_check.py --quick    # a smoke run: the mlp, 1 and 2 ranks, three strategies
    python benchmarks/memory_check.py --device cuda --ranks 1    # make gpu-check's: against the allocator
    python benchmarks/memory_check.py --recipes bf16 --ranks 2,4 --strategies "zero,zero stage=3"  # a subset

For each world size (1, 2, then 4 for the strategies that shard), gloo ranks are spawned once and
train each case for 3 steps as train.py builds it (a row every step, so every step is sampled);
rank 0's `memory/<kind>_peak_mb` (the most over the rows) is the measured side (docs/metrics.md,
Memory). The predicted side is `python -m trainer.tools.memory` with the same overrides and
`--ranks N` (docs/memory.md). The models: the default mlp, and a small gpt (experiment=gpt_tiny's
shape, char-level text) with and without activation checkpointing, all with AdamW; each in fp32 and
with 16-bit parameters and an fp32 master copy (trainer.param_dtype=bf16, the recipes).

The table gives each kind as predicted / measured MiB and the relative error (predicted - measured)
/ measured; a kind both sides put at 0 reads "0". The last line: the largest error over every
kind and total, and the cases where a kind's error passes 10 %. With `--device cuda` (nccl, a GPU
per rank) the measured total is the CUDA allocator's peak over the sampled step
(`max_memory_allocated`), which the predicted total (the kinds' peaks added up) bounds from above
where the allocator rounds little and the kinds do not peak together.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer.core import DistContext  # noqa: E402
from trainer.measures import MEMORY_KINDS  # noqa: E402
from trainer.setup.build import build_parts, build_trainer, prepare_data  # noqa: E402
from trainer.setup.config import compose_config  # noqa: E402
from trainer.tools import memory as predictor  # noqa: E402

MIB = 2**20
STEPS = 3
BOUND = 0.10  # the bound on each kind's relative error
RUN = [
    "logger=none",
    "trainer.progress_bar=false",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",  # every step a row, so every step sampled
    "trainer.sample_budget=null",  # ... whatever the samples cost
    "trainer.eval_every_n_steps=0",
    "trainer.checkpoint_every_n_steps=0",
    "optim=adamw",
]
GPT = ["experiment=gpt_tiny", "data.batch_size=4", "schedule.warmup_steps=0"]  # no warm-up longer than the run
MODELS = {
    "mlp": ["data.num_samples=512"],
    "gpt": GPT,
    "gpt, checkpointed": [
        "experiment=gpt_tiny",
        "data.batch_size=4",
        "schedule.warmup_steps=0",
        "model.activation_checkpointing=true",
    ],
}
STRATEGIES = {  # name -> (overrides, whether it shards: checked at 4 ranks too)
    "none": (["sync=none"], False),
    "manual": (["sync=manual"], False),
    "bucketed": (["sync=bucketed"], False),
    "ddp": (["sync=ddp"], False),
    "zero stage=1": (["sync=zero", "sync.stage=1"], True),
    "zero": (["sync=zero"], True),
    "zero stage=3": (["sync=zero", "sync.stage=3"], True),
    "fsdp": (["sync=fsdp"], True),
    # nodes of 2 ranks: at 2 ranks one node (hierarchical: every bucket's half kept; hsdp: fsdp), at 4 two
    "hierarchical shard=2": (["sync=hierarchical", "sync.shard=2"], False),
    "hsdp shard=2": (["sync=hsdp", "sync.shard=2"], True),
}
# The precision recipes: fp32, and 16-bit parameters and gradients with an fp32 master copy (the
# reduction in fp32, trainer.reduce_dtype's default).
RECIPES = {"fp32": [], "bf16": ["trainer.param_dtype=bf16"]}
QUICK = {"models": ["mlp"], "strategies": ["ddp", "zero", "fsdp"], "world_sizes": [1, 2], "recipes": ["fp32"]}


def cases(world_size: int, models: list[str], strategies: list[str], recipes: list[str]) -> dict[str, list[str]]:
    """The cases run at this world size: `none` alone at 1 rank (more ranks of it are more copies),
    the sharding strategies at 4."""
    chosen = {}
    for recipe in recipes:
        for model in models:
            for name in strategies:
                overrides, shards = STRATEGIES[name]
                if (name == "none" and world_size > 1) or (world_size > 2 and not shards):
                    continue
                if "sync.shard=2" in overrides and world_size % 2:  # nodes of 2: one rank forms none
                    continue
                label = model if recipe == "fp32" else f"{model}, {recipe}"
                chosen[f"{label} | {name}"] = [*RUN, *MODELS[model], *overrides, *RECIPES[recipe]]
    return chosen


def measured(rank: int, world_size: int, overrides: list[str], run_dir: Path, device: str) -> dict[str, float]:
    """Rank `rank`'s peak MiB per kind (and memory/peak_mb: the total) over a run of STEPS steps."""
    cfg = compose_config([*overrides, f"trainer.device={device}"])
    parts = build_parts(cfg, world_size)
    where = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    ctx = DistContext(rank, rank, world_size, where, "nccl" if device == "cuda" else "gloo")
    prepare_data(parts.data, ctx)
    trainer = build_trainer(parts, ctx, [], run_dir, {})
    trainer.train(STEPS)
    rows = [row for row in trainer._rows.rows if "memory/peak_mb" in row]
    keys = [f"memory/{kind}_peak_mb" for kind in MEMORY_KINDS] + ["memory/peak_mb"]
    return {key: max(row[key] for row in rows) for key in keys}


def rank_main(rank: int, world_size: int, store_path: str, out: str, chosen: dict[str, list[str]], device: str) -> None:
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=dt.timedelta(seconds=300))
    results = {name: measured(rank, world_size, o, Path(out) / name, device) for name, o in chosen.items()}
    if rank == 0:
        (Path(out) / "measured.json").write_text(json.dumps(results))
    dist.barrier()  # no rank closes its connections while a peer's last bytes are in flight
    gc.collect()  # what still holds the group (a DDP reducer, FSDP's state) goes before the group does
    dist.destroy_process_group()


def predicted(overrides: list[str], world_size: int) -> dict[str, float]:
    """The predictor's MiB per kind, and the total under memory/peak_mb: what the measured side names it."""
    report = predictor.run(predictor.parse_args([*overrides, "--ranks", str(world_size)]))
    (prediction, _), *_ = report.rows
    kinds = {f"memory/{kind}_peak_mb": nbytes / MIB for kind, nbytes in prediction.kinds.items()}
    return kinds | {"memory/peak_mb": prediction.total / MIB}


def error(pred: float, meas: float) -> float:
    return 0.0 if pred == meas else (pred - meas) / meas if meas else float("inf")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the mlp at 1 and 2 ranks, three strategies")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: nccl, a GPU per rank")
    parser.add_argument("--ranks", help="only these world sizes, comma-separated (default 1,2,4)")
    parser.add_argument("--json", type=Path, help="also write every case's predicted and measured MiB here")
    parser.add_argument("--recipes", help=f"only these, comma-separated (default {','.join(RECIPES)})")
    parser.add_argument("--strategies", help="only these, comma-separated (default: every one)")
    parser.add_argument("--models", help=f"only these, comma-separated (default {','.join(MODELS)})")
    args = parser.parse_args()
    models = QUICK["models"] if args.quick else list(MODELS)
    strategies = QUICK["strategies"] if args.quick else list(STRATEGIES)
    world_sizes = QUICK["world_sizes"] if args.quick else [1, 2, 4]
    world_sizes = [int(n) for n in args.ranks.split(",")] if args.ranks else world_sizes
    recipes = QUICK["recipes"] if args.quick else list(RECIPES)
    recipes = args.recipes.split(",") if args.recipes else recipes
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else strategies
    models = [m.strip() for m in args.models.split(",")] if args.models else models
    keys = [f"memory/{kind}_peak_mb" for kind in MEMORY_KINDS] + ["memory/peak_mb"]
    names = [kind.replace("_", " ") for kind in MEMORY_KINDS] + ["total"]
    on = "nccl, total: the CUDA allocator's peak" if args.device == "cuda" else "gloo"
    print(f"Predicted / measured MiB on rank 0 (relative error); 3 steps of AdamW on {on}, every step sampled")
    print(f"| model | strategy | ranks | {' | '.join(names)} |")
    print("|---|---|---|" + "---|" * len(names))
    everything, worst, over = [], 0.0, []
    for world_size in world_sizes:
        chosen = cases(world_size, models, strategies, recipes)
        if not chosen:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            spawned = (world_size, str(Path(tmp) / "store"), tmp, chosen, args.device)
            mp.spawn(rank_main, args=spawned, nprocs=world_size)
            results = json.loads((Path(tmp) / "measured.json").read_text())
        for name, overrides in chosen.items():
            pred, meas = predicted(overrides, world_size), results[name]
            errors = [error(pred[k], meas[k]) for k in keys]
            worst = max(worst, *(abs(e) for e in errors))
            over += [
                f"{name} x{world_size}: {n} {e:+.1%}" for n, e in zip(names, errors, strict=True) if abs(e) > BOUND
            ]
            cells = [
                "0" if pred[k] == meas[k] == 0 else f"{pred[k]:.3f} / {meas[k]:.3f} ({e:+.1%})"
                for k, e in zip(keys, errors, strict=True)
            ]
            print(f"| {name.replace(' | ', ' | ', 1)} | {world_size} | {' | '.join(cells)} |")
            everything.append({"case": name, "ranks": world_size, "predicted": pred, "measured": meas})
    print(f"largest error: {worst:.1%}; over {BOUND:.0%}: {', '.join(over) if over else 'none'}")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
