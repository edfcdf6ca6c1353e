"""Hydra launcher plugin: each multirun job runs as its own torchrun group (see torchrun_launcher)."""
