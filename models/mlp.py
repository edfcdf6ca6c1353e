"""Multi-layer perceptron: flatten, then Linear+ReLU per hidden size, then a Linear head.

Why no BatchNorm and no dropout: the DDP equivalence tests compare parameters across ranks and
against one process on the concatenated batch, which only holds exactly for a model whose
forward pass is a per-sample function with no randomness and no batch statistics.
"""

import math
from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    """Fully connected classifier for samples of any shape (they are flattened)."""

    def __init__(self, hidden_sizes: Sequence[int], input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        # hidden_sizes may be an omegaconf ListConfig when built by instantiate: copy to ints.
        sizes = [int(h) for h in hidden_sizes]
        if any(h <= 0 for h in sizes):
            raise ValueError(
                f"model.hidden_sizes={sizes} is invalid: every entry must be an integer > 0 "
                "(an empty list gives a linear classifier)"
            )
        layers: list[nn.Module] = [nn.Flatten()]
        in_features = math.prod(int(s) for s in input_shape)
        for width in sizes:
            layers += [nn.Linear(in_features, width), nn.ReLU()]
            in_features = width
        layers.append(nn.Linear(in_features, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
