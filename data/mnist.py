"""MNIST through torchvision, with a ValueError instead of a RuntimeError when files are missing.

Why check the files ourselves: torchvision only says "Dataset not found"; the user needs the
absolute path it looked in and the exact file names. The check mirrors torchvision 0.29's
MNIST._check_exists: all four *uncompressed* idx files under <root>/MNIST/raw/ must exist, for
either split, and their md5 is not checked.
"""

import os

from torch.utils.data import Dataset
from torchvision import datasets, transforms

from data.base import DataModule, fetch

RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# torchvision still loads a pre-0.10 cache of both splits instead of the raw files.
LEGACY_FILES = ("training.pt", "test.pt")
MEAN, STD = (0.1307,), (0.3081,)


class MnistData(DataModule):
    """MNIST digits, 1x28x28, normalised with the train set's mean and std."""

    input_shape = (1, 28, 28)
    num_classes = 10

    def __init__(
        self, root: str, batch_size: int, download: bool = False, num_workers: int = 0, drop_last: bool = True
    ) -> None:
        super().__init__(batch_size, num_workers, drop_last)
        self.root = os.path.abspath(os.path.expanduser(root))
        self.download = download

    def prepare(self) -> None:
        if self.download:
            fetch(datasets.MNIST, self.root, "MNIST", f"copy the four idx files into {self.root}/MNIST/raw/")

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        self._check_files()
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        return (
            datasets.MNIST(self.root, train=True, transform=transform),
            datasets.MNIST(self.root, train=False, transform=transform),
        )

    def _check_files(self) -> None:
        raw = os.path.join(self.root, "MNIST", "raw")
        processed = os.path.join(self.root, "MNIST", "processed")
        if all(os.path.isfile(os.path.join(processed, f)) for f in LEGACY_FILES):
            return
        missing = [f for f in RAW_FILES if not os.path.isfile(os.path.join(raw, f))]
        if missing:
            raise ValueError(
                f"data.root={self.root} has no usable MNIST: missing {', '.join(missing)} in "
                f"{raw}/; set data.download=true where a network exists, or copy the four "
                f"uncompressed idx files ({', '.join(RAW_FILES)}) into {raw}/"
            )
