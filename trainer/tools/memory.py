"""Will it fit? Each rank's memory predicted, kind by kind, for a strategy at N ranks.

    python -m trainer.tools.memory --ranks 2 --all
    python -m trainer.tools.memory model=gpt data=text data.tokenizer=bpe data.vocab_size=50257 \\
        model.n_layer=12 model.n_head=12 model.n_embd=768 model.block_size=1024 data.batch_size=8 optim=adamw \\
        --ranks 64 --all --device-gb 80

Takes train.py's overrides, refused as train.py refuses them (one line, exit 2); composes the config
train.py would see, builds the model on the meta device (no memory; the data module only says its
sample's shape, though data=text with the char tokenizer counts its corpus's characters), asks each
strategy what it keeps (SyncStrategy.footprint) and prints each kind's peak per rank in MiB
(trainer/scaling/memory.py, docs/memory.md). --all: every strategy of conf/sync/ and each variant of
it that changes the prediction: a choice of one of its keys (true/false, or a key's named options),
or of two where the first unlocks the second (zero's stage=3 and reshard_after_forward);
--device-gb: which fit in that many GiB, and each one's largest per-rank micro-batch that does;
--ladder: the ZeRO paper's stages 0-3 (ddp, zero stage=1, 2, 3) in GB, each one's model states
beside the paper's terms and what it keeps beyond them (figure 1: docs/memory.md);
--json: the same, as JSON (each kind in bytes);
--gpus-per-node G (default 8): the ranks of one node (fewer ranks than G: one node of them), which
the header names. It is network.gpus_per_node, which sync=hierarchical's and sync=hsdp's sync.shard
follow, so they are predicted in two levels as they would run on such nodes; a network.gpus_per_node
among the overrides says it instead.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import sys
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from trainer.core import TrainSettings
from trainer.errors import ConfigError, from_leaves
from trainer.footprint import Plan
from trainer.measures import MEMORY_KINDS
from trainer.scaling.memory import (
    GIB,
    MIB,
    Activations,
    OptimizerState,
    Prediction,
    Sample,
    count_activations,
    largest_batch,
    optimizer_state,
    predict,
    zero_model_states,
)
from trainer.setup.config import compose_config, sync_options
from trainer.setup.instantiate import instantiate, optimizer_factory, split_sync_batchnorm
from trainer.setup.precheck import check_overrides
from trainer.setup.validate import check_group, check_pairing, check_rules, per_rank_batch
from trainer.sync.base import SyncStrategy
from trainer.sync.master import DTYPES, SIXTEEN_BITS, cast_parameters

SAME = 1e-3  # two variants whose every kind is this close (relative) are one row
GPUS_PER_NODE = 8  # --gpus-per-node's default: a node of 8 GPUs, the common cluster node
NODE_KEY = "network.gpus_per_node"
Row = tuple[Prediction, dict[str, Any]]  # a strategy's prediction, and the sync config it was made for
HEADERS = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer_state": "optimizer",
    "comm_buffers": "comm",
    "activations": "activations",
}


class Parser(argparse.ArgumentParser):
    """argparse, whose refusals are one line and exit 2 like the rest of the command's."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser(prog="python -m trainer.tools.memory", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="train.py's overrides (model=gpt sync=zero sync.stage=3 ...)")
    parser.add_argument("--ranks", type=int, required=True, help="the world size N to predict for")
    parser.add_argument("--device-gb", type=float, help="a device's memory in GiB: which fit, the largest batch")
    parser.add_argument("--all", action="store_true", help="every strategy of conf/sync/ and its variants")
    parser.add_argument("--ladder", action="store_true", help="the ZeRO paper's stages 0-3 against its terms, GB")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of the table (MiB)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        help=f"ranks per node (default {GPUS_PER_NODE}; fewer ranks: one node of them): hierarchical's and hsdp's "
        "sync.shard (network.gpus_per_node)",
    )
    return parser.parse_intermixed_args(argv)


def ranks_per_node(ranks: int, gpus_per_node: int | None, overrides: Sequence[str]) -> tuple[int, str]:
    """The node the prediction assumes, and where it comes from: network.gpus_per_node among the
    overrides, else --gpus-per-node (default 8), at most the ranks; refused where the ranks do not
    fill whole nodes or the two disagree."""
    given = _node_override(overrides)
    if given is not None:
        node, source = given, NODE_KEY
        if gpus_per_node is not None and gpus_per_node != node:
            raise ConfigError(f"--gpus-per-node={gpus_per_node} and {NODE_KEY}={node} disagree: give one of them")
    else:
        node = GPUS_PER_NODE if gpus_per_node is None else gpus_per_node
        source = "--gpus-per-node" + ("" if gpus_per_node is not None else f", default {GPUS_PER_NODE}")
    if node < 1:
        raise ConfigError(f"--gpus-per-node={node} is invalid: accepted: an integer >= 1")
    if ranks > node and ranks % node:
        raise ConfigError(
            f"--ranks={ranks} does not fill nodes of {node} ({source}): accepted: a multiple of {node}, "
            f"or a node size that divides {ranks}"
        )
    return min(node, ranks), f"{node} ({source})"


def _layout(ranks: int, node: int) -> str:
    return f"{ranks // node} nodes of {node}" if ranks > node else f"one node of {node}"


def _node_override(overrides: Sequence[str]) -> int | None:
    values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == NODE_KEY]
    if not values:
        return None
    try:
        return int(values[-1])
    except ValueError:
        raise ConfigError(f"{NODE_KEY}={values[-1]} is invalid: accepted: an integer >= 1") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except ConfigError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_json(), indent=2) if args.json else report.table())
    return 0


@dataclass
class Report:
    """The predictions, and what they were made of."""

    header: list[str]
    rows: list[Row]
    activations: Activations
    state: OptimizerState
    device_bytes: int | None
    notes: list[str]
    facts: dict[str, Any]
    paper: list[float] | None = None  # --ladder: per row (stage 0-3), the ZeRO paper's model states in bytes
    terms: tuple[int, int, int] = (2, 2, 12)  # --ladder: the paper's bytes per parameter (P + G + K) for this run

    def fit(self, prediction: Prediction) -> tuple[bool | None, int | None]:
        if self.device_bytes is None:
            return None, None
        return prediction.total <= self.device_bytes, largest_batch(prediction, self.activations, self.device_bytes)

    def table(self) -> str:
        if self.paper is not None:
            return self.ladder()
        columns = [HEADERS[kind] for kind in MEMORY_KINDS] + ["total"]
        extra = ["fits", "max batch"] if self.device_bytes is not None else []
        width = max(len("strategy"), *(len(p.label) for p, _ in self.rows))
        lines = [*self.header, "", f"{'strategy':<{width}}" + "".join(f"{c:>13}" for c in columns + extra)]
        for prediction, _ in self.rows:
            values = [prediction.kinds[kind] for kind in MEMORY_KINDS] + [prediction.total]
            line = f"{prediction.label:<{width}}" + "".join(f"{v / MIB:>13.2f}" for v in values)
            fits, batch = self.fit(prediction)
            if fits is not None:
                line += f"{'yes' if fits else 'no':>13}{'any' if batch is None else batch:>13}"
            lines.append(line)
        lines.append(f"MiB per rank; total: the sum of the kinds' peaks (docs/memory.md){self._fit_note()}")
        return "\n".join(lines + self.notes)

    def ladder(self) -> str:
        """--ladder: a row per ZeRO stage, in GB (10^9 bytes, the paper's unit)."""
        assert self.paper is not None
        columns = ["paper's terms", "model states", "more grads", "comm", "activations", "total"]
        width = max(len(p.label) for p, _ in self.rows)
        lines = [*self.header, "", f"stage  {'strategy':<{width}}" + "".join(f"{c:>15}" for c in columns)]
        for stage, ((prediction, _), paper) in enumerate(zip(self.rows, self.paper, strict=True)):
            kinds = prediction.kinds
            values = [paper, prediction.model_states, prediction.beyond, kinds["comm_buffers"], kinds["activations"]]
            cells = "".join(f"{v / 1e9:>15.2f}" for v in [*values, prediction.total])
            lines.append(f"{stage:<7}{prediction.label:<{width}}{cells}")
        p, g, k = self.terms
        lines += [
            f"GB per rank (10^9 bytes). paper's terms: Rajbhandari et al.'s model states for these parameters, "
            f"{p} + {g} + {k} bytes each (parameters, gradients, optimizer state: figure 1's 2 + 2 + 12 with 16-bit "
            "parameters and Adam) divided as each stage divides them; model states: this lab's parameters, gradients "
            "and optimizer state, each at its peak, without what the terms leave out: more grads (fp32 copies of "
            "16-bit gradients, units' full gradients before their reduce-scatter), comm (buckets in flight, gathered "
            "units), activations (docs/memory.md, the ZeRO paper compared)"
        ]
        return "\n".join(lines + self.notes)

    def _fit_note(self) -> str:
        if self.device_bytes is None:
            return ""
        return f"; fits: in {self.device_bytes / GIB:g} GiB; max batch: the largest per-rank micro-batch that does"

    def as_json(self) -> dict[str, Any]:
        strategies = []
        for prediction, sync in self.rows:
            fits, batch = self.fit(prediction)
            strategies.append(
                {
                    "strategy": prediction.label,
                    "sync": sync,
                    "bytes": prediction.kinds,
                    "total_bytes": prediction.total,
                    "fits": fits,
                    "largest_batch": batch,
                }
            )
        activations = {"fixed_bytes": self.activations.fixed, "per_sample_bytes": self.activations.per_sample}
        optimizer = {"name": self.state.name, "per_element_bytes": self.state.per_element}
        if self.paper is not None:
            for entry, paper, (prediction, _) in zip(strategies, self.paper, self.rows, strict=True):
                entry |= {"paper_model_states_bytes": paper, "model_states_bytes": prediction.model_states}
                entry |= {"gradients_beyond_bytes": prediction.beyond}
        return self.facts | {
            "device_bytes": self.device_bytes,
            "optimizer": optimizer | {"per_tensor_bytes": self.state.per_tensor, "entries": list(self.state.entries)},
            "activations": activations | {"source": self.activations.source},
            "strategies": strategies,
            "notes": self.notes,
        }


def run(args: argparse.Namespace) -> Report:
    if args.ranks < 1:
        raise ConfigError(f"--ranks={args.ranks} is invalid: accepted: an integer >= 1")
    if args.device_gb is not None and not args.device_gb > 0:
        raise ConfigError(f"--device-gb={args.device_gb:g} is invalid: accepted: a number > 0 (GiB)")
    node, assumed = ranks_per_node(args.ranks, args.gpus_per_node, args.overrides)
    overrides = list(args.overrides)
    if _node_override(overrides) is None:
        overrides.append(f"{NODE_KEY}={node}")  # every composition below sees the node
    with from_leaves():
        check_overrides(overrides, world_size=args.ranks)  # train.py's own check: its refusals, its words
        cfg = compose_config(overrides)
    settings: TrainSettings = check_group(cfg.trainer, "trainer")
    check_pairing(cfg)
    if settings.global_batch_size is not None:  # as the builder sets it (trainer/setup/build.py)
        with open_dict(cfg):
            cfg.data.batch_size = per_rank_batch(settings.global_batch_size, args.ranks, settings.grad_accum_steps)
    data = instantiate(cfg.data)
    model_node, _ = split_sync_batchnorm(cfg.model)

    param_dtype, reduce_dtype = DTYPES[settings.param_dtype], DTYPES[settings.reduce_dtype]

    def build() -> nn.Module:
        model = instantiate(model_node, input_shape=data.input_shape, num_classes=data.num_classes)
        cast_parameters(model, param_dtype)  # as the trainer casts it before the strategy wraps it
        return model

    with torch.device("meta"):
        model = build()
    factory = optimizer_factory(cfg.optim)
    dtype = next(model.parameters()).dtype
    state = optimizer_state(factory.build, torch.float32 if dtype in SIXTEEN_BITS else dtype)  # a 16-bit one's copy
    sample = Sample(tuple(data.input_shape), data.input_dtype, bool(getattr(data, "tokens", False)))
    activations = count_activations(build, sample, settings.precision)
    groups = factory.groups(model.parameters())
    plan = Plan(model, args.ranks, groups, settings.grad_accum_steps > 1, param_dtype, reduce_dtype)
    batch = int(cfg.data.batch_size)

    def predicted(label: str, strategy: SyncStrategy) -> Prediction:
        return predict(label, strategy.footprint(plan), state, activations, args.ranks, batch)

    notes: list[str] = []
    numel = sum(p.numel() for p in model.parameters())
    paper, terms = None, (2, 2, 12)
    if args.ladder:
        rows = list(_ladder(overrides, settings, predicted))
        # The paper's K: the optimizer's state per element, and the fp32 master copy where parameters are 16-bit
        size = dtype.itemsize
        terms = (size, size, state.per_element + (torch.float32.itemsize if dtype in SIXTEEN_BITS else 0))
        paper = [zero_model_states(numel, args.ranks, stage, *terms) for stage in range(4)]
    elif args.all:
        rows = list(_every(cfg, settings, predicted, notes, overrides))
    else:
        rows = list(_chosen(cfg, settings, predicted, overrides))
    param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    k = settings.grad_accum_steps
    recipe = ""
    if dtype in SIXTEEN_BITS:  # trainer.param_dtype: 16-bit parameters, an fp32 master copy
        recipe = f", param_dtype={settings.param_dtype}, reduce_dtype={settings.reduce_dtype}"
    header = [
        f"model {cfg.model._target_}: {numel:,} parameters ({param_mib:.2f} MiB, {str(dtype).removeprefix('torch.')}); "
        f"{args.ranks} rank(s), micro-batch {batch} per rank x {k} (trainer.grad_accum_steps), "
        f"trainer.precision={settings.precision}{recipe}",
        f"optimizer {state.name}: {state.per_element} bytes per element ({', '.join(state.entries) or 'no state'}), "
        f"{state.per_tensor} per tensor stepped",
        f"activations: {activations.fixed / MIB:.2f} MiB + {activations.per_sample / MIB:.4f} MiB per sample, "
        f"from {activations.source}",
        f"ranks per node: {assumed}: {_layout(args.ranks, node)}, hierarchical's and hsdp's sync.shard={node}",
    ]
    facts = {
        "ranks": args.ranks,
        "gpus_per_node": node,
        "batch": batch,
        "grad_accum_steps": k,
        "precision": settings.precision,
        "param_dtype": settings.param_dtype,
        "reduce_dtype": settings.reduce_dtype,
        "model": {"target": str(cfg.model._target_), "parameters": numel, "dtype": str(dtype)},
    }
    device_bytes = None if args.device_gb is None else int(args.device_gb * GIB)
    return Report(header, rows, activations, state, device_bytes, notes, facts, paper, terms)


def predicted_total_mb(overrides: Sequence[str], ranks: int) -> float:
    """The chosen strategy's total per rank in MiB, for these overrides at `ranks` ranks (report
    --memory); a ConfigError where the command would refuse them."""
    (prediction, _), *_ = run(parse_args([*overrides, "--ranks", str(ranks)])).rows
    return prediction.total / MIB


Predict = Callable[[str, SyncStrategy], Prediction]


def _label(name: str, node: DictConfig, default: DictConfig) -> str:
    """The option's name and the keys where this node differs from the option's YAML."""
    changed = [f"{k}={_show(node[k])}" for k in map(str, node) if k != "_target_" and node[k] != default.get(k)]
    return " ".join([name, *changed])


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _name_of(node: DictConfig, context: Sequence[str] = ()) -> tuple[str, DictConfig]:
    """The option this sync node came from (the one building the same _target_)."""
    for name, default in sync_options(context).items():
        if default.get("_target_") == node.get("_target_"):
            return name, default
    return str(node.get("_target_")), node


# The ZeRO paper's stages as this lab runs them: stage 0 is plain data parallelism (ddp).
LADDER = (["sync=ddp"], ["sync=zero", "sync.stage=1"], ["sync=zero", "sync.stage=2"], ["sync=zero", "sync.stage=3"])


def _ladder(overrides: Sequence[str], settings: TrainSettings, predicted: Predict) -> Iterator[Row]:
    """Stages 0-3 with the overrides' other groups (a sync key of theirs is left out: the ladder sets it)."""
    others = [o for o in overrides if not o.lstrip("+~").startswith("sync")]
    for stage in LADDER:
        cfg = compose_config([*others, *stage])
        strategy = instantiate(cfg.sync)
        refusal = strategy.refuses(settings)
        if refusal:
            raise ConfigError(refusal)
        label = " ".join(o.removeprefix("sync=").removeprefix("sync.") for o in stage)
        yield predicted(label, strategy), _plain(cfg.sync)


def _chosen(cfg: DictConfig, settings: TrainSettings, predicted: Predict, context: Sequence[str]) -> Iterator[Row]:
    """The strategy the overrides chose: refused as train.py refuses it."""
    strategy = instantiate(cfg.sync)
    refusal = strategy.refuses(settings)
    if refusal:
        raise ConfigError(refusal)
    name, default = _name_of(cfg.sync, context)
    yield predicted(_label(name, cfg.sync, default), strategy), _plain(cfg.sync)


def _every(
    cfg: DictConfig, settings: TrainSettings, predicted: Predict, notes: list[str], context: Sequence[str]
) -> Iterator[Row]:
    """Every option of conf/sync/ (the chosen one with the overrides' keys; every one composed with the
    overrides of the other groups, which its interpolations may read), and its variants."""
    chosen, _ = _name_of(cfg.sync, context)
    for name, default in sync_options(context).items():
        node = cfg.sync if name == chosen else default
        yield from _variants(cfg, name, node, default, settings, predicted, notes)


def _choices(hint: Any) -> tuple[Any, ...]:
    """The values a key's type names: true and false, a Literal's options (in a union too)."""
    if hint is bool:
        return (False, True)
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return tuple(c for arg in typing.get_args(hint) for c in _choices(arg))


def _variants(
    cfg: DictConfig,
    name: str,
    node: DictConfig,
    default: DictConfig,
    settings: TrainSettings,
    predicted: Predict,
    notes: list[str],
) -> Iterator[Row]:
    """The node, then each choice of one key that changes the prediction, then of a second key that
    changed nothing alone (a key of zero's stage 3 under sync.stage=3)."""
    target = hydra.utils.get_object(str(node._target_))
    hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    keys = [str(k) for k in node if k != "_target_" and _choices(hints.get(str(k)))]
    seen: list[Prediction] = []

    def attempt(variant: DictConfig) -> Row | None:
        """The variant's row, or None where train.py would refuse it or it predicts what a row did."""
        label = _label(name, variant, default)
        whole = copy.deepcopy(cfg)
        try:
            with open_dict(whole):
                whole.sync = variant
            check_group(variant, "sync")
            check_rules(whole)
            strategy = instantiate(variant)
        except ConfigError:
            return None
        refusal = strategy.refuses(settings)
        if refusal:
            notes.append(f"{label}: refused: {refusal}")
            return None
        prediction = predicted(label, strategy)
        if any(_same(prediction, other) for other in seen):
            return None
        seen.append(prediction)
        return prediction, _plain(variant)

    def changed(base: DictConfig, key: str) -> Iterator[DictConfig]:
        for value in _choices(hints[key]):
            if value != base[key]:
                variant = copy.deepcopy(base)
                variant[key] = value
                yield variant

    first = attempt(node)
    if first is None:
        return
    yield first
    unlocking: list[DictConfig] = []  # the variants with a row of their own
    idle: list[str] = []  # the keys none of whose choices changed the prediction alone
    for key in keys:
        rows = [(variant, attempt(variant)) for variant in changed(node, key)]
        yield from (row for _, row in rows if row is not None)
        unlocking += [variant for variant, row in rows if row is not None]
        idle += [] if any(row for _, row in rows) else [key]
    for base in unlocking:
        for key in idle:
            yield from (row for row in map(attempt, changed(base, key)) if row is not None)


def _same(a: Prediction, b: Prediction) -> bool:
    return all(abs(a.kinds[k] - b.kinds[k]) <= SAME * max(a.kinds[k], b.kinds[k]) for k in MEMORY_KINDS)


def _plain(node: DictConfig) -> dict[str, Any]:
    plain = OmegaConf.to_container(node, resolve=True)
    assert isinstance(plain, dict)
    return {str(k): v for k, v in plain.items()}


if __name__ == "__main__":
    sys.exit(main())
