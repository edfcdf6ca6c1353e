"""Models build from (input_shape, num_classes) and refuse data they cannot take."""

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
        (lambda shape, n: CNN([8, 8, 8], input_shape=shape, num_classes=n), (1, 8, 8)),
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


def test_cnn_refuses_images_too_small_for_its_pooling():
    with pytest.raises(ValueError, match=r"model\.channels"):
        CNN([8, 8, 8, 8], input_shape=(1, 8, 8), num_classes=10)


def test_resnet18_small_stem_keeps_resolution():
    model = resnet18((1, 28, 28), 10)
    assert model.conv1.in_channels == 1 and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
