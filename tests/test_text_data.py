"""data=text: tokenizers' round trips, the split, windows across ranks, the token file; bpe's training,
cache and sample; bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from data import bpe
from data.bpe_cache import meta_file, tokenizer_file
from data.text import TextData
from data.tokens import decode, default_corpus, encode, text_batches, token_file
from tests.cli import CPU, output, python_train_forked
from tests.compose import compose_config
from tests.text_helpers import tiny_gpt, write_corpus
from trainer.errors import ConfigError
from trainer.setup.build import build_parts
from trainer.tools import sample


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


BPE: dict[str, object] = {"tokenizer": "bpe", "vocab_size": 300}


def bpe_text(tmp_path: Path) -> str:
    """1800 characters of word salad (the training text), then 200 of a word only the validation text
    has: a BPE trained on the whole corpus would make tokens of it (it does, at 300)."""
    return write_corpus(tmp_path / "salad.txt", 1800).read_text(encoding="utf-8") + "quizzical " * 20


def test_bpe_is_trained_on_the_training_text_only_and_round_trips(tmp_path: Path):
    text = bpe_text(tmp_path)
    data = make(tmp_path, text, **BPE)
    train, val = data.build_datasets()
    vocab = data.vocabulary()
    assert decode(train.tokens.tolist(), vocab) == text[:1800] and decode(val.tokens.tolist(), vocab) == text[1800:]
    assert data.num_train == len(train.tokens) < 1800  # the split is cut in the text, then counted in tokens
    assert (
        data.num_classes == vocab["vocab_size"] == 300
        and int(np.max(train.tokens.tolist() + val.tokens.tolist())) < 300
    )
    words = bpe.load(str(vocab["bpe"])).get_vocab()
    assert len(words) == 300 and not [w for w in words if "quiz" in w]  # nothing of the validation text
    assert data.decode(data.encode("héllo → the lab\n")) == "héllo → the lab\n"  # any UTF-8: byte-level
    (tmp_path / "again").mkdir()
    again = make(tmp_path / "again", text, **BPE)  # a fresh cache: trained again, the same tokenizer
    assert again.vocabulary()["bpe"] == vocab["bpe"]


def test_bpe_is_trained_once_and_reused_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    text, cache = bpe_text(tmp_path), str(tmp_path / "tok")
    first = make(tmp_path, text, **BPE)
    files = [tokenizer_file(cache, first.corpus), token_file(cache, first.corpus), meta_file(cache, first.corpus)]
    written = [f.stat().st_mtime_ns for f in files]

    def no_training(*args: object) -> str:
        raise AssertionError("bpe trained again: the cached tokenizer was not reused")

    with monkeypatch.context() as patch:
        patch.setattr(bpe, "train", no_training)
        second = make(tmp_path, text, **BPE)  # another run on the same corpus and size: rank 0's prepare again
    assert [f.stat().st_mtime_ns for f in files] == written and second.vocabulary() == first.vocabulary()
    other = make(tmp_path, text, tokenizer="bpe", vocab_size=280)  # another size: its own tokenizer, beside
    assert tokenizer_file(cache, other.corpus) != files[0] and other.vocabulary()["bpe"] != first.vocabulary()["bpe"]
    files[0].unlink()  # a deleted tokenizer is trained again, the same: its tokens stay
    assert make(tmp_path, text, **BPE).vocabulary() == first.vocabulary() and files[1].stat().st_mtime_ns == written[1]


def test_a_cached_tokenizer_that_does_not_match_is_refused(tmp_path: Path):
    text = bpe_text(tmp_path)
    data = make(tmp_path, text, **BPE)
    path = tokenizer_file(str(tmp_path / "tok"), data.corpus)
    good = path.read_text(encoding="utf-8")

    def refusal(tokenizer_json: str) -> str:
        path.write_text(tokenizer_json, encoding="utf-8")
        with pytest.raises(ValueError) as err:
            make(tmp_path, text, **BPE)
        message = str(err.value)
        assert "\n" not in message and f"{path} does not match the cache" in message and "delete it" in message
        return message

    edited = json.loads(good)
    edited["model"]["merges"].pop()
    assert "not the tokenizer that made" in refusal(json.dumps(edited))
    assert "not a tokenizer's JSON" in refusal(good[:100])
    larger = bpe.train(text_batches(data.corpus.files, 0, 1800), 320)
    assert "has 320 tokens, not 256 to data.vocab_size=300" in refusal(larger)
    path.write_text(good, encoding="utf-8")
    assert make(tmp_path, text, **BPE).vocabulary() == data.vocabulary()


def test_a_bpe_run_samples_without_corpus_or_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    corpus, cache, run_dir = write_corpus(tmp_path / "c.txt", 3000), tmp_path / "tok", tmp_path / "run"
    args = [CPU, *tiny_gpt(corpus, cache), "data.tokenizer=bpe", "data.vocab_size=300", "logger=none"]
    args += ["trainer.max_steps=2", "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"]
    proc = python_train_forked(args, cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    saved = json.loads((run_dir / "vocab.json").read_text(encoding="utf-8"))
    (trained,) = cache.glob("*.bpe300.tokenizer.json")
    assert saved["tokenizer"] == "bpe" and saved["vocab_size"] == 300 and saved["bpe"] == trained.read_text()
    shutil.rmtree(cache)
    corpus.unlink()
    assert sample.main([str(run_dir), "--prompt", "the lab", "--tokens", "20", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("the lab") and len(printed) > len("the lab\n")


# Bad input: each a ConfigError naming the key or path, raised while building the parts (before any
# process group, logger or file exists); train.py turns it into exit code 2 (test_gpt_train).
def parts_error(tmp_path: Path, overrides: list[str]) -> str:
    cfg = compose_config(["logger=none", *overrides])
    with pytest.raises(ConfigError) as err:
        build_parts(cfg)
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
    as_bpe = [*gpt, "data.tokenizer=bpe"]  # the leaf's own checks, in the schema's words (test_config_refusals)
    assert "data.vocab_size=255 is invalid: accepted: an integer >= 256" in parts_error(
        tmp_path, [*as_bpe, "data.vocab_size=255"]
    )
    too_large = parts_error(tmp_path, [*as_bpe, "data.vocab_size=65537"])
    assert "data.vocab_size=65537 is invalid" in too_large and "and <= 65536" in too_large
    assert "data.vocab_size=null is invalid for data.tokenizer=bpe" in parts_error(tmp_path, as_bpe)
    assert "data.vocab_size=300 is invalid for data.tokenizer=char" in parts_error(
        tmp_path, [*gpt, "data.vocab_size=300"]
    )
    assert "not UTF-8" in parts_error(tmp_path, [*gpt, f"data.path={_latin1(tmp_path)}"])


def _latin1(tmp_path: Path) -> Path:
    path = tmp_path / "latin1.txt"
    path.write_bytes("café ".encode("latin-1") * 100)
    return path
