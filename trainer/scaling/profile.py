"""What a finished run measured, as the scaling model needs it: compute per phase and the gradients.

Compute comes from the ranks' median phase times in summary.json (`time/data_s`, `time/forward_s`,
`time/backward_s`, `time/optimizer_s`, averaged over ranks); the sync phase is left out, as it is
the strategy's communication. The gradients are summary.json's `model.parameter_tensors`, in
registration order (backward produces them roughly in reverse).

A run that communicated (a strategy on several ranks; on one rank nothing is sent, and the phases
are taken as they are) can wait for its collectives inside those
phases too: sync=ddp at the end of backward, zero's gathers in the next forward. What it waited for
beyond its sync phase (`time/comm_exposed_s` less `time/sync_s`) is taken out of the phases, in
proportion, so that what is left is the run's compute: its model's, plus the strategy's own work
(DDP's copies into and out of its buckets, a sharded step's bookkeeping) and whatever the real
collectives running meanwhile took from it. A sharded strategy's optimizer phase (one whose
schedule() shards the optimizer: zero, fsdp, hsdp) steps 1/N of the parameters, N the ranks that
split it (every rank; hsdp's shard dimension, as its sync facts name it); it is scaled back to the
whole model's step, which the model divides again.
"""

from __future__ import annotations

import json
from collections.abc import Container
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
            f"the compute comes from a sync={self.strategy} run on {self.world_size} rank(s): its waits for "
            "communication are taken out, but it includes that strategy's own work (predict that strategy from "
            "it); a 1-rank sync=none run measures the model's compute alone"
        )


def _mean(ranks: list[dict[str, Any]], key: str, path: Path) -> float:
    values = [r[key] for r in ranks if r.get(key) is not None]
    if not values:
        raise ConfigError(f"{path}: no rank has {key!r}; the run logged no training rows (trainer.log_every_n_steps)")
    return sum(values) / len(values)


def read_profile(run_dir: Path, sharded: Container[str] = ()) -> RunProfile:
    """The profile of a finished run; a ConfigError that says what is missing otherwise. `sharded`:
    the strategies whose optimizer steps a shard of the parameters (their schedule says so)."""
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
    world_size, strategy = int(summary["world_size"]), str(summary["sync"].get("strategy", "?"))
    shards = _shards(summary["sync"], world_size, strategy in sharded)
    return RunProfile(
        run_dir=run_dir,
        world_size=world_size,
        device=str(summary["device"]),
        strategy=strategy,
        batch_per_rank=int(summary["global_batch_size"]) // world_size,
        phase_s=_compute_phases(ranks, path, world_size, shards=shards),
        tensors=tuple(Tensor(t["name"], int(t["bytes"]), t.get("block")) for t in layout),
    )


def _shards(sync: dict[str, Any], world_size: int, sharded: bool) -> int:
    """The ranks that split the optimizer step: 1 unless sharded; the mesh's shard dimension where the
    run had one (hsdp's sync facts: a unit is split inside a node, each node steps the whole
    model), else every rank."""
    if not sharded:
        return 1
    mesh = sync.get("mesh_replicate_x_shard")
    return int(mesh[1]) if isinstance(mesh, list) and len(mesh) == 2 else world_size


def _compute_phases(ranks: list[dict[str, Any]], path: Path, world_size: int, *, shards: int) -> dict[str, float]:
    """The phases' compute: the waits for communication inside them taken out (module docstring)."""
    phases = {p: _mean(ranks, f"median_time/{p}_s", path) for p in PHASES}
    if world_size == 1:  # nothing was sent: what a strategy timed as waiting is its own work on one rank
        return phases
    waited = _mean_or_zero(ranks, "median_time/comm_exposed_s") - _mean_or_zero(ranks, "median_time/sync_s")
    total = sum(phases.values())
    if waited > 0 and total > 0:
        phases = {p: v * max(0.0, 1.0 - waited / total) for p, v in phases.items()}
    phases["optimizer"] *= shards  # a sharded optimizer stepped 1/shards of the model
    return phases


def _mean_or_zero(ranks: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in ranks if r.get(key) is not None]
    return sum(values) / len(values) if values else 0.0


def measured_step_s(run_dir: Path) -> float:
    """A finished run's step time: the mean over ranks of each rank's median `time/step_s`."""
    path = run_dir / "summary.json"
    return _mean(json.loads(path.read_text())["ranks"], "median_time/step_s", path)
