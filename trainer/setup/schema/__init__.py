"""Typed schemas of every option of every config group, registered in Hydra's ConfigStore.

Each conf/<group>/<option>.yaml starts with `defaults: [/schema/<group>/<option>@_here_]`, so
Hydra composes the dataclass first and the YAML's values onto it: OmegaConf then rejects a value
of the wrong type (or a YAML key the schema lacks) at compose time, naming the full key. Ranges and
choices are checked by trainer/setup/validate.py. Adding a key: docs/configuration.md.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from trainer.setup.schema import data, models, optim, run, sync

SCHEMAS: dict[str, dict[str, type]] = {
    "model": models.OPTIONS,
    "data": data.OPTIONS,
    "sync": sync.OPTIONS,
    "optim": optim.OPTIONS,
    "schedule": run.SCHEDULES,
    "trainer": run.TRAINERS,
    "logger": run.LOGGERS,
}
# Where each group's schemas live, for the messages that ask for a missing one.
MODULES = {
    group: f"trainer/setup/schema/{m}.py"
    for group, m in (
        ("model", "models"),
        ("data", "data"),
        ("sync", "sync"),
        ("optim", "optim"),
        ("schedule", "run"),
        ("trainer", "run"),
        ("logger", "run"),
    )
}


def register() -> None:
    """Store every schema as schema/<group>/<option> (idempotent: the store is replaced, not added to)."""
    store = ConfigStore.instance()
    for group, options in SCHEMAS.items():
        for option, schema in options.items():
            store.store(group=f"schema/{group}", name=option, node=schema)


register()
