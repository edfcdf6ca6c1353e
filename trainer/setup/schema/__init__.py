"""Typed schemas of every option of every config group, registered in Hydra's ConfigStore.

Each conf/<group>/<option>.yaml starts with `defaults: [/schema/<group>/<option>@_here_]`, so
Hydra composes the schema first and the YAML's values onto it: OmegaConf then rejects a value of
the wrong type (or a YAML key the schema lacks) at compose time, naming the full key. A key is
declared once, as a pydantic type (schema/declare.py); pydantic checks ranges and choices
(trainer/setup/validate.py) and the ConfigStore gets each schema's OmegaConf twin. Adding a key:
docs/configuration.md.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from trainer.setup.schema import data, models, network, optim, run, sync
from trainer.setup.schema.declare import for_omegaconf

# The ConfigStore dataclasses (OmegaConf.get_type of a composed node), made from the declared schemas.
SCHEMAS: dict[str, dict[str, type]] = {
    group: {option: for_omegaconf(declared) for option, declared in options.items()}
    for group, options in (
        ("model", models.OPTIONS),
        ("data", data.OPTIONS),
        ("sync", sync.OPTIONS),
        ("optim", optim.OPTIONS),
        ("schedule", run.SCHEDULES),
        ("trainer", run.TRAINERS),
        ("logger", run.LOGGERS),
        ("network", network.OPTIONS),
    )
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
        ("network", "network"),
    )
}


def register() -> None:
    """Store every schema as schema/<group>/<option> (idempotent: the store is replaced, not added to)."""
    store = ConfigStore.instance()
    for group, options in SCHEMAS.items():
        for option, schema in options.items():
            store.store(group=f"schema/{group}", name=option, node=schema)


register()
