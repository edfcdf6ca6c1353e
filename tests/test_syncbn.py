"""model.sync_batchnorm: the builder's conversion and its refusals; what plain BatchNorm does across ranks.

Two ranks sharing one GPU with SyncBatchNorm against one process with plain BatchNorm is in
test_gpu.py (marked `gpu`): torch's SyncBatchNorm refuses CPU tensors whenever a process group
exists, which test_cpu_refused_at_world_size_one_because_torch_refuses_it pins.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from models.cnn import CNN
from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import SIX_STEPS, bit_identical, build, case_results, max_abs_diff, params_of, train_each
from trainer.errors import ConfigError
from trainer.setup.build import build_parts, convert_sync_batchnorm, split_sync_batchnorm
from trainer.setup.precheck import check_overrides

# A small cnn with BatchNorm on 8x8 fake images; 64 samples, 2 ranks x 8 = 4 steps per epoch, as in
# test_equivalence.py: 6 steps cross an epoch boundary.
CNN_BN = [
    "logger=none",
    "model=cnn",
    "model.channels=[4,8]",
    "model.hidden_size=16",
    "model.batchnorm=true",
    "data=fake",
    "data.image_shape=[3,8,8]",
    *SIX_STEPS,
]


def train_cnn(
    rank: int, world_size: int, overrides: list[str], run_dir: str, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """train.py's build path on the helper's gloo group; the state dict holds BatchNorm's running statistics too."""
    if device.startswith("cuda"):
        # cuDNN's default TF32 convolutions round to ~1e-3, and may choose differently for batch 8 and 16.
        torch.backends.cudnn.allow_tf32 = False
    trainer = build(rank, world_size, CNN_BN + overrides, run_dir, device)
    trainer.fit()
    assert trainer.step == 6 and trainer.epoch == 1
    return params_of(trainer)


def initial_cnn_params() -> dict[str, torch.Tensor]:
    cfg = compose_config(CNN_BN)
    return build_parts(cfg).model.state_dict()


def weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained parameters, without BatchNorm's buffers (num_batches_tracked alone moves from 0 to 6)."""
    return {k: v for k, v in state.items() if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def batchnorms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


# --- the key: read and removed by the builder ---------------------------------------------------


def test_split_removes_the_key_and_returns_its_value() -> None:
    node = OmegaConf.create({"_target_": "models.cnn.CNN", "channels": [4], "sync_batchnorm": True})
    rest, value = split_sync_batchnorm(node)
    assert value is True and "sync_batchnorm" not in rest and list(rest.channels) == [4]
    assert "sync_batchnorm" in node  # the composed config itself is left alone
    mlp = OmegaConf.create({"_target_": "models.mlp.MLP"})
    assert split_sync_batchnorm(mlp) == (mlp, False)  # a model whose YAML lacks the key


def test_sync_batchnorm_must_be_a_boolean() -> None:
    # The schema types it: refused while composing, as train.py checks its command line.
    with pytest.raises(ConfigError, match=r"model\.sync_batchnorm=maybe is invalid: accepted: true or false"):
        check_overrides(["model=cnn", "data=fake", "model.batchnorm=true", "model.sync_batchnorm=maybe"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=cnn", "model.sync_batchnorm=true"],  # batchnorm defaults to false
        ["model=mlp", "+model.sync_batchnorm=true"],  # the mlp's constructor never sees the key
    ],
)
def test_sync_batchnorm_without_batchnorm_is_a_config_error(overrides: list[str]) -> None:
    """An error, not a warning: the user asked for synchronised statistics and would get none."""
    cfg = compose_config([*overrides, "data=fake"])
    with pytest.raises(ConfigError) as caught:
        build_parts(cfg)
    message = str(caught.value)
    assert "model.sync_batchnorm=true" in message and "no BatchNorm layer" in message
    assert "model.batchnorm=true" in message and "model.sync_batchnorm=false" in message


def test_mlp_has_no_sync_batchnorm_key_to_override() -> None:
    """Without '+', Hydra itself refuses the key on the mlp, before anything is built."""
    with pytest.raises(ConfigError, match="'model.sync_batchnorm' is not a config key"):
        compose_config(["model=mlp", "model.sync_batchnorm=true"])


@pytest.mark.parametrize("model", ["cnn", "resnet18"])
def test_build_parts_keeps_plain_batchnorm_until_the_device_is_known(model: str) -> None:
    extra = ["model.batchnorm=true"] if model == "cnn" else []
    cfg = compose_config(
        [f"model={model}", "data=fake", "data.image_shape=[3,8,8]", "model.sync_batchnorm=true", *extra]
    )
    parts = build_parts(cfg)
    assert parts.sync_batchnorm is True
    assert batchnorms(parts.model) and not any(isinstance(m, nn.SyncBatchNorm) for m in parts.model.modules())


# --- conversion ---------------------------------------------------------------------------------


def test_conversion_on_cpu_is_a_config_error_saying_what_to_do() -> None:
    model = CNN([4], batchnorm=True, input_shape=(1, 8, 8), num_classes=3)
    with pytest.raises(ConfigError) as caught:
        convert_sync_batchnorm(model, torch.device("cpu"))
    message = str(caught.value)
    assert "model.sync_batchnorm=true" in message and "cpu" in message
    assert "trainer.device=cuda" in message and "model.sync_batchnorm=false" in message


def test_conversion_for_cuda_replaces_every_batchnorm_and_keeps_the_state() -> None:
    """Converting needs no GPU (the model moves later): names and values survive, so checkpoints load."""
    torch.manual_seed(0)
    model = CNN([4, 8], batchnorm=True, input_shape=(3, 8, 8), num_classes=3)
    model(torch.randn(5, 3, 8, 8))  # running statistics away from their initial values
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_sync_batchnorm(model, torch.device("cuda", 0))
    assert len(batchnorms(converted)) == 2
    assert all(isinstance(m, nn.SyncBatchNorm) for m in batchnorms(converted))
    assert bit_identical(before, converted.state_dict())


def test_converted_model_without_a_process_group_trains_like_plain_batchnorm() -> None:
    """With no process group, SyncBatchNorm falls back to BatchNorm's own kernel: same outputs, same statistics."""
    assert not dist.is_initialized()  # tests start process groups only in spawned processes
    torch.manual_seed(0)
    plain = CNN([4, 8], batchnorm=True, input_shape=(3, 8, 8), num_classes=3)
    synced = convert_sync_batchnorm(
        CNN([4, 8], batchnorm=True, input_shape=(3, 8, 8), num_classes=3), torch.device("cuda")
    )
    synced.load_state_dict(plain.state_dict())
    x = torch.randn(6, 3, 8, 8)
    assert torch.equal(plain(x), synced(x))
    assert bit_identical(plain.state_dict(), synced.state_dict())


def cpu_group_outcomes(rank: int, world_size: int, run_dir: str) -> dict[str, str]:
    """On a gloo group of one CPU rank: what train.py's build path says, and what torch's SyncBatchNorm says."""
    outcomes = {}
    try:
        build(rank, world_size, [*CNN_BN, "model.sync_batchnorm=true"], run_dir, "cpu")
        outcomes["build"] = "built"
    except ConfigError as err:
        outcomes["build"] = str(err)
    try:
        nn.SyncBatchNorm(4).train()(torch.randn(8, 4, 2, 2))
        outcomes["torch"] = "ran"
    except ValueError as err:
        outcomes["torch"] = str(err)
    return outcomes


def test_cpu_refused_at_world_size_one_because_torch_refuses_it(tmp_path: Path) -> None:
    """train.py always starts a process group, so even one CPU rank cannot run SyncBatchNorm.

    If a later torch runs SyncBatchNorm on CPU, the second assertion fails: the refusal in
    convert_sync_batchnorm can then go.
    """
    (outcomes,) = run_on_ranks(cpu_group_outcomes, 1, tmp_path / "group", str(tmp_path / "run"))
    assert "model.sync_batchnorm=true cannot run on cpu" in outcomes["build"]
    assert "SyncBatchNorm expected input tensor to be on GPU" in outcomes["torch"]


# --- plain BatchNorm across ranks: why sync_batchnorm exists -------------------------------------


@pytest.fixture(scope="module")
def single_cnn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """One process, batch 16, plain BatchNorm."""
    root = tmp_path_factory.mktemp("single-cnn")
    (params,) = run_on_ranks(train_cnn, 1, root / "ref", ["sync=none", "data.batch_size=16"], str(root / "run"))
    return params


@pytest.fixture(scope="module")
def plain_bn_pairs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    root = tmp_path_factory.mktemp("bn-pairs")
    cases = {sync: [f"sync={sync}", "data.batch_size=8"] for sync in ("ddp", "manual")}
    return run_on_ranks(train_each, 2, root / "ranks", train_cnn, cases, str(root / "runs"), timeout_s=600)


@pytest.mark.parametrize("sync", ["ddp", "manual"])
def test_plain_batchnorm_two_ranks_are_not_one_process_with_twice_the_batch(
    plain_bn_pairs: list[dict[str, object]], single_cnn: dict[str, torch.Tensor], sync: str
) -> None:
    """Each rank normalises with its own 8 samples' statistics, not the 16 of the global batch."""
    rank0, rank1 = case_results(plain_bn_pairs, sync)
    assert bit_identical(weights(rank0), weights(rank1)), "the gradient average keeps the parameters equal"
    assert max_abs_diff(weights(rank0), weights(initial_cnn_params())) > 1e-3, "nothing was trained"
    assert max_abs_diff(weights(rank0), weights(single_cnn)) > 1e-4


def test_manual_leaves_each_rank_its_own_running_statistics(plain_bn_pairs: list[dict[str, object]]) -> None:
    """manual (and bucketed) broadcast buffers only once, in wrap(); then each rank updates its own."""
    rank0, rank1 = case_results(plain_bn_pairs, "manual")
    stats = [k for k in rank0 if k.endswith(("running_mean", "running_var"))]
    assert len(stats) == 4 and all(not torch.equal(rank0[k], rank1[k]) for k in stats)
