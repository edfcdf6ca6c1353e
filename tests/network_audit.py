"""Run Python code in a fresh interpreter, with WANDB_MODE unset, that records every non-loopback
network lookup or connection through an audit hook (wandb's background threads and exit included)
and prints them last as `NETWORK [...]`: "NETWORK []" in the output means none was made."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.compose import REPO

HOOK = """
import atexit, sys
hits = []
def hook(event, args):
    if event in ("socket.getaddrinfo", "socket.connect") and not isinstance(args[1], str):
        if not any(local in str(args[1]) for local in ("127.0.0.1", "localhost", "::1")):
            hits.append((event, str(args[1])[:80]))
sys.addaudithook(hook)
atexit.register(lambda: print("NETWORK", hits))  # registered first, so it runs last
"""


def run_audited(code: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-c", HOOK + code, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
