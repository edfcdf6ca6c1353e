"""data=text: tokenizers' round trips, the split, windows across ranks, the token file; bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from data.text import TextData
from data.tokens import decode, default_corpus, encode, token_file
from tests.compose import compose_config
from tests.text_helpers import tiny_gpt, write_corpus
from trainer.errors import ConfigError
from trainer.setup.build import build_parts, instantiate


def make(tmp_path: Path, text: str | None = None, **kw: object) -> TextData:
    corpus = tmp_path / "corpus.txt"
    if text is None:
        write_corpus(corpus, 2000)
    else:
        corpus.write_text(text, encoding="utf-8")
    args: dict[str, object] = dict(batch_size=4, block_size=8, path=str(corpus), cache_dir=str(tmp_path / "tok"))
    args.update(kw)
    data = TextData(**args)  # type: ignore[arg-type]
    data.prepare()
    data.setup()
    return data


@pytest.mark.parametrize("tokenizer", ["char", "byte"])
def test_round_trip_and_token_file(tmp_path: Path, tokenizer: str):
    text = "héllo, wörld → ok\n" * 20
    data = make(tmp_path, text, tokenizer=tokenizer)
    assert data.decode(data.encode(text)) == text
    tokens = np.fromfile(token_file(str(tmp_path / "tok"), data.corpus), dtype=np.uint16)
    assert decode(tokens.tolist(), data.vocabulary()) == text  # the file is the whole corpus, in order
    assert data.num_classes == (len(set(text)) if tokenizer == "char" else 256)
    assert data.num_classes == data.vocabulary()["vocab_size"]


def test_char_ids_are_the_sorted_distinct_characters(tmp_path: Path):
    data = make(tmp_path, "cabbage" * 20)
    assert data.vocabulary()["chars"] == "abceg"
    assert encode("cab", data.vocabulary()) == [2, 0, 1]


def test_first_90_percent_train_last_10_validate(tmp_path: Path):
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    data = make(tmp_path, text)
    train, val = data.build_datasets()
    assert data.num_train == 900
    assert decode(train.tokens.tolist(), data.vocabulary()) == text[:900]
    assert decode(val.tokens.tolist(), data.vocabulary()) == text[900:]
    x, y = train[3]  # window 3 starts at token 3 * block_size; targets are the inputs shifted by one
    assert decode(x.tolist(), data.vocabulary()) == text[24:32] and decode(y.tolist(), data.vocabulary()) == text[25:33]
    assert x.dtype == torch.int64


def test_ranks_take_disjoint_windows_each_epoch(tmp_path: Path):
    # Every window distinct (a-z cycling over 26 with block 8 would repeat): positions from ids alone.
    text = "".join(chr(0x4E00 + i) for i in range(1000))
    data = make(tmp_path, text)
    (train, _) = data._built()
    for epoch in (0, 1):
        starts = []
        for rank in (0, 1):
            loader = data.train_loader(rank, 2, seed=0)
            loader.sampler.set_epoch(epoch)
            starts.append([int(x[0]) // 8 for inputs, _ in loader for x in inputs])  # char id = position here
        assert not set(starts[0]) & set(starts[1])
        assert len(set(starts[0])) == len(starts[0]) and len(starts[0]) == len(starts[1]) > 0
        assert set(starts[0]) | set(starts[1]) <= set(range(len(train)))


def test_resumed_sampler_serves_the_rest_of_the_epoch(tmp_path: Path):
    data = make(tmp_path)
    whole = [torch.cat(b) for b in data.train_loader(1, 2, seed=3)]
    resumed = data.train_loader(1, 2, seed=3)
    resumed.sampler.skip_next(2 * data.batch_size)
    assert all(torch.equal(a, b) for a, b in zip(whole[2:], [torch.cat(b) for b in resumed], strict=True))


def test_default_corpus_is_pythons_stdlib(tmp_path: Path):
    files = default_corpus()
    assert len(files) > 50 and all(f.suffix == ".py" for f in files)
    assert (Path(files[0]).parent / "os.py").is_file()


# Bad input: each a ConfigError naming the key or path, raised while building the parts (before any
# process group, logger or file exists); train.py turns it into exit code 2 (test_gpt_train).
def parts_error(tmp_path: Path, overrides: list[str]) -> str:
    cfg = compose_config(["logger=none", *overrides])
    with pytest.raises(ConfigError) as err:
        build_parts(cfg, instantiate(cfg.trainer))
    return str(err.value)


def test_bad_input_names_the_key_or_path(tmp_path: Path):
    gpt = tiny_gpt(write_corpus(tmp_path / "c.txt", 2000), tmp_path / "tok")
    missing = tmp_path / "nope.txt"
    assert f"data.path={missing} does not exist" in parts_error(tmp_path, [*gpt, f"data.path={missing}"])
    (tmp_path / "empty.txt").write_text("")
    assert "is empty" in parts_error(tmp_path, [*gpt, f"data.path={tmp_path / 'empty.txt'}"])
    assert "model.n_embd=16 is not divisible by model.n_head=3" in parts_error(tmp_path, [*gpt, "model.n_head=3"])
    assert "model.block_size=500 is too long" in parts_error(tmp_path, [*gpt, "model.block_size=500"])
    assert "use data=text" in parts_error(tmp_path, ["model=gpt", "data=fake"])
    assert "use model=gpt" in parts_error(tmp_path, ["model=cnn", *gpt[5:]])
    assert "data.tokenizer='word' is invalid" in parts_error(tmp_path, [*gpt, "data.tokenizer=word"])
    assert "data.num_workers=2 is invalid for data=text" in parts_error(tmp_path, [*gpt, "data.num_workers=2"])
    assert "not UTF-8" in parts_error(tmp_path, [*gpt, f"data.path={_latin1(tmp_path)}"])


def _latin1(tmp_path: Path) -> Path:
    path = tmp_path / "latin1.txt"
    path.write_bytes("café ".encode("latin-1") * 100)
    return path
