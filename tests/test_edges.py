"""The equivalence promise at its edges, on 2 real gloo ranks against one process in float64:
tied weights under every strategy, a layer reused under reentrant checkpointing, a parameter unused
on every rank or on one (zero stage 3: also inside a unit every rank runs, or a unit whose output
one rank drops), every grouping of manual, a parameter unused in some steps (hierarchical too),
zero, the flat-buffer strategies and hierarchical after a plain optimizer.zero_grad(), and the timed
collective's future. One launch serves every case (torch start-up is the cost)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_helpers import run_on_ranks
from tests.edge_models import Case, batch, make, optimizer_for, reference, train
from tests.observe_helpers import on_the_wire, sampled, sent, watch_every_step
from tests.sync_helpers import class_from_yaml, from_yaml
from tests.test_fsdp import real_collectives
from trainer.sync.comm import Comm
from trainer.sync.describe import describe
from trainer.sync.flat import FlatGrads
from trainer.sync.fsdp import FSDPSync
from trainer.sync.none import NoSync
from trainer.sync.zero import ZeroSync
from trainer.sync.zero3 import Zero3Sync


class NativeZero3(Zero3Sync):
    """zero stage 3 sending what it sends on NCCL (or on an emulated link): all_gathers and
    reduce_scatters, here on gloo, whose slow paths it otherwise replaces."""

    def wrap(self, model: Any) -> Any:
        wrapped = super().wrap(model)
        self._native = True
        return wrapped


def timed(make: Any) -> Any:
    """The strategy with every step's collectives watched by the observer (the loop samples 1 step in n)."""
    return watch_every_step(make())


# Each strategy as its conf/sync/ YAML builds it (the defaults live there), a test's keys changed.
MANUAL, BUCKETED, DDP, FSDP = (partial(from_yaml, option) for option in ("manual", "bucketed", "ddp", "fsdp"))
ZERO, ZERO3, NATIVE_ZERO3 = (partial(class_from_yaml, cls, "zero") for cls in (ZeroSync, Zero3Sync, NativeZero3))
# The two-level strategies on 2 ranks: 2 nodes of 1 (sync.shard's default outside torchrun) or 1 node of 2.
HIERARCHICAL, HSDP = (partial(from_yaml, option) for option in ("hierarchical", "hsdp"))
TINY_MB = 300 / 2**20  # below the branch's 8x8 float64 weight (512 bytes): that tensor makes a group alone
FIND = {"find_unused_parameters": True}

EVERY_STRATEGY = {
    "none": NoSync,
    "manual": MANUAL,
    "manual-rs_ag": partial(MANUAL, collective="rs_ag"),
    "manual-alone": partial(MANUAL, coalesce_mb=0),
    "bucketed": partial(BUCKETED, bucket_cap_mb=TINY_MB),
    "bucketed-rs_ag": partial(BUCKETED, bucket_cap_mb=TINY_MB, collective="rs_ag"),
    "ddp": DDP,
    "zero": ZERO,
    "zero-tiny": partial(ZERO, bucket_cap_mb=TINY_MB),  # a bucket per tensor or two, several in flight
    "zero-stage1": partial(ZERO, stage=1, bucket_cap_mb=TINY_MB),
    "fsdp": FSDP,  # wrap=auto: the blocks are units, the tied embedding and head in the root
    "fsdp-module": partial(FSDP, wrap="module"),  # the tied modules are left to the root
    "zero3": ZERO3,  # as fsdp's units: the blocks, the tied embedding and head in the root
    "zero3-module": partial(ZERO3, wrap="module", prefetch=2),
    "zero3-no-prefetch": partial(ZERO3, prefetch=0, reshard_after_forward=False),
    "zero3-native": NATIVE_ZERO3,  # reduce_scatter and all_gather: NCCL's path
    "zero3-native-module": partial(NATIVE_ZERO3, wrap="module", prefetch=2),
    "hierarchical": HIERARCHICAL,  # each bucket all-reduced across the 2 nodes of 1
    "hierarchical-node": partial(HIERARCHICAL, shard=2, bucket_cap_mb=TINY_MB),  # scattered, gathered in a node
    "hsdp": HSDP,  # each unit whole on its rank, its gradients all-reduced across the nodes
    "hsdp-node": partial(HSDP, shard=2),  # one node: fsdp's shards
}
MANUAL_GROUPINGS = {
    "manual": (partial(MANUAL, **FIND), "branchy"),
    "manual-rs_ag": (partial(MANUAL, collective="rs_ag", **FIND), "branchy"),
    "manual-coalesce0": (partial(MANUAL, coalesce_mb=0, **FIND), "branchy"),
    "manual-above-cap": (partial(MANUAL, coalesce_mb=TINY_MB, **FIND), "branchy"),
    "manual-mixed-dtypes": (partial(MANUAL, **FIND), "branchy-mixed"),
    "zero": (partial(ZERO, **FIND), "branchy"),
    "zero-tiny": (partial(ZERO, bucket_cap_mb=TINY_MB, **FIND), "branchy"),
    "zero-stage1": (partial(ZERO, stage=1, bucket_cap_mb=TINY_MB, **FIND), "branchy"),
    "ddp": (partial(DDP, **FIND), "branchy"),
    "zero3": (partial(ZERO3, wrap="block", **FIND), "branchy"),  # no blocks: every parameter in the root
    "hierarchical": (partial(HIERARCHICAL, shard=2, **FIND), "branchy"),
}

CASES: dict[str, Case] = {
    **{f"tied-{name}": Case("tied", make, replicas=name not in ("none",)) for name, make in EVERY_STRATEGY.items()},
    # A layer reused under reentrant checkpointing: its hook fires three times per backward.
    "reused-manual": Case("reused", MANUAL),
    "reused-bucketed": Case("reused", partial(BUCKETED, bucket_cap_mb=TINY_MB)),
    "reused-bucketed-one-bucket": Case("reused", BUCKETED),
    "reused-bucketed-rs_ag": Case("reused", partial(BUCKETED, bucket_cap_mb=TINY_MB, collective="rs_ag")),
    "reused-bucketed-timed": Case("reused", partial(timed, partial(BUCKETED, bucket_cap_mb=TINY_MB))),
    "reused-nonreentrant-bucketed": Case("reused-nonreentrant", partial(BUCKETED, bucket_cap_mb=TINY_MB)),
    "reused-ddp-static": Case("reused", partial(DDP, static_graph=True)),
    "reused-zero": Case("reused", ZERO),
    "reused-zero-tiny": Case("reused", partial(ZERO, bucket_cap_mb=TINY_MB)),  # staged, added to, sent
    "reused-fsdp-root": Case("reused", partial(FSDP, wrap="block")),  # no blocks: the root reduces once
    "reused-nonreentrant-fsdp": Case("reused-nonreentrant", FSDP),
    "frozen-twice-fsdp": Case("frozen", FSDP),  # a unit run twice without grad, but frozen: not refused
    "reused-zero-stage1": Case("reused", partial(timed, partial(ZERO, stage=1, bucket_cap_mb=TINY_MB))),
    "reused-nonreentrant-zero3": Case("reused-nonreentrant", ZERO3),  # a unit gathered twice in a forward
    "reused-nonreentrant-zero3-native": Case("reused-nonreentrant", NATIVE_ZERO3),
    "reused-zero3-root": Case("reused", partial(ZERO3, wrap="block")),
    "reused-hierarchical": Case("reused", partial(HIERARCHICAL, shard=2, bucket_cap_mb=TINY_MB)),
    **{f"unused-all-{n}": Case(m, s) for n, (s, m) in MANUAL_GROUPINGS.items()},
    **{f"unused-one-{n}": Case(m, s, branch_ranks=(1,)) for n, (s, m) in MANUAL_GROUPINGS.items()},
    "unused-all-fsdp": Case("branchy", FSDP),
    "unused-all-fsdp-root": Case("branchy", partial(FSDP, wrap="block")),
    # zero after a plain optimizer.zero_grad() (set_to_none), and the flat-buffer strategies too
    "zero-grad-zero": Case("tied", ZERO, plain_zero_grad=True),
    "zero-grad-zero-stage1": Case("tied", partial(ZERO, stage=1, bucket_cap_mb=TINY_MB), plain_zero_grad=True),
    "zero-grad-zero3": Case("tied", ZERO3, plain_zero_grad=True),
    "zero-grad-manual": Case("tied", MANUAL, plain_zero_grad=True),
    "zero-grad-bucketed": Case("tied", partial(BUCKETED, bucket_cap_mb=TINY_MB), plain_zero_grad=True),
    "zero-grad-hierarchical": Case("tied", partial(HIERARCHICAL, shard=2, bucket_cap_mb=TINY_MB), plain_zero_grad=True),
    "zero-grad-hierarchical-nodes": Case("tied", HIERARCHICAL, plain_zero_grad=True),  # 2 nodes of 1
}
# A parameter unused in some steps (4 steps, both optimizers): by every rank in step 2 (an expert no
# sample chose), by every rank in step 1, by rank 1 only in step 2, by rank 1 only in step 1.
SCHEDULES = {"all-later": {1: ()}, "all-first": {0: ()}, "some-later": {1: (0,)}, "some-first": {0: (0,)}}


def scheduled(name: str, strategy: Any, schedule: str, optimizer: str) -> tuple[str, Case]:
    case = Case("branchy", strategy, (0, 1), branch_steps=SCHEDULES[schedule], optimizer=optimizer, steps=4)
    return f"sometimes-{schedule}-{name}-{optimizer}", case


def _schedules(names: dict[str, Any], schedules: tuple[str, ...], optimizers: tuple[str, ...]) -> dict[str, Case]:
    return dict(scheduled(n, s, sched, o) for n, s in names.items() for sched in schedules for o in optimizers)


EVERY, OPTIMIZERS = tuple(SCHEDULES), ("sgd", "adamw")
FUP = {
    "manual": partial(MANUAL, **FIND),
    "ddp": partial(DDP, **FIND),
    "zero": partial(ZERO, **FIND),
    "zero-stage1": partial(ZERO, stage=1, bucket_cap_mb=TINY_MB, **FIND),
    "zero3-root": partial(ZERO3, wrap="block", **FIND),  # no blocks: every parameter in the root unit
    "hierarchical": partial(HIERARCHICAL, shard=2, bucket_cap_mb=TINY_MB, **FIND),  # 1 node of 2
    "hierarchical-nodes": partial(HIERARCHICAL, **FIND),  # 2 nodes of 1
}
# Each equals one process: with find_unused_parameters a parameter no rank used gets no update, one
# some ranks used is averaged as sum / N. zero's flat shard has one step count per piece, so a
# parameter no rank used is refused with a step-counted optimizer (AdamW) below, equal with SGD.
REPLICATED_FUP = ("manual", "ddp", "hierarchical", "hierarchical-nodes")
SHARDED_FUP = {k: v for k, v in FUP.items() if k not in REPLICATED_FUP}
CASES |= _schedules({k: v for k, v in FUP.items() if k not in SHARDED_FUP}, EVERY, OPTIMIZERS)
CASES |= _schedules(SHARDED_FUP, EVERY, ("sgd",))
CASES |= _schedules(SHARDED_FUP, ("some-later", "some-first"), ("adamw",))
CASES |= _schedules({"zero3-unit": partial(ZERO3, wrap="module", **FIND)}, ("all-later", "all-first"), ("sgd",))
# zero stage 3 reduces each unit as its backward ends, from step 1 on, find_unused_parameters too. The
# gated block is a unit every rank runs: without the branch a rank reduces it on the gradients that
# came; with its output dropped (discarded) none comes, and its turn is taken where backward reaches
# the next unit, so that the ranks' collectives pair up. The first block is the last unit backward
# reaches: dropped there, its turn comes after backward, before any control collective.
GATED = {
    "zero3-gated": (partial(ZERO3, wrap="block", **FIND), "gated"),
    "zero3-discarded": (partial(ZERO3, wrap="block", **FIND), "gated-discard"),
    "zero3-first-discarded": (partial(ZERO3, wrap="block", **FIND), "gated-first-discard"),
    "zero3-native-first-discarded": (partial(NATIVE_ZERO3, wrap="block", prefetch=0, **FIND), "gated-first-discard"),
}
CASES |= {f"unused-one-{n}": Case(m, s, branch_ranks=(1,)) for n, (s, m) in GATED.items()}
CASES |= {f"unused-all-{n}": Case(m, s) for n, (s, m) in GATED.items()}
CASES |= {
    f"sometimes-{sched}-{n}-{o}": Case(m, s, (0, 1), branch_steps=SCHEDULES[sched], optimizer=o, steps=4)
    for n, (s, m) in GATED.items()
    for sched, optimizers in (("some-later", OPTIMIZERS), ("some-first", OPTIMIZERS), ("all-later", ("sgd",)))
    for o in optimizers
}
FSDP_EVERY_FORWARD = {
    "fsdp-fup": partial(FSDP, **FIND),  # the branch is a unit (Branchy has no ModuleList)
    "fsdp-root-fup": partial(FSDP, wrap="block", **FIND),  # every parameter in the root unit
}
CASES |= _schedules(
    {"fsdp": FSDP, "fsdp-root": partial(FSDP, wrap="block"), **FSDP_EVERY_FORWARD},
    ("all-later", "all-first"),
    OPTIMIZERS,
)

# Refused on every rank alike, naming the parameter, before the first optimizer step.
REFUSED = {
    "unused-all-manual-noflag": (Case("branchy", MANUAL), "'branch.weight'"),
    "unused-one-manual-noflag": (Case("branchy", partial(MANUAL, coalesce_mb=0), branch_ranks=(1,)), "1 of 2"),
    "unused-all-zero-noflag": (Case("branchy", ZERO), "'branch.weight'"),
    "unused-one-zero-noflag": (Case("branchy", partial(ZERO, bucket_cap_mb=TINY_MB), branch_ranks=(1,)), "1 of 2"),
    "unused-all-bucketed": (Case("branchy", BUCKETED), "'branch.weight'"),
    "unused-one-bucketed": (Case("branchy", BUCKETED, branch_ranks=(1,)), "'branch.weight'"),
    # fsdp: the branch is a unit rank 0 skips (module), or parameters of the root it leaves out (block:
    # Branchy has no ModuleList, so every parameter is in the root)
    "unused-one-fsdp": (Case("branchy", FSDP, branch_ranks=(1,)), "'branch.weight'"),
    "unused-one-fsdp-root": (Case("branchy", partial(FSDP, wrap="block"), branch_ranks=(1,)), "1 of 2"),
    "unused-rank0-fsdp": (Case("branchy", FSDP, branch_ranks=(0,)), "'branch.weight'"),
    # the shared layer is a unit run in two reentrant checkpoints and outside: FSDP2 reduces it early
    "reused-fsdp": (Case("reused", FSDP), "'shared.weight'"),
    "unused-one-fsdp-last": (Case("branchy-last", FSDP, branch_ranks=(1,)), "'branch.weight'"),
    # zero stage 3: a unit one rank skips (module: the branch is one), refused in the first forward;
    # a parameter of the root one rank leaves out, after the first backward (unused.py's rule)
    "unused-one-zero3-unit": (Case("branchy", partial(ZERO3, **FIND), branch_ranks=(1,)), "zero unit branch"),
    "unused-one-zero3-root": (Case("branchy", partial(ZERO3, wrap="block"), branch_ranks=(1,)), "1 of 2"),
    "unused-all-zero3-noflag": (Case("branchy", partial(ZERO3, wrap="block")), "'branch.weight'"),
    # the shared layer is a unit run under reentrant checkpoints: its backward reruns it unannounced
    "reused-zero3": (Case("reused", ZERO3), "zero unit shared"),
    # a unit every rank runs, its branch left out or its output dropped on one rank: reduced during
    # backward where it got its gradients, refused after it on every rank alike
    "unused-one-zero3-gated-noflag": (
        Case("gated", partial(ZERO3, wrap="block"), branch_ranks=(1,)),
        "'blocks.2.branch.weight' (used on 1 of 2 ranks)",
    ),
    "unused-one-zero3-discarded-noflag": (
        Case("gated-discard", partial(ZERO3, wrap="block"), branch_ranks=(1,)),
        "'blocks.2.main.weight' (used on 1 of 2 ranks)",
    ),
    "unused-one-zero3-first-discarded-noflag-no-prefetch": (
        Case("gated-first-discard", partial(ZERO3, wrap="block", prefetch=0), branch_ranks=(0,)),
        "'blocks.0.main.weight' (used on 1 of 2 ranks)",
    ),
    "unused-all-hierarchical-noflag": (Case("branchy", HIERARCHICAL), "'branch.weight'"),
    "reused-hsdp": (Case("reused", partial(HSDP, shard=2)), "'shared.weight'"),  # fsdp's refusal
}
# ...or at the first later step where a parameter goes without a gradient on every rank: without
# find_unused_parameters each rank checks its own (sending zeros would step it where one process
# skips it); zero with find_unused_parameters and AdamW (its step count is the shard piece's).
NO_FUP = {
    "manual-noflag": MANUAL,
    "bucketed": partial(BUCKETED, bucket_cap_mb=TINY_MB),
    "zero-noflag": ZERO,
    "zero3-root-noflag": partial(ZERO3, wrap="block"),
    "hierarchical-noflag": partial(HIERARCHICAL, shard=2),
}
REFUSED |= {name: (case, "'branch.weight'") for name, case in _schedules(NO_FUP, ("all-later",), OPTIMIZERS).items()}
NEVER_USED = _schedules(SHARDED_FUP, ("all-later", "all-first"), ("adamw",))
REFUSED |= {name: (case, "with torch.optim.AdamW") for name, case in NEVER_USED.items()}
# zero stage 3 with find_unused_parameters agrees on each unit every forward: a unit one rank skips in a
# later step is refused there, before its gathers could pair with another unit's.
REFUSED |= {
    name: (case, "zero unit branch")
    for name, case in _schedules(
        {"zero3-unit": partial(ZERO3, wrap="module", **FIND)}, ("some-later",), OPTIMIZERS
    ).items()
}
# fsdp with find_unused_parameters checks every training forward as the first: a unit one rank skips
# later, or a root parameter it leaves out, is refused in that forward (FSDP2's collectives would not pair).
REFUSED |= {
    name: (case, "'branch.weight'")
    for name, case in _schedules(FSDP_EVERY_FORWARD, ("some-later",), OPTIMIZERS).items()
}


def _every_case(rank: int, world_size: int) -> dict[str, Any]:
    assert not set(CASES) & set(REFUSED), "a case name used twice would report one case's result for both"
    results = {name: train(rank, case) for name, case in CASES.items()}
    results.update({name: train(rank, case) for name, (case, _) in REFUSED.items()})
    results["timed-future"] = _timed_future(rank, world_size)
    results["shard-ops"] = {native: _shard_ops(rank, world_size, native) for native in (True, False)}
    results["fsdp-comm"] = {wrap: _fsdp_comm(rank, wrap) for wrap in ("auto", "module")}
    results["graph-changed"] = _graph_changed(rank)  # last: it stops a backward midway
    return results


def _graph_changed(rank: int) -> str:
    """bucketed after step 1 learned 3 hook calls for the shared layer: a 4th in step 2 is an error
    naming it, raised from the hook (on every rank here, as the graph changed on every rank)."""
    model = make("reused")
    sync = BUCKETED(bucket_cap_mb=TINY_MB)
    sync.wrap(model)
    for step in range(2):
        model.extra = step == 1
        x, y = batch("reused", step, rank)
        try:
            F.cross_entropy(model(x), y).backward()
        except RuntimeError as err:
            dist.barrier()
            return str(err)
        sync.after_backward(model)
        sync.zero_grad(optimizer_for(model.parameters()))
    return "no error"


def _fsdp_comm(rank: int, wrap: str) -> dict[str, Any]:
    """One step of the tied model: what fsdp counted from its units, and what FSDP2 really sent."""
    model = make("tied")
    sync = FSDP(wrap=wrap)
    sync.wrap(model)
    optimizer = sync.build_optimizer(model, optimizer_for)
    with real_collectives() as real, sampled(sync) as row:
        x, y = batch("tied", 0, rank)
        F.cross_entropy(model(x), y).backward()
        sync.after_backward(model)
        sync.optimizer_step(optimizer)
    return {"counted": sent(row), "real": on_the_wire(real, 2), "describe": describe(sync)}


def _shard_ops(rank: int, world_size: int, native: bool) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """zero's two forms of reduce-to-shard and gather (native: NCCL's; else gloo's), on one gloo group,
    through zero.py's own _reduce, _average and _gather on one bucket of 8 float64 weights."""
    model = torch.nn.Linear(8, 1, bias=False).double()
    sync = ZERO(bucket_cap_mb=1.0)
    sync.wrap(model)
    sync.build_optimizer(model, optimizer_for)
    sync._native = native
    model.weight.grad = (torch.arange(8.0, dtype=torch.float64) * (rank + 1) + 0.5).view(1, 8)  # sums exact in binary
    assert sync._grads is not None and sync.param_shard is not None and sync.flat is not None
    sync._grads.hold(0, 0, model.weight, first=True)  # as its hook does: staged (stage 2)
    with sampled(sync) as row:
        sync._reduce(0).wait()
        sync._average(0)  # the average: halves of these sums are exact too
        shard = sync._grads.shards[0].clone()
        sync.param_shard.copy_(shard * 10)
        for work in sync._gather(0):
            work.wait()
    return shard, sync.flat.clone(), list(sent(row))


def _timed_future(rank: int, world_size: int) -> tuple[Any, torch.Tensor]:
    """A timed collective on a real gloo pair: what its wait() returns, and the bucket after it."""
    comm = Comm()
    comm.observer.every = 1
    comm.observer.begin_step(1)
    param = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    bucket = FlatGrads([[param]], world_size).buckets[0]
    bucket.grads.copy_(torch.arange(5.0) + rank)
    waited = comm.all_reduce(bucket.grads).wait()
    comm.observer.end_step()
    assert comm.observer.take()["time/comm_s"] > 0, "the collective was watched, launch to completion"
    return waited, bucket.grads.clone()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(_every_case, 2, tmp_path_factory.mktemp("edges") / "run", timeout_s=600)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        tol = 1e-5 if want[key].dtype == torch.float32 else 1e-10
        diff = (got[key].double() - want[key].double()).abs().max().item()
        assert diff < tol, f"{key}: off by {diff:.3g}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_trains_what_one_process_trains(results: list[dict[str, Any]], name: str) -> None:
    case = CASES[name]
    if not case.replicas:  # none: each rank trains one process's model on its own samples
        for rank in (0, 1):
            _close(results[rank][name]["params"], reference(case, ranks=(rank,)))
        return
    assert "error" not in results[0][name], results[0][name].get("error")
    _close(results[0][name]["params"], reference(case))
    if not isinstance(case.strategy(), FSDPSync):  # fsdp: rank 0 holds the full state
        _close(results[1][name]["params"], results[0][name]["params"])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_on_every_rank_naming_the_parameter(results: list[dict[str, Any]], name: str) -> None:
    _, names = REFUSED[name]
    messages = [results[rank][name].get("error") for rank in (0, 1)]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert names in messages[0] and "sync." in messages[0], messages[0]


def test_unused_parameter_gets_no_update(results: list[dict[str, Any]]) -> None:
    """What the reference comparison implies, said directly: the branch no rank used kept its start."""
    for name, (_, model) in MANUAL_GROUPINGS.items():
        untouched = make(model).state_dict()
        for key in ("branch.weight", "branch.bias"):
            assert torch.equal(results[0][f"unused-all-{name}"]["params"][key], untouched[key]), (name, key)


def test_a_timed_collective_is_waited_for_and_reduced(results: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        waited, bucket = results[rank]["timed-future"]
        expected = (torch.arange(5.0) * 2 + 1).double()
        assert waited is True  # the Work's own wait (on CUDA it orders the waiting stream after NCCL's)
        assert torch.equal(bucket, expected)


def test_both_forms_of_zeros_collectives_give_the_same_bits(results: list[dict[str, Any]]) -> None:
    """reduce_scatter + all_gather (NCCL), all_reduce + a slice + a broadcast per rank (gloo's fast form)."""
    total = torch.arange(8.0, dtype=torch.float64) * 3 + 1.0  # rank 0's (x1) and rank 1's (x2), summed
    for rank, result in enumerate(results):
        for native, kinds in ((True, ["reduce_scatter", "all_gather"]), (False, ["all_reduce", "broadcast"])):
            shard, gathered, used = result["shard-ops"][native]
            assert used == kinds
            assert torch.equal(shard, total[rank * 4 : rank * 4 + 4] / 2), (native, shard)
            assert torch.equal(gathered, total * 5), (native, gathered)


def test_fsdp_counts_the_tied_model_units_it_really_sends(results: list[dict[str, Any]]) -> None:
    """block (auto): two block units and the root (embedding = head, norm); module: the blocks' and
    the norm's Linear/LayerNorm units, the tied pair left to the root. Counted from the layout = sent."""
    for rank in results:
        for wrap, units in (("auto", 3), ("module", 4)):
            got = rank["fsdp-comm"][wrap]
            assert got["describe"]["num_units"] == units and got["describe"]["wrap_in_use"] in ("block", "module")
            assert got["counted"] == got["real"], wrap


def test_summary_records_each_parameter_block() -> None:
    """What python -m trainer.scaling --fsdp-wrap reads: the ModuleList element of each parameter."""
    from tests.edge_models import Tied
    from trainer.loop.summary import parameter_layout

    tensors = parameter_layout(Tied())["parameter_tensors"]
    assert [(t["name"], t["block"]) for t in tensors] == [
        ("emb.weight", None),  # the head's weight is this one: listed once
        ("blocks.0.0.weight", "blocks.0"),
        ("blocks.0.0.bias", "blocks.0"),
        ("blocks.1.0.weight", "blocks.1"),
        ("blocks.1.0.bias", "blocks.1"),
        ("norm.weight", None),
        ("norm.bias", None),
    ]


def test_a_changed_graph_is_an_error_naming_the_parameter(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert "'shared.bias' got gradient number 4" in rank["graph-changed"], rank["graph-changed"]
        assert "3 in the first step" in rank["graph-changed"]
