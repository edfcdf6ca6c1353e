"""Sampling token ids from a causal language model (models.gpt.GPT): what the sample command prints
and what a run logs as its text sample. A model's concern, not training's: both the loop and the
command import it from here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module, prompt: list[int], tokens: int, temperature: float, top_k: int | None, seed: int
) -> list[int]:
    """prompt + `tokens` sampled ids; the context is cropped to the model's block_size.

    A CPU generator seeded with `seed` draws every token, so the same seed gives the same text on
    every rank and every run.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    block_size = model.block_size  # the GPT's context length
    assert isinstance(block_size, int), "generate() needs a model with an int block_size (models.gpt.GPT)"
    ids = list(prompt)
    for _ in range(tokens):
        context = torch.tensor([ids[-block_size:]], dtype=torch.int64, device=device)
        logits = model(context)[0, -1].float().cpu()
        if temperature <= 0:  # greedy
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k is not None and top_k < logits.numel():
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ids.append(int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)))
    model.train(was_training)
    return ids
