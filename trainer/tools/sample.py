"""Print text sampled from a trained language model's run.

    python -m trainer.tools.sample <run dir> --prompt "def " --tokens 300 --temperature 0.8 --top-k 40 --seed 1

Loads the run's last checkpoint in either format, as trainer.tools.export chooses it: last.pt or the
sharded last/ (the newer, where a run wrote both). A full file is read with weights_only=True
(tensors and plain data only: no code in the file runs); a sharded one's parts are put together in
this one process, with no process group, and its meta.pt read with weights_only=True too. The model
is rebuilt from the config saved in the checkpoint and decodes with the vocabulary saved beside the
weights (a full file's `vocab`, a sharded one's meta.pt), so the corpus is not needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from torch import nn

from data.tokens import decode, encode
from models.generate import generate
from models.gpt import GPT
from trainer.reliability.checkpoint import CheckpointError
from trainer.tools.export import checkpoint_of, read
from trainer.tools.jobs import job_dirs, wrote_no_checkpoint

GPT_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "bias")


def load_run(run_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The model of the run's last checkpoint (either format) and its vocabulary."""
    try:
        path = checkpoint_of(run_dir, None)
        state, saved = read(path)
    except CheckpointError as err:
        raise SystemExit(f"error: {err}: give the run dir of a finished (or checkpointed) run") from None
    vocab = saved.get("vocab")
    if vocab is None:
        raise SystemExit(f"error: {path} holds no vocabulary: it is not a language model's run (data=text)")
    # The model is built from its saved keys, never from a _target_ read from the file.
    node = saved.get("config", {}).get("model", {})
    if node.get("_target_") != "models.gpt.GPT":
        raise SystemExit(f"error: {path} was not written by a model=gpt run (its config has no such model)")
    keys = {k: v for k, v in node.items() if k in GPT_KEYS}
    model = GPT(**keys, input_shape=(int(keys["block_size"]),), num_classes=int(vocab["vocab_size"]))
    model.load_state_dict(state)
    return model, vocab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.sample", description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dir", type=Path, help="a run directory with checkpoints/ (data=text), or a sweep dir (each job)"
    )
    parser.add_argument("--prompt", default="\n", help="text the sample continues (default: a newline)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens to generate (default 300)")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens; 0: all")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if not args.run_dir.exists():
        print(f"error: {args.run_dir} does not exist", file=sys.stderr)
        return 2
    if args.tokens < 0:
        parser.error(f"--tokens={args.tokens} is invalid: must be >= 0")
    if args.top_k < 0:
        parser.error(f"--top-k={args.top_k} is invalid: must be >= 0 (0: no cut)")
    jobs = job_dirs(args.run_dir, "checkpoints")
    none = wrote_no_checkpoint(args.run_dir) if not jobs else None
    if none is not None:  # trainer.checkpoint=false: nothing to sample from
        print(f"error: {none}", file=sys.stderr)
        return 1
    jobs = jobs or [args.run_dir]  # none: load_run says why
    for job in jobs:
        model, vocab = load_run(job)
        try:
            prompt = encode(args.prompt, vocab)
        except ValueError as err:
            parser.error(f"--prompt: {err}")
        if not prompt:
            parser.error("--prompt is empty: give at least one character")
        ids = generate(model, prompt, args.tokens, args.temperature, args.top_k or None, args.seed)
        if len(jobs) > 1:
            sys.stdout.write(f"== job {job}\n")
        sys.stdout.write(decode(ids, vocab) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
