"""One W&B run per rank, named rank-{r}, all ranks of a job in one group."""

from __future__ import annotations

from typing import Any

from trainer.errors import ConfigError

MODES = ("offline", "online", "disabled")


class WandbLogger:
    """Starts this rank's run on construction; offline runs land in <run dir>/wandb/offline-run-*."""

    def __init__(
        self,
        mode: str,
        project: str,
        entity: str | None,
        *,
        dir: str,
        name: str,
        group: str,
        run_config: dict[str, Any],
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"logger.mode={mode!r} is not one of: {', '.join(MODES)}")
        import wandb  # here, so that logger=none never imports W&B

        # wandb 0.31 sends its own usage telemetry based on the global settings, not init()'s, so
        # offline must be set here too, or an "offline" run still reaches for the network at exit.
        wandb.setup(settings=wandb.Settings(mode=mode))  # type: ignore[arg-type]  # checked against MODES
        # mode is always passed explicitly: without it and without an API key wandb.init fails.
        self._run = wandb.init(
            mode=mode,  # type: ignore[arg-type]
            project=project,
            entity=entity,
            dir=dir,
            name=name,
            group=group,
            config=run_config,
            # Each rank already has its own log file; W&B's stdout capture would only duplicate it.
            settings=wandb.Settings(console="off", silent=True),
        )
        self.location: str | None = self._run.dir.removesuffix("/files") if mode == "offline" else self._run.url
        self._closed = False

    def log(self, row: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def log_summary(self, summary: dict[str, Any]) -> None:
        self._run.summary.update(summary)

    def close(self, exit_code: int = 0) -> None:
        # Offline runs reach the disk only here: this must run on every exit path, SIGTERM included.
        if not self._closed:
            self._closed = True
            self._run.finish(exit_code=exit_code)
