"""A hand-written table of bad command-line values that train.py must refuse, naming the key and the value.

Every range and choice a config key takes is declared once, in trainer/setup/schema.py (pydantic's
`Field(ge=...)`, `Literal[...]`). tests/test_config_schema.py sweeps every key with bad values *derived from those
declarations*, which has a blind spot: delete a bound from the schema (the `gt=0` of optim.lr, say)
and its bad value disappears from the sweep together with the bound, so nothing fails. The values
here are therefore written by hand, one row per bound side (lower, upper), choice list and fixed
length of every option's keys, at the boundary itself where there is one (lr=0 for `gt=0`,
seed=2**32 for `lt=2**32`): a bound that is removed, loosened or turned from `gt` into `ge` makes
its row pass the check, and the row fails.

Each row goes through precheck.check_command_line, the very call train.py makes on every rank
before Hydra's app (compose with Hydra's compose API, the schema's types, pydantic's ranges and
choices, then the constructors of trainer, data and sync), in-process: it must exit 2 and print one
line that names the key and the offending value (as Python writes it: 0.0 for a float key given 0).
What is checked is the refusal, not which layer makes it: some keys are guarded twice (the sync
strategies check their own bucket_cap_mb, collective, ...), so for those a bound
deleted from the schema alone still leaves the row passing, and the coverage test below says so.

The one place this file reads the schema is test_the_table_covers_every_bound_and_choice: it checks
that every bound, choice list and length the schemas declare has a row here, and that every row
still has its declaration, so a new bound without a row, or a dropped one, fails too.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import NamedTuple

import pytest

from trainer.setup.precheck import EXIT_CODE, check_command_line
from trainer.setup.schema import SCHEMAS
from trainer.setup.validate import Key, key_of, nested


class Row(NamedTuple):
    options: str  # the group choices the key lives under ("sync=zero"; "data=text model=gpt": they go together)
    override: str  # the bad value, as typed on the command line
    side: str  # what it breaks: "low" (ge/gt), "high" (le/lt), "choice" or "length"
    said: str  # the key and value as the one-line message must name them

    @property
    def key(self) -> str:
        return self.override.split("=", 1)[0]


GPT = "model=gpt data=text"  # a token model reads token data, and back
TEXT = "data=text model=gpt"

TABLE: list[Row] = [
    # model
    Row("model=mlp", "model.hidden_sizes=[64,0]", "low", "model.hidden_sizes=[64, 0]"),
    Row("model=cnn", "model.channels=[0]", "low", "model.channels=[0]"),
    Row("model=cnn", "model.hidden_size=0", "low", "model.hidden_size=0"),
    Row(GPT, "model.n_layer=0", "low", "model.n_layer=0"),
    Row(GPT, "model.n_head=0", "low", "model.n_head=0"),
    Row(GPT, "model.n_embd=0", "low", "model.n_embd=0"),
    Row(GPT, "model.block_size=0", "low", "model.block_size=0"),
    Row(GPT, "model.dropout=-0.1", "low", "model.dropout=-0.1"),
    Row(GPT, "model.dropout=1", "high", "model.dropout=1.0"),
    # data
    Row("data=synthetic", "data.batch_size=0", "low", "data.batch_size=0"),
    Row("data=synthetic", "data.num_workers=-1", "low", "data.num_workers=-1"),
    Row("data=synthetic", "data.num_samples=0", "low", "data.num_samples=0"),
    Row("data=synthetic", "data.num_val_samples=0", "low", "data.num_val_samples=0"),
    Row("data=synthetic", "data.input_dim=0", "low", "data.input_dim=0"),
    Row("data=synthetic", "data.num_classes=1", "low", "data.num_classes=1"),
    Row("data=synthetic", "data.seed=-1", "low", "data.seed=-1"),
    Row("data=synthetic", "data.seed=4294967296", "high", "data.seed=4294967296"),
    Row("data=fake", "data.batch_size=0", "low", "data.batch_size=0"),
    Row("data=fake", "data.num_workers=-1", "low", "data.num_workers=-1"),
    Row("data=fake", "data.num_samples=0", "low", "data.num_samples=0"),
    Row("data=fake", "data.num_val_samples=0", "low", "data.num_val_samples=0"),
    Row("data=fake", "data.image_shape=[3,0,32]", "low", "data.image_shape=[3, 0, 32]"),
    Row("data=fake", "data.image_shape=[32,32]", "length", "data.image_shape=[32, 32]"),
    Row("data=fake", "data.num_classes=1", "low", "data.num_classes=1"),
    Row("data=mnist", "data.batch_size=0", "low", "data.batch_size=0"),
    Row("data=mnist", "data.num_workers=-1", "low", "data.num_workers=-1"),
    Row("data=cifar10", "data.batch_size=0", "low", "data.batch_size=0"),
    Row("data=cifar10", "data.num_workers=-1", "low", "data.num_workers=-1"),
    Row(TEXT, "data.batch_size=0", "low", "data.batch_size=0"),
    Row(TEXT, "data.num_workers=-1", "low", "data.num_workers=-1"),
    Row(TEXT, "data.num_workers=1", "high", "data.num_workers=1"),
    Row(TEXT, "data.tokenizer=wordpiece", "choice", "data.tokenizer='wordpiece'"),
    Row(TEXT, "data.vocab_size=255", "low", "data.vocab_size=255"),  # below byte-level BPE's 256 bytes
    Row(TEXT, "data.vocab_size=65537", "high", "data.vocab_size=65537"),  # beyond the uint16 token file
    Row(TEXT, "data.block_size=0", "low", "data.block_size=0"),
    # sync
    Row("sync=ddp", "sync.bucket_cap_mb=0", "low", "sync.bucket_cap_mb=0"),
    Row("sync=ddp", "sync.bucket_cap_mb=automatic", "choice", "sync.bucket_cap_mb='automatic'"),
    Row("sync=ddp", "sync.auto_candidates_mb=[5,0]", "low", "sync.auto_candidates_mb=[5.0, 0.0]"),
    Row("sync=ddp", "sync.auto_steps_per_trial=0", "low", "sync.auto_steps_per_trial=0"),
    Row("sync=ddp", "sync.auto_warmup_steps=0", "low", "sync.auto_warmup_steps=0"),
    Row("sync=ddp", "sync.comm_hook=fp8", "choice", "sync.comm_hook='fp8'"),
    Row("sync=ddp", "sync.powersgd_rank=0", "low", "sync.powersgd_rank=0"),
    Row("sync=ddp", "sync.powersgd_start_step=1", "low", "sync.powersgd_start_step=1"),
    Row("sync=bucketed", "sync.bucket_cap_mb=-1", "low", "sync.bucket_cap_mb=-1"),
    Row("sync=bucketed", "sync.bucket_cap_mb=max", "choice", "sync.bucket_cap_mb='max'"),
    Row("sync=bucketed", "sync.auto_candidates_mb=[0]", "low", "sync.auto_candidates_mb=[0.0]"),
    Row("sync=bucketed", "sync.auto_steps_per_trial=0", "low", "sync.auto_steps_per_trial=0"),
    Row("sync=bucketed", "sync.auto_warmup_steps=0", "low", "sync.auto_warmup_steps=0"),
    Row("sync=bucketed", "sync.collective=all_gather", "choice", "sync.collective='all_gather'"),
    Row("sync=manual", "sync.coalesce_mb=-1", "low", "sync.coalesce_mb=-1.0"),
    Row("sync=manual", "sync.collective=reduce", "choice", "sync.collective='reduce'"),
    Row("sync=fsdp", "sync.wrap=layer", "choice", "sync.wrap='layer'"),
    Row("sync=zero", "sync.stage=4", "choice", "sync.stage=4"),
    Row("sync=zero", "sync.prefetch=-1", "low", "sync.prefetch=-1"),
    Row("sync=zero", "sync.wrap=layer", "choice", "sync.wrap='layer'"),
    Row("sync=zero", "sync.stage=0", "choice", "sync.stage=0"),
    Row("sync=zero", "sync.bucket_cap_mb=0", "low", "sync.bucket_cap_mb=0.0"),
    Row("sync=zero", "sync.num_buckets_staged=0", "low", "sync.num_buckets_staged=0"),
    Row("sync=hierarchical", "sync.bucket_cap_mb=0", "low", "sync.bucket_cap_mb=0.0"),
    Row("sync=hierarchical", "sync.replicate=0", "low", "sync.replicate=0"),
    Row("sync=hierarchical", "sync.shard=0", "low", "sync.shard=0"),
    Row("sync=hsdp", "sync.wrap=layer", "choice", "sync.wrap='layer'"),
    Row("sync=hsdp", "sync.replicate=0", "low", "sync.replicate=0"),
    Row("sync=hsdp", "sync.shard=0", "low", "sync.shard=0"),
    # optim
    Row("optim=sgd", "optim._partial_=false", "choice", "optim._partial_=False"),
    Row("optim=sgd", "optim.lr=0", "low", "optim.lr=0.0"),
    Row("optim=sgd", "optim.weight_decay=-0.1", "low", "optim.weight_decay=-0.1"),
    Row("optim=sgd", "optim.weight_decay_on=vectors", "choice", "optim.weight_decay_on='vectors'"),
    Row("optim=sgd", "optim.momentum=-0.1", "low", "optim.momentum=-0.1"),
    Row("optim=sgd", "optim.momentum=1", "high", "optim.momentum=1.0"),
    Row("optim=sgd", "optim.dampening=-0.1", "low", "optim.dampening=-0.1"),
    Row("optim=sgd", "optim.dampening=1.1", "high", "optim.dampening=1.1"),
    Row("optim=adamw", "optim._partial_=false", "choice", "optim._partial_=False"),
    Row("optim=adamw", "optim.lr=0", "low", "optim.lr=0.0"),
    Row("optim=adamw", "optim.weight_decay=-0.01", "low", "optim.weight_decay=-0.01"),
    Row("optim=adamw", "optim.weight_decay_on=none", "choice", "optim.weight_decay_on='none'"),
    Row("optim=adamw", "optim.betas=[-0.1,0.999]", "low", "optim.betas=[-0.1, 0.999]"),
    Row("optim=adamw", "optim.betas=[0.9,1]", "high", "optim.betas=[0.9, 1.0]"),
    Row("optim=adamw", "optim.betas=[0.9,0.99,0.999]", "length", "optim.betas=[0.9, 0.99, 0.999]"),
    Row("optim=adamw", "optim.eps=0", "low", "optim.eps=0.0"),
    # schedule
    Row("schedule=warmup_cosine", "schedule.warmup_steps=-1", "low", "schedule.warmup_steps=-1"),
    Row("schedule=warmup_cosine", "schedule.min_lr_ratio=-0.1", "low", "schedule.min_lr_ratio=-0.1"),
    Row("schedule=warmup_cosine", "schedule.min_lr_ratio=1.5", "high", "schedule.min_lr_ratio=1.5"),
    # trainer
    Row("trainer=default", "trainer.max_steps=-1", "low", "trainer.max_steps=-1"),
    Row("trainer=default", "trainer.num_epochs=0", "low", "trainer.num_epochs=0"),
    Row("trainer=default", "trainer.seed=-1", "low", "trainer.seed=-1"),
    Row("trainer=default", "trainer.seed=4294967296", "high", "trainer.seed=4294967296"),
    Row("trainer=default", "trainer.log_every_n_steps=0", "low", "trainer.log_every_n_steps=0"),
    Row("trainer=default", "trainer.sample_every_n_steps=-1", "low", "trainer.sample_every_n_steps=-1"),
    Row("trainer=default", "trainer.sample_budget=0", "low", "trainer.sample_budget=0"),
    Row("trainer=default", "trainer.sample_budget=1.5", "high", "trainer.sample_budget=1.5"),
    Row("trainer=default", "trainer.sample_max_gap_steps=0", "low", "trainer.sample_max_gap_steps=0"),
    Row("trainer=default", "trainer.eval_every_n_steps=-1", "low", "trainer.eval_every_n_steps=-1"),
    Row("trainer=default", "trainer.eval_max_samples=0", "low", "trainer.eval_max_samples=0"),
    Row("trainer=default", "trainer.grad_accum_steps=0", "low", "trainer.grad_accum_steps=0"),
    Row("trainer=default", "trainer.global_batch_size=0", "low", "trainer.global_batch_size=0"),
    Row("trainer=default", "trainer.max_grad_norm=0", "low", "trainer.max_grad_norm=0"),
    Row("trainer=default", "trainer.end_sample_tokens=-1", "low", "trainer.end_sample_tokens=-1"),
    Row("trainer=default", "trainer.device=mps", "choice", "trainer.device='mps'"),
    Row("trainer=default", "trainer.precision=fp8", "choice", "trainer.precision='fp8'"),
    Row("trainer=default", "trainer.param_dtype=fp8", "choice", "trainer.param_dtype='fp8'"),
    Row("trainer=default", "trainer.reduce_dtype=fp8", "choice", "trainer.reduce_dtype='fp8'"),
    Row("trainer=default", "trainer.checkpoint_format=dcp", "choice", "trainer.checkpoint_format='dcp'"),
    Row("trainer=default", "trainer.collective_timeout_s=0", "low", "trainer.collective_timeout_s=0.0"),
    Row("trainer=default", "trainer.flight_recorder=-1", "low", "trainer.flight_recorder=-1"),
    Row("trainer=default", "trainer.flight_recorder=always", "choice", "trainer.flight_recorder='always'"),
    Row("trainer=default", "trainer.step_grace_s=0", "low", "trainer.step_grace_s=0.0"),
    Row("trainer=default", "trainer.checkpoint_every_n_steps=-1", "low", "trainer.checkpoint_every_n_steps=-1"),
    Row("trainer=default", "trainer.keep_checkpoints=0", "low", "trainer.keep_checkpoints=0"),
    Row("trainer=default", "trainer.on_nonfinite=ignore", "choice", "trainer.on_nonfinite='ignore'"),
    Row("trainer=default", "trainer.check_replicas_every_n_steps=-1", "low", "trainer.check_replicas_every_n_steps=-1"),
    Row("trainer=default", "trainer.peak_tflops=0", "low", "trainer.peak_tflops=0.0"),
    Row("trainer=default", "trainer.fault.rank=-1", "low", "trainer.fault.rank=-1"),
    Row("trainer=default", "trainer.fault.at_step=0", "low", "trainer.fault.at_step=0"),
    Row("trainer=default", "trainer.fault.kind=segfault", "choice", "trainer.fault.kind='segfault'"),
    Row("trainer=default", "trainer.fault.delay_ms=-1", "low", "trainer.fault.delay_ms=-1"),
    # logger
    Row("logger=wandb", "logger.mode=onlin", "choice", "logger.mode='onlin'"),
    # network: every option is a preset of the one schema, so each takes the same rows
    *(
        row
        for option in ("none", "nvlink", "ib-ndr400", "100gbe", "10gbe", "1gbe")
        for row in (
            Row(f"network={option}", "network.preset=2gbe", "choice", "network.preset='2gbe'"),
            Row(f"network={option}", "network.latency_us=-1", "low", "network.latency_us=-1.0"),
            Row(f"network={option}", "network.bandwidth_gbps=0", "low", "network.bandwidth_gbps=0.0"),
            Row(f"network={option}", "network.gpus_per_node=0", "low", "network.gpus_per_node=0"),
            Row(f"network={option}", "network.intra=loopback", "choice", "network.intra='loopback'"),
            Row(f"network={option}", "network.intra_latency_us=-1", "low", "network.intra_latency_us=-1.0"),
            Row(f"network={option}", "network.intra_bandwidth_gbps=0", "low", "network.intra_bandwidth_gbps=0.0"),
            Row(f"network={option}", "network.time_scale=0", "low", "network.time_scale=0.0"),
        )
    ),
]


def _argv(row: Row) -> list[str]:
    return [*row.options.split(), row.override]


@pytest.mark.parametrize("row", TABLE, ids=[" ".join(_argv(r)) for r in TABLE])
def test_a_bad_value_is_refused_naming_the_key_and_the_value(row: Row, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        check_command_line(_argv(row), rank=0)  # what train.py runs before Hydra's app, without a job store
    except SystemExit as exited:
        assert exited.code == EXIT_CODE, f"{' '.join(_argv(row))}: exit {exited.code}, not {EXIT_CODE}"
    else:
        pytest.fail(f"{' '.join(_argv(row))} was accepted: is its bound or choice list still in the schema?")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("configuration error: "), lines
    assert row.key in lines[0] and row.said in lines[0], f"expected {row.said!r} in: {lines[0]}"


def _leaves(schema: type, prefix: str) -> list[tuple[str, Key]]:
    """(full key, Key) of every leaf field, those of nested dataclasses (trainer.fault) included."""
    typing.get_type_hints(schema)
    found: list[tuple[str, Key]] = []
    for field in dataclasses.fields(schema):
        inner = nested(schema, field.name)  # trainer.fault
        if inner is not None:
            found += _leaves(inner, f"{prefix}{field.name}.")
        else:
            found.append((f"{prefix}{field.name}", key_of(schema, field.name)))
    return found


def _sides(spec: Key) -> set[str]:
    """What a key's declaration restricts beyond its type, in the table's words."""
    sides = {"low"} if spec.ge is not None or spec.gt is not None else set()
    sides |= {"high"} if spec.le is not None or spec.lt is not None else set()
    sides |= {"choice"} if spec.choices else set()
    sides |= {"length"} if spec.length is not None else set()
    return sides


def _declared() -> set[tuple[str, str, str]]:
    """(group=option, full key, side) of every bound, choice list and length the schemas declare."""
    found: set[tuple[str, str, str]] = set()
    for group, options in SCHEMAS.items():
        for option, schema in options.items():
            for key, spec in _leaves(schema, f"{group}."):
                found |= {(f"{group}={option}", key, side) for side in _sides(spec)}
    return found


def _tabled() -> set[tuple[str, str, str]]:
    """(group=option, full key, side) of every row: the option is the one of the key's own group."""
    found: set[tuple[str, str, str]] = set()
    for row in TABLE:
        group = row.key.split(".")[0]
        option = next(o for o in row.options.split() if o.startswith(f"{group}="))
        found.add((option, row.key, row.side))
    return found


def test_the_table_covers_every_bound_and_choice() -> None:
    declared, tabled = _declared(), _tabled()
    missing = sorted(declared - tabled)
    assert not missing, (
        f"bounds or choices without a hand-written row in tests/test_config_refusals.py's TABLE: {missing}"
    )
    stale = sorted(tabled - declared)
    assert not stale, f"rows whose bound or choice list the schema no longer declares: {stale}"


def test_the_table_is_well_formed() -> None:
    argvs = [" ".join(_argv(r)) for r in TABLE]
    assert len(argvs) == len(set(argvs)), sorted({a for a in argvs if argvs.count(a) > 1})
    for row in TABLE:
        assert row.side in ("low", "high", "choice", "length"), row
        assert row.said.startswith(f"{row.key}="), row  # the message's "key=value", the key as typed
