"""The one exception type for bad user input.

train.py turns a ConfigError into a short message and exit code 2 on every rank, instead of a
traceback: the message itself must name the offending key, its value and what is accepted.

The leaves (models/, data/) know nothing of training and raise plain ValueErrors with such
messages; where the trainer calls into them, from_leaves() makes those ConfigErrors.
"""

from collections.abc import Iterator
from contextlib import contextmanager


class ConfigError(ValueError):
    """A configuration value (or a file it points at) that cannot be used."""


def check(ok: bool, key: str, value: object, accepted: str) -> None:
    """Raise a ConfigError that names the key, the value and what would have been accepted."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {accepted}")


@contextmanager
def from_leaves() -> Iterator[None]:
    """Calls into models/ or data/ (constructors, file checks): their ValueErrors are bad input."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err
