"""A decoder-only transformer in GPT-2's shape, for next-token prediction on token windows.

Token and learned position embeddings, n_layer pre-LayerNorm blocks (causal self-attention through
scaled_dot_product_attention, a 4x GELU MLP), a final LayerNorm and an LM head whose weight *is*
the token embedding (tied, as in GPT-2). Initialised as GPT-2: normal(0, 0.02), the projections
that write into the residual stream scaled by 1/sqrt(2 n_layer) so the stream's variance does not
grow with depth. dropout defaults to 0: with randomness in the forward pass, N ranks x B no longer
train the same model as one process x N*B.

activation_checkpointing=True keeps only each block's input for backward and runs the block again
there (torch.utils.checkpoint, non-reentrant): activation memory falls from every block's
intermediates to one tensor per block, for about one more forward per step. The recomputation
repeats the same kernels on the same inputs (and replays the RNG state, so dropout masks repeat
too), so the gradients are the ones without it. Only a training forward with autograd on is
checkpointed: evaluation and sampling (no grad) run each block once, plainly.

The forward returns logits of shape (batch, block_size, vocab): the trainer's cross-entropy and
accuracy flatten the leading dimensions, so a token is a sample for the loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _check(key: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"model.{key}={value!r} is invalid: must be an integer >= {least}")


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)  # writes into the residual stream
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)  # writes into the residual stream
        self.mlp_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_dropout(self.proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """GPT-2-shaped language model; vocab_size and block_size come from the text data."""

    takes_tokens = True  # the builder pairs it with token data only (data=text)

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        n_embd: int,
        block_size: int,
        input_shape: Sequence[int],
        num_classes: int,
        dropout: float = 0.0,
        bias: bool = True,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        _check("n_layer", n_layer, 1)
        _check("n_head", n_head, 1)
        _check("n_embd", n_embd, 1)
        if n_embd % n_head:
            raise ValueError(
                f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}: each head takes "
                f"n_embd / n_head channels; use e.g. model.n_head={math.gcd(n_embd, 8) or 1}"
            )
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"model.dropout={dropout!r} is invalid: must be a number in [0, 1)")
        _check("block_size", block_size, 1)
        if tuple(input_shape) != (block_size,):  # data=text reads model.block_size unless overridden
            raise ValueError(
                f"model.block_size={block_size} but the data gives samples of shape {tuple(input_shape)}: "
                f"the model reads windows of ({block_size},) tokens; leave data.block_size at model.block_size"
            )
        if not isinstance(activation_checkpointing, bool):
            raise ValueError(
                f"model.activation_checkpointing={activation_checkpointing!r} is invalid: accepted true, false"
            )
        self.n_layer, self.n_head, self.n_embd, self.block_size = n_layer, n_head, n_embd, block_size
        self.activation_checkpointing = activation_checkpointing
        self.vocab_size = num_classes
        self.wte = nn.Embedding(num_classes, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, float(dropout), bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, num_classes, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, registered (and synced) once
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            # Through block's __call__ either way, so hooks on it (FSDP's unit gathers) fire on
            # the recomputation too. Non-reentrant: the parameters' gradients come from the one
            # backward pass, so DDP's and the strategies' per-parameter hooks fire once, as without.
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.lm_head(self.ln_f(x))

    def non_embedding_params(self) -> int:
        """Parameters minus the position embedding (the tied token embedding is the head: counted)."""
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), as nanoGPT and PaLM count them:
        6 N for the matmuls of N non-embedding parameters, plus 12 L d T for attention."""
        return 6.0 * self.non_embedding_params() + 12.0 * self.n_layer * self.n_embd * self.block_size
