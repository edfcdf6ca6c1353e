"""Which trainable parameters got a gradient: DDP's find_unused_parameters, for the flat-buffer strategies.

A parameter whose gradient lives in a flat buffer always has a .grad (a view, zeroed between
steps), so "no gradient" cannot be read off it: a zero gradient and none look the same, and an
optimizer with weight decay or momentum updates a parameter on a zero gradient where one process
(grad None) leaves it alone. So each parameter's post-accumulate-grad hook sets its flag, and the
ranks agree on the flags with one small all_reduce (SUM: on how many ranks each was used).

find_unused_parameters=false (the default): the flags are kept for the first step only. If a
parameter got no gradient there on some rank, every rank refuses alike (the same all_reduce told
them all) with a ConfigError naming it; then the hooks are removed and the step path pays nothing.
A gradient missing in a later step counts as zero in every grouping.
find_unused_parameters=true: the hooks and the all_reduce stay, every step; a parameter no rank
used gets no gradient (the optimizer skips it), one some rank used is averaged as sum / N.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainer.errors import ConfigError
from trainer.sync.collectives import Collectives


class UsedParams:
    """A flag per trainable parameter, set by its hook in this step's backwards (all micro-batches)."""

    def __init__(
        self, params: Sequence[nn.Parameter], names: Sequence[str], find_unused: bool, strategy: str, comm: Collectives
    ) -> None:
        self.params, self.names = list(params), list(names)
        self.comm = comm  # the strategy's: the flags' all_reduce is counted as control traffic, on the link
        self.find_unused = find_unused
        self.strategy = strategy
        self._used = [False] * len(self.params)
        self._handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(lambda _, i=index: self._mark(i))
            for index, param in enumerate(self.params)
        ]

    def _mark(self, index: int) -> None:
        self._used[index] = True

    @property
    def active(self) -> bool:
        """Whether this step's flags are being kept (always with find_unused, else the first step)."""
        return bool(self._handles)

    def unused_everywhere(self) -> list[int]:
        """After the step's backward, on every rank alike (a collective while active): the indices of the
        parameters no rank used, which get no update; [] once the first step's check has passed."""
        if not self._handles:
            return []
        device = self.params[0].device
        counts = torch.tensor(self._used, dtype=torch.int32, device=device)
        self.comm.agree(counts)  # every rank must reach this, at every step's end (SUM: ranks that used each)
        self._used = [False] * len(self.params)
        world_size = dist.get_world_size()
        per_param = counts.tolist()
        if self.find_unused:
            return [i for i, n in enumerate(per_param) if n == 0]
        missing = [(self.names[i], n) for i, n in enumerate(per_param) if n < world_size]
        for handle in self._handles:  # checked once: the step path keeps no hooks
            handle.remove()
        self._handles = []
        if missing:
            raise ConfigError(
                f"sync.find_unused_parameters=false is invalid for this model with sync={self.strategy}: "
                f"parameter(s) {used_on(missing, world_size)} got no gradient in the first step; set "
                "sync.find_unused_parameters=true (a parameter no rank used is then left untouched, as one "
                "process leaves it), or freeze them (requires_grad=False)"
            )
        return []


def used_on(counts: Sequence[tuple[str, int]], world_size: int) -> str:
    """'a.weight' (used on 1 of 2 ranks), ...: the first five, and how many more."""
    shown = ", ".join(f"{name!r} (used on {n} of {world_size} ranks)" for name, n in counts[:5])
    return shown + (f" and {len(counts) - 5} more" if len(counts) > 5 else "")
