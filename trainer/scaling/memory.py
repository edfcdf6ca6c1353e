"""Memory per rank, predicted: each kind's peak for a strategy at N ranks, and whether it fits.

The arithmetic, written once (docs/memory.md). Each strategy describes what it keeps
(`SyncStrategy.footprint`, in trainer/footprint.py's words: its buffers, units, padding); from that:
- parameters, gradients, communication buffers: a kind's peak is the most that any one moment of
  the step holds, each holding counting all its pieces, or its `at_once` largest consecutive ones;
- optimizer state: what the optimizer keeps per element and per tensor, read off the optimizer
  itself after one step on a tiny tensor (exp_avg and exp_avg_sq and a 0-d step for Adam, a
  momentum buffer for SGD with momentum), times the tensors the strategy has it step;
- activations: what autograd saves for backward in one forward and loss, counted by the measured
  side's own counter (trainer/measures.py's SavedForBackward), on fake tensors: they take the CPU's
  kernels and autocast (a plain meta tensor takes attention's math path, which saves the T x T
  scores that the CPU's and CUDA's fused kernels never keep) and allocate nothing. At micro-batch 1
  and 2: a fixed part and a part per sample, scaled to any batch. Where the fake forward fails, one
  real forward on the CPU at each size, said as such.
The total is the sum of the kinds' peaks: what the measured side reports on a CPU, an upper bound
on what they hold at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer

from trainer.footprint import Footprint
from trainer.measures import MEMORY_KINDS, SavedForBackward

MIB = 2**20
GIB = 2**30
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # trainer.precision


def window(sizes: Sequence[int], at_once: int) -> int:
    """The most that `at_once` consecutive pieces hold together (0, or as many as there are: all)."""
    if at_once <= 0 or at_once >= len(sizes):
        return sum(sizes)
    return max(sum(sizes[i : i + at_once]) for i in range(len(sizes) - at_once + 1))


def held_peaks(footprint: Footprint) -> dict[str, int]:
    """parameters, gradients, comm_buffers: each kind's peak, the most that one moment holds (a holding
    named with no moment is alive in all of them)."""
    moments = sorted({m for h in footprint.held for m in h.during}) or ["step"]

    def at(kind: str, moment: str) -> int:
        alive = [h for h in footprint.held if h.kind == kind and moment in (h.during or [moment])]
        return sum(window(h.sizes, h.at_once) for h in alive)

    return {kind: max(at(kind, m) for m in moments) for kind in ("parameters", "gradients", "comm_buffers")}


@dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps for each tensor it steps: bytes per element of it, bytes per tensor."""

    name: str
    per_element: int
    per_tensor: int
    entries: tuple[str, ...]

    def nbytes(self, stepped: Sequence[int]) -> int:
        return sum(numel * self.per_element + self.per_tensor for numel in stepped)


def optimizer_state(build: Callable[[list[nn.Parameter]], Optimizer], dtype: torch.dtype) -> OptimizerState:
    """One step of the optimizer on a 3-element tensor of the parameters' dtype, its state read back:
    an entry shaped like the tensor is per element, any other tensor per tensor."""
    param = nn.Parameter(torch.zeros(3, dtype=dtype))
    param.grad = torch.ones_like(param)
    optimizer = build([param])
    optimizer.step()
    state = {k: v for k, v in optimizer.state[param].items() if isinstance(v, torch.Tensor)}
    per_element = sum(v.element_size() for v in state.values() if v.shape == param.shape)
    per_tensor = sum(v.untyped_storage().nbytes() for v in state.values() if v.shape != param.shape)
    return OptimizerState(type(optimizer).__name__, per_element, per_tensor, tuple(state))


@dataclass(frozen=True)
class Sample:
    """One sample as the data gives it: its shape and dtype, and whether its targets are tokens."""

    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    tokens: bool


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward in one micro-batch's forward and loss: fixed + per_sample x batch."""

    fixed: int
    per_sample: int
    source: str

    def at(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch


def _autocast(precision: str) -> AbstractContextManager[Any]:
    """What trainer/loop/step.py's forward runs in (fp32: nothing)."""
    dtype = AUTOCAST[precision]
    return nullcontext() if dtype is None else torch.autocast(device_type="cpu", dtype=dtype)


def saved_bytes(model: nn.Module, sample: Sample, batch: int, precision: str) -> int:
    """What one micro-batch's forward and loss save for backward, as trainer/loop/step.py runs them
    and trainer/measures.py counts them. Inputs and targets are zeros (token id 0, class 0)."""
    inputs = torch.zeros((batch, *sample.input_shape), dtype=sample.input_dtype)
    targets = torch.zeros((batch, *sample.input_shape) if sample.tokens else (batch,), dtype=torch.int64)
    with SavedForBackward() as saved, _autocast(precision):
        logits = model(inputs)
        if targets.dim() > 1:  # a language model: every token is a sample of the loss
            F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        else:
            F.cross_entropy(logits, targets)
    return saved.peak


def count_activations(build: Callable[[], nn.Module], sample: Sample, precision: str) -> Activations:
    """Activations at micro-batch 1 and 2 on fake tensors (no memory), or on the CPU if that fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # torch's own tracer: meta storage, CPU dispatch

    try:
        with FakeTensorMode():
            model = build().train()
            one, two = (saved_bytes(model, sample, b, precision) for b in (1, 2))
        source = "one forward on fake tensors (meta storage, the CPU's kernels): no memory used"
    except Exception as err:  # a model the fake tensors cannot run: measured instead
        model = build().train()
        one, two = (saved_bytes(model, sample, b, precision) for b in (1, 2))
        source = f"one real forward on the CPU (fake tensors failed: {type(err).__name__})"
    return Activations(fixed=2 * one - two, per_sample=two - one, source=source)


@dataclass(frozen=True)
class Prediction:
    """One strategy's peak bytes per rank, by kind, at `ranks` ranks and per-rank micro-batch `batch`.
    `beyond`: how much of the gradients' peak the ZeRO paper's terms leave out (footprint.Held.beyond:
    fp32 copies of 16-bit gradients, units' full gradients before their reduction)."""

    label: str
    ranks: int
    batch: int
    kinds: dict[str, int]
    beyond: int = 0

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    @property
    def model_states(self) -> int:
        """The ZeRO paper's model states as this strategy holds them: parameters, gradients (their
        beyond the paper's terms left out) and optimizer state, each at its peak."""
        return self.kinds["parameters"] + self.kinds["gradients"] - self.beyond + self.kinds["optimizer_state"]


def predict(
    label: str, footprint: Footprint, state: OptimizerState, activations: Activations, ranks: int, batch: int
) -> Prediction:
    kinds = held_peaks(footprint) | {
        "optimizer_state": state.nbytes(footprint.stepped),
        "activations": activations.at(batch),
    }
    within = held_peaks(Footprint(tuple(h for h in footprint.held if not h.beyond), footprint.stepped))
    beyond = kinds["gradients"] - within["gradients"]
    return Prediction(label, ranks, batch, {kind: kinds[kind] for kind in MEMORY_KINDS}, beyond)


def largest_batch(prediction: Prediction, activations: Activations, device_bytes: int) -> int | None:
    """The largest per-rank micro-batch whose total fits in device_bytes (0: not even one sample; None:
    activations do not grow with the batch)."""
    room = device_bytes - (prediction.total - prediction.kinds["activations"]) - activations.fixed
    if activations.per_sample <= 0:
        return None if room >= 0 else 0
    return max(0, room // activations.per_sample)


def zero_model_states(
    num_params: int, world_size: int, stage: int, param_bytes: int = 2, grad_bytes: int = 2, state_bytes: int = 12
) -> float:
    """The ZeRO paper's model states per rank (Rajbhandari et al., 2020, figure 1), in bytes:
    mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter (fp16 parameters and gradients; fp32
    master parameters, momentum and variance); stage 1 shards the 12, stage 2 the gradients too,
    stage 3 the parameters as well (0: plain data parallelism)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: the ZeRO paper's stages are 0, 1, 2 and 3")
    sharded = (stage >= 3, stage >= 2, stage >= 1)
    terms = zip((param_bytes, grad_bytes, state_bytes), sharded, strict=True)
    return float(sum(b * num_params / world_size if split else b * num_params for b, split in terms))
