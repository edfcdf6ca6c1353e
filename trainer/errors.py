"""The one exception type for bad user input.

train.py turns a ConfigError into a short message and exit code 2 on every rank, instead of a
traceback: the message itself must name the offending key, its value and what is accepted.
"""


class ConfigError(ValueError):
    """A configuration value (or a file it points at) that cannot be used."""


def check(ok: bool, key: str, value: object, accepted: str) -> None:
    """Raise a ConfigError that names the key, the value and what would have been accepted."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {accepted}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
