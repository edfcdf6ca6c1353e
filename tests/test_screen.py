"""What a run puts on the screen, launched as the README says: no noise that is not ours, the sync:
lines in key=value form, one throughput statistic (a quiet screen)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import CPU, launch, output
from tests.text_helpers import tiny_gpt, write_corpus
from trainer.loop.rows import LIST_SHOWN, PAIRS_PER_LINE, sync_lines

BLOCK = 16  # tiny_gpt's block_size: tokens per sample
SAMPLE_TOKENS = 30  # the end-of-run sample's length (characters: the tokenizer is char-level)
NOISE = ("USDT:", "gpuGetDeviceCount", "DeviceProperties.cpp", "Symlinked", "wandb: WARNING", "ChildFailedError")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One profiled GPT run with W&B offline, as a user starts it (W&B not silenced as the suite does)."""
    root = tmp_path_factory.mktemp("screen")
    run_dir = root / "run"
    args = [
        CPU,
        *tiny_gpt(write_corpus(root / "c.txt", 3000), root / "tok", sample_tokens=SAMPLE_TOKENS),
        "sync=bucketed",
        "sync.bucket_cap_mb=0.001",  # many buckets: a long list on the sync: line
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=3",
        "trainer.profile=true",
        "trainer.peak_tflops=0.5",
        "logger=wandb",
        f"hydra.run.dir={run_dir}",
    ]
    saved = os.environ.pop("WANDB_SILENT", None)  # tests/conftest.py silences W&B; a user's shell does not
    try:
        proc = launch(args, cwd=root)
    finally:
        if saved is not None:
            os.environ["WANDB_SILENT"] = saved
    assert proc.returncode == 0, output(proc)
    return proc, run_dir


@pytest.mark.slow
def test_a_profiled_run_with_wandb_prints_nothing_but_ours(
    profiled: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, run_dir = profiled
    text = output(proc)
    for noise in NOISE:
        assert noise not in text, (noise, text)
    (rank0,) = run_dir.glob("wandb/offline-run-*-rank0")
    trace = rank0 / "files" / "timeline.json"  # still in the W&B run, now a file of its own
    assert trace.is_file() and not trace.is_symlink()


@pytest.mark.slow
def test_the_end_of_run_sample_is_as_long_as_asked_in_the_summary_and_on_screen(
    profiled: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, run_dir = profiled
    sample = json.loads((run_dir / "summary.json").read_text())["sample"]
    assert len(sample) == 1 + SAMPLE_TOKENS  # the prompt (a newline) and the tokens generated
    assert "sample (temperature 0.8, top-k 40):" in proc.stdout
    assert sample.strip().split("\n")[0] in proc.stdout


@pytest.mark.slow
def test_the_sync_lines_are_key_value_pairs(profiled: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, run_dir = profiled
    lines = proc.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("[rank0] sync: "))
    block = [lines[first].removeprefix("[rank0] sync: ")]
    block += [line.strip() for line in lines[first + 1 :] if line.startswith(" " * len("[rank0] sync: "))][:20]
    block = block[: next((i for i, line in enumerate(block[1:], 1) if "=" not in line), len(block))]
    pairs = [word for line in block for word in shlex.split(line)]
    assert all(re.fullmatch(r"\w+=\S.*", pair) for pair in pairs), block
    assert all(len(shlex.split(line)) <= PAIRS_PER_LINE for line in block), block
    shown = dict(pair.split("=", 1) for pair in pairs)
    described = json.loads((run_dir / "summary.json").read_text())["sync"]
    assert set(shown) == set(described)  # every key (summary.json sorts them)
    assert shown["comm_timing"] == described["comm_timing"] and " " in described["comm_timing"]
    sizes = described["bucket_sizes_bytes"]
    assert len(sizes) > LIST_SHOWN and shown["bucket_sizes_bytes"].endswith(f",+{len(sizes) - LIST_SHOWN}_more]")


@pytest.mark.slow
def test_one_throughput_statistic_for_samples_and_tokens(
    profiled: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, run_dir = profiled
    (line,) = [line for line in proc.stdout.splitlines() if "throughput" in line]
    found = re.fullmatch(
        r"\s*throughput (\d+) samples/s, (\d+) tokens/s, MFU [\d.]+ % \(all ranks, whole-run mean\)", line
    )
    assert found, line
    summary = json.loads((run_dir / "summary.json").read_text())
    samples, tokens = summary["throughput/global_samples_per_s"], summary["throughput/global_tokens_per_s"]
    assert (
        tokens == pytest.approx(BLOCK * samples) and int(found[1]) == round(samples) and int(found[2]) == round(tokens)
    )
    assert summary["perf/mfu"] == pytest.approx(sum(r["mfu"] for r in summary["ranks"]) / 2)


def test_sync_lines_quote_spaces_and_cut_long_lists() -> None:
    text = sync_lines({"strategy": "x", "timing": "1 step in 10", "sizes": list(range(10)), "a": 1, "b": True})
    first, second = text.splitlines()
    assert first == 'sync: strategy=x timing="1 step in 10" sizes=[0,1,2,3,4,5,+4_more] a=1'
    assert second == " " * len("[rank0] sync: ") + "b=True"


WINDOWS = ("last row", "last eval", "whole-run mean", "median row")


def windowed_numbers(text: str) -> dict[tuple[str, str], float]:
    """`train/loss 1.17   train/accuracy 0.707 (last row)`: each printed number under its (name, window);
    a name printed twice under one window must print one value."""
    found: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        parts = re.split(r"\(([^()]*)\)", line)  # text, group, text, group, ...
        for numbers, group in zip(parts[::2], parts[1::2], strict=False):
            window = group.split(", ")[-1]  # `(all ranks, whole-run mean)`: the scope, then the window
            if window not in WINDOWS:
                continue
            for name, value in re.findall(r"([\w/]+) ([\d.]+)", numbers):
                assert found.setdefault((name, window), float(value)) == float(value), (name, window)
    return found


@pytest.mark.slow
def test_one_value_per_name_and_window(profiled: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """The end-of-run report, summary.json, the sweep report and the W&B reader of one run: every printed
    loss and throughput names its window, and one name and window is one number everywhere."""
    proc, run_dir = profiled
    printed = windowed_numbers(proc.stdout + proc.stderr)  # the bar (stderr) too
    summary = json.loads((run_dir / "summary.json").read_text())
    windows = summary["windows"]
    assert windows["train/loss"] == "last row" and windows["eval/loss"] == "last eval"
    assert windows["throughput/global_samples_per_s"] == "whole-run mean"
    for key in ("train/loss", "train/accuracy", "eval/loss", "eval/accuracy"):
        assert printed[(key, windows[key])] == pytest.approx(summary[key], abs=6e-4), key
    assert printed[("throughput", "whole-run mean")] == round(summary["throughput/global_samples_per_s"])
    # The bar's loss is rank 0's own, under a name of its own (the job's train/loss is the ranks' mean).
    bar = re.findall(r"rank 0 loss ([\d.]+) \(last row\)", proc.stderr + proc.stdout)
    assert bar and printed[("loss", "last row")] == float(bar[-1])  # its own name: not train/loss
    rank0 = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert float(bar[-1]) == pytest.approx([r for r in rank0 if "train/loss" in r][-1]["train/loss"], abs=6e-5)
    # Every row says what it is; the kinds of this run: training rows, evaluations, a checkpoint's.
    assert {r["row"] for r in rank0} == {"train", "eval", "checkpoint"}
    assert all(("train/loss" in r) == (r["row"] == "train") for r in rank0)
    # The sweep report of the run: its train loss is the same last row; its samples/s another window, named.
    report = subprocess.run(
        [sys.executable, "-m", "trainer.tools.report", str(run_dir), "--out", str(run_dir / "report")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "train loss the last row" in report.stdout and "samples/s" in report.stdout
    table = [line.strip("| ").split(" | ") for line in (run_dir / "report" / "report.md").read_text().splitlines()]
    header = next(line for line in table if line[0] == "job")
    (row,) = [line for line in table if line[0] == run_dir.name]
    assert "samples/s (median row)" in header
    assert float(row[header.index("train loss")]) == pytest.approx(summary["train/loss"], abs=6e-5)
