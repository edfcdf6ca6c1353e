"""Building an object from its config node: Hydra's instantiate, with a constructor's refusal kept
as one line, and the two nodes whose keys are the builder's (optim.weight_decay_on, model.sync_batchnorm).

Its own module so that a tool that builds only the strategies (`python -m trainer.scaling`,
`python -m trainer.tools.memory`) does not import the trainer's loop with trainer/setup/build.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from trainer.errors import ConfigError, check, from_leaves
from trainer.sync.base import DecayGroups

if TYPE_CHECKING:
    from trainer.sync.base import SyncStrategy

# The strategy the rank's command-line check built (trainer/setup/precheck.py), with the sync node's
# values and the world size it was checked for: build_parts takes it, so a rank builds it once.
_checked: tuple[Any, int, SyncStrategy] | None = None


def instantiate(node: DictConfig, **runtime: Any) -> Any:
    """hydra.utils.instantiate, with runtime objects bound after Hydra is done with the config.

    Runtime kwargs (shapes, a run's config dict) are passed to the constructor untouched rather
    than merged into the config, where Hydra would try to instantiate any `_target_` inside them.
    Hydra wraps constructor errors in InstantiationException; a constructor's ValueError (the
    leaves' way to reject a value, and ConfigError's base) is let through as a ConfigError, so a bad
    value reads as the constructor's own message, not a framework traceback.
    """
    try:
        with from_leaves():
            if not runtime:
                return hydra.utils.instantiate(node, _convert_="all")
            return hydra.utils.instantiate(node, _partial_=True, _convert_="all")(**runtime)
    except InstantiationException as err:
        if isinstance(err.__cause__, ValueError):
            raise (
                err.__cause__ if isinstance(err.__cause__, ConfigError) else ConfigError(str(err.__cause__))
            ) from None
        raise


def optimizer_factory(node: DictConfig) -> DecayGroups:
    """torch's optimizer, bound to the config's keywords, in the groups optim.weight_decay_on names.

    weight_decay_on is the builder's key, not the optimizer's: it is taken out before the rest is
    instantiated (a plain node without it, `~optim +optim._target_=...`, decays everything).
    """
    keywords = OmegaConf.to_container(node, resolve=True)
    assert isinstance(keywords, dict)
    weight_decay_on = keywords.pop("weight_decay_on", "all")
    return DecayGroups(instantiate(OmegaConf.create(keywords)), weight_decay_on)


def split_sync_batchnorm(node: DictConfig) -> tuple[DictConfig, bool]:
    """The model's node without model.sync_batchnorm, and its value.

    The key is the builder's, not the model's: the leaves know nothing of process groups, so a
    model is built with plain BatchNorm and converted here. Any model takes it, even one whose
    YAML lacks it (+model.sync_batchnorm=true on the mlp reaches has_batchnorm's error, not a
    TypeError from the constructor).
    """
    if "sync_batchnorm" not in node:
        return node, False
    value = node.sync_batchnorm
    check(isinstance(value, bool), "model.sync_batchnorm", value, "accepted: true, false")
    # A copy of a sub-node no longer sees the root, so interpolations are resolved first.
    plain = OmegaConf.to_container(node, resolve=True)
    assert isinstance(plain, dict)
    del plain["sync_batchnorm"]
    return OmegaConf.create(plain), value


def keep_checked_strategy(node: DictConfig, world_size: int, sync: SyncStrategy) -> None:
    """The command-line check built `sync` from `node` and checked its layout for `world_size`."""
    global _checked
    _checked = (OmegaConf.to_container(node, resolve=True), world_size, sync)


def checked_strategy(node: DictConfig, world_size: int) -> SyncStrategy:
    """The strategy for this sync node with its layout checked for `world_size`: the one the
    command-line check built where it was built from the same values for the same world size
    (taken once: a second build, a test's or a tool's, gets a new one), else built and checked now."""
    global _checked
    kept, _checked = _checked, None
    if kept is not None and kept[1] == world_size and kept[0] == OmegaConf.to_container(node, resolve=True):
        return kept[2]
    sync: SyncStrategy = instantiate(node)
    sync.check_world_size(world_size)
    return sync
