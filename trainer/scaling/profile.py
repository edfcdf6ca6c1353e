"""What a finished run measured, as the scaling model needs it: compute per phase and the gradients.

Compute comes from the ranks' median phase times in summary.json (`time/data_s`, `time/forward_s`,
`time/backward_s`, `time/optimizer_s`, averaged over ranks); the sync phase is left out, as it is
the strategy's communication. The gradients are summary.json's `model.parameter_tensors`, in
registration order (backward produces them roughly in reverse).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError

PHASES = ("data", "forward", "backward", "optimizer")


@dataclass(frozen=True)
class Tensor:
    name: str
    nbytes: int
    block: str | None = None  # the nn.ModuleList element holding it (sync.wrap=block's unit), if any

    @property
    def module(self) -> str:
        """The module that owns the parameter: FSDP's unit of sharding."""
        return self.name.rpartition(".")[0]


@dataclass(frozen=True)
class RunProfile:
    run_dir: Path
    world_size: int
    device: str
    strategy: str
    batch_per_rank: int
    phase_s: dict[str, float]  # PHASES -> seconds per step
    tensors: tuple[Tensor, ...]  # registration order

    @property
    def compute_s(self) -> float:
        return sum(self.phase_s.values())

    @property
    def gradient_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def with_compute(self, seconds: float) -> RunProfile:
        """The same model on a device whose step takes `seconds`, each phase keeping its share."""
        if seconds <= 0:
            raise ConfigError(f"--compute-ms={seconds * 1e3:g} is invalid: it must be > 0 (ms of compute per step)")
        phases = {k: v * seconds / self.compute_s for k, v in self.phase_s.items()}
        return RunProfile(**{**self.__dict__, "phase_s": phases})

    def caveat(self) -> str | None:
        """Why this run's compute may not be pure compute, or None."""
        if self.strategy == "none" and self.world_size == 1:
            return None
        return (
            f"the compute comes from a sync={self.strategy} run on {self.world_size} rank(s), so it includes that "
            "strategy's own work and waits; a 1-rank sync=none run measures compute alone"
        )


def _mean(ranks: list[dict[str, Any]], key: str, path: Path) -> float:
    values = [r[key] for r in ranks if r.get(key) is not None]
    if not values:
        raise ConfigError(f"{path}: no rank has {key!r}; the run logged no training rows (trainer.log_every_n_steps)")
    return sum(values) / len(values)


def read_profile(run_dir: Path) -> RunProfile:
    """The profile of a finished run; a ConfigError that says what is missing otherwise."""
    if not run_dir.exists():
        raise ConfigError(f"--run {run_dir} does not exist; pass a finished run's directory")
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"--run {run_dir}: no summary.json ({err.strerror}); pass a finished run") from err
    except ValueError as err:
        raise ConfigError(f"{path} is not JSON ({err})") from err
    layout = summary.get("model", {}).get("parameter_tensors")
    if not layout:
        raise ConfigError(
            f"{path} has no model.parameter_tensors: it was written before ddplab recorded the gradients' "
            "layout (or the model has no trainable parameters); run the job again"
        )
    ranks = summary["ranks"]
    return RunProfile(
        run_dir=run_dir,
        world_size=int(summary["world_size"]),
        device=str(summary["device"]),
        strategy=str(summary["sync"].get("strategy", "?")),
        batch_per_rank=int(summary["global_batch_size"]) // int(summary["world_size"]),
        phase_s={p: _mean(ranks, f"median_time/{p}_s", path) for p in PHASES},
        tensors=tuple(Tensor(t["name"], int(t["bytes"]), t.get("block")) for t in layout),
    )


def measured_step_s(run_dir: Path) -> float:
    """A finished run's step time: the mean over ranks of each rank's median `time/step_s`."""
    path = run_dir / "summary.json"
    return _mean(json.loads(path.read_text())["ranks"], "median_time/step_s", path)
