"""Checkpoints against real deaths (slow): a save SIGKILLed half-way, and a node lost under torchrun's
elastic rendezvous (`--nnodes=1:2`), each resumed by the same command and ending where one
uninterrupted process ends (to 1e-5: the 2-rank steps add their reductions in another order).

Every run trains the same thing: BASE's MLP, sync=zero, a global batch of 64 (trainer.global_batch_size,
so data.batch_size follows the world size), 12 steps with a sharded checkpoint every 4.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.cli import CPU, TRAIN, env, output, torchrun
from tests.test_reliability import BASE
from trainer.reliability import sharded

pytestmark = pytest.mark.slow

RUN = [
    *BASE,
    CPU,
    "sync=zero",
    "trainer.global_batch_size=64",
    "trainer.max_steps=12",
    "trainer.checkpoint_every_n_steps=4",
    "trainer.checkpoint_format=sharded",
    "trainer.collective_timeout_s=30",  # a lost peer that gloo does not notice still ends the step
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """One process, no interruption: the model at step 12."""
    root = tmp_path_factory.mktemp("straight")
    proc = torchrun([*RUN, f"hydra.run.dir={root}"], cwd=root, nproc=1)
    assert proc.returncode == 0, output(proc)
    return final_model(root)


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    last = run_dir / "checkpoints" / sharded.LAST
    assert os.readlink(last) == "step-12", os.readlink(last)
    return sharded.load_model(last.resolve())


def farthest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_and_the_same_command_resumes(
    straight: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    # Rank 0 SIGKILLs itself in step 8's save: both ranks' parts written, meta.pt and the rename not.
    kill = ["trainer.fault.rank=0", "trainer.fault.at_step=8", "trainer.fault.kind=kill_in_save"]
    run = [*RUN, f"hydra.run.dir={tmp_path}"]
    killed = torchrun([*run, *kill], cwd=tmp_path)
    assert killed.returncode != 0 and "kill_in_save on rank 0 at step 8" in output(killed), output(killed)
    ckpt = tmp_path / "checkpoints"
    half = ckpt / ".step-8.partial"
    assert sorted(p.name for p in half.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # the parts
    assert not (half / sharded.META).exists() and not (ckpt / "step-8").exists()
    assert os.readlink(ckpt / sharded.LAST) == "step-4"

    resumed = torchrun(run, cwd=tmp_path)  # the same command, without the fault
    text = output(resumed)
    assert resumed.returncode == 0, text
    assert "resumed from" in text and "at step 4" in text, text
    assert not list(ckpt.glob(".*partial")), list(ckpt.iterdir())  # step 8's save redone, the half one gone
    assert farthest(final_model(tmp_path), straight) <= 1e-5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node(endpoint: str, is_host: bool, args: list[str], cwd: Path) -> subprocess.Popen[str]:
    """One torchrun agent of an elastic job of 1 to 2 nodes, one rank each, that may restart once.

    The first node hosts the rendezvous store (is_host), so losing the other keeps it. last_call: how
    long a round with fewer than 2 nodes waits for more, so the first round gets both. keep_alive: a
    heartbeat every second, 5 missed ones and a node is dead (torch's default: 3 missed, 5 s apart),
    so the restart's round starts 5 s after the node is lost, not 15."""
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nnodes=1:2",
        "--nproc_per_node=1",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=shrink",
        f"--rdzv-conf=is_host={str(is_host).lower()},last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5",
        TRAIN,
        *args,
    ]
    return subprocess.Popen(
        cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def lose(agent: subprocess.Popen[str]) -> None:
    """The node is gone: its agent and its worker SIGKILLed together (no handler runs)."""
    for proc in [*psutil.Process(agent.pid).children(recursive=True), psutil.Process(agent.pid)]:
        proc.send_signal(signal.SIGKILL)
    agent.wait(timeout=30)


def test_an_elastic_job_that_loses_a_node_resumes_on_the_one_left(
    straight: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    # Rank 1 stops responding at step 6 (after step 4's checkpoint); then its node is lost.
    args = [
        *RUN,
        f"hydra.run.dir={tmp_path}",
        "trainer.fault.rank=1",
        "trainer.fault.at_step=6",
        "trainer.fault.kind=hang",
    ]
    endpoint = f"127.0.0.1:{free_port()}"
    first = node(endpoint, True, args, tmp_path)
    second = node(endpoint, False, args, tmp_path)
    try:
        deadline = time.monotonic() + 180
        last = tmp_path / "checkpoints" / sharded.LAST
        while not (last.is_symlink() and os.readlink(last) == "step-4"):
            assert time.monotonic() < deadline and first.poll() is None and second.poll() is None
            time.sleep(0.2)
        lose(second)
        text = first.communicate(timeout=240)[0]
    finally:
        for agent in (first, second):
            if agent.poll() is None:
                lose(agent)
    assert first.returncode == 0, text
    assert "resuming at world size 1 a checkpoint of 2 ranks" in text, text
    assert "resumed from" in text and "at step 4" in text, text
    assert farthest(final_model(tmp_path), straight) <= 1e-5
