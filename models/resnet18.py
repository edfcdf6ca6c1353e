"""torchvision's ResNet-18, untrained, with its stem adapted to the data's images.

Why adapt the stem: the ImageNet stem (7x7 stride-2 conv, then max-pool) shrinks a 32x32 CIFAR
image to 8x8 before the first block; the usual small-image stem (3x3 stride-1 conv, no max-pool)
keeps the resolution. conv1 also has to match the data's channel count (1 for MNIST).
"""

from collections.abc import Sequence

import torchvision
from torch import nn

from models.image_input import image_shape


def resnet18(
    input_shape: Sequence[int],
    num_classes: int,
    small_input_stem: bool = True,
    sync_batchnorm: bool = False,  # the builder's key, not the model's
) -> nn.Module:
    """Build ResNet-18 for images of input_shape (C, H, W) with a fresh num_classes head.

    sync_batchnorm is read (and removed) by trainer.setup.build, which converts the BatchNorm
    layers once the device is known; it is accepted here only so that conf/model/resnet18.yaml
    instantiates as it stands, with hydra.utils.instantiate alone.
    """
    del sync_batchnorm
    in_channels = image_shape("resnet18", input_shape)[0]
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if small_input_stem:
        model.conv1 = _stem_conv(in_channels, kernel_size=3, stride=1)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = _stem_conv(in_channels, kernel_size=7, stride=2)
    return model


def _stem_conv(in_channels: int, kernel_size: int, stride: int) -> nn.Conv2d:
    conv = nn.Conv2d(in_channels, 64, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)
    # The init torchvision gives its own convs, so a replaced stem starts like the original.
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    return conv
