"""The run's set-up: the launcher's environment and process group, the Hydra boundary, building the parts."""
