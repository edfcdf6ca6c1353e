"""data.tokenizer=bpe in data.cache_dir: its tokenizer, trained once per corpus and vocab_size, and its tokens.

Rank 0 (prepare) trains the BPE on the training split's text only, the corpus's first 90 % of
characters, so that nothing of the validation text shapes the vocabulary; a cached one is reused.
It then encodes the training text and the validation text each on its own, so that the split in
tokens is exactly the split in text, and writes three files, keyed like the char and byte token
files by the corpus's hash, plus the vocab size:

    <hash>.bpe<N>.tokenizer.json   the tokenizer, in tokenizers' own format (Tokenizer.from_file)
    <hash>.bpe<N>.u16              the training text's tokens, then the validation text's (uint16)
    <hash>.bpe<N>.json             what the tokens were made with: their count, the training
                                   split's, and the sha256 of the tokenizer file

Each is written under a temporary name and renamed, the metadata last, so a reader sees whole
files, and tokens are only ever read with the tokenizer that made them. Every rank then reads them
(read): the tokens memory-mapped, the tokenizer's JSON for the run dir and the checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data import bpe
from data.tokens import Corpus, text_batches, token_file

META_KEYS = {"num_tokens", "num_train", "tokenizer_sha256"}


@dataclass(frozen=True)
class BpeTokens:
    tokens: np.memmap  # the corpus's ids: [0, num_train) train, the rest validate
    num_train: int
    tokenizer_json: str


def tokenizer_file(cache_dir: str, corpus: Corpus) -> Path:
    return token_file(cache_dir, corpus).with_suffix(".tokenizer.json")


def meta_file(cache_dir: str, corpus: Corpus) -> Path:
    return token_file(cache_dir, corpus).with_suffix(".json")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f"{path.name}.partial{os.getpid()}")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def _meta(cache_dir: str, corpus: Corpus) -> dict[str, Any] | None:
    """The metadata of complete tokens (the token file has the count it says), or None."""
    try:
        meta = json.loads(meta_file(cache_dir, corpus).read_text(encoding="utf-8"))
        size = token_file(cache_dir, corpus).stat().st_size
    except (OSError, ValueError):  # missing, or cut short by a crash: the tokens are written again
        return None
    if not isinstance(meta, dict) or not set(meta) >= META_KEYS or size != 2 * meta["num_tokens"]:
        return None
    return meta


def _cached_tokenizer(cache_dir: str, corpus: Corpus, meta: dict[str, Any] | None) -> str | None:
    """The cached tokenizer's JSON, or None when there is none; one that does not match is refused."""
    path = tokenizer_file(cache_dir, corpus)
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    assert corpus.bpe_vocab_size is not None, "scan() sets it for bpe"
    why = bpe.mismatch(text, corpus.bpe_vocab_size)
    if why is None and meta is not None and meta.get("tokenizer_sha256") != _sha256(text):
        why = f"it is not the tokenizer that made {token_file(cache_dir, corpus).name} (edited or replaced)"
    if why is not None:
        raise ValueError(
            f"{path} does not match the cache for data.tokenizer=bpe data.vocab_size={corpus.bpe_vocab_size}: "
            f"{why}; delete it (and the {token_file(cache_dir, corpus).name} beside it) and rank 0 trains it again"
        )
    return text


def _write_tokens(cache_dir: str, corpus: Corpus, tokenizer_json: str, num_train_chars: int) -> dict[str, Any]:
    """The training text's ids, then the validation text's, each encoded on its own, into the token file."""
    path = token_file(cache_dir, corpus)
    partial = path.with_suffix(f".partial{os.getpid()}")
    counts = []
    with partial.open("wb") as handle:
        for start, stop in ((0, num_train_chars), (num_train_chars, corpus.num_tokens)):
            count = 0
            for lines in text_batches(corpus.files, start, stop):
                ids = np.asarray(bpe.encode_batch(tokenizer_json, lines), dtype=np.uint16)  # < vocab_size <= 2**16
                handle.write(ids.tobytes())
                count += len(ids)
            counts.append(count)
    os.replace(partial, path)
    return {"num_tokens": sum(counts), "num_train": counts[0], "tokenizer_sha256": _sha256(tokenizer_json)}


def write(cache_dir: str, corpus: Corpus, num_train_chars: int) -> Path:
    """Rank 0, before any rank reads: the tokenizer (trained unless cached) and its tokens (unless cached)."""
    assert corpus.bpe_vocab_size is not None, "scan() sets it for bpe"
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    meta = _meta(cache_dir, corpus)
    tokenizer_json = _cached_tokenizer(cache_dir, corpus, meta)
    if tokenizer_json is None:
        tokenizer_json = bpe.train(text_batches(corpus.files, 0, num_train_chars), corpus.bpe_vocab_size)
        if meta is not None and meta["tokenizer_sha256"] != _sha256(tokenizer_json):
            meta = None  # retrained otherwise (another tokenizers release, say): its tokens differ too
        if meta is None:  # gone before the new tokenizer lands: stale metadata must never vouch for it
            meta_file(cache_dir, corpus).unlink(missing_ok=True)
        _write_atomically(tokenizer_file(cache_dir, corpus), tokenizer_json)
    if meta is None:
        meta = _write_tokens(cache_dir, corpus, tokenizer_json, num_train_chars)
        _write_atomically(meta_file(cache_dir, corpus), json.dumps(meta) + "\n")
    return token_file(cache_dir, corpus)


def read(cache_dir: str, corpus: Corpus) -> BpeTokens:
    """Every rank, after rank 0's write: the tokens memory-mapped, and the tokenizer that made them."""
    meta = _meta(cache_dir, corpus)
    tokenizer_json = _cached_tokenizer(cache_dir, corpus, meta)
    if meta is None or tokenizer_json is None:
        path = token_file(cache_dir, corpus)
        raise ValueError(
            f"token file {path} or its tokenizer is missing or incomplete: rank 0 writes both in prepare()"
        )
    tokens = np.memmap(token_file(cache_dir, corpus), dtype=np.uint16, mode="r")
    return BpeTokens(tokens, int(meta["num_train"]), tokenizer_json)
