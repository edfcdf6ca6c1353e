"""The W&B offline-run reader (trainer/logger/wandb_files.py) and its command, on real offline runs (no network).

The runs are written by a child process running the real wandb SDK in offline mode: that keeps wandb's
stdout wrapping, atexit hooks and wandb-core service out of the pytest process, and one module-scoped
fixture pays the start-up cost once for every test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.logger.wandb_files import BLOCK, find_runs, iter_records, read_run
from trainer.tools import wandb_offline

ROOT = Path(__file__).resolve().parents[1]
LOSSES = [1.0 / (i + 1) for i in range(5)]
CONFIG = {
    "lr": 0.1,
    "model": {"depth": 3, "act": "relu"},
    "opt": {"value": 3, "desc": "user nesting that merely looks like W&B's {'value': ...} wrapping"},
    "tags": ["a", "b"],
}
# Over 3 blocks, and not periodic, so a mis-ordered or dropped middle chunk cannot go unnoticed.
BIG = "".join(f"{i:06d}," for i in range(14_000))

WRITER = r"""
import json, os, socket, sys

def no_network(event, args):  # wandb 0.31 probes its server from a thread unless WANDB_MODE=offline is set
    if event == "socket.getaddrinfo" or (event == "socket.connect" and args[0].family != socket.AF_UNIX):
        os.write(2, f"NETWORK {event} {args[1:]}\n".encode())

sys.addaudithook(no_network)
import wandb
root, losses, config, big = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
run = wandb.init(mode="offline", dir=root, project="p", group="g", name="rank-0", job_type="train",
                 config=config)
run.define_metric("step", hidden=True)
run.define_metric("train/*", step_metric="step", summary="min,last")
for i, loss in enumerate(losses):
    run.log({"train/loss": loss, "step": i})
run.config.update({"late": {"x": 1}})
run.summary["best"] = min(losses)
run.summary["tmp"] = 1
del run.summary["tmp"]
run.summary["nest"] = {"a": 1}
run.summary["nest"]["b"] = 2
run.summary["layout"] = {"tensors": [{"name": f"t{i}", "bytes": i} for i in range(52)], "_inner": 1}
run.finish()
big_run = wandb.init(mode="offline", dir=root, project="p", group="g", name="rank-1",
                     config={"blob": big, "n": 1})
big_run.log({"val/acc": 0.5})
big_run.finish(exit_code=3)
print(json.dumps([run.id, big_run.id]))
"""


def _env(tmp: Path) -> dict[str, str]:
    """Offline, silent, and every wandb directory inside tmp so nothing touches ~ or the network."""
    env = dict(os.environ, WANDB_SILENT="true", WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        env[var] = str(tmp / var.lower())
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_BASE_URL", None)
    return env


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Write two real offline runs (normal + >32 KiB config) once; return their dir= root."""
    tmp = tmp_path_factory.mktemp("wandb_offline")
    out = subprocess.run(
        [sys.executable, "-c", WRITER, str(tmp), json.dumps(LOSSES), json.dumps(CONFIG), BIG],
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NETWORK" not in out.stderr, out.stderr[-3000:]
    tmp.joinpath("ids.json").write_text(out.stdout.strip().splitlines()[-1])
    return tmp


@pytest.fixture(scope="module")
def runs(root: Path) -> dict[str, object]:
    """find_runs on the fixture root, keyed by name."""
    found = find_runs(root)
    assert [r.name for r in found] == ["rank-0", "rank-1"]
    return {r.name: r for r in found}


def test_round_trip(root: Path, runs: dict) -> None:
    run = runs["rank-0"]
    ids = json.loads(root.joinpath("ids.json").read_text())
    assert run.run_id == ids[0] and run.path.name.endswith("-" + ids[0])
    assert run.path.parent == root / "wandb"
    assert (run.name, run.group, run.project, run.job_type) == ("rank-0", "g", "p", "train")
    assert run.config == {**CONFIG, "late": {"x": 1}}  # plain values, user's nesting kept, no "_wandb"
    assert [row["train/loss"] for row in run.history] == LOSSES
    assert [row["step"] for row in run.history] == list(range(5))
    assert [row["_step"] for row in run.history] == list(range(5))
    assert run.summary["best"] == min(LOSSES)
    assert run.summary["train/loss"] == {"min": min(LOSSES), "last": LOSSES[-1]}  # as defined
    assert run.metrics == {
        "step": {"step_metric": None, "summary": [], "hidden": True, "step_sync": False},
        "train/*": {"step_metric": "step", "summary": ["last", "min"], "hidden": False, "step_sync": True},
    }
    assert run.summary["nest"] == {"a": 1, "b": 2} and "tmp" not in run.summary  # nested update, removal
    assert run.exit_code == 0


def test_large_config_is_reassembled_from_chunks(runs: dict) -> None:
    run = runs["rank-1"]
    assert run.path.joinpath(f"run-{run.run_id}.wandb").stat().st_size > 3 * BLOCK
    assert run.config == {"blob": BIG, "n": 1}
    assert [row["val/acc"] for row in run.history] == [0.5]
    assert run.exit_code == 3


def test_read_run_accepts_the_wandb_file_and_iter_records_yields_records(runs: dict) -> None:
    run = runs["rank-0"]
    wandb_file = run.path / f"run-{run.run_id}.wandb"
    assert read_run(wandb_file) == run == read_run(run.path)
    kinds = [r.WhichOneof("record_type") for r in iter_records(wandb_file)]
    assert kinds.count("history") == len(LOSSES) and kinds.count("run") == 1 and kinds[-1] == "exit"


def _copy(runs: dict, name: str, tmp_path: Path, edit) -> Path:
    src = runs[name].path / f"run-{runs[name].run_id}.wandb"
    dst = tmp_path / "offline-run-x-broken" / src.name
    dst.parent.mkdir()
    dst.write_bytes(edit(bytearray(src.read_bytes())))
    return dst


def _flip(data: bytearray) -> bytearray:
    data[200] ^= 0xFF  # inside the first records' payload
    return data


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("rank-0", _flip, "checksum"),
        ("rank-0", lambda d: d[:-10], "truncated chunk"),
        ("rank-1", lambda d: d[: 2 * BLOCK], "inside a multi-chunk record"),
        ("rank-0", lambda d: b"not a wandb file" + d, "not a W&B offline file"),
    ],
    ids=["bit-flip", "truncated-chunk", "truncated-mid-record", "bad-header"],
)
def test_damaged_file_raises_value_error_naming_file_and_offset(runs, tmp_path, name, edit, message) -> None:
    broken = _copy(runs, name, tmp_path, edit)
    with pytest.raises(ValueError, match=message) as info:
        read_run(broken.parent)
    assert str(broken) in str(info.value) and "byte offset" in str(info.value)


def test_tail_ok_keeps_what_was_flushed(runs, tmp_path) -> None:
    # What a killed or still-running writer leaves: complete records, then a record cut short.
    cut = _copy(runs, "rank-0", tmp_path, lambda d: d[:-10])
    run = read_run(cut, tail_ok=True)
    assert [row["train/loss"] for row in run.history] == LOSSES
    assert run.exit_code is None  # the exit record was the one cut off


def test_cli_prints_runs_as_aligned_key_value_lines(root: Path) -> None:
    out = subprocess.run(  # --keys '*': every key of every run (the default is a line per run)
        [sys.executable, "-m", "trainer.tools.wandb_offline", str(root), "--keys", "*"],
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.index("rank-0"), out.stdout.index("rank-1")
    assert first < second
    rank0 = out.stdout[first:second]
    assert "group=g" in rank0 and "history_rows=5" in rank0
    assert re.search(rf"^    train/loss  {LOSSES[-1]:.6g}$", rank0, re.M), rank0
    # Nested summary values are dotted keys, one a line; best is padded to the longest (train/loss.last).
    assert re.search(r"^    best {13}0.2$", rank0, re.M) and re.search(r"^    nest.b {11}2$", rank0, re.M), rank0
    assert "_step" not in rank0 and "_runtime" not in rank0 and "metric definitions" not in rank0
    # A 52-record list is its length and fields, not one line of thousands of characters; no `_` keys.
    assert re.search(r"^    layout.tensors +\[52 items, each \{bytes, name\}\]$", rank0, re.M), rank0
    assert "_inner" not in rank0 and max(len(line) for line in rank0.splitlines()[1:]) < 150, rank0


def test_cli_full_prints_long_values_whole(root: Path, capsys) -> None:
    assert wandb_offline.main([str(root), "--full"]) == 0
    text = capsys.readouterr().out
    (line,) = [line for line in text.splitlines() if line.strip().startswith("layout.tensors")]
    assert json.loads(line.split(None, 1)[1]) == [{"bytes": i, "name": f"t{i}"} for i in range(52)]


def test_cli_all_shows_internal_keys_and_a_sweep_dir_lists_each_job(root: Path, tmp_path: Path, capsys) -> None:
    for job in ("0", "1"):  # a sweep dir: numbered job dirs, each a run dir
        shutil.copytree(root / "wandb", tmp_path / job / "wandb")
    assert wandb_offline.main([str(tmp_path), "--all"]) == 0
    text = capsys.readouterr().out
    assert text.index(f"== job {tmp_path / '0'}") < text.index(f"== job {tmp_path / '1'}")
    assert text.count("history_rows=5") == 2
    assert re.search(r"^    _step +4$", text, re.M) and "metric definitions:" in text


def test_cli_help_and_bad_paths(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        wandb_offline.main(["--help"])
    assert done.value.code == 0 and "usage: python -m trainer.tools.wandb_offline" in capsys.readouterr().out
    assert wandb_offline.main([str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    assert wandb_offline.main([str(tmp_path)]) == 1
    assert "no W&B offline runs" in capsys.readouterr().err


def test_cli_default_is_a_line_per_run_with_its_headline_values(root: Path, tmp_path: Path, capsys) -> None:
    assert wandb_offline.main([str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # train/loss is the one headline key these runs logged: rank-1 logged only val/acc (W&B's _step 0).
    assert [line.split() for line in lines[:3]] == [
        ["run", "rank", "step", "rows", "exit", "train/loss"],
        ["rank-0", "0", "4", "5", "0", f"{LOSSES[-1]:.4g}"],
        ["rank-1", "1", "0", "1", "3"],
    ]
    assert len(lines) == 4 and lines[3].startswith("2 run(s). More: ")
    assert "--keys '*'" in lines[3] and "--all" in lines[3] and "--ranks 0" in lines[3]
    # A sweep dir: its jobs' runs in one table, the job first.
    for job in ("0", "1"):
        shutil.copytree(root / "wandb", tmp_path / job / "wandb")
    assert wandb_offline.main([str(tmp_path), "--ranks", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[:3] == [
        ["job", "run", "rank", "step", "rows", "exit"],
        ["0", "rank-1", "1", "0", "1", "3"],
        ["1", "rank-1", "1", "0", "1", "3"],
    ]
    assert " ".join(rows[3]).startswith("2 run(s).")


def test_cli_keys_are_globs_or_prefixes_and_ranks_pick_runs(root: Path, capsys) -> None:
    assert wandb_offline.main([str(root), "--keys", "train/*, nest", "--ranks", "0"]) == 0
    text = capsys.readouterr().out
    assert "rank-0" in text and "rank-1" not in text
    keys = [line.split()[0] for line in text.splitlines() if line.startswith("    ")]
    # The glob matches the logged key and the summary's nested train/loss.{last,min}; the prefix nest.a, nest.b.
    assert keys == ["train/loss", "nest.a", "nest.b", "train/loss.last", "train/loss.min"], text
    assert wandb_offline.main([str(root), "--keys", "val", "--ranks", "0,1"]) == 0
    text = capsys.readouterr().out
    rank0, rank1 = text[: text.index("rank-1")], text[text.index("rank-1") :]
    assert "no key matches --keys val" in rank0 and re.search(r"^    val/acc  0.5$", rank1, re.M), text
    assert wandb_offline.main([str(root), "--ranks", "7"]) == 1
    assert "no run of rank [7] under" in (err := capsys.readouterr().err) and "its ranks are [0, 1]" in err, err


def test_cli_refuses_a_rank_list_that_is_not_one(root: Path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        wandb_offline.main([str(root), "--ranks", "zero"])
    assert done.value.code == 2 and "'zero' is not a rank list: e.g. 0 or 0,1" in capsys.readouterr().err
