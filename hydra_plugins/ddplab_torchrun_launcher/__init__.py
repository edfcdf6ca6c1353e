"""Hydra launcher plugin hydra/launcher=torchrun: each multirun job runs as its own torchrun group.

Self-contained (Hydra, OmegaConf, torch and cloudpickle only): config.py registers the options with
Hydra's ConfigStore, torchrun_launcher.py is the Launcher, _core.py runs the jobs and _worker.py is
what every worker runs.
"""
