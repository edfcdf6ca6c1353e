"""A small deterministic corpus and the tiny GPT the language-model tests train on it."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = ("the", "lab", "trains", "a", "small", "model", "on", "text", "so", "every", "rank", "sees", "its")
WORDS += ("own", "windows", "of", "tokens")


def write_corpus(path: Path, num_chars: int, seed: int = 0) -> Path:
    """num_chars of word salad with newlines: a learnable, varied char-level corpus, no download."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        word = rng.choice(WORDS) + ("\n" if rng.random() < 0.1 else " ")
        parts.append(word)
        size += len(word)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(parts)[:num_chars], encoding="utf-8")
    return path


def tiny_gpt(corpus: Path, cache_dir: Path, sample_tokens: int = 0) -> list[str]:
    """2 blocks of 2 heads x 8 channels over 16-token windows: 28 gradient tensors, a tied head. No
    end-of-run sample unless asked for (tests/test_screen.py reads one): at 2 ranks it took about a
    third of an equivalence module's time."""
    return [
        "model=gpt",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=16",
        "model.block_size=16",
        "data=text",
        f"data.path={corpus}",
        f"data.cache_dir={cache_dir}",
        f"trainer.end_sample_tokens={sample_tokens}",
    ]


# ~1150 characters: 1035 train tokens = 64 windows of 16, so 2 ranks x 8 = 4 steps per epoch and 6 steps
# cross an epoch boundary (set_epoch reshuffles); 115 validation tokens.
EPOCH_CHARS = 1150


def tiny_gpt_corpus(root: Path) -> list[str]:
    """The tiny GPT on an EPOCH_CHARS corpus written under root: the overrides that train it."""
    return tiny_gpt(write_corpus(root / "corpus.txt", EPOCH_CHARS), root / "tokens")
