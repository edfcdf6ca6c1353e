"""Commands run with `python -m trainer.tools.<name>`: collective benchmark, sweep report, W&B offline reader,
the set-up's installer, the memory predictor."""
