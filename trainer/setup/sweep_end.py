"""The last line of a sweep: how many jobs ran, where their run dirs are, and the command that reports them.

A Hydra callback (conf/config.yaml's hydra.callbacks), so every route ends the same way: multirun
inside torchrun (each rank runs the sweep; global rank 0 prints), the torchrun launcher plugin and
submitit (the launching process prints). Without it a sweep ends on its last job's W&B lines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def sweep_line(sweep_dir: Path) -> str:
    """'sweep: 4 jobs in multirun/x; report: python -m trainer.tools.report multirun/x' (plus jobs left unfinished)."""
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    unfinished = [p.name for p in jobs if not (p / "summary.json").is_file()]
    missing = f" ({len(unfinished)} without a summary.json: {', '.join(unfinished)})" if unfinished else ""
    return f"sweep: {len(jobs)} jobs in {sweep_dir}{missing}; report: python -m trainer.tools.report {sweep_dir}"


class SweepEnd(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            print(sweep_line(sweep_dir), flush=True)
