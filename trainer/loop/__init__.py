"""The training loop and what it measures: steps, metrics, timing, the LR schedule, the summary."""
