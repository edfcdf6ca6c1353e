"""CIFAR-10 through torchvision, with ValueErrors for missing or corrupt batch files.

Why the verify_md5 switch: torchvision's CIFAR10 checks the md5 of every batch file (and of
batches.meta) each time it is constructed, which guards against a truncated download but makes
small hand-written files (tests, subsets) impossible to load. verify_md5=false swaps in a
subclass that only checks the files exist; the default keeps torchvision's check.
"""

import os

from torch.utils.data import Dataset
from torchvision import datasets, transforms
from torchvision.datasets.utils import check_integrity

from data.base import DataModule, fetch

BATCH_DIR = datasets.CIFAR10.base_folder  # "cifar-10-batches-py"
# (file, md5) for every file torchvision reads: the batches are checked on construction,
# batches.meta separately when it is loaded.
CHECKSUMS = [
    *[(name, md5) for name, md5 in datasets.CIFAR10.train_list + datasets.CIFAR10.test_list],
    (datasets.CIFAR10.meta["filename"], datasets.CIFAR10.meta["md5"]),
]
FILES = [name for name, _ in CHECKSUMS]
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class _UncheckedCIFAR10(datasets.CIFAR10):
    """CIFAR10 that checks the files exist but not their md5 (check_integrity(path, None))."""

    # Only the expected checksums change: torchvision's own _check_integrity and _load_meta read
    # these attributes, and base_folder is inherited, so the files are found where CIFAR10 looks.
    train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]
    test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]
    meta = {**datasets.CIFAR10.meta, "md5": None}


class Cifar10Data(DataModule):
    """CIFAR-10, 3x32x32, normalised with the train set's per-channel mean and std."""

    input_shape = (3, 32, 32)
    num_classes = 10

    def __init__(
        self,
        root: str,
        batch_size: int,
        download: bool = False,
        verify_md5: bool = True,
        num_workers: int = 0,
        drop_last: bool = True,
    ) -> None:
        super().__init__(batch_size, num_workers, drop_last)
        self.root = os.path.abspath(os.path.expanduser(root))
        self.download = download
        self.verify_md5 = verify_md5

    def prepare(self) -> None:
        if self.download:
            fetch(datasets.CIFAR10, self.root, "CIFAR-10", f"extract cifar-10-python.tar.gz into {self.root}")

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        folder = os.path.join(self.root, BATCH_DIR)
        missing = [f for f in FILES if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise ValueError(
                f"data.root={self.root} has no usable CIFAR-10: missing {', '.join(missing)} in "
                f"{folder}/ (expects {', '.join(FILES)}); set data.download=true where a network "
                f"exists, or extract cifar-10-python.tar.gz into {self.root}"
            )
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        cls = datasets.CIFAR10 if self.verify_md5 else _UncheckedCIFAR10
        try:
            return (
                cls(self.root, train=True, transform=transform),
                cls(self.root, train=False, transform=transform),
            )
        except RuntimeError as error:
            if not self.verify_md5:
                raise
            raise ValueError(
                f"data.root={self.root} has corrupt CIFAR-10 files: md5 mismatch for "
                f"{', '.join(self._md5_mismatches(folder))} in {folder}/; re-download them "
                "(delete the folder and set data.download=true), or set data.verify_md5=false "
                "to load files that are not the official release (e.g. a subset)"
            ) from error

    def _md5_mismatches(self, folder: str) -> list[str]:
        return [n for n, md5 in CHECKSUMS if not check_integrity(os.path.join(folder, n), md5)]
