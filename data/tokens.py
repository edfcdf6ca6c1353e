"""A text corpus read as a stream, its tokenizer (char, byte or bpe), and its token file on disk.

Why streaming: every rank scans the corpus once at start-up (for its hash, its characters and its
length, which the model's vocab size and the config checks need before any process group exists),
and that scan must not hold the corpus in memory. The tokens themselves are written once, by rank
0, to a uint16 file keyed by the corpus's hash; every rank memory-maps it. bpe's tokenizer is trained
by rank 0 too, and its files live beside the token file (data/bpe_cache.py).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sysconfig
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from data import bpe

Tokenizer = Literal["char", "byte", "bpe"]  # the schema's choices for data.tokenizer
TOKENIZERS: tuple[str, ...] = typing.get_args(Tokenizer)
CHUNK_BYTES = 1 << 20
MAX_VOCAB = 1 << 16  # ids are stored as uint16: the largest vocabulary (data.vocab_size) that fits


def default_corpus() -> list[Path]:
    """Python's own standard library sources (the top-level *.py files): on every machine that runs
    this lab, with no download."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def corpus_files(path: str | None) -> list[Path]:
    """The files of data.path (one file, or a directory's *.txt sorted by name), or the default corpus."""
    if path is None:
        return default_corpus()
    where = Path(path)
    if where.is_file():
        return [where]
    if where.is_dir():
        files = sorted(where.glob("*.txt"))
        if not files:
            raise ValueError(f"data.path={path} is a directory with no *.txt files: nothing to train on")
        return files
    raise ValueError(f"data.path={path} does not exist: give a UTF-8 text file or a directory of *.txt files")


def _chunks(files: list[Path]) -> Iterator[tuple[Path, bytes]]:
    for file in files:
        with file.open("rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                yield file, chunk


def _texts(files: list[Path]) -> Iterator[str]:
    """The corpus decoded as UTF-8, chunk by chunk (a character split across chunks is kept whole)."""
    for file in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        with file.open("rb") as handle:
            try:
                while chunk := handle.read(CHUNK_BYTES):
                    yield decoder.decode(chunk)
                yield decoder.decode(b"", final=True)
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{file} is not UTF-8 text ({err}); use data.tokenizer=byte for arbitrary bytes"
                ) from err


@dataclass(frozen=True)
class Corpus:
    """What one streaming pass over the corpus learns: enough to size the model and check the config."""

    files: list[Path]
    tokenizer: str
    digest: str  # sha256 of the tokenizer's name and the files' bytes, in order
    # char and byte: the tokens. bpe: the characters (its split is cut in the text; only rank 0's
    # trained tokenizer can count the tokens, which it writes beside them: data/bpe_cache.py).
    num_tokens: int
    chars: str  # the sorted distinct characters (char tokenizer); "" for byte and bpe
    bpe_vocab_size: int | None = None  # data.vocab_size: bpe's, at most; None for char and byte

    @property
    def vocab_size(self) -> int:
        if self.tokenizer == "bpe":
            assert self.bpe_vocab_size is not None, "scan() sets it for bpe"
            return self.bpe_vocab_size
        return len(self.chars) if self.tokenizer == "char" else 256

    @property
    def tag(self) -> str:
        """The tokenizer in the cache's file names: char, byte, bpe<vocab_size>."""
        return f"bpe{self.bpe_vocab_size}" if self.tokenizer == "bpe" else self.tokenizer

    def vocab(self) -> dict[str, object]:
        """What decoding needs, without the corpus: goes to the run dir and into checkpoints (bpe's
        tokenizer JSON is added once rank 0 has trained it: TextData.vocabulary)."""
        if self.tokenizer == "bpe":  # no "chars": the end-of-run sample then starts from a newline
            return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size}
        return {"tokenizer": self.tokenizer, "chars": self.chars, "vocab_size": self.vocab_size}


def scan(files: list[Path], tokenizer: str, bpe_vocab_size: int | None = None) -> Corpus:
    digest = hashlib.sha256(tokenizer.encode())
    for _, chunk in _chunks(files):
        digest.update(chunk)
    if tokenizer == "byte":
        return Corpus(files, tokenizer, digest.hexdigest(), sum(f.stat().st_size for f in files), "")
    seen: set[str] = set()
    count = 0
    for text in _texts(files):
        if tokenizer == "char":
            seen.update(text)
        count += len(text)
    if tokenizer == "bpe":
        return Corpus(files, tokenizer, digest.hexdigest(), count, "", bpe_vocab_size)
    if len(seen) > MAX_VOCAB:
        raise ValueError(
            f"the corpus has {len(seen)} distinct characters, more than {MAX_VOCAB}: use data.tokenizer=byte"
        )
    return Corpus(files, tokenizer, digest.hexdigest(), count, "".join(sorted(seen)))


def text_batches(files: list[Path], start: int, stop: int) -> Iterator[list[str]]:
    """Characters [start, stop) of the corpus as batches of lines (each ends with a newline, but the
    last and any line longer than a chunk), about a chunk at a time: the pieces bpe is trained on and
    encodes apart, the same pieces both times, so that no merge spans two lines and the work runs
    in parallel."""
    pos, rest = 0, ""
    for text in _texts(files):
        part = text[max(start - pos, 0) : max(stop - pos, 0)]
        pos += len(text)
        *lines, rest = (rest + part).split("\n")
        batch = [line + "\n" for line in lines]
        if len(rest) > CHUNK_BYTES:  # a text without newlines is still served a chunk at a time
            batch, rest = [*batch, rest], ""
        if batch:
            yield batch
        if pos >= stop:
            break
    if rest:
        yield [rest]


def encode(text: str, vocab: dict[str, object]) -> list[int]:
    if vocab["tokenizer"] == "bpe":
        return bpe.encode_batch(str(vocab["bpe"]), [text])
    if vocab["tokenizer"] == "byte":
        return list(text.encode("utf-8"))
    index = {c: i for i, c in enumerate(str(vocab["chars"]))}
    missing = sorted({c for c in text if c not in index})
    if missing:
        raise ValueError(f"characters {missing!r} are not in the corpus's vocabulary")
    return [index[c] for c in text]


def decode(ids: list[int], vocab: dict[str, object]) -> str:
    if vocab["tokenizer"] == "bpe":
        return bpe.decode(str(vocab["bpe"]), ids)
    if vocab["tokenizer"] == "byte":
        return bytes(ids).decode("utf-8", errors="replace")
    chars = str(vocab["chars"])
    return "".join(chars[i] for i in ids)


def _token_chunks(corpus: Corpus) -> Iterator[np.ndarray]:
    if corpus.tokenizer == "byte":
        for _, chunk in _chunks(corpus.files):
            yield np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16)
        return
    points = np.array([ord(c) for c in corpus.chars], dtype=np.uint32)  # sorted, as the ids are
    for text in _texts(corpus.files):
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        yield np.searchsorted(points, codes).astype(np.uint16)


def token_file(cache_dir: str, corpus: Corpus) -> Path:
    return Path(cache_dir) / f"{corpus.digest[:20]}.{corpus.tag}.u16"


def write_tokens(cache_dir: str, corpus: Corpus) -> Path:
    """Tokenize the corpus into its uint16 file (rank 0, once per corpus): written to a temporary
    name and renamed, so a reader never sees half a file."""
    path = token_file(cache_dir, corpus)
    if path.exists() and path.stat().st_size == 2 * corpus.num_tokens:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".partial{os.getpid()}")
    with partial.open("wb") as handle:
        for ids in _token_chunks(corpus):
            handle.write(ids.tobytes())
    os.replace(partial, path)
    path.with_suffix(".json").write_text(json.dumps(corpus.vocab()) + "\n", encoding="utf-8")
    return path


def map_tokens(cache_dir: str, corpus: Corpus) -> np.memmap:
    """The corpus's tokens, memory-mapped read-only: pages are read as windows touch them."""
    path = token_file(cache_dir, corpus)
    if not path.exists() or path.stat().st_size != 2 * corpus.num_tokens:
        raise ValueError(f"token file {path} is missing or incomplete: rank 0 writes it in prepare()")
    return np.memmap(path, dtype=np.uint16, mode="r")
