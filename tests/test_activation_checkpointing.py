"""model.activation_checkpointing on the GPT alone: blocks recomputed in a training backward only,
the same gradients, fewer bytes kept for backward. (Every strategy with it: test_gpt_equivalence.py.)"""

from __future__ import annotations

import pytest
import torch

from benchmarks.activation_memory import saved_bytes
from models.gpt import GPT


def make(checkpointing: bool, dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(
        n_layer=2,
        n_head=2,
        n_embd=16,
        block_size=8,
        input_shape=(8,),
        num_classes=11,
        dropout=dropout,
        activation_checkpointing=checkpointing,
    )


def block_forwards(model: GPT) -> list[int]:
    """Calls of each block, counted by a pre-hook (a recomputation stops once it has what backward needs)."""
    calls = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def step_grads(model: GPT, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # dropout's masks, when there is dropout
    model(idx).logsumexp(-1).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_each_block_is_recomputed_in_a_training_backward():
    idx = torch.randint(0, 11, (2, 8))
    for checkpointing, expected in ((False, [1, 1]), (True, [2, 2])):
        model = make(checkpointing)
        calls = block_forwards(model)
        model(idx).sum().backward()
        assert calls == expected, checkpointing


def test_evaluation_and_no_grad_run_each_block_once():
    model = make(True)
    calls = block_forwards(model)
    with torch.no_grad():
        model(torch.randint(0, 11, (2, 8)))  # training mode, but no backward to recompute for
    model.eval()
    model(torch.randint(0, 11, (2, 8)))
    assert calls == [2, 2]


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gradients_are_the_ones_without_it(dropout: float):
    # With dropout the recomputation replays the RNG state, so the masks, and the gradients, repeat.
    idx = torch.randint(0, 11, (4, 8))
    plain, checkpointed = step_grads(make(False, dropout), idx), step_grads(make(True, dropout), idx)
    assert plain.keys() == checkpointed.keys() and len(plain) == len(list(make(False).parameters()))
    assert all(torch.equal(plain[k], checkpointed[k]) for k in plain)


def test_fewer_bytes_are_kept_for_backward():
    # The benchmark's count (benchmarks/activation_memory.py): each block's input instead of its
    # intermediates, and block 0's input is one (batch, time, n_embd) float tensor.
    windows = torch.randint(0, 11, (4, 9))
    inputs, targets = windows[:, :-1], windows[:, 1:]
    plain, checkpointed = saved_bytes(make(False), inputs, targets), saved_bytes(make(True), inputs, targets)
    assert checkpointed < plain / 2, (plain, checkpointed)
    assert checkpointed >= 2 * 4 * 8 * 16 * 4  # at least the two blocks' inputs


def test_a_non_boolean_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="model.activation_checkpointing='yes' is invalid"):
        GPT(2, 2, 16, 8, (8,), 11, activation_checkpointing="yes")  # type: ignore[arg-type]
