import os

import pytest

# Tests never reach W&B's servers: offline runs only, and quietly.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run where CUDA is available and are skipped, saying why, everywhere else."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in gpu_items:
        item.add_marker(skip)
