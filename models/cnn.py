"""Small convolutional net for 1- or 3-channel images: conv stages, then a dense head.

Why this shape: conv3x3(+BatchNorm)+ReLU+MaxPool per stage, then a hidden Linear layer over the
whole flattened feature map, is the classic MNIST convnet (about 99% on MNIST). An earlier version
averaged the feature map to one value per channel before a single Linear layer: with two stages
that throws away where the strokes are, and it reached 0.89 on MNIST in 300 steps. The same shape
takes MNIST's 28x28 and CIFAR's 32x32 with one config.

BatchNorm is off by default: without it (and with no dropout) each sample's output depends on that
sample alone, so a data-parallel run can match a single-process run exactly, as with the MLP.
"""

from collections.abc import Sequence

import torch
from torch import nn

from models.image_input import image_shape

# The head flattens at most this many rows and columns of the last feature map: bigger images are
# average-pooled down to it first, so the head's size stays bounded (MNIST gives 7x7, CIFAR 8x8).
MAX_HEAD_GRID = 8


class CNN(nn.Module):
    """[conv3x3, BatchNorm2d if batchnorm, ReLU, MaxPool2d(2)] per entry of channels, then Linear+ReLU+Linear."""

    def __init__(
        self,
        channels: Sequence[int] = (32, 64),
        hidden_size: int = 128,
        batchnorm: bool = False,
        sync_batchnorm: bool = False,  # the builder's key, not the model's: see below
        *,
        input_shape: Sequence[int],
        num_classes: int,
    ) -> None:
        # sync_batchnorm is read (and removed) by trainer.setup.build, which converts the BatchNorm
        # layers once the device is known; it is accepted here only so that conf/model/cnn.yaml
        # instantiates as it stands, with hydra.utils.instantiate alone.
        del sync_batchnorm
        super().__init__()
        in_channels, height, width = image_shape("cnn", input_shape)
        widths = [int(c) for c in channels]
        if not widths or any(c <= 0 for c in widths):
            raise ValueError(f"model.channels={widths} is invalid: must be a non-empty list of integers > 0")
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"model.hidden_size={hidden_size!r} is invalid: must be an integer > 0")
        # Each stage halves H and W (floor): the image must survive every pooling with >= 1 pixel.
        if min(height, width) < 2 ** len(widths):
            raise ValueError(
                f"model.channels={widths} has {len(widths)} pooling stages, which need images of "
                f"at least {2 ** len(widths)}x{2 ** len(widths)}, but the data gives "
                f"{height}x{width}; use fewer entries in model.channels"
            )
        layers: list[nn.Module] = []
        for out_channels in widths:
            # A conv's bias is redundant right before BatchNorm, which subtracts the channel mean.
            layers.append(nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=not batchnorm))
            if batchnorm:
                layers.append(nn.BatchNorm2d(out_channels))
            layers += [nn.ReLU(), nn.MaxPool2d(2)]
            in_channels = out_channels
            height, width = height // 2, width // 2
        if max(height, width) > MAX_HEAD_GRID:
            height, width = min(height, MAX_HEAD_GRID), min(width, MAX_HEAD_GRID)
            layers.append(nn.AdaptiveAvgPool2d((height, width)))
        layers += [
            nn.Flatten(),
            nn.Linear(in_channels * height * width, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, num_classes),
        ]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
