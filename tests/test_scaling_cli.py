"""python -m trainer.scaling on a real run: the command, its JSON rows and plot, a fitted network,
and its refusals. One train.py run (1 rank, sync=ddp with small buckets) serves every test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed

from tests.cli import CPU, output, python_train_forked
from tests.compose import REPO
from trainer.comm_schedule import Buckets
from trainer.links import KINDS, Link, ring_s
from trainer.scaling.__main__ import main
from trainer.scaling.options import schedules
from trainer.scaling.predict import buckets
from trainer.scaling.profile import measured_step_s, read_profile
from trainer.tools.collective_ops import bandwidths
from trainer.tools.collectives import write_results

pytestmark = pytest.mark.slow
WIDE = "model.hidden_sizes=[512,512,512]"  # two 1 MiB weight matrices: 3 DDP buckets at 0.25 MiB
STRATEGIES = list(schedules()[0])  # the options of conf/sync/ that say what their step sends, in the table's order


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scaling")
    args = [CPU, "logger=none", WIDE, "sync=ddp", "sync.bucket_cap_mb=0.25", "trainer.max_steps=20"]
    args += ["trainer.log_every_n_steps=5", "trainer.eval_every_n_steps=0", f"hydra.run.dir={root / 'run'}"]
    proc = python_train_forked(args, cwd=root)
    assert proc.returncode == 0, output(proc)
    return root / "run"


def scaling(args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trainer.scaling", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_summary_records_the_gradients_as_ddp_buckets_them(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    tensors = summary["model"]["parameter_tensors"]
    assert [t["name"] for t in tensors][:2] == ["net.1.weight", "net.1.bias"]
    # synthetic data: 32 features, 10 classes
    assert summary["model"]["parameter_bytes"] == (32 * 512 + 512 + 2 * (512 * 512 + 512) + 512 * 10 + 10) * 4
    assert sum(t["bytes"] for t in tensors) == summary["model"]["parameter_bytes"]
    # The model's buckets for DDP's rules are the ones DDP itself built (after its rebuild).
    grads = [t["bytes"] for t in reversed(tensors)]
    ddp = schedules()[0]["ddp"].sends  # as sync=ddp states them
    assert isinstance(ddp, Buckets) and ddp.first_cap_mb is not None
    predicted = buckets(grads, 0.25, ddp.first_cap_mb, ddp=ddp.rule == "ddp")
    assert len(predicted) == 3 and predicted == summary["sync"]["bucket_sizes_bytes"]
    assert ddp.first_cap_mb * 2**20 == torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def test_caps_that_tie_are_said_to_tie(run_dir: Path, tmp_path: Path) -> None:
    # The run's 2.2 MB of gradients fit in one bucket at 100 and at 200 MiB: the same layout.
    proc = scaling(
        ["--run", str(run_dir), "--ranks", "2", "--bucket-caps", "100,200", "--plot", str(tmp_path / "e.png")]
    )
    assert proc.returncode == 0, output(proc)
    assert "all caps give the same buckets (" in proc.stdout and "best sync.bucket_cap_mb" not in proc.stdout


def with_step_times(run_dir: Path, dest: Path, times_ms: list[float]) -> Path:
    """A copy of the run whose training rows are one per 10 steps, as the README's run logs them,
    with these step times."""
    shutil.copytree(run_dir, dest)
    template = next(
        r for r in map(json.loads, (dest / "metrics" / "rank0.jsonl").read_text().splitlines()) if "train/loss" in r
    )
    rows = [template | {"step": 10 * (i + 1), "time/step_s": t / 1e3} for i, t in enumerate(times_ms)]
    (dest / "metrics" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dest


@pytest.mark.parametrize(
    ("times_ms", "warned"),
    [
        # Unpinned threads fighting over the cores: 1.4 to 11 ms.
        ([1.4, 11.0, 2.0, 9.0, 5.0, 1.6, 1.4, 11.0, 2.0, 9.0], True),
        # The README's run (100 steps, 10 rows) on an idle core with two rows disturbed: the median is
        # the quiet step, though the rows' interquartile range is 37 % of it.
        ([1.08, 0.90, 0.92, 0.88, 0.86, 1.74, 1.60, 0.89, 0.96, 0.81], False),
        # The README's run while other jobs shared both cores: most rows waited for the CPU.
        ([4.71, 4.19, 3.29, 4.53, 4.27, 3.66, 4.95, 4.81, 3.11, 3.08], True),
    ],
)
def test_a_run_slowed_by_other_work_is_warned_about(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], times_ms: list[float], warned: bool
) -> None:
    run = with_step_times(run_dir, tmp_path / "run", times_ms)
    assert main(["--run", str(run), "--ranks", "2", "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert ("warning: the run's median step time" in out) == warned, out


def efficiencies(out: str) -> dict[tuple[str, int], float]:
    """The printed table's efficiency column, by (strategy, ranks)."""
    cells = [line.split() for line in out.splitlines()]
    return {(c[0], int(c[1])): float(c[-1]) for c in cells if len(c) == 8 and c[0] in STRATEGIES}


def test_an_efficiency_above_1_is_explained_on_screen(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--run", str(run_dir), "--ranks", "1,8", "--plot", str(tmp_path / "p.png")]
    # A network that costs next to nothing: a sharded strategy's step loses 7/8 of the optimizer's
    # step and gains no communication worth printing, so it beats the 1-rank compute.
    assert main([*args, "--network", "0.001,1000000"]) == 0
    out = capsys.readouterr().out
    above = [s for s in STRATEGIES if any(e > 1 for (name, _), e in efficiencies(out).items() if name == s)]
    assert "zero" in above and not {"none", "manual", "bucketed", "ddp"} & set(above)
    assert f"efficiency > 1 ({', '.join(above)}): each rank's optimizer steps 1/N of the parameters" in out
    # A 1 MB/s link: communication outweighs that saving, every efficiency is at most 1, nothing to explain.
    assert main([*args, "--network", "50,0.001"]) == 0
    out = capsys.readouterr().out
    table = efficiencies(out)
    assert len(table) == 2 * len(STRATEGIES) and max(table.values()) == 1.0
    assert "efficiency >" not in out


def test_command_prints_writes_and_plots(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "pred.json"
    args = ["--run", str(run_dir), "--ranks", "1,2,16", "--network", "100gbe", "--intra-network", "nvlink"]
    proc = scaling([*args, "--gpus-per-node", "8", "--json", str(out), "--plot", str(tmp_path / "eff.png")])
    text = output(proc)
    assert proc.returncode == 0, text
    assert "note: the compute comes from a sync=ddp run on 1 rank(s)" in text
    assert "100gbe (alpha 15 us, beta 10 GB/s) between nodes, nvlink (alpha 2 us, beta 360 GB/s) inside" in text
    assert "; 8 ranks per node (--gpus-per-node);" in text
    assert "best sync.bucket_cap_mb for sync=ddp: N=1:" in text and "N=16:" in text
    assert (tmp_path / "eff.png").read_bytes()[:4] == b"\x89PNG"
    rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    assert [(r["strategy"], r["ranks"]) for r in rows] == [(s, n) for s in STRATEGIES for n in (1, 2, 16)]
    assert {r["nodes"] for r in rows if r["ranks"] == 16} == {2}
    compute = read_profile(run_dir).compute_s
    (rank,) = json.loads((run_dir / "summary.json").read_text())["ranks"]
    phases = ("data", "forward", "backward", "optimizer")  # the sync phase is the strategy's, not compute
    assert compute == pytest.approx(sum(rank[f"median_time/{p}_s"] for p in phases))
    assert measured_step_s(run_dir) == rank["median_time/step_s"]
    by = {(r["strategy"], r["ranks"]): r for r in rows}
    for strategy in STRATEGIES:
        assert by[strategy, 1]["step_s"] == pytest.approx(compute)  # one rank: nothing to send
        assert by[strategy, 16]["samples_per_s"] == pytest.approx(16 * 64 / by[strategy, 16]["step_s"])
    assert by["none", 16]["efficiency"] == 1.0
    # More ranks, more communication, for every strategy that sends anything; efficiency falls
    # where every rank still does all the work (zero and fsdp step the optimizer on 1/N of it).
    for strategy in ("manual", "bucketed", "ddp", "zero", "fsdp"):
        assert 0 == by[strategy, 1]["comm_s"] < by[strategy, 2]["comm_s"] < by[strategy, 16]["comm_s"]
    for strategy in ("manual", "bucketed", "ddp"):
        assert by[strategy, 1]["efficiency"] > by[strategy, 2]["efficiency"] > by[strategy, 16]["efficiency"]


def test_network_fitted_to_a_collectives_json(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = Link(alpha_s=50e-6, beta_Bps=2e9)
    records = []
    for kind in KINDS:
        for size in (2**k for k in range(12, 26)):
            seconds = ring_s(kind, size, 2, truth)
            algbw, busbw = bandwidths(kind, size, seconds, 2)
            gbps = {"algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9}
            records.append({"op": kind, "size_bytes": size, "seconds": seconds, **gbps})
    write_results(tmp_path, records, {"world_size": 2, "backend": "gloo", "device": "cpu", "dtype": "float32"})
    out = tmp_path / "fit.json"
    args = ["--run", str(run_dir), "--collectives", str(tmp_path / "collectives.json"), "--ranks", "2"]
    assert main([*args, "--strategies", "manual", "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # manual at 2 ranks: the compute, then one all_reduce of every gradient (one 25 MiB buffer).
    profile = read_profile(run_dir)
    expected = profile.compute_s + ring_s("all_reduce", profile.gradient_bytes, 2, truth)
    assert row["step_s"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--network", "infiniband"],
            "network 'infiniband' is neither a preset (loopback, nvlink, ib-ndr400, 100gbe, 10gbe, 1gbe)",
        ),
        (["--ranks", "12", "--gpus-per-node", "8"], "12 ranks do not fill nodes of 8"),
        (["--ranks", "2,x"], "--ranks='2,x' is invalid: a comma-separated list of integers > 0"),
        (["--strategies", "ddp,horovod"], "--strategies: unknown horovod; accepted: none, "),
        (["--compute-ms", "0"], "--compute-ms=0 is invalid: it must be > 0"),
    ],
)
def test_bad_input_is_refused_by_name(
    run_dir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--run", str(run_dir), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_run_without_summary_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--run", str(tmp_path)]) == 2
    assert f"--run {tmp_path}: no summary.json" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text(json.dumps({"ranks": [], "sync": {}}))
    assert main(["--run", str(tmp_path)]) == 2
    assert "has no model.parameter_tensors: it was written before" in capsys.readouterr().err
