"""The W&B logger stays offline: no network use at all, even with WANDB_MODE unset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.compose import REPO

# Runs in a fresh interpreter: an audit hook records every non-loopback network lookup or
# connection, including the ones wandb makes from background threads and at exit.
PROBE = """
import atexit, os, sys
hits = []
def hook(event, args):
    if event in ("socket.getaddrinfo", "socket.connect") and not isinstance(args[1], str):
        if not any(local in str(args[1]) for local in ("127.0.0.1", "localhost", "::1")):
            hits.append((event, str(args[1])[:80]))
sys.addaudithook(hook)
atexit.register(lambda: print("NETWORK", hits))  # registered first, so it runs last
from trainer.logger.wandb import WandbLogger
logger = WandbLogger("offline", "p", None, dir=sys.argv[1], name="rank-0", group="g", run_config={"a": 1})
logger.log({"step": 1, "train/loss": 1.0})
logger.close()
logger.close()  # closing twice is harmless
"""


def test_offline_logger_never_touches_the_network(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "NETWORK []" in out.stdout, out.stdout
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
