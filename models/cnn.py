"""Small convolutional net for 1- or 3-channel images of any size.

Why this shape: conv3x3+ReLU+MaxPool per stage, then global average pooling, works for MNIST's
28x28 and CIFAR's 32x32 alike with one config; no BatchNorm or dropout, so (like the MLP) a
data-parallel run can match a single-process run exactly.
"""

from collections.abc import Sequence

import torch
from torch import nn

from models.image_input import image_shape


class CNN(nn.Module):
    """conv3x3+ReLU+MaxPool2d(2) per entry of channels, global average pool, Linear head."""

    def __init__(
        self,
        channels: Sequence[int] = (32, 64),
        *,
        input_shape: Sequence[int],
        num_classes: int,
    ) -> None:
        super().__init__()
        in_channels, height, width = image_shape("cnn", input_shape)
        widths = [int(c) for c in channels]
        if not widths or any(c <= 0 for c in widths):
            raise ValueError(f"model.channels={widths} is invalid: must be a non-empty list of integers > 0")
        # Each stage halves H and W (floor): the image must survive every pooling with >= 1 pixel.
        if min(height, width) < 2 ** len(widths):
            raise ValueError(
                f"model.channels={widths} has {len(widths)} pooling stages, which need images of "
                f"at least {2 ** len(widths)}x{2 ** len(widths)}, but the data gives "
                f"{height}x{width}; use fewer entries in model.channels"
            )
        layers: list[nn.Module] = []
        for out_channels in widths:
            layers += [
                nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            in_channels = out_channels
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
