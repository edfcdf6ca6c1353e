"""The sync line a run prints and summary.json keeps: a strategy read back, never written by it.

What a strategy was built with is its constructor's parameters, so the line reads them from the
object rather than asking the strategy to repeat them; what it built is its `facts()`.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from trainer.sync.base import SyncStrategy


def describe(sync: SyncStrategy) -> dict[str, Any]:
    """The strategy's name, the keys it was built with (a key named after an option of another key,
    `auto_*` or `powersgd_*`, only while that option is chosen), the tuner's trials, the facts of
    what it built."""
    hints = typing.get_type_hints(type(sync).__init__)
    options = {key: _literals(hint) for key, hint in hints.items()}
    values = {k: getattr(sync, sync.key_attributes.get(k, k)) for k in hints if k != "return"}
    info: dict[str, Any] = {"strategy": sync.name}
    for key, value in values.items():
        prefix = key.split("_")[0]
        chooser = next((k for k, choices in options.items() if prefix in choices and k != key), None)
        if chooser is None or values[chooser] == prefix:
            info[key] = value
    if sync.tuner is not None:
        info |= sync.tuner.describe()
    return info | sync.facts()


def settled(sync: SyncStrategy) -> bool:
    """Whether describe()'s layout is final, which the run's `sync:` line waits for: bucket_cap_mb=auto
    is trying caps before that, and a DDP built with the chosen cap rebuilds its buckets after its
    first step (its fact `buckets_rebuilt`)."""
    return sync.tuner is None or (sync.tuner.done and bool(sync.facts().get("buckets_rebuilt", True)))


def _literals(hint: Any) -> set[Any]:
    """The values a type hint's Literal parts allow (float | Literal["auto"]: {"auto"})."""
    if typing.get_origin(hint) is Literal:
        return set(typing.get_args(hint))
    return set().union(*(_literals(arg) for arg in typing.get_args(hint)))
