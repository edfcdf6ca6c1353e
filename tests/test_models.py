"""Models build from (input_shape, num_classes) and refuse data they cannot take."""

import re

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from models.cnn import CNN
from models.mlp import MLP
from models.resnet18 import resnet18


@pytest.mark.parametrize(
    ("build", "input_shape"),
    [
        (lambda shape, n: MLP([16, 8], input_shape=shape, num_classes=n), (32,)),
        (lambda shape, n: MLP([16], input_shape=shape, num_classes=n), (1, 28, 28)),
        (lambda shape, n: CNN(input_shape=shape, num_classes=n), (3, 32, 32)),
        (lambda shape, n: CNN(input_shape=shape, num_classes=n), (1, 28, 28)),
        (lambda shape, n: CNN(input_shape=shape, num_classes=n), (1, 5, 9)),  # 1x2 after two floor-halvings
        (lambda shape, n: CNN(input_shape=shape, num_classes=n), (3, 100, 40)),  # head pooled to 8 rows
        (lambda shape, n: CNN([8, 8, 8], hidden_size=4, input_shape=shape, num_classes=n), (1, 8, 8)),
        (lambda shape, n: CNN(batchnorm=True, input_shape=shape, num_classes=n), (3, 32, 32)),
        (lambda shape, n: resnet18(shape, n), (3, 32, 32)),
        (lambda shape, n: resnet18(shape, n), (1, 28, 28)),
        (lambda shape, n: resnet18(shape, n, small_input_stem=False), (1, 32, 32)),
        (lambda shape, n: resnet18(shape, n, small_input_stem=False), (3, 32, 32)),
    ],
)
def test_forward_gives_one_logit_per_class(build, input_shape):
    model = build(input_shape, 7)
    assert model(torch.randn(3, *input_shape)).shape == (3, 7)


def test_mlp_accepts_listconfig_hidden_sizes():
    model = MLP(OmegaConf.create([4, 5]), input_shape=(6,), num_classes=2)
    assert [m.out_features for m in model.modules() if isinstance(m, nn.Linear)] == [4, 5, 2]


def test_mlp_has_no_batch_statistics_or_randomness():
    model = MLP([16, 16], input_shape=(32,), num_classes=10)
    banned = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    assert not any(isinstance(m, banned) for m in model.modules())


def test_mlp_rejects_non_positive_hidden_size():
    with pytest.raises(ValueError, match=r"model\.hidden_sizes=\[16, 0\]"):
        MLP([16, 0], input_shape=(32,), num_classes=10)


@pytest.mark.parametrize(
    ("name", "build"),
    [
        ("cnn", lambda: CNN(input_shape=(32,), num_classes=10)),
        ("resnet18", lambda: resnet18((32,), 10)),
    ],
)
def test_image_models_refuse_vector_inputs(name, build):
    with pytest.raises(ValueError) as caught:
        build()
    message = str(caught.value)
    assert f"model={name} needs image inputs (C, H, W)" in message
    assert "(32,)" in message and "data=cifar10" in message


def test_cnn_default_is_conv_stages_then_a_dense_head_without_batch_statistics():
    """Two conv stages and Linear+ReLU+Linear over the whole 7x7 map; nothing that mixes samples or draws randomness."""
    model = CNN(input_shape=(1, 28, 28), num_classes=10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [(1, 32), (32, 64)]
    assert [(lin.in_features, lin.out_features) for lin in linears] == [(64 * 7 * 7, 128), (128, 10)]
    banned = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    assert not any(isinstance(m, banned) for m in model.modules())
    assert sum(p.numel() for p in model.parameters()) < 500_000  # a CPU step stays cheap


def test_cnn_batchnorm_follows_every_conv_whose_bias_it_replaces():
    model = CNN([4, 8, 16], batchnorm=True, input_shape=(3, 32, 32), num_classes=10)
    layers = list(model.net)
    convs = [i for i, m in enumerate(layers) if isinstance(m, nn.Conv2d)]
    assert len(convs) == 3
    for i in convs:
        assert isinstance(layers[i + 1], nn.BatchNorm2d) and layers[i + 1].num_features == layers[i].out_channels
        assert layers[i].bias is None


def test_cnn_head_size_does_not_grow_with_the_image():
    """Past 8x8 the last map is average-pooled to 8x8: a 224x224 image gives the head CIFAR's size."""

    def count(shape):
        return sum(p.numel() for p in CNN(input_shape=shape, num_classes=10).parameters())

    assert count((3, 224, 224)) == count((3, 32, 32))
    assert count((1, 28, 28)) < count((1, 32, 32))  # 7x7 is flattened as it is


def test_cnn_ignores_sync_batchnorm_which_the_builder_applies():
    """conf/model/cnn.yaml instantiates as it stands; the conversion is trainer.setup.build's."""
    model = CNN(batchnorm=True, sync_batchnorm=True, input_shape=(1, 28, 28), num_classes=10)
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())


def test_cnn_refuses_images_too_small_for_its_pooling():
    with pytest.raises(ValueError) as caught:
        CNN([8, 8, 8, 8], input_shape=(1, 8, 8), num_classes=10)
    message = str(caught.value)
    assert "model.channels=[8, 8, 8, 8] has 4 pooling stages" in message
    assert "at least 16x16, but the data gives 8x8" in message and "use fewer entries" in message


@pytest.mark.parametrize("channels", [[], [8, 0], [-1]])
def test_cnn_rejects_bad_channels(channels):
    with pytest.raises(ValueError, match=re.escape(f"model.channels={channels} is invalid: must be a non-empty list")):
        CNN(channels, input_shape=(1, 28, 28), num_classes=10)


@pytest.mark.parametrize("hidden_size", [0, -3, 1.5, True])
def test_cnn_rejects_bad_hidden_size(hidden_size):
    with pytest.raises(ValueError, match=r"model\.hidden_size=.* is invalid: must be an integer > 0"):
        CNN(hidden_size=hidden_size, input_shape=(1, 28, 28), num_classes=10)


def test_resnet18_ignores_sync_batchnorm_which_the_builder_applies():
    model = resnet18((3, 32, 32), 10, sync_batchnorm=True)
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())


def test_resnet18_small_stem_keeps_resolution():
    model = resnet18((1, 28, 28), 10)
    assert model.conv1.in_channels == 1 and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
