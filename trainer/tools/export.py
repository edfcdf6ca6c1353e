"""Export a run's trained model as one plain file: `{"model": state_dict}`.

    python -m trainer.tools.export outputs/<run name> --out model.pt              # its last checkpoint
    python -m trainer.tools.export outputs/<run name> --step 200 --out model.pt   # step-200.pt or step-200/
    python -m trainer.tools.export multirun/<run name> --out exported/            # a sweep: exported/<job>.pt

The file holds the unwrapped model's state_dict (the keys and shapes of the model as models/ builds
it, no optimizer, schedule or RNG): it loads with torch.load(path, weights_only=True) and then
model.load_state_dict(...), strict, whichever strategy trained it. Either checkpoint format: a full
file (read with weights_only=True, so nothing in it runs) or a sharded step-<N>/ (its model's parts
put together here, in this one process, with no process group: every strategy's parts, zero's
ranges of a parameter too, are blocks of the parameter's own shape). The file is written to a
temporary name and renamed: an export that fails half-way leaves no partial file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.reliability import sharded
from trainer.reliability.checkpoint import CheckpointError, load_checkpoint
from trainer.reliability.sharded import LAST
from trainer.tools.jobs import job_dirs, wrote_no_checkpoint


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.export", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run dir (holding checkpoints/) or a sweep dir (its jobs' run dirs)")
    parser.add_argument("--step", type=int, default=None, help="export step-<N>.pt or step-<N>/ (default: the last)")
    parser.add_argument("--out", type=Path, required=True, help="the file to write (a directory for a sweep dir)")
    return parser.parse_args(argv)


def checkpoint_of(run_dir: Path, step: int | None) -> Path:
    """The checkpoint to export, in either format: last.pt or last/ (the newer), or step-<N>.pt or step-<N>/."""
    directory = run_dir / "checkpoints"
    names = ("last.pt", LAST) if step is None else (f"step-{step}.pt", f"step-{step}")
    found = [directory / name for name in names if (directory / name).exists()]
    if not found:
        kept = sorted(p.name for p in directory.glob("step-*")) if directory.is_dir() else []
        raise CheckpointError(
            f"{directory / names[0]} does not exist (checkpoints kept there: {', '.join(kept) or 'none'})"
        )
    return max(found, key=lambda p: p.resolve().stat().st_mtime)  # a run that switched format: its newest


def read(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint's model state and what it holds besides (config, vocab, step, ...), either format:
    a full file's own dict, or a sharded step-<N>/'s meta.pt beside its model's parts put together."""
    if checkpoint.is_dir():
        return sharded.load_model(checkpoint), sharded.load_meta(checkpoint)
    saved = load_checkpoint(checkpoint)
    return saved["model"], saved


def export(checkpoint: Path, out: Path) -> int:
    """Write checkpoint's model state to out; returns the number of tensors written."""
    model, _ = read(checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save({"model": model}, tmp)
    os.replace(tmp, out)
    return len(model)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.path.exists():
        print(f"error: {args.path} does not exist", file=sys.stderr)
        return 2
    runs = job_dirs(args.path, "checkpoints")
    if not runs:
        none = wrote_no_checkpoint(args.path)  # trainer.checkpoint=false: a run that kept no model
        why = none or f"no checkpoints/ under {args.path} or its jobs: train with it as hydra.run.dir first"
        print(f"error: {why}", file=sys.stderr)
        return 1
    sweep = runs != [args.path]
    if sweep and args.out.suffix:
        print(
            f"error: {args.path} is a sweep dir of {len(runs)} jobs: give --out a directory, not {args.out}",
            file=sys.stderr,
        )
        return 2
    for run in runs:
        out = args.out / f"{run.name}.pt" if sweep else args.out
        try:
            checkpoint = checkpoint_of(run, args.step)
            tensors = export(checkpoint, out)
        except CheckpointError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"exported {checkpoint} -> {out} ({tensors} tensors; torch.load(..., weights_only=True)['model'])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
