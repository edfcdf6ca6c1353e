"""A checkpoint written before a config key existed resumes with that key's default; a changed key is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.dist_helpers import run_on_ranks
from tests.test_reliability import fit
from trainer.reliability.checkpoint import config_differences, fingerprint, load_checkpoint, option_defaults
from trainer.setup.config import CONF_DIR


def _forget_key(checkpoint: Path, group: str, key: str) -> None:
    """Make the file look as if written before `group.key` existed (the config then had no such key)."""
    saved = load_checkpoint(checkpoint)
    del saved["config"][group][key]
    saved["fingerprint"] = fingerprint(saved["config"])
    torch.save(saved, checkpoint)  # last.pt is a hard link: its step file changes with it


def older_checkpoint_then_resume(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    first = fit(rank, world_size, ["trainer.max_steps=2"], run_dir)
    _forget_key(Path(run_dir) / "checkpoints" / "last.pt", "data", "drop_last")
    changed = fit(rank, world_size, ["trainer.max_steps=2", "data.drop_last=false"], run_dir)
    resumed = fit(rank, world_size, ["trainer.max_steps=2"], run_dir)
    return {"first": first, "changed": changed, "resumed": resumed}


def test_a_key_added_after_the_checkpoint_resumes_at_its_default_and_refuses_another_value(tmp_path: Path) -> None:
    (result,) = run_on_ranks(older_checkpoint_then_resume, 1, tmp_path / "ranks", str(tmp_path / "run"))
    assert result["first"]["step"] == 2
    error = result["changed"]["error"]
    assert "data.drop_last: not in the checkpoint (added later, default True), now False" in error, error
    assert "error" not in result["resumed"] and result["resumed"]["step"] == 2  # resumed at 2: nothing left to do


def test_the_default_comes_from_the_option_the_run_uses() -> None:
    current = {"data": {"_target_": "data.synthetic.SyntheticData", "drop_last": True, "batch_size": 64}}
    default_of = option_defaults(CONF_DIR, current)
    assert default_of("data.drop_last") is True and default_of("data.batch_size") == 64
    saved = {"data": {"_target_": "data.synthetic.SyntheticData", "batch_size": 64}}
    assert config_differences(saved, current, default_of) == []
    assert config_differences(saved, current) == ["data.drop_last: checkpoint None, now True"]  # no defaults known
    assert config_differences({**saved, "data": {**saved["data"], "batch_size": 32}}, current, default_of) == [
        "data.batch_size: checkpoint 32, now 64"
    ]
    unknown = {"data": {**current["data"], "brand_new": 1}}  # no option file sets it: it always differs
    assert config_differences(saved | {"data": {**saved["data"], "drop_last": True}}, unknown, default_of) == [
        "data.brand_new: not in the checkpoint (added later, default no default), now 1"
    ]
