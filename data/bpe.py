"""data.tokenizer=bpe: a byte-level BPE trained here, with Hugging Face's `tokenizers`, on the training text.

Why byte-level: it starts from the 256 byte values (so vocab_size >= 256), so any UTF-8 text encodes
with no unknown token and decoding gives the text back exactly. Why trained here: nothing is
downloaded, and the merges are the corpus's own. Training is deterministic: the same text, in the
same pieces, and the same vocab_size give the same JSON, byte for byte (tests/test_text_data.py).

This module knows tokenizers, not corpora: data/tokens.py says which text it is trained on and where
the files go. A tokenizer travels as its JSON text (tokenizers' own format, `Tokenizer.from_str`):
that is what goes into the run dir and the checkpoints, so decoding needs neither corpus nor cache.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

MIN_VOCAB = 256  # the byte alphabet every byte-level BPE starts from


def train(batches: Iterable[list[str]], vocab_size: int) -> str:
    """The JSON of a byte-level BPE of at most vocab_size tokens, trained on the text of batches.

    A small text can run out of pairs to merge first: its vocabulary is then smaller, never larger.
    """
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: decoding must give back exactly the text, with nothing added at its start.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen in the text or not
        special_tokens=[],
    )
    tokenizer.train_from_iterator(batches, trainer=trainer)
    return tokenizer.to_str()


@functools.lru_cache(maxsize=4)
def load(text: str) -> Tokenizer:
    """The tokenizer of a JSON text (parsed once per text: encode and decode are called per prompt)."""
    return Tokenizer.from_str(text)


def mismatch(text: str, vocab_size: int) -> str | None:
    """Why a tokenizer JSON is not a byte-level BPE of at most vocab_size tokens, or None."""
    try:
        tokenizer = load(text)
    except Exception as err:  # tokenizers raises a bare Exception for JSON it cannot read
        return f"it is not a tokenizer's JSON ({err})"
    kinds = (type(tokenizer.model), type(tokenizer.pre_tokenizer), type(tokenizer.decoder))
    if kinds != (models.BPE, pre_tokenizers.ByteLevel, decoders.ByteLevel):
        return f"it is not a byte-level BPE (model, pre-tokenizer, decoder: {', '.join(k.__name__ for k in kinds)})"
    size = tokenizer.get_vocab_size()
    if not MIN_VOCAB <= size <= vocab_size:
        return f"it has {size} tokens, not {MIN_VOCAB} to data.vocab_size={vocab_size}"
    return None


def encode_batch(tokenizer_json: str, pieces: list[str]) -> list[int]:
    """The ids of pieces of text, encoded apart (in parallel) and concatenated."""
    return [i for encoding in load(tokenizer_json).encode_batch(pieces) for i in encoding.ids]


def decode(tokenizer_json: str, ids: list[int]) -> str:
    return load(tokenizer_json).decode(ids)
