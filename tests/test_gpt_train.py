"""The real train.py on a tiny GPT: the language-model rows, the sample, and bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli import CPU, output, python_train, python_train_forked, train_rows
from tests.text_helpers import tiny_gpt, write_corpus

pytestmark = pytest.mark.slow


def test_gpt_logs_tokens_per_s_perplexity_mfu_and_ends_with_a_sample(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", 3000)
    run_dir = tmp_path / "run"
    args = [
        CPU,
        "logger=none",
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=2",
        "trainer.progress_bar=false",
    ]
    gpt = tiny_gpt(corpus, tmp_path / "tok", sample_tokens=120)  # trainer.end_sample_tokens's default
    proc = python_train_forked([*args, *gpt, "trainer.peak_tflops=0.5", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    rows = train_rows(run_dir / "metrics" / "rank0.jsonl")
    assert all(r["throughput/tokens_per_s"] == pytest.approx(16 * r["throughput/samples_per_s"]) for r in rows)
    assert all(0 < r["perf/mfu"] < 1 for r in rows)
    assert "eval/perplexity" in proc.stdout and "sample (temperature 0.8" in proc.stdout
    assert (run_dir / "vocab.json").is_file()

    # On CPU with no peak given, MFU is left out rather than invented; end_sample_tokens=0: no sample.
    other = tmp_path / "nopeak"
    gpt = tiny_gpt(corpus, tmp_path / "tok", sample_tokens=0)
    proc = python_train_forked([*args, *gpt, f"hydra.run.dir={other}"], cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    assert not any("perf/mfu" in r for r in train_rows(other / "metrics" / "rank0.jsonl"))
    assert "sample (" not in proc.stdout and "sample" not in json.loads((other / "summary.json").read_text())


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.path=/no/such/corpus.txt"], "data.path=/no/such/corpus.txt does not exist"),
        (["model.n_head=3"], "model.n_embd=16 is not divisible by model.n_head=3"),
        (["model=cnn"], "use a model that reads tokens (model=gpt)"),  # the gpt's own keys dropped below
    ],
)
def test_bad_input_exits_2_before_anything_starts(tmp_path: Path, overrides: list[str], expected: str) -> None:
    gpt = tiny_gpt(write_corpus(tmp_path / "c.txt", 3000), tmp_path / "tok")
    run_dir = tmp_path / "run"
    if overrides == ["model=cnn"]:
        gpt = [arg for arg in gpt if not arg.startswith("model")]
    proc = python_train([CPU, *gpt, "logger=none", *overrides, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 2, output(proc)
    assert expected in output(proc) and "Traceback" not in output(proc)
    assert not (run_dir / "metrics").exists() and not (tmp_path / "tok").exists()  # nothing started
