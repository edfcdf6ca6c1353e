"""fp16's loss scaling, agreed on every rank without reading anything on the host.

torch's GradScaler finds an overflow per device and reads it on the host before each optimizer step
(and ShardedGradScaler all-reduces it first, past the lab's communication object). Here the overflow
is the step's gradient norm being non-finite: that norm is global already (replicated gradients are
equal on every rank; a sharded strategy reduces its shards' squares through `comm`), so every rank
finds the same overflow, one shard's included, with no collective of its own. The scale then moves
on the device with torch's own update (backoff on an overflow, growth after `growth_interval`
clean steps), and the step is skipped on the device: by a fused optimizer itself, by
trainer/loop/device_skip.py for any other.
The state (scale, growth count) is GradScaler's, so checkpoints hold the same `grad_scaler` entry.
"""

from __future__ import annotations

import torch


class AgreedScaler(torch.amp.GradScaler):
    """GradScaler's scale and state, with the unscale and the update driven by an agreed `found_inf`."""

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Divide the gradients the optimizer reads by the scale (a 0-dim tensor: no host read)."""
        scale = self._get_scale_async()
        if grads and scale is not None:
            inverse = scale.double().reciprocal().float()
            torch._foreach_mul_(grads, inverse.to(grads[0].device))

    def update_from(self, found_inf: torch.Tensor) -> None:
        """Back off after an overflow, grow after growth_interval clean steps: on the device."""
        scale, tracker = self._get_scale_async(), self._growth_tracker
        assert scale is not None and tracker is not None, "scale() runs first and makes the scale"
        torch._amp_update_scale_(
            scale, tracker, found_inf.to(scale), self._growth_factor, self._backoff_factor, self._growth_interval
        )
