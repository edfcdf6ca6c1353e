"""models/gpt.py: shapes, causality, the tied head, GPT-2's init, the FLOP count; bad shapes refused."""

from __future__ import annotations

import math

import pytest
import torch

from models.gpt import GPT


def make(**kw: object) -> GPT:
    args: dict[str, object] = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, input_shape=(8,), num_classes=11)
    args.update(kw)
    torch.manual_seed(0)
    return GPT(**args)  # type: ignore[arg-type]


def test_logits_have_one_distribution_per_position():
    model = make()
    idx = torch.randint(0, 11, (3, 8))
    assert model(idx).shape == (3, 8, 11)
    assert model(idx[:, :5]).shape == (3, 5, 11)  # shorter contexts (sampling) work too


def test_output_at_t_ignores_tokens_after_t():
    model = make()
    idx = torch.randint(0, 11, (2, 8))
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 11
    a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert not torch.allclose(a[:, 5:], b[:, 5:], atol=1e-4)  # and the later ones do change


def test_head_is_the_token_embedding():
    model = make()
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # registered (and synced) once
    model(torch.randint(0, 11, (2, 8))).sum().backward()
    assert model.wte.weight.grad is not None  # gradients of both uses land in one tensor


def test_gpt2_init_scales_residual_projections():
    model = make(n_layer=8, n_embd=64, n_head=4)
    assert model.blocks[0].fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.blocks[0].proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert torch.count_nonzero(model.blocks[0].fc.bias) == 0


def test_flops_per_token_counts_6n_plus_attention():
    model = make()
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    assert model.flops_per_token() == 6 * n + 12 * 2 * 16 * 8


def test_n_embd_not_divisible_by_n_head_is_refused():
    with pytest.raises(ValueError, match=r"model.n_embd=16 is not divisible by model.n_head=3"):
        make(n_head=3)


def test_block_size_must_match_the_data_windows():
    with pytest.raises(ValueError, match=r"model.block_size=8 but the data gives samples of shape \(3, 32, 32\)"):
        make(input_shape=(3, 32, 32))
