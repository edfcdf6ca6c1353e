"""16-bit parameters with an fp32 master copy (trainer.param_dtype=bf16 or fp16), for a strategy whose
optimizer steps the model's own parameters (none, manual, bucketed, ddp, hierarchical).

What people train at scale (the ZeRO paper's 2 + 2 + 12 bytes, DeepSpeed's bf16, Megatron's
optimizer, FSDP2's MixedPrecisionPolicy) keeps the parameters forward and backward read, and so
their gradients, in 16 bits, and an fp32 copy of each parameter that the optimizer steps with its
state: an update smaller than a 16-bit parameter's rounding step still lands in the copy. Here:

- the trainer casts the model's floating parameters to the 16-bit dtype before the strategy wraps
  it (`cast_parameters`): the strategy then holds, buckets and reduces 16-bit gradients, and the
  communication object sends them in trainer.reduce_dtype (trainer/sync/comm.py);
- the optimizer is built over an fp32 copy of each 16-bit trainable parameter (`Masters.stepped`);
- after the strategy has averaged the gradients, each copy takes its parameter's as fp32
  (`take_grads`): the gradient scaler, the norm, the clip and the optimizer read those;
- after the optimizer step each 16-bit parameter is refreshed from its copy (`refresh`).

A checkpoint holds the copies' fp32 values as the model's state (a run resumed from it continues
bit for bit, and the file reads as an fp32 model's whichever strategy wrote it). A strategy whose
optimizer steps a shard of its own (zero, fsdp) keeps that shard in fp32 itself: its copy is the
shard, and Masters has nothing to do there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # trainer.param_dtype's names
SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the optimizer steps for parameters of this dtype: fp32 for 16-bit ones, else their own."""
    return torch.promote_types(dtype, torch.float32)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's floating parameters in `dtype`, in place (the same Parameter objects: tied ones stay
    tied). Buffers keep theirs (a BatchNorm's running statistics, as FSDP2 leaves them)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


class Masters:
    """The fp32 copies of the 16-bit parameters an optimizer steps, each beside its parameter."""

    def __init__(self) -> None:
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (16-bit parameter, its fp32 copy)

    def stepped(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimizer steps for these parameters: a 16-bit trainable one's fp32 copy (made
        here, once), any other as it is."""
        out = []
        for param in params:
            if param.dtype in SIXTEEN_BITS and param.requires_grad:
                master = nn.Parameter(param.detach().float())
                self.pairs.append((param, master))
                param = master
            out.append(param)
        return out

    def take_grads(self) -> None:
        """Each copy's gradient: its parameter's averaged one, as fp32 (none where it has none: the
        optimizer then skips it, as it skips the parameter in one process)."""
        for param, master in self.pairs:
            grad = param.grad
            master.grad = None if grad is None else grad.to(torch.float32)

    def refresh(self) -> None:
        """Each 16-bit parameter rounded from its stepped copy; the copies' gradients dropped (each
        step takes them anew), so they live from take_grads() to the optimizer step's end only."""
        if self.pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])
            for _, master in self.pairs:
                master.grad = None

    def zero_grad(self) -> None:
        """The 16-bit parameters' gradients dropped (their optimizer clears only its copies')."""
        for param, _ in self.pairs:
            param.grad = None

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """model.state_dict() with each 16-bit parameter's entry its copy's fp32 value (a tied parameter
        under each of its names)."""
        copy = {id(p): m for p, m in self.pairs}
        state = model.state_dict(keep_vars=True)
        return {name: copy.get(id(t), t).detach() for name, t in state.items()}

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """The reverse: every copy from its parameter's entry, then the parameters from the copies."""
        copy = {id(p): m for p, m in self.pairs}
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                if id(tensor) in copy:
                    copy[id(tensor)].copy_(state[name])
        self.refresh()

    def held(self) -> int:
        """The copies' bytes (the memory probe counts them as the optimizer's parameters)."""
        return sum(m.numel() * m.element_size() for _, m in self.pairs)
