"""One typed config key: its type (checked by OmegaConf at compose time) and the range or choices a
type cannot say (checked by trainer/setup/validate.py before anything starts).

A schema is a dataclass of such keys; the YAML option gives the values. `key()` with no default
means the YAML must set it (a test checks that every field is in its YAML and every YAML key is a
field), so the defaults live in one place: the YAML, next to their comments.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from trainer.errors import check, is_int, is_number

SEED_BOUND = 2**32  # numpy's seed range; torch's is wider


@dataclass(frozen=True)
class Spec:
    """What a value must be beyond its type: bounds, choices, or (for `Any` fields) a number or a choice."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] = ()
    number: type | None = None  # for Any-typed keys that take a number or one of the choices (bucket_cap_mb: auto)
    length: int | None = None  # for lists: exactly this many items (betas)
    nonempty: bool = False  # for lists and strings
    note: str = ""  # what the key means, appended to the message

    @property
    def bounded(self) -> bool:
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt))


def key(
    default: Any = MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[Any, ...] = (),
    number: type | None = None,
    length: int | None = None,
    nonempty: bool = False,
    note: str = "",
) -> Any:
    """A dataclass field carrying its Spec (a list's bounds apply to each item)."""
    spec = Spec(ge, gt, le, lt, choices, number, length, nonempty, note)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: default.copy(), metadata={"spec": spec})
    return dataclasses.field(default=default, metadata={"spec": spec})


def spec_of(field: dataclasses.Field[Any]) -> Spec:
    spec = field.metadata.get("spec", Spec())
    assert isinstance(spec, Spec)
    return spec


def _kind(annotation: Any) -> str:
    """The type in words, as the message's "accepted" part."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{_kind(inner[0])}, or null"
    if origin is list:
        return f"a list of {_kind(args[0]).removeprefix('an ').removeprefix('a ')}s" if args else "a list"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(annotation, "any value")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _bounds(spec: Spec) -> str:
    parts = [
        f"{op} {_num(v)}"
        for op, v in ((">=", spec.ge), (">", spec.gt), ("<=", spec.le), ("<", spec.lt))
        if v is not None
    ]
    return " and ".join(parts)


def accepted(annotation: Any, spec: Spec) -> str:
    """What a key accepts, in words: "an integer >= 1", "all_reduce, rs_ag", "a number > 0, or auto"."""
    kind = _kind(annotation)
    nullable = kind.endswith(", or null")
    kind = kind.removesuffix(", or null")
    choices = ", ".join(str(c) for c in spec.choices)
    if spec.number is not None:
        text = f"{_kind(spec.number)} {_bounds(spec)}".strip()
        text = f"{text}, or {choices}" if choices else text
    elif spec.choices:
        text = choices
    else:
        text = f"{kind} {_bounds(spec)}".strip()
        if spec.length is not None:
            text = f"{text} ({spec.length} items)"
        elif spec.nonempty:
            text = f"{text} (not empty)"
    text += ", or null" if nullable else ""
    return f"accepted: {text}" + (f" ({spec.note})" if spec.note else "")


def _in_bounds(value: Any, spec: Spec) -> bool:
    return (
        is_number(value)
        and (spec.ge is None or value >= spec.ge)
        and (spec.gt is None or value > spec.gt)
        and (spec.le is None or value <= spec.le)
        and (spec.lt is None or value < spec.lt)
    )


def check_value(full_key: str, value: Any, annotation: Any, spec: Spec) -> None:
    """Raise ConfigError naming the key when a (type-checked) value is out of its range or choices."""
    if value is None:
        return  # the type said whether null is allowed
    ok = True
    if spec.number is not None:  # an Any field: a number of this kind in range, or one of the choices
        number_ok = (is_int(value) if spec.number is int else is_number(value)) and _in_bounds(value, spec)
        ok = number_ok or (isinstance(value, str) and value in spec.choices)
    elif isinstance(value, (list, tuple)):
        ok = (spec.length is None or len(value) == spec.length) and (not spec.nonempty or len(value) > 0)
        ok = ok and (not spec.bounded or all(_in_bounds(v, spec) for v in value))
    elif spec.choices:
        ok = value in spec.choices
    elif spec.bounded:
        ok = _in_bounds(value, spec)
    elif spec.nonempty:
        ok = value != ""
    check(ok, full_key, value, accepted(annotation, spec))
