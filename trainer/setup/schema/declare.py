"""How a config key is declared: once, as a pydantic type on a field of a plain dataclass.

A schema is a stdlib dataclass (a subclass of `Schema`) whose fields are annotated with pydantic's
own means: `Annotated[int, Field(ge=1, description="per rank")]` for a range and what the key
means, `Literal["all_reduce", "rs_ag"]` for choices, `Annotated[list[...], Field(min_length=3,
max_length=3)]` for a length. pydantic validates the composed values against it
(trainer/setup/validate.py). Hydra's ConfigStore gets a twin made from it here, `for_omegaconf()`,
with each annotation lowered to what OmegaConf understands (`Literal["a", "b"]` to `str`, a number
or a word to `Any`; OmegaConf strips `Annotated` itself), so OmegaConf still refuses a value of the
wrong type, or a key the schema lacks, while composing.

A field without a default (`= MISSING`) must be set by the YAML (a test checks that every field is
in its YAML and every YAML key is a field), so the defaults live in one place: the YAML, next to
their comments.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter

SEED_BOUND = 2**32  # numpy's seed range; torch's is wider

NonEmpty = Annotated[str, Field(min_length=1)]


class Schema:
    """The base of every schema: pydantic refuses a key the dataclass lacks (added with +group.key=...)."""

    __pydantic_config__ = ConfigDict(extra="forbid")


def _lowered(annotation: Any) -> Any:
    """The type OmegaConf is given for a pydantic annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _lowered(args[0])
    if origin is Literal:
        kinds = {type(a) for a in args}
        assert len(kinds) == 1, f"{annotation}: choices of one type only"
        return kinds.pop()
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        lowered = {_lowered(m) for m in members}
        base = lowered.pop() if len(lowered) == 1 else Any  # a number or a word (bucket_cap_mb: auto)
        return base | None if len(members) < len(args) and base is not Any else base
    if origin is list:
        return list[_lowered(args[0])]  # type: ignore[misc]
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return for_omegaconf(annotation)
    return annotation


@functools.cache
def for_omegaconf(declared: type) -> type:
    """The dataclass registered in Hydra's ConfigStore for a schema: its fields and defaults, OmegaConf's types."""
    hints = typing.get_type_hints(declared, include_extras=True)
    fields: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(declared):
        if f.default_factory is not dataclasses.MISSING:
            factory = f.default_factory
            if isinstance(factory, type) and dataclasses.is_dataclass(factory):
                factory = for_omegaconf(factory)
            fields.append((f.name, _lowered(hints[f.name]), dataclasses.field(default_factory=factory)))
        else:
            fields.append((f.name, _lowered(hints[f.name]), dataclasses.field(default=f.default)))
    twin = dataclasses.make_dataclass(declared.__name__, fields, namespace={"__declared__": declared})
    twin.__module__, twin.__qualname__, twin.__doc__ = declared.__module__, declared.__qualname__, declared.__doc__
    return twin


def declared_of(schema: type | None) -> type | None:
    """The pydantic-typed schema behind a ConfigStore dataclass (OmegaConf.get_type of a node), or None."""
    declared = getattr(schema, "__declared__", None)
    return declared if isinstance(declared, type) else None


@functools.cache
def adapter(declared: type) -> TypeAdapter[Any]:
    return TypeAdapter(declared)


@dataclass(frozen=True)
class Key:
    """What a key's declaration accepts, read back from pydantic's JSON schema of its annotation.

    For the message's "accepted" words and the tests that list every bound; pydantic does the
    checking. A list's bounds are those of each item. Anything else pydantic could enforce (a
    pattern, a multiple of) is refused here, so no constraint goes unsaid in the message.
    """

    kind: str  # JSON schema's type: integer, number, boolean, string, array; "" for a nested schema or any value
    items: str = ""  # an array's item type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] = ()
    number: str | None = None  # a number or one of the choices (bucket_cap_mb: a number or auto): its type
    length: int | None = None  # an array of exactly this many items (betas)
    nonempty: bool = False  # an array or a string
    nullable: bool = False
    note: str = ""  # the declaration's description: what the key means


_BOUNDS = {"minimum": "ge", "exclusiveMinimum": "gt", "maximum": "le", "exclusiveMaximum": "lt"}
_KNOWN = {"type", "enum", "const", "anyOf", "items", "minItems", "maxItems", "minLength", "description", *_BOUNDS}


def _read(schema: dict[str, Any]) -> dict[str, Any]:
    unknown = set(schema) - _KNOWN
    assert not unknown, f"a constraint the message cannot say: {sorted(unknown)} in {schema}"
    out: dict[str, Any] = {"kind": schema.get("type", "")}
    out |= {_BOUNDS[k]: v for k, v in schema.items() if k in _BOUNDS}
    if "enum" in schema or "const" in schema:
        out["choices"] = tuple(schema["enum"]) if "enum" in schema else (schema["const"],)
    if "description" in schema:
        out["note"] = schema["description"]
    if "anyOf" in schema:
        members = [m for m in schema["anyOf"] if m != {"type": "null"}]
        out["nullable"] = len(members) < len(schema["anyOf"])
        read = [_read(m) for m in members]
        numbers = [r for r in read if not r.get("choices")]
        assert len(numbers) <= 1, f"more than one type: {schema}"
        choices = tuple(c for r in read for c in r.get("choices", ()))
        if numbers and choices:
            out |= {**numbers[0], "number": numbers[0]["kind"], "choices": choices, "kind": ""}
        elif numbers:
            out |= numbers[0]
        else:
            out |= {"kind": read[0]["kind"], "choices": choices}
        out["note"] = schema.get("description", out.get("note", ""))
    if "items" in schema:
        item = _read(schema["items"])
        assert not item.get("choices") and not item.get("nonempty"), f"list items with choices: {schema}"
        out |= {k: v for k, v in item.items() if k in _BOUNDS.values()}
        out["items"] = item["kind"]
    low, high = schema.get("minItems", schema.get("minLength")), schema.get("maxItems", schema.get("maxLength"))
    if high is not None:
        assert low == high, f"say a length range in words first: {schema}"
        out["length"] = high
    elif low is not None:
        assert low == 1, f"say a minimum length other than 1 in words first: {schema}"
        out["nonempty"] = True
    return out


@functools.cache
def key_of(schema: type, name: str) -> Key:
    """What field `name` of a schema (declared, or its ConfigStore twin) accepts."""
    declared = declared_of(schema) or schema
    annotation = typing.get_type_hints(declared, include_extras=True)[name]
    if nested_schema(annotation) is not None:  # its own keys say the rest (trainer.fault, sync.bucket_timer)
        notes = [m.description for m in typing.get_args(annotation)[1:] if getattr(m, "description", None)]
        inner = typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation
        return Key(kind="", nullable=type(None) in typing.get_args(inner), note=notes[0] if notes else "")
    return Key(**_read(TypeAdapter(annotation).json_schema()))


def nested_schema(annotation: Any) -> type | None:
    """The schema of a nested node (trainer.fault), or of one that may be null (sync.bucket_timer); else None."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    members = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if len(members) == 1 and isinstance(members[0], type) and dataclasses.is_dataclass(members[0]):
        return members[0]
    return None


_KINDS = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string"}


def _kind(kind: str, items: str = "") -> str:
    if kind == "array":
        return f"a list of {_KINDS[items].removeprefix('an ').removeprefix('a ')}s" if items else "a list"
    return _KINDS.get(kind, "any value")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _bounds(key: Key) -> str:
    pairs = ((">=", key.ge), (">", key.gt), ("<=", key.le), ("<", key.lt))
    return " and ".join(f"{op} {_num(v)}" for op, v in pairs if v is not None)


def accepted(schema: type, name: str) -> str:
    """What a key accepts, in words: "accepted: an integer >= 1", "all_reduce, rs_ag", "a number > 0, or auto"."""
    key = key_of(schema, name)
    choices = ", ".join(str(c) for c in key.choices)
    if key.number is not None:
        text = f"{_kind(key.number)} {_bounds(key)}".strip()
        text = f"{text}, or {choices}" if choices else text
    elif key.choices:
        text = choices
    else:
        text = f"{_kind(key.kind, key.items)} {_bounds(key)}".strip()
        if key.length is not None:
            text = f"{text} ({key.length} items)"
        elif key.nonempty:
            text = f"{text} (not empty)"
    text += ", or null" if key.nullable else ""
    return f"accepted: {text}" + (f" ({key.note})" if key.note else "")
