"""What FSDP2 (torch 2.14) holds for communication, unit by unit, predicted from the units' sizes for
fsdp's and hsdp's footprint (the memory predictor): `gathered` is each block's parameters gathered
whole, in forward order; `reduced` its gradients flattened for the reduce-scatter. An all-gather's
flat output is copied out into the unit's parameters, and kept until the next all-gather starts
(FSDP2's all_gather_state); a reduce-scatter's flat input is kept until the next unit's
reduce-scatter starts (reduce_scatter_max_input_buffers, 1). Arithmetic only: the measured side
is the observer's.
"""

from __future__ import annotations

from collections.abc import Sequence


def forward_buffers(gathered: Sequence[int], reshard_after_forward: bool) -> int:
    """The most the blocks hold at once in forward: at unit u's all-gather, its flat output and the
    last unit's, kept (that unit resharded after its forward); reshard_after_forward=false: every unit
    before it too, still gathered."""
    peak = 0
    for u in range(len(gathered)):
        before = sum(gathered[: u - 1]) if not reshard_after_forward and u > 1 else 0
        peak = max(peak, before + (gathered[u - 1] if u else 0) + gathered[u])
    return peak


def backward_buffers(gathered: Sequence[int], reduced: Sequence[int], reshard_after_forward: bool) -> int:
    """The most the blocks hold at once in backward, which meets the last block first. While unit u
    computes: its parameters gathered, the next unit's flat all-gather output (prefetched), and the
    unit before's reduce-scatter input, kept. At u's reduce-scatter: u resharded, its input, the next
    unit's gather. reshard_after_forward=false: every unit not yet reduced is still gathered from the
    forward (the last one's flat output kept too), and nothing is gathered again."""
    peak = 0
    for u in reversed(range(len(gathered))):
        kept = reduced[u + 1] if u + 1 < len(reduced) else 0
        if reshard_after_forward:
            ahead = gathered[u - 1] if u > 0 else 0
            peak = max(peak, kept + gathered[u] + ahead, reduced[u] + ahead)
        else:
            flat = gathered[-1] if gathered else 0
            peak = max(peak, flat + kept + sum(gathered[: u + 1]), flat + reduced[u] + sum(gathered[:u]))
    return peak
