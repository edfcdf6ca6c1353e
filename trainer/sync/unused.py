"""Parameters without a gradient: one rule, for every strategy that averages gradients itself.

A strategy that keeps gradients in flat buffers cannot read "no gradient" off a parameter (its
.grad is a view, zeroed between steps, so zero and none look alike), and one that sends a bucket
when all its gradients are in would wait for one that never comes. So a hook on each trainable
parameter counts the gradients it receives in a step's backward(s) (`Arrivals`, or the strategy's
own hook), and the ranks agree on the counts in a small control all_reduce.

The rule:
- without find_unused_parameters, every trainable parameter must get a gradient on every rank in
  every step. The first step checks it on every rank alike (the same all_reduce told them all): a
  parameter that got no gradient on some rank is refused (`refuse_missing`: a ConfigError naming
  it and on how many ranks it was used). After that each rank checks its own counts, with no
  collective and no host read of a device value: a parameter without a gradient in a later step
  (an expert no sample chose, a branch skipped) is refused on the rank(s) where it happened, and
  the other ranks stop when they do, as DDP's own check stops them. Sending its zeros instead would
  train silently another model than one process, which skips a parameter without a gradient.
- find_unused_parameters=true: the ranks agree every step; a parameter no rank used gets no update
  (the optimizer skips it, as one process's does), one some rank used is averaged as sum / N (the
  ranks without it add zeros).
fsdp finds what each rank used by its own walk of the first forward's graph (FSDP2 must know before
backward) and applies the same refusal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainer.errors import ConfigError
from trainer.sync.comm import Comm


def ranks_using(comm: Comm, counts: Sequence[int], device: torch.device) -> list[int]:
    """On how many ranks each parameter got a gradient (one control all_reduce every rank must reach)."""
    used = torch.tensor([n > 0 for n in counts], dtype=torch.int32, device=device)
    return comm.agree(used).tolist()  # SUM over the ranks


def fewest_and_most(comm: Comm, counts: Sequence[int], device: torch.device) -> tuple[list[int], list[int]]:
    """Each parameter's fewest and most gradients on any rank (one control all_reduce every rank must reach)."""
    local = torch.tensor(counts, dtype=torch.int64, device=device)
    both = comm.agree(torch.cat([-local, local]), dist.ReduceOp.MAX)
    return (-both[: len(counts)]).tolist(), both[len(counts) :].tolist()


def refuse_missing(
    used_on: Sequence[int], names: Sequence[str], strategy: str, fix: str, where: str = "the first step"
) -> None:
    """The rule: every parameter that got a gradient on fewer than all ranks is refused, named."""
    world_size = dist.get_world_size()
    missing = [(names[i], n) for i, n in enumerate(used_on) if n < world_size]
    if missing:
        shown = ", ".join(f"{name!r} (used on {n} of {world_size} ranks)" for name, n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConfigError(
            f"sync={strategy} cannot train this model as configured: parameter(s) {shown}{more} got no gradient "
            f"in {where} on some rank, and a sum over the ranks would miss their share; {fix}, or "
            "freeze them (requires_grad=False)"
        )


class Arrivals:
    """A hook per trainable parameter counting its gradients (all micro-batches of a step), and the
    rule applied after backward (manual, zero)."""

    checked = 0  # steps checked so far: the first agrees across ranks

    def __init__(
        self, params: Sequence[nn.Parameter], names: Sequence[str], comm: Comm, strategy: str, find_unused: bool
    ) -> None:
        self.params, self.names, self.comm = list(params), list(names), comm
        self.strategy, self.find_unused = strategy, find_unused
        self.counts = [0] * len(self.params)
        self._handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(lambda _, i=index: self._arrived(i))
            for index, param in enumerate(self.params)
        ]

    def _arrived(self, index: int) -> None:
        self.counts[index] += 1

    def unused_everywhere(self) -> list[int]:
        """After the step's backward, on every rank alike: the parameters (indices) no rank used, which
        get no update (find_unused_parameters=true). Without it, [] or a refusal (the module's rule)."""
        counts, self.counts = self.counts, [0] * len(self.params)
        self.checked += 1
        if self.checked > 1 and not self.find_unused:  # this rank's own counts: no collective
            missing = [self.names[i] for i, n in enumerate(counts) if n == 0]
            if missing:
                raise ConfigError(
                    f"sync={self.strategy} cannot train this model as configured: parameter(s) {missing[:5]} got no "
                    f"gradient on this rank in step {self.checked} after every rank used them in step 1; "
                    "without sync.find_unused_parameters=true every parameter must get one on every rank in every "
                    "step (sending zeros would train another model than one process, which skips it): set "
                    "sync.find_unused_parameters=true, or freeze them (requires_grad=False)"
                )
            return []
        used_on = ranks_using(self.comm, counts, self.params[0].device)
        if self.find_unused:
            return [i for i, n in enumerate(used_on) if n == 0]
        refuse_missing(used_on, self.names, self.strategy, "set sync.find_unused_parameters=true")
        return []
