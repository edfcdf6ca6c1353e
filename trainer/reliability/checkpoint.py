"""Checkpoints: written atomically by rank 0, loadable without running code, found again on resume.

Layout in <run dir>/checkpoints/: step-<n>.pt for the last `keep` checkpoints, and last.pt, a hard
link to the newest. Every file is written to a temporary name, fsynced, then renamed, so a crash
leaves the previous files intact. Loading uses torch.load(weights_only=True): tensors and plain
containers only, so a file holding a pickled callable is refused instead of executed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from trainer.errors import ConfigError

log = logging.getLogger(__name__)

FORMAT = 1
_STEP_FILE = re.compile(r"step-(\d+)\.pt$")
# Keys that change what is logged or how the job is run, not the numbers training produces: a
# checkpoint may be resumed with different values of these.
NOT_TRAINING = (
    "logger",
    "run_name",
    "trainer.log_every_n_steps",
    "trainer.eval_every_n_steps",
    "trainer.eval_max_samples",  # what evaluation reads, not what is trained
    "model.activation_checkpointing",  # the same gradients, recomputed
    "trainer.progress_bar",
    "trainer.end_sample_tokens",  # what is printed after training
    "trainer.profile",
    "trainer.collective_timeout_s",
    "trainer.step_grace_s",
    "trainer.fault",
    "trainer.resume",
    "trainer.checkpoint",
    "trainer.checkpoint_every_n_steps",
    "trainer.keep_checkpoints",
    "trainer.checkpoint_format",  # how the state is written, not what it is: either format resumes the other
    "trainer.checkpoint_async",
    "trainer.checkpoint_on_sigterm",
    "trainer.check_replicas_every_n_steps",
    "trainer.device",
    "data.num_workers",
    "sync.time_buckets",
    "network",  # an emulated link delays collectives; it changes no value they carry
    "trainer.sample_every_n_steps",  # what the observer watches, not what the step computes
    "trainer.sample_budget",
    "trainer.sample_max_gap_steps",
    "trainer.time_comm_every_n_steps",  # its name in checkpoints written before it was renamed
)


class CheckpointError(ConfigError):
    """A checkpoint file that cannot be used: named, with the reason."""


def _strip(config: dict[str, Any], dotted: str) -> None:
    head, _, rest = dotted.partition(".")
    if head in config:
        if rest and isinstance(config[head], dict):
            _strip(config[head], rest)
        elif not rest:
            del config[head]


def training_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of the resolved config that determines the training trajectory."""
    kept = json.loads(json.dumps(config))  # a deep copy of plain data
    for key in NOT_TRAINING:
        _strip(kept, key)
    return kept


def fingerprint(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(training_config(config), sort_keys=True).encode()).hexdigest()[:16]


def config_differences(
    saved: dict[str, Any],
    current: dict[str, Any],
    default_of: Callable[[str], Any] | None = None,
    ignore: Sequence[str] = (),
) -> list[str]:
    """Dotted keys whose training-relevant values differ, with both values (`ignore`: keys checked elsewhere).

    A key the checkpoint does not have was added to the lab after it was written: the run it
    continues used that key's default behaviour, so the key differs only if its value now is not
    its default (`default_of(key)`; without it such a key always differs).
    """
    then, now = training_config(saved), training_config(current)
    for key in ignore:
        _strip(then, key)
        _strip(now, key)
    return _differences(then, now, "", default_of)


def _differences(
    saved: dict[str, Any], current: dict[str, Any], prefix: str, default_of: Callable[[str], Any] | None
) -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b, name = saved.get(key), current.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{name}.", default_of)
        elif key not in saved and default_of is not None:
            default = default_of(name)
            if b != default:
                diffs.append(f"{name}: not in the checkpoint (added later, default {default!r}), now {b!r}")
        elif a != b:
            diffs.append(f"{name}: checkpoint {a!r}, now {b!r}")
    return diffs


def option_defaults(conf_dir: Path, current: dict[str, Any]) -> Callable[[str], Any]:
    """`default_of` for config_differences: a key's value in the YAML of the option this run uses
    (the group's option whose `_target_` is this run's), read without Hydra."""

    def default_of(dotted: str) -> Any:
        group, _, rest = dotted.partition(".")
        target = (current.get(group) or {}).get("_target_") if isinstance(current.get(group), dict) else None
        for path in sorted((conf_dir / group).glob("*.yaml")) if target else []:
            option = yaml.safe_load(path.read_text()) or {}
            if option.get("_target_") != target:
                continue
            value: Any = option
            for part in rest.split("."):
                value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
            return value
        return _ABSENT

    return default_of


class _Absent:
    def __repr__(self) -> str:
        return "no default"


_ABSENT = _Absent()  # a key no option file sets: it differs from any value


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random generators, as plain data (numpy's state split into tensors/ints)."""
    legacy: tuple[str, np.ndarray, int, int, float] = np.random.get_state(legacy=True)  # type: ignore[assignment]
    kind, keys, pos, has_gauss, gauss = legacy
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _write_atomically(path: Path, state: dict[str, Any], before_rename: Callable[[], None] | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if before_rename is not None:
        before_rename()  # trainer.fault.kind=kill_in_save: the file written, not yet in place
    os.replace(tmp, path)


def _link_atomically(target: Path, link: Path) -> None:
    """Point `link` at `target`'s data without copying it (a copy where hard links are not allowed)."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(target, tmp)
    except OSError:
        tmp.write_bytes(target.read_bytes())
    os.replace(tmp, link)


def step_files(directory: Path) -> list[Path]:
    """step-<n>.pt files, newest first."""
    found = [(int(m.group(1)), p) for p in directory.glob("step-*.pt") if (m := _STEP_FILE.search(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def save_checkpoint(
    directory: Path, state: dict[str, Any], keep: int, before_publish: Callable[[], None] | None = None
) -> Path:
    """Rank 0 only: step-<n>.pt, then last.pt pointing at it, then prune to the newest `keep`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{state['step']}.pt"
    _write_atomically(path, {"format": FORMAT, **state}, before_publish)
    _link_atomically(path, directory / "last.pt")
    for old in step_files(directory)[max(keep, 1) :]:
        old.unlink(missing_ok=True)
    # Make the renames themselves durable before anyone relies on them.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    """weights_only=True; a damaged or unsafe file raises CheckpointError naming it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing checkpoint {path}: it holds objects that are not plain data "
            f"(weights_only=True would have to run code to load it): {err}"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {err}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not a ddplab checkpoint (format {FORMAT})")
    return state


def find_resume_state(run_dir: Path, resume: str) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from, by trainer.resume: never, auto (newest good one), or a path.

    `auto` tries last.pt, then step files newest first, skipping (and naming) any it cannot load.
    A path that cannot be loaded is an error: the user asked for exactly that file.
    """
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_file():
            raise CheckpointError(
                f"trainer.resume={resume!r}: no such file (accepted: auto, never, or a checkpoint path)"
            )
        return path, load_checkpoint(path)
    directory = run_dir / "checkpoints"
    candidates = [directory / "last.pt", *step_files(directory)] if directory.is_dir() else []
    for path in candidates:
        if not path.is_file():
            continue
        try:
            return path, load_checkpoint(path)
        except CheckpointError as err:
            log.warning("%s; trying an older checkpoint", err)
    return None
