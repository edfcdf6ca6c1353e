"""Learning-rate schedules as multipliers of the optimizer's lr, for torch's LambdaLR.

They are small callable objects rather than lambdas so that LambdaLR.state_dict() can save them
(it stores a callable object's attributes) and a resumed run continues the same curve.
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup from 0 to 1 over warmup_steps, then cosine decay to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Constant:
    """The optimizer's lr, unchanged."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps

    def __call__(self, step: int) -> float:
        return 1.0


class WarmupCosine:
    """Warmup, then cosine decay over the run's total steps (known only at run time)."""

    def __init__(self, total_steps: int, warmup_steps: int = 10, min_lr_ratio: float = 0.0) -> None:
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        return warmup_cosine(step, self.warmup_steps, self.total_steps, self.min_lr_ratio)
