"""A learnable synthetic classification task, generated deterministically from a seed.

Why: tests and quick experiments need data that costs no download, is identical in every process
(so ranks and reruns agree without sharing files) and is learnable, so a loss curve means
something. Inputs are x ~ N(0, I); the label is the argmax of a fixed random linear teacher with
unit-norm rows, which keeps the classes close to balanced.
"""

import torch
from torch.utils.data import Dataset, TensorDataset

from data.base import DataModule


class SyntheticData(DataModule):
    """Gaussian inputs of input_dim labelled by a seeded random linear teacher."""

    def __init__(
        self,
        batch_size: int,
        num_samples: int = 8192,
        num_val_samples: int = 1024,
        input_dim: int = 32,
        num_classes: int = 10,
        seed: int = 0,
        num_workers: int = 0,
        drop_last: bool = True,
    ) -> None:
        super().__init__(batch_size, num_workers, drop_last)  # sizes and counts: checked by the config's schema
        self.num_samples = num_samples
        self.num_val_samples = num_val_samples
        self.input_shape = (input_dim,)
        self.num_classes = num_classes
        self.seed = seed

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        # One CPU generator per stream, all derived from seed: the same seed gives bit-identical
        # tensors in every process, and train and val never share samples' random draws.
        root = torch.Generator().manual_seed(self.seed)
        teacher_seed, train_seed, val_seed = torch.randint(0, 2**62, (3,), generator=root).tolist()
        teacher_rng = torch.Generator().manual_seed(teacher_seed)
        teacher = torch.randn(self.num_classes, self.input_shape[0], generator=teacher_rng)
        teacher /= teacher.norm(dim=1, keepdim=True)
        return (
            self._sample(teacher, self.num_samples, train_seed),
            self._sample(teacher, self.num_val_samples, val_seed),
        )

    def _sample(self, teacher: torch.Tensor, count: int, seed: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(count, teacher.shape[1], generator=generator, dtype=torch.float32)
        labels = (inputs @ teacher.T).argmax(dim=1).to(torch.int64)
        return TensorDataset(inputs, labels)
