"""Data modules: per-rank sharding, determinism, and real torchvision loading from tiny files."""

import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from data.base import DataModule
from data.cifar10 import Cifar10Data
from data.fake import FakeImageData
from data.mnist import MnistData
from data.synthetic import SyntheticData
from data.tensor_loader import TensorLoader


class IndexData(DataModule):
    """Samples are their own indices, so loaders can be compared as index lists."""

    input_shape = (1,)
    num_classes = 1

    def __init__(self, batch_size: int, num_samples: int = 50, num_val_samples: int = 11) -> None:
        super().__init__(batch_size)
        self.sizes = (num_samples, num_val_samples)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return tuple(TensorDataset(torch.arange(n)) for n in self.sizes)


def epoch_batches(loader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [batch.tolist() for (batch,) in loader]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


# --- train loader ---------------------------------------------------------------------------


def test_ranks_get_disjoint_shards_covering_the_trimmed_train_set():
    data = IndexData(batch_size=4)  # 50 samples, 2 ranks x 4 -> 6 batches each, 48 used
    ranks = [flat(epoch_batches(data.train_loader(r, 2, seed=3), 0)) for r in range(2)]
    assert [len(r) for r in ranks] == [24, 24]
    assert not set(ranks[0]) & set(ranks[1])
    single = flat(epoch_batches(IndexData(batch_size=8).train_loader(0, 1, seed=3), 0))
    assert sorted(ranks[0] + ranks[1]) == sorted(single)
    assert len(set(single)) == 48 and set(single) <= set(range(50))


def test_order_depends_on_epoch_and_only_on_epoch():
    data = IndexData(batch_size=4)
    loader = data.train_loader(0, 2, seed=3)
    first = epoch_batches(loader, 0)
    assert epoch_batches(loader, 1) != first
    assert epoch_batches(loader, 0) == first
    assert epoch_batches(IndexData(batch_size=4).train_loader(0, 2, seed=3), 0) == first


def test_ranks_kth_batches_together_are_the_single_process_kth_batch():
    seed, batch_size, world_size = 7, 4, 2
    ranks = [epoch_batches(IndexData(batch_size).train_loader(r, world_size, seed), epoch=2) for r in range(world_size)]
    single = epoch_batches(IndexData(batch_size * world_size).train_loader(0, 1, seed), epoch=2)
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 6
    for k, batch in enumerate(single):
        assert sorted(ranks[0][k] + ranks[1][k]) == sorted(batch)


def test_train_set_smaller_than_one_global_batch_is_a_config_error():
    with pytest.raises(ValueError) as caught:
        IndexData(batch_size=30).train_loader(0, 2, seed=0)
    message = str(caught.value)
    assert "data.batch_size=30" in message and "world size 2" in message and "50" in message


@pytest.mark.parametrize("batch_size", [0, -3, 2.5])
def test_bad_batch_size_names_the_key(batch_size):
    with pytest.raises(ValueError, match=rf"data\.batch_size={batch_size} is invalid"):
        SyntheticData(batch_size=batch_size)


# --- val loader -----------------------------------------------------------------------------


def test_val_shards_are_disjoint_in_order_and_cover_the_val_set_exactly():
    data = IndexData(batch_size=4)  # 11 val samples: shards of 6 and 5, no padding
    shards = [[i for (b,) in data.val_loader(r, 2) for i in b.tolist()] for r in range(2)]
    assert shards == [list(range(0, 11, 2)), list(range(1, 11, 2))]
    assert [i for (b,) in data.val_loader(0, 1) for i in b.tolist()] == list(range(11))


# --- synthetic and fake ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        SyntheticData(batch_size=8, num_samples=64, num_val_samples=20),
        FakeImageData(batch_size=4, num_samples=16, num_val_samples=6, image_shape=[1, 4, 4]),
    ],
)
def test_in_memory_data_is_served_whole_batches_equal_to_per_sample_loading(data):
    # The same samples in the same order as DataLoader's per-sample path (index, then stack),
    # so equivalence and bit-identical resume hold; but fetched with one gather per tensor.
    train, val = data.build_datasets()
    loader = data.train_loader(1, 2, seed=3)
    assert isinstance(loader, TensorLoader) and loader.batch_size == data.batch_size
    reference = torch.utils.data.DataLoader(train, batch_size=data.batch_size, sampler=loader.sampler, drop_last=True)
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        ours, theirs = list(loader), list(reference)
        assert len(ours) == len(theirs) > 0
        for (x, y), (x_ref, y_ref) in zip(ours, theirs, strict=True):
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref) and y.dtype == y_ref.dtype == torch.int64
    val_batches = list(data.val_loader(1, 2))  # in order, the last batch partial
    val_ref = list(
        torch.utils.data.DataLoader(torch.utils.data.Subset(val, range(1, len(val), 2)), batch_size=data.batch_size)
    )
    assert len(val_batches) == len(val_ref) == len(data.val_loader(1, 2)) and len(val_batches[-1][0]) < data.batch_size
    assert all(
        torch.equal(a, b)
        for batch, ref in zip(val_batches, val_ref, strict=True)
        for a, b in zip(batch, ref, strict=True)
    )


def test_synthetic_is_deterministic_and_uses_several_classes():
    def make() -> SyntheticData:
        return SyntheticData(batch_size=8, num_samples=256, num_val_samples=64, seed=5)

    (train_a, val_a), (train_b, val_b) = make().build_datasets(), make().build_datasets()
    for a, b in [(train_a, train_b), (val_a, val_b)]:
        assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))
    inputs, labels = train_a.tensors
    assert inputs.shape == (256, 32) and inputs.dtype == torch.float32
    assert labels.dtype == torch.int64 and len(labels.unique()) > 5
    assert not torch.equal(val_a.tensors[0], inputs[:64])
    other = SyntheticData(batch_size=8, num_samples=256, seed=6).build_datasets()[0]
    assert not torch.equal(other.tensors[0], inputs)


def test_fake_images_are_deterministic_and_val_differs():
    data = FakeImageData(batch_size=2, num_samples=4, num_val_samples=2, image_shape=[1, 12, 12])
    train, val = data.build_datasets()
    image, label = train[1]
    assert data.input_shape == (1, 12, 12) and image.shape == (1, 12, 12)
    assert image.dtype == torch.float32 and 0 <= label < 10
    again = FakeImageData(batch_size=2, image_shape=[1, 12, 12]).build_datasets()[0]
    assert torch.equal(again[1][0], image)
    assert not torch.equal(val[0][0], train[0][0])


# --- MNIST, from idx files in the real format -------------------------------------------------


def write_idx(path, array: np.ndarray) -> None:
    """IDX: zero, zero, type byte 0x08 (uint8), ndim; then big-endian uint32 dims; then data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist(root, num_train: int = 20, num_test: int = 10) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in [("train", num_train), ("t10k", num_test)]:
        write_idx(raw / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{split}-labels-idx1-ubyte", np.arange(n) % 10)


def test_mnist_loads_through_torchvision(tmp_path):
    write_mnist(tmp_path)
    data = MnistData(root=str(tmp_path), batch_size=4)
    train, val = data.build_datasets()
    assert (len(train), len(val)) == (20, 10)
    image, label = train[13]
    assert image.shape == data.input_shape == (1, 28, 28) and image.dtype == torch.float32
    assert label == 3
    raw = train.data[13, 0, 0].item()  # the uint8 pixel as read from the idx file
    assert image[0, 0, 0].item() == pytest.approx((raw / 255 - 0.1307) / 0.3081, abs=1e-5)
    images, labels = next(iter(data.train_loader(0, 2, seed=0)))
    assert images.shape == (4, 1, 28, 28) and labels.dtype == torch.int64


def test_mnist_missing_files_name_the_absolute_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as caught:
        MnistData(root="nowhere", batch_size=4).build_datasets()
    message = str(caught.value)
    assert str(tmp_path / "nowhere") in message and "data.download=true" in message
    assert "train-images-idx3-ubyte" in message


def test_mnist_needs_the_test_files_too(tmp_path):
    write_mnist(tmp_path)
    os.remove(tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte")
    with pytest.raises(ValueError, match="missing t10k-labels-idx1-ubyte"):
        MnistData(root=str(tmp_path), batch_size=4).build_datasets()


# --- CIFAR-10, from python pickles in the real format -----------------------------------------


def write_cifar10(root, per_batch: int = 4, num_test: int = 10) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = num_test if name == "test_batch" else per_batch
        batch = {
            "batch_label": name,
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),  # rows: R plane, G, B
            "labels": [i % 10 for i in range(n)],
        }
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))


def test_cifar10_loads_small_files_without_md5(tmp_path):
    write_cifar10(tmp_path)
    data = Cifar10Data(root=str(tmp_path), batch_size=4, verify_md5=False)
    train, val = data.build_datasets()
    assert (len(train), len(val)) == (20, 10)
    image, label = val[7]
    assert image.shape == data.input_shape == (3, 32, 32) and image.dtype == torch.float32
    assert label == 7 and train.classes[3] == "cat"
    raw = val.data[7, 0, 0, 2].item()  # HWC uint8: pixel (0, 0), blue channel
    assert image[2, 0, 0].item() == pytest.approx((raw / 255 - 0.4465) / 0.2616, abs=1e-5)


def test_cifar10_md5_mismatch_is_a_config_error(tmp_path):
    write_cifar10(tmp_path)
    with pytest.raises(ValueError) as caught:
        Cifar10Data(root=str(tmp_path), batch_size=4).build_datasets()
    message = str(caught.value)
    assert "md5" in message and "data.verify_md5=false" in message and "data_batch_1" in message


def test_cifar10_missing_files_name_the_absolute_root(tmp_path):
    root = tmp_path / "nowhere"
    with pytest.raises(ValueError) as caught:
        Cifar10Data(root=str(root), batch_size=4).build_datasets()
    message = str(caught.value)
    assert str(root) in message and "cifar-10-batches-py" in message
    assert "data_batch_5" in message and "batches.meta" in message
