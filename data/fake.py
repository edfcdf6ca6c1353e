"""Random images with random labels (torchvision's FakeData), in any (C, H, W) shape.

Why: exercises the image models and the loaders with no download. Not learnable beyond
memorisation: each image and label is drawn from torch's RNG seeded by its index.

The images are generated once, when the datasets are built, and then served from memory.
FakeData draws each sample by reseeding torch's global RNG, and on a CUDA build of torch every
reseed also queues a lazy CUDA/XPU/MTIA seed call that captures the Python call stack: per
sample, at a cost that grows with how deep the training loop's stack is. Generated on the fly,
that cost showed up as "framework overhead" in benchmarks/overhead.py.
"""

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset, TensorDataset
from torchvision import datasets, transforms

from data.base import DataModule


class FakeImageData(DataModule):
    """FakeData train and val sets; val is offset so it holds different images."""

    def __init__(
        self,
        batch_size: int,
        num_samples: int = 2048,
        num_val_samples: int = 256,
        image_shape: Sequence[int] = (3, 32, 32),
        num_classes: int = 10,
        num_workers: int = 0,
        drop_last: bool = True,
    ) -> None:
        super().__init__(batch_size, num_workers, drop_last)
        shape = tuple(int(s) for s in image_shape)  # may arrive as an omegaconf ListConfig
        if len(shape) != 3 or shape[0] not in (1, 3) or min(shape) < 1:
            raise ValueError(
                f"data.image_shape={list(shape)} is invalid: must be [C, H, W] with C 1 or 3 and H, W >= 1"
            )
        self.num_samples = num_samples
        self.num_val_samples = num_val_samples
        self.input_shape = shape
        self.num_classes = num_classes

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        # FakeData seeds sample i with i + random_offset: offsetting val by the train size keeps
        # the two sets disjoint, and every process generates the same images.
        def fake(size: int, random_offset: int) -> Dataset:
            generated = datasets.FakeData(
                size=size,
                image_size=self.input_shape,
                num_classes=self.num_classes,
                transform=transforms.ToTensor(),
                random_offset=random_offset,
            )
            images, labels = zip(*(generated[i] for i in range(size)), strict=True)
            return TensorDataset(torch.stack(images), torch.tensor(labels, dtype=torch.int64))

        return fake(self.num_samples, 0), fake(self.num_val_samples, self.num_samples)
