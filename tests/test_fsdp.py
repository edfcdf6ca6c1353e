"""sync=fsdp (FSDP2's fully_shard) on real gloo ranks: the same model as one process on the doubled
batch, half the optimizer state, the checkpoint contract and bit-identical resume, and the
communication it reports against the collectives FSDP2 really issued."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from tests.observe_helpers import on_the_wire, sent
from tests.train_helpers import SIX_STEPS, bit_identical, build, case_results, max_abs_diff, train_each
from trainer.errors import ConfigError
from trainer.loop.metrics import optimizer_state_mb
from trainer.setup.build import build_parts, check_device
from trainer.setup.precheck import check_overrides
from trainer.sync.describe import describe

# As tests/test_equivalence.py: 64 samples, 2 ranks x 8 = 4 steps per epoch, 6 steps cross an epoch.
COMMON = [
    "logger=none",
    "model.hidden_sizes=[32,32]",
    *SIX_STEPS,
]


def full_params(trainer: Any) -> dict[str, torch.Tensor]:
    """The full model on rank 0 ({} elsewhere): a collective, so every rank calls it."""
    model_state, _ = trainer.sync.checkpointing.state_dicts(trainer.model, trainer.optimizer)
    return {k: v.detach().cpu().clone() for k, v in model_state.items()}


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    trainer = build(rank, world_size, COMMON + overrides, run_dir)
    start = trainer.step  # > 0 when it resumed
    trainer.fit()
    return {
        "params": full_params(trainer),
        "optimizer_mb": optimizer_state_mb(trainer.optimizer),
        "start": start,
        "skipped": trainer._rows.skipped_steps,
    }


def resume(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """6 steps with a checkpoint at step 3; then as if the run had died after it: resume, to step 6."""
    first = train(rank, world_size, overrides, run_dir)
    ckpt = Path(run_dir) / "checkpoints"
    if rank == 0:
        for name in ("step-6.pt", "last.pt"):
            (ckpt / name).unlink()
        os.link(ckpt / "step-3.pt", ckpt / "last.pt")
    dist.barrier()  # nobody resumes before rank 0 has put step 3 back as last.pt
    resumed = train(rank, world_size, overrides, run_dir)
    # The file a plain model will be loaded from: the final checkpoint the resumed run wrote.
    saved = torch.load(ckpt / "last.pt", weights_only=True) if rank == 0 else None
    return {"first": first["params"], "resumed": resumed["params"], "start": resumed["start"], "saved": saved}


@contextmanager
def real_collectives() -> Iterator[dict[str, list[int]]]:
    """What FSDP2 really sends: its default all-gather and reduce-scatter call these two functions."""
    seen: dict[str, list[int]] = {"all_gather": [0, 0], "reduce_scatter": [0, 0]}
    originals = dist.all_gather_single, dist.reduce_scatter_single

    def counted(kind: str, fn: Callable[..., Any], buffer: str, position: int) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = kwargs[buffer] if buffer in kwargs else args[position]
            seen[kind][0] += tensor.numel() * tensor.element_size()  # the whole (unsharded) buffer
            seen[kind][1] += 1
            return fn(*args, **kwargs)

        return call

    dist.all_gather_single = counted("all_gather", originals[0], "output_tensor", 0)  # type: ignore[assignment]
    dist.reduce_scatter_single = counted("reduce_scatter", originals[1], "input", 1)  # type: ignore[assignment]
    try:
        yield seen
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = originals  # type: ignore[assignment]


# Layers of 32 -> 7 -> 5 -> 3: dim 0 of 7, 5 and 3 rows is padded to 8, 6 and 4 at 2 ranks.
ODD = ["model.hidden_sizes=[7,5]", "data.num_classes=3", "trainer.log_every_n_steps=100"]


def comm(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """Step 1, step 2 (sampled), then an evaluation, then step 3 (sampled): what the observer counted
    on the sampled steps and what really went in them."""
    trainer = build(rank, world_size, COMMON + ODD + overrides, run_dir)
    trainer.train(1)
    trainer.observer.every = 1  # every step sampled from here
    with real_collectives() as real:
        trainer.train(2)
    counted = trainer.observer.take()
    trainer.evaluate()  # forwards without backward, without grad
    with real_collectives() as real_after_eval:
        trainer.train(3)
    counted_after_eval = trainer.observer.take()
    return {
        "counted": sent(counted),
        "bytes": counted["comm/bytes_per_step"],
        "real": on_the_wire(real, world_size),
        "counted_after_eval": sent(counted_after_eval),
        "real_after_eval": on_the_wire(real_after_eval, world_size),
        "describe": describe(trainer.sync),
    }


EQUIVALENCE = {
    "sgd": ["sync=fsdp", "optim=sgd", "data.batch_size=8"],
    "adamw": ["sync=fsdp", "optim=adamw", "data.batch_size=8"],
    "sgd-keep": ["sync=fsdp", "sync.reshard_after_forward=false", "optim=sgd", "data.batch_size=8"],
    "adamw-keep": ["sync=fsdp", "sync.reshard_after_forward=false", "optim=adamw", "data.batch_size=8"],
    # 2 micro-batches of 4 per rank: the first under no_sync (no reduce-scatter).
    "sgd-accum": ["sync=fsdp", "optim=sgd", "data.batch_size=4", "trainer.grad_accum_steps=2"],
    "adamw-accum": ["sync=fsdp", "optim=adamw", "data.batch_size=4", "trainer.grad_accum_steps=2"],
}
OTHERS = {
    "ddp-adamw": ["sync=ddp", "optim=adamw", "data.batch_size=8"],  # optimizer state to compare with
    # 65 training and 17 val samples: one rank has a last batch of 1 the other lacks, so the other
    # runs forward and backward on 0 samples (the all-gathers pair up), in training and evaluation.
    "uneven": [
        "sync=fsdp",
        "data.batch_size=8",
        "data.drop_last=false",
        "data.num_samples=65",
        "data.num_val_samples=17",
        "trainer.eval_every_n_steps=2",
        "trainer.max_steps=9",
    ],
    # A NaN loss on rank 1 at step 3: every rank's gradient shard is NaN after the reduce-scatter,
    # and all agree (the gradient norm's all_reduce) to skip that step.
    "nan-skip": [
        "sync=fsdp",
        "data.batch_size=8",
        "trainer.on_nonfinite=skip",
        "trainer.fault.kind=nan_loss",
        "trainer.fault.rank=1",
        "trainer.fault.at_step=3",
    ],
}
RESUME = {"resume": ["sync=fsdp", "optim=adamw", "data.batch_size=8", "trainer.checkpoint_every_n_steps=3"]}
COMM = {
    "comm": ["sync=fsdp", "data.batch_size=8"],
    "comm-keep": ["sync=fsdp", "sync.reshard_after_forward=false", "data.batch_size=8"],
    "comm-accum": ["sync=fsdp", "data.batch_size=4", "trainer.grad_accum_steps=2"],
}


def all_cases(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every 2-rank case in one spawn of the ranks (a spawn costs more than a case's training)."""
    return {
        **train_each(rank, world_size, train, {**EQUIVALENCE, **OTHERS}, root),
        **train_each(rank, world_size, resume, RESUME, root),
        **train_each(rank, world_size, comm, COMM, root),
    }


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fsdp")
    return run_on_ranks(all_cases, 2, root / "ranks", str(root / "runs"), timeout_s=600)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """One process, batch 16, per optimizer: what every 2-rank run with batch 8 must reproduce."""
    root = tmp_path_factory.mktemp("single")
    cases = {optim: ["sync=none", f"optim={optim}", "data.batch_size=16"] for optim in ("sgd", "adamw")}
    (results,) = run_on_ranks(train_each, 1, root / "ranks", train, cases, str(root / "runs"))
    return {optim: case_results([results], optim)[0]["params"] for optim in cases}


@pytest.mark.parametrize("case", EQUIVALENCE)
def test_two_ranks_equal_one_process_with_twice_the_batch(
    pairs: list[dict[str, Any]], single_process: dict[str, dict[str, torch.Tensor]], case: str
) -> None:
    rank0, rank1 = case_results(pairs, case)
    assert rank1["params"] == {}  # the full state is gathered to rank 0 only
    reference = single_process[case.split("-")[0]]
    assert max_abs_diff(rank0["params"], reference) <= 1e-5
    assert max_abs_diff(rank0["params"], initial_params()) > 1e-3, "nothing was trained"


def initial_params() -> dict[str, torch.Tensor]:
    cfg = compose_config(COMMON)
    return build_parts(cfg).model.state_dict()


def test_each_rank_holds_half_the_optimizer_state(pairs: list[dict[str, Any]]) -> None:
    for fsdp, ddp in zip(case_results(pairs, "adamw"), case_results(pairs, "ddp-adamw"), strict=True):
        assert 0.45 <= fsdp["optimizer_mb"] / ddp["optimizer_mb"] <= 0.55


def test_a_rank_without_data_runs_empty_batches(pairs: list[dict[str, Any]]) -> None:
    rank0, _ = case_results(pairs, "uneven")
    assert all(torch.isfinite(t).all() for t in rank0["params"].values())


def test_nonfinite_gradients_skip_the_step_on_every_rank(pairs: list[dict[str, Any]]) -> None:
    rank0, rank1 = case_results(pairs, "nan-skip")
    assert rank0["skipped"] == rank1["skipped"] == 1
    assert all(torch.isfinite(t).all() for t in rank0["params"].values())


def test_checkpoint_holds_the_plain_model_and_resume_is_bit_identical(pairs: list[dict[str, Any]]) -> None:
    rank0, _ = case_results(pairs, "resume")
    straight = case_results(pairs, "adamw")[0]["params"]
    assert bit_identical(rank0["first"], straight)  # checkpointing changes nothing
    assert rank0["start"] == 3 and bit_identical(rank0["resumed"], straight)
    # The contract: last.pt holds the plain model's state (and the optimizer's usual layout).
    saved = rank0["saved"]
    cfg = compose_config([*COMMON, "optim=adamw"])
    plain = build_parts(cfg).model
    assert list(saved["model"]) == list(plain.state_dict())
    plain.load_state_dict(saved["model"], strict=True)
    assert bit_identical(plain.state_dict(), straight)
    optimizer = torch.optim.AdamW(plain.parameters())
    optimizer.load_state_dict(saved["optimizer"])
    for param, state in zip(plain.parameters(), optimizer.state.values(), strict=True):
        assert state["exp_avg"].shape == param.shape  # full, not a shard


def odd_layout(world_size: int = 2) -> list[int]:
    """Each unit's padded unsharded fp32 bytes, by hand: (7x32 + 7), (5x7 + 5), (3x5 + 3) rows padded."""
    pad = lambda rows: math.ceil(rows / world_size) * world_size  # noqa: E731
    return [4 * (pad(7) * 32 + pad(7)), 4 * (pad(5) * 7 + pad(5)), 4 * (pad(3) * 5 + pad(3))]


@pytest.mark.parametrize(
    ("case", "gathers_per_step", "gathers_after_eval"),
    # reshard: each unit gathered in forward and again in backward; keep: in forward only;
    # accum: twice per micro-batch. The same in the step after an evaluation, whose forwards left
    # FSDP2's prefetch record stale and the units (keep) gathered: the step starts clean.
    [("comm", 2, 2), ("comm-keep", 1, 1), ("comm-accum", 4, 4)],
)
def test_counted_communication_is_what_fsdp_sent(
    pairs: list[dict[str, Any]], case: str, gathers_per_step: int, gathers_after_eval: int
) -> None:
    units = odd_layout()
    assert units == [1056, 192, 96]
    for rank in case_results(pairs, case):
        # On the wire (docs/metrics.md): an all_gather or reduce_scatter of S bytes on 2 ranks sends S/2.
        assert rank["counted"]["all_gather"] == [gathers_per_step * sum(units) / 2, gathers_per_step * 3]
        assert rank["counted"]["reduce_scatter"] == [sum(units) / 2, 3]  # once per step
        assert rank["bytes"] == (gathers_per_step + 1) * sum(units) // 2
        assert rank["counted"] == rank["real"]
        after = rank["counted_after_eval"]
        assert after.get("all_gather", [0, 0]) == [gathers_after_eval * sum(units) / 2, gathers_after_eval * 3]
        assert after["reduce_scatter"] == [sum(units) / 2, 3]
        assert rank["real_after_eval"] == after
        assert rank["describe"]["num_units"] == 3 and rank["describe"]["sharded_bytes_per_rank"] == sum(units) // 2


def test_bad_values_are_refused_with_the_key() -> None:
    # FSDP2's policy is trainer.param_dtype's now (every strategy's), and runs on the CPU too
    with pytest.raises(ConfigError, match=r"mixed_precision' is not a config key\. It moved: trainer\.param_dtype"):
        check_overrides(["sync=fsdp", "sync.mixed_precision=bf16"])
    with pytest.raises(ConfigError, match=r"sync\.reshard_after_forward=sometimes is invalid"):
        check_overrides(["sync=fsdp", "sync.reshard_after_forward=sometimes"])  # train.py's check of its command line
    cfg = compose_config(["sync=fsdp", "trainer.param_dtype=bf16"])
    check_device(build_parts(cfg), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"sync\.wrap='layer' is invalid: accepted: auto.*block.*module"):
        check_overrides(["sync=fsdp", "sync.wrap=layer"])


def test_units_per_wrap_keep_shared_parameters_in_one_unit() -> None:
    """sync.wrap's units (fsdp_units.choose_units, no process group needed): blocks or owning modules,
    and every candidate holding a parameter another one holds (tied weights) left to the root."""
    from tests.edge_models import Branchy, Tied
    from trainer.sync.fsdp_units import choose_units, resolve

    tied = Tied()
    units, root = choose_units(tied, "auto")
    assert resolve(tied, "auto") == "block" and units == list(tied.blocks)
    assert [id(p) for p in root] == [id(tied.emb.weight), id(tied.norm.weight), id(tied.norm.bias)]
    units, root = choose_units(tied, "module")  # emb and head share a weight: both left to the root
    assert units == [tied.blocks[0][0], tied.blocks[1][0], tied.norm] and [id(p) for p in root] == [id(tied.emb.weight)]
    branchy = Branchy()
    assert resolve(branchy, "auto") == "module" and choose_units(branchy, "auto")[0] == [
        branchy.trunk,
        branchy.branch,
        branchy.out,
    ]
    assert choose_units(branchy, "block") == ([], list(branchy.parameters()))  # no blocks: one root unit
    tied.blocks[1][0].weight = tied.blocks[0][0].weight  # a weight shared by two blocks
    units, _ = choose_units(tied, "block")
    assert units == []
