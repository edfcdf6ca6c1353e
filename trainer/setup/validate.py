"""A composed config checked against its schema (trainer/setup/schema.py), once, before anything is
built: the first bad value is one ConfigError line naming the full key, the value and what the key
accepts (read back from the key's declaration), then the rules that tie keys together.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import typing
from dataclasses import dataclass
from types import ModuleType
from typing import Annotated, Any

import hydra
from omegaconf import DictConfig, OmegaConf
from pydantic import TypeAdapter, ValidationError

from data.text import check_vocab_size
from trainer.core import CONF_DIR, TrainSettings
from trainer.errors import ConfigError, check, from_leaves
from trainer.setup.schema import SCHEMAS


def schema_of(group: str, node: DictConfig) -> type | None:
    """The schema a group's node is checked against: its option's, found by what it builds (the
    trainer's is TrainSettings); None for a target no option builds (a plain `~optim +optim._target_=...`)."""
    if group == "trainer":
        return TrainSettings
    option = _by_target().get((group, str(node.get("_target_"))))
    return None if option is None else SCHEMAS[group][option]


@functools.cache
def _by_target() -> dict[tuple[str, str], str]:
    """(group, _target_) -> option, from each option's YAML: its _target_ is declared there only (its
    schema is built when asked for: a sync option's imports its strategy's module)."""
    found = {}
    for group, options in SCHEMAS.items():
        for option in options:
            yaml = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
            if isinstance(yaml, DictConfig) and "_target_" in yaml:
                found[(group, str(yaml._target_))] = option
    return found


@functools.cache
def adapter(schema: type) -> TypeAdapter[Any]:
    return TypeAdapter(schema)


def validate(cfg: DictConfig) -> dict[str, Any]:
    """Each group's checked value (an instance of its schema), or the first refusal as a ConfigError."""
    run_name = cfg.get("run_name")
    check(isinstance(run_name, str) and run_name != "", "run_name", run_name, "accepted: a non-empty name")
    checked: dict[str, Any] = {}
    for group in (str(g) for g in cfg if g != "hydra"):
        node = cfg[group]
        if isinstance(node, DictConfig):
            if "_target_" in node:
                check_target(node, group)
            checked[group] = check_group(node, group)
    check_rules(cfg)
    return checked


def check_group(node: DictConfig, group: str) -> Any:
    """One group's node as an instance of its schema (None for an untyped one), or its first refusal."""
    schema = schema_of(group, node)
    if schema is None:
        return None
    try:
        return adapter(schema).validate_python(OmegaConf.to_container(node, resolve=True))
    except ValidationError as err:
        raise ConfigError(refusal(err.errors()[0], schema, node, f"{group}.")) from None


def refusal(error: Any, schema: type, node: DictConfig, prefix: str) -> str:
    """pydantic's first error as one line; its location is followed through nested schemas (trainer.fault)."""
    loc = list(error["loc"])
    while len(loc) > 1 and isinstance(loc[0], str) and (inner := nested(schema, loc[0])) is not None:
        prefix, node, schema, loc = f"{prefix}{loc[0]}.", node[loc[0]], inner, loc[1:]
    name = str(loc[0]) if loc else ""
    if error["type"] == "unexpected_keyword_argument":  # added with +group.key=...
        names = ", ".join(f.name for f in dataclasses.fields(schema) if not f.name.startswith("_"))
        return f"{prefix}{name} is not a key of {prefix.rstrip('.')} ({schema.__name__}): accepted keys: {names}"
    if name not in node:
        return f"{prefix}{'.'.join(str(part) for part in loc)}: {error['msg']}"
    value = OmegaConf.to_container(node[name], resolve=True) if OmegaConf.is_config(node[name]) else node[name]
    annotation = typing.get_type_hints(schema)[name]
    words = isinstance(value, str) and _types(annotation) <= {int, float, bool, type(None)}  # lots, maybe: as typed
    return f"{prefix}{name}={value if words else repr(shown(value, annotation))} is invalid: {accepted(schema, name)}"


def nested(schema: type, name: str) -> type | None:
    """The schema of a nested node (trainer.fault), or None."""
    hint = typing.get_type_hints(schema).get(name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def shown(value: Any, annotation: Any) -> Any:
    """An integer given for a key that holds numbers reads as a number (1.0, [5.0, 0.0])."""
    if _types(annotation) & {int, str} or float not in _types(annotation):
        return value
    as_float = lambda v: float(v) if isinstance(v, int) and not isinstance(v, bool) else v  # noqa: E731
    return [as_float(v) for v in value] if isinstance(value, list) else as_float(value)


def _types(annotation: Any) -> set[Any]:
    """The plain types an annotation is made of (a Literal's choices count as theirs)."""
    if typing.get_origin(annotation) is Annotated:
        return _types(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is typing.Literal:
        return {type(a) for a in typing.get_args(annotation)}
    args = typing.get_args(annotation)
    return set().union(*(_types(a) for a in args)) if args else {annotation}


@dataclass(frozen=True)
class Key:
    """What a key's declaration accepts, read back from pydantic's JSON schema of its annotation: for
    the message's words and the tests that sweep every bound. pydantic does the checking."""

    kind: str  # JSON schema's type: integer, number, boolean, string, array; "" for any value
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


def _read(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": schema.get("type", "")}
    out |= {_BOUNDS[k]: v for k, v in schema.items() if k in _BOUNDS}
    if "enum" in schema or "const" in schema:
        out["choices"] = tuple(schema["enum"]) if "enum" in schema else (schema["const"],)
    if "anyOf" in schema:
        members = [m for m in schema["anyOf"] if m != {"type": "null"}]
        read = [_read(m) for m in members]
        numbers = [r for r in read if not r.get("choices")]
        choices = tuple(c for r in read for c in r.get("choices", ()))
        out |= numbers[0] if numbers else {"kind": read[0]["kind"]}
        if numbers and choices:
            out |= {"number": numbers[0]["kind"], "kind": ""}
        out |= {"choices": choices} if choices else {}
        out["nullable"] = len(members) < len(schema["anyOf"])
    if "items" in schema:
        item = _read(schema["items"])
        out |= {k: v for k, v in item.items() if k in _BOUNDS.values()}
        out["items"] = item["kind"]
    low, high = schema.get("minItems", schema.get("minLength")), schema.get("maxItems", schema.get("maxLength"))
    if high is not None:
        out["length"] = high
    elif low is not None:
        out["nonempty"] = True
    out["note"] = schema.get("description", "")
    return out


@functools.cache
def key_of(schema: type, name: str) -> Key:
    """What field `name` of a schema accepts."""
    annotation = typing.get_type_hints(schema, include_extras=True)[name]
    if nested(schema, name) is not None:  # its own keys say the rest (trainer.fault)
        return Key(kind="")
    return Key(**_read(TypeAdapter(annotation).json_schema()))


_KINDS = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string"}


def _kind(kind: str, items: str = "") -> str:
    if kind == "array":
        return f"a list of {_KINDS[items].split(' ', 1)[1]}s" if items else "a list"
    return _KINDS.get(kind, "any value")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def accepted(schema: type, name: str) -> str:
    """In words: "accepted: an integer >= 1", "accepted: all_reduce, rs_ag", "a number > 0, or auto"."""
    key = key_of(schema, name)
    pairs = ((">=", key.ge), (">", key.gt), ("<=", key.le), ("<", key.lt))
    bounds = " and ".join(f"{op} {_num(v)}" for op, v in pairs if v is not None)
    choices = ", ".join(str(c) for c in key.choices)
    if key.number is not None:
        text = f"{_kind(key.number)} {bounds}".strip() + (f", or {choices}" if choices else "")
    elif key.choices:
        text = choices
    else:
        text = f"{_kind(key.kind, key.items)} {bounds}".strip()
        text += f" ({key.length} items)" if key.length is not None else " (not empty)" if key.nonempty else ""
    text += ", or null" if key.nullable else ""
    return f"accepted: {text}" + (f" ({key.note})" if key.note else "")


def accepted_for(cfg: DictConfig, full_key: str) -> str | None:
    """What a key accepts under this config's choices ("accepted: an integer >= 1"), or None if untyped."""
    group, _, rest = full_key.split("[")[0].partition(".")
    node = cfg.get(group) if isinstance(cfg, DictConfig) else None
    schema = schema_of(group, node) if isinstance(node, DictConfig) else None
    parent, _, leaf = rest.rpartition(".")
    for part in parent.split(".") if parent else ():
        schema = nested(schema, part) if schema is not None else None  # trainer.fault
    if schema is None or leaf not in {f.name for f in dataclasses.fields(schema)}:
        return None
    return accepted(schema, leaf)


class ImportFailed(ConfigError):
    """A _target_ whose module exists but raised while it was imported (a package it needs is missing or
    broken, e.g. a torchvision built for another torch): the set-up's fault, not the key's."""


class _NotFound(LookupError):
    """Nothing by a _target_'s name exists (no such module, no such attribute)."""


class _ModuleFailed(Exception):
    """An existing module raised while it was imported; the error is its __cause__."""

    def __init__(self, module: str) -> None:
        super().__init__(module)
        self.module = module


def _import(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module:
            raise _NotFound(module) from None
        raise _ModuleFailed(module) from err  # a module it imports is missing
    except Exception as err:
        raise _ModuleFailed(module) from err


def locate(target: str) -> Any:
    """The object a dotted _target_ names, found front to back as hydra.utils.get_object finds it. Raises
    _NotFound where no such module or attribute exists and _ModuleFailed where an existing module's
    import raised."""
    parts = target.split(".")
    if not all(parts):
        raise _NotFound(target)
    found: Any = _import(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            found = getattr(found, part)
        except AttributeError:
            if not isinstance(found, ModuleType):
                raise _NotFound(target) from None
            found = _import(".".join(parts[:i]))
    return found


# Frames of the import machinery, skipped when looking for the package whose import failed.
_IMPORT_MACHINERY = ("importlib", "_frozen_importlib", "_frozen_importlib_external")


def import_failure(chosen: str, module: str, err: BaseException) -> str:
    """ "data=fake needs torchvision, whose import failed: RuntimeError: operator torchvision::nms does not
    exist": the first package outside the target's own that raised (the traceback says which), or the
    target's module itself."""
    text = str(err).strip()
    error = type(err).__name__ + (f": {text.splitlines()[0]}" if text else "")
    own = module.split(".")[0]
    if isinstance(err, ModuleNotFoundError) and err.name and err.name.split(".")[0] != own:
        return f"{chosen} needs {err.name.split('.')[0]}, which is not installed: {error}"
    inside, tb = False, err.__traceback__
    while tb is not None:
        top = str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0]
        inside = inside or top == own
        if inside and top not in (own, *_IMPORT_MACHINERY):
            return f"{chosen} needs {top}, whose import failed: {error}"
        tb = tb.tb_next
    return f"{chosen} cannot be built: importing {module} failed: {error}"


def check_target(node: DictConfig, group: str) -> None:
    """The group's _target_ is importable; for optim, every key is one of its parameters: a _target_
    swapped for another optimizer would otherwise reach the user as torch's TypeError, later. A target
    that does not exist is a bad key; one whose module raises on import is reported as that failure."""
    target = str(node.get("_target_"))
    try:
        built = locate(target)
    except _NotFound:
        raise ConfigError(
            f"{group}._target_={target} is invalid: accepted: the dotted path of a class or function "
            f"that can be imported (as in conf/{group}/*.yaml)"
        ) from None
    except _ModuleFailed as failed:
        option = _by_target().get((group, target))
        chosen = f"{group}={option}" if option is not None else f"{group}._target_={target}"
        assert failed.__cause__ is not None
        raise ImportFailed(import_failure(chosen, failed.module, failed.__cause__)) from None
    if group != "optim":
        return
    params = inspect.signature(built).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for name in (str(k) for k in node if not str(k).startswith("_") and k != "weight_decay_on"):  # the builder's
        takes = ", ".join(p for p in params if p != "params")
        check(name in params, f"{group}.{name}", node[name], f"{target} takes no keyword {name}; accepted: {takes}")


def check_pairing(cfg: DictConfig) -> None:
    """The model and the data read the same kind of sample (and data=text's vocabulary fits its
    tokenizer): refused before either is built, since reading a corpus takes time."""
    get = functools.partial(OmegaConf.select, cfg, default=None)
    model, data = get("model._target_"), get("data._target_")
    takes_tokens = bool(getattr(hydra.utils.get_object(model), "takes_tokens", False)) if model else False
    if data and model and takes_tokens != bool(getattr(hydra.utils.get_object(data), "tokens", False)):
        raise ConfigError(
            f"model {model} reads token ids but data {data} gives images or features: use data=text"
            if takes_tokens
            else f"data {data} gives token windows but model {model} does not read tokens: use a model that "
            "reads tokens (model=gpt). The lab's one is the GPT: with data=text, use model=gpt"
        )
    if get("data.tokenizer") is not None:
        with from_leaves():
            check_vocab_size(get("data.tokenizer"), get("data.vocab_size"))


def check_rules(cfg: DictConfig) -> None:
    """The rules that tie keys together."""
    check_pairing(cfg)
    get = functools.partial(OmegaConf.select, cfg, default=None)
    max_steps, warmup = get("trainer.max_steps"), get("schedule.warmup_steps")
    if max_steps is None and get("trainer.num_epochs") is None:
        raise ConfigError("trainer.max_steps and trainer.num_epochs are both null: set at least one")
    if warmup is not None and max_steps is not None:
        check(warmup <= max_steps, "schedule.warmup_steps", warmup, f"must not exceed trainer.max_steps={max_steps}")
    if get("trainer.checkpoint") is False:  # no key may ask for what it turns off (the sweeps' experiments set it)
        for key in ("checkpoint_every_n_steps", "checkpoint_on_sigterm", "checkpoint_async"):
            if value := get(f"trainer.{key}"):
                raise ConfigError(
                    f"trainer.{key}={str(value).lower()} is invalid: it asks for checkpoints, but "
                    "trainer.checkpoint=false writes none: add trainer.checkpoint=true"
                )
    if get("trainer.checkpoint_async"):
        check(
            get("trainer.checkpoint_format") == "sharded",
            "trainer.checkpoint_async",
            True,
            "needs trainer.checkpoint_format=sharded (DCP's async save writes a part per rank; "
            f"trainer.checkpoint_format={get('trainer.checkpoint_format')} writes one file from rank 0)",
        )
    check_recipe(get("trainer.precision"), get("trainer.param_dtype"), get("trainer.reduce_dtype"))
    hook = get("sync.comm_hook")  # sync=ddp's
    if hook is not None and hook != "none":
        check(
            get("trainer.param_dtype") == "fp32",
            "sync.comm_hook",
            hook,
            f"with trainer.param_dtype={get('trainer.param_dtype')} the reduction's dtype is trainer.reduce_dtype's; "
            "torch's hooks pick their own: use comm_hook=none, or trainer.param_dtype=fp32",
        )
        check(
            not get("sync.time_buckets"),
            "sync.comm_hook",
            hook,
            "sync.time_buckets=true registers DDP's one communication hook already: use comm_hook=none, or "
            "time_buckets=false (the communication object times the hooked communication too)",
        )
        check(
            hook != "powersgd" or get("sync.bucket_cap_mb") != "auto",
            "sync.comm_hook",
            hook,
            "with sync.bucket_cap_mb=auto: PowerSGD keeps per-bucket state (error feedback, warm start) that "
            "a rebuild of the buckets would invalidate; give bucket_cap_mb a number",
        )
    if get("optim.nesterov"):  # torch's SGD raises for this when the trainer builds it
        momentum, dampening = get("optim.momentum"), get("optim.dampening")
        check(
            momentum > 0 and dampening == 0,
            "optim.nesterov",
            True,
            f"needs optim.momentum > 0 and optim.dampening=0 (have {momentum} and {dampening})",
        )


def check_recipe(precision: str | None, param_dtype: str | None, reduce_dtype: str | None) -> None:
    """16-bit parameters compute in their own dtype (autocast of it, the scaler with fp16), and their
    gradients are reduced in fp32 or in those 16 bits: a third dtype would be another recipe."""
    if param_dtype is None or param_dtype == "fp32":
        check(
            reduce_dtype in (None, "fp32"),
            "trainer.reduce_dtype",
            reduce_dtype,
            "with trainer.param_dtype=fp32 the gradients are fp32: accepted: fp32 (a 16-bit reduction comes with "
            "trainer.param_dtype=bf16 or fp16)",
        )
        return
    check(
        precision == param_dtype,
        "trainer.precision",
        precision,
        f"with trainer.param_dtype={param_dtype} the forward computes in {param_dtype}: accepted: {param_dtype} "
        "(its default follows trainer.param_dtype)",
    )
    check(
        reduce_dtype in ("fp32", param_dtype),
        "trainer.reduce_dtype",
        reduce_dtype,
        f"accepted: fp32, {param_dtype} (trainer.param_dtype's)",
    )


def per_rank_batch(global_batch: int, world_size: int, grad_accum_steps: int) -> int:
    """trainer.global_batch_size's data.batch_size on world_size ranks; refused where it does not divide."""
    per_step = world_size * grad_accum_steps
    if global_batch % per_step:
        raise ConfigError(
            f"trainer.global_batch_size={global_batch} is invalid on {world_size} rank(s) x "
            f"trainer.grad_accum_steps={grad_accum_steps}: accepted: a multiple of {per_step}"
        )
    return global_batch // per_step
