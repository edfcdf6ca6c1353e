"""The ZeRO ladder measured on 4 gloo ranks: the peak per rank falls stage by stage (ddp, zero stage 1,
2, 3), each step down saving at least half of what the ZeRO paper's terms say it should, in fp32 and
with 16-bit parameters, on an mlp whose parameters outweigh its activations (16 layers of 512, 4.2 M
parameters, 8 samples a rank): a unit of stage 3 is one layer, a sixteenth of the model.

The measured peak is each rank's `memory/peak_mb` (the sum of the kinds' peaks, every step sampled;
docs/metrics.md). The paper's model states per rank (Rajbhandari et al., figure 1) with P + G + K bytes
a parameter: stage 0 (P + G + K)Ψ, stage 1 (P + G)Ψ + KΨ/N, stage 2 PΨ + (G + K)Ψ/N, stage 3
(P + G + K)Ψ/N: what each stage saves over the one before is the difference of two of these.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist_helpers import run_on_ranks
from tests.train_helpers import build, case_results, train_each
from trainer.scaling.memory import zero_model_states

RANKS = 4
COMMON = [
    "logger=none",
    "trainer.progress_bar=false",
    f"model.hidden_sizes=[{','.join(['512'] * 16)}]",  # 16 units for stage 3, each 1/16 of the model
    "data.batch_size=8",
    "data.num_samples=256",
    "optim=adamw",
    "trainer.max_steps=3",
    "trainer.log_every_n_steps=1",  # every step sampled: its peak is in every row
    "trainer.eval_every_n_steps=0",
    "trainer.checkpoint=false",
]
LADDER = {  # stage: the strategy (1 MiB buckets: a few of them are far less than the 16.8 MB gradient)
    0: ["sync=ddp"],
    1: ["sync=zero", "sync.stage=1", "sync.bucket_cap_mb=1"],
    2: ["sync=zero", "sync.stage=2", "sync.bucket_cap_mb=1"],
    3: ["sync=zero", "sync.stage=3"],
}
# the paper's bytes per parameter: P, G, K (AdamW's two moments; with 16-bit parameters the fp32 copy too)
RECIPES = {"fp32": ([], (4, 4, 8)), "bf16": (["trainer.param_dtype=bf16", "trainer.reduce_dtype=bf16"], (2, 2, 12))}


def _peak(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir)
    trainer.train(3)
    rows = [row for row in trainer._rows.rows if "memory/peak_mb" in row]
    numel = sum(p.numel() for p in trainer.model.parameters())
    return {"peak_mb": max(row["memory/peak_mb"] for row in rows), "numel": numel}


def _ladder(rank: int, world_size: int, root: str) -> dict[str, Any]:
    cases = {f"{r}-{s}": [*o, *LADDER[s]] for r, (o, _) in RECIPES.items() for s in LADDER}
    return train_each(rank, world_size, _peak, cases, root)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("ladder")
    return run_on_ranks(_ladder, RANKS, root / "ranks", str(root / "runs"), timeout_s=600)


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_stage_saves_at_least_half_of_what_the_paper_says(ranks: list[dict[str, Any]], recipe: str) -> None:
    _, terms = RECIPES[recipe]
    for rank in range(RANKS):
        measured = [case_results(ranks, f"{recipe}-{stage}")[rank] for stage in LADDER]
        numel = measured[0]["numel"]
        paper = [zero_model_states(numel, RANKS, stage, *terms) / 2**20 for stage in LADDER]
        peaks = [m["peak_mb"] for m in measured]
        for stage in (1, 2, 3):
            saved, should = peaks[stage - 1] - peaks[stage], paper[stage - 1] - paper[stage]
            assert saved >= should / 2, (recipe, rank, stage, peaks, paper)
