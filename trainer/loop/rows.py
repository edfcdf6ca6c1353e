"""The rows a rank logs while training, and what they add up to for the job's summary.

A row is written at logged steps only, after the one host synchronisation of that step: it
reduces the window of steps since the previous row (loss, accuracy, phase times, communication).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from trainer import arrivals
from trainer.core import DistContext, hostname
from trainer.logger.base import MetricLogger
from trainer.loop.lm import TokenRates
from trainer.loop.metrics import Window
from trainer.loop.step import StepRunner
from trainer.loop.summary import rank_timing
from trainer.measures import cuda_peak_mb
from trainer.observer import Observer
from trainer.reliability.save_cost import ResidentMemory
from trainer.sync.base import SyncStrategy
from trainer.sync.describe import describe, settled
from trainer.windows import CHECKPOINT, ROW, TRAIN

log = logging.getLogger(__name__)


PAIRS_PER_LINE = 4  # the sync: line's key=value pairs per screen line (a count, not a width: the same layout every run)
LIST_SHOWN = 6  # items of a list value shown on screen; summary.json keeps them all


def _one_word(value: Any) -> str:
    """A value as one word of a key=value line: text with spaces quoted, lists without spaces, cut short."""
    if isinstance(value, (list, tuple)):
        shown = [_one_word(v) for v in value[:LIST_SHOWN]]
        more = [f"+{len(value) - LIST_SHOWN}_more"] if len(value) > LIST_SHOWN else []
        return "[" + ",".join(shown + more) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_one_word(v)}" for k, v in value.items()) + "}"
    text = str(value)
    return f'"{text}"' if " " in text else text


def sync_facts(sync: SyncStrategy, network: str | None, trials: bool = False) -> dict[str, Any]:
    """The strategy's describe(), which step the observer measures, and the emulated network it ran
    on (network=<preset>): what the `sync:` line and summary.json's `sync` show. summary.json
    (trials=True) also keeps bucket_cap_mb=auto's trials with every timed step (`auto_trials`),
    which the line shows rounded."""
    observer = sync.comm.observer
    info = {**describe(sync), "comm_timing": observer.describe()}
    if observer.every and observer.budget.active:  # how often a candidate step is sampled
        info["sample_budget"] = observer.budget.describe()
    if trials and sync.tuner is not None:
        info["auto_trials"] = sync.tuner.table()
    return info if network is None else {**info, "network": network}


def sync_lines(info: dict[str, Any]) -> str:
    """The strategy's describe() on screen: `sync: key=value ...`, a few pairs a line, continued indented."""
    pairs = [f"{key}={_one_word(value)}" for key, value in info.items()]
    lines = [" ".join(pairs[i : i + PAIRS_PER_LINE]) for i in range(0, len(pairs), PAIRS_PER_LINE)]
    return "sync: " + f"\n{' ' * len('[rank0] sync: ')}".join(lines)  # continued under the first key


class TrainRows:
    """Writes each logged row to every logger and keeps the rows for this rank's summary."""

    def __init__(
        self,
        ctx: DistContext,
        sync: SyncStrategy,
        loggers: Sequence[MetricLogger],
        rates: TokenRates | None = None,
        network: str | None = None,
    ) -> None:
        self.ctx, self.sync, self.loggers = ctx, sync, loggers
        self.network = network  # network=<preset>: the emulated link, as the sync line names it
        self.rates = rates  # token data: tokens/s and MFU rows
        self.rows: list[dict[str, Any]] = []
        self.skipped_steps = 0  # on_nonfinite=skip: steps whose gradients were not finite, so far
        self.overflow_steps = 0  # fp16: steps the scaler skipped for an overflow, so far
        self._samples = 0  # trained on, over every window (evaluation and checkpoints excluded)
        self._tokens = 0  # the same windows' tokens (token data: the whole-run tokens/s and MFU)
        self._seconds = 0.0
        self._rss = ResidentMemory()
        self._saves: list[dict[str, float]] = []  # each checkpoint's cost to this rank
        self._sync_line_shown = False

    def show_sync_line(self) -> None:
        """Once per job: at the first logged step where the strategy's layout is final (DDP has rebuilt
        its buckets by then; bucket_cap_mb=auto has chosen), or at the end of a run too short for that."""
        if not self._sync_line_shown and self.ctx.is_main_process:
            log.info("%s", sync_lines(sync_facts(self.sync, self.network)))
        self._sync_line_shown = True

    def log(
        self,
        step: int,
        epoch: int,
        window: Window,
        totals: tuple[float, int, int],
        observer: Observer,
        runner: StepRunner,
    ) -> float:
        """One row from the window since the previous row and the observer's sampled step; returns
        its loss. The window is reset."""
        loss_sum, correct, _ = totals
        # The mean micro-batch loss (each was divided by grad_accum_steps): a rank that ran
        # micro-batches it had no data for (data.drop_last=false) averages only those it trained.
        trained = window.micro_batches
        loss = loss_sum * runner.settings.grad_accum_steps / trained if trained else float("nan")
        elapsed = time.perf_counter() - window.started
        self._samples += window.samples
        self._tokens += window.tokens
        self._seconds += elapsed
        self._count_skipped(window.not_finite_steps, runner)
        row: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            ROW: TRAIN,
            # Omitted by a rank that trained on nothing since the last row (it only ran micro-batches without data).
            **({"train/loss": loss} if trained else {}),
            # The sampled step's own samples (docs/metrics.md).
            **({"train/accuracy": correct / window.predicted} if window.predicted else {}),
            "train/lr": runner.lr,
            # The sampled step's global norm of the averaged gradient, before clipping.
            **({"train/grad_norm": window.grad_norm} if window.grad_norm is not None else {}),
            "throughput/samples_per_s": window.samples / elapsed,
            **(self.rates.row(window.tokens, elapsed) if self.rates else {}),
            "memory/rss_mb": self._rss.bytes() / 2**20,
            **observer.take(),  # the sampled step's time/*, comm/*, memory/* (trainer/measures.py)
            **({"train/skipped_steps": self.skipped_steps} if self.skipped_steps else {}),
            # fp16: the loss scale in use, and the steps its overflows skipped so far.
            **(
                {"train/grad_scale": window.extra["scale"][0], "train/overflow_steps": self.overflow_steps}
                if runner.scaler is not None
                else {}
            ),
            **({"sync/bucket_cap_mb": self.sync.tuner.cap_mb} if self.sync.tuner is not None else {}),
            # trainer.profile=true: these steps ran under the profiler (slower than the others).
            **({"trainer/profiled_steps": observer.profiled} if observer.profiled else {}),
        }
        observer.profiled = 0
        if not self._sync_line_shown and settled(self.sync):
            self.show_sync_line()
        if self.ctx.device.type == "cuda":
            row["memory/cuda_max_allocated_mb"] = cuda_peak_mb(self.ctx.device)
        for logger in self.loggers:
            logger.log(row)
        self.rows.append(row)
        window.reset()
        return loss

    def _count_skipped(self, steps: list[int], runner: StepRunner) -> None:
        """The window's steps whose gradients were not finite: fp16's overflows, or on_nonfinite=skip's
        skips (said here, at the row: the step itself never reads its flag on the host)."""
        if not steps:
            return
        if runner.scaler is not None:
            self.overflow_steps += len(steps)
            return
        self.skipped_steps += len(steps)
        log.warning(
            "step(s) %s: non-finite gradients, optimizer step skipped on every rank (trainer.on_nonfinite=skip)",
            ", ".join(map(str, steps)),
        )

    def log_checkpoint(self, step: int, epoch: int, cost: dict[str, float]) -> None:
        """A checkpoint's own row at its step (its blocking time, this rank's peak memory while saving)."""
        for logger in self.loggers:
            logger.log({"step": step, "epoch": epoch, ROW: CHECKPOINT, **cost})
        self._saves.append(cost)

    def _save_costs(self) -> dict[str, float]:
        """For summary.json: the checkpoints written, the longest wait for one, the highest peak during one."""
        if not self._saves:
            return {}
        keys = set().union(*self._saves)
        return {"checkpoints_written": len(self._saves)} | {
            f"max_{key}": max(cost[key] for cost in self._saves if key in cost) for key in sorted(keys)
        }

    def rank_record(self) -> dict[str, Any]:
        """What this rank contributes to summary.json: its last row's results and its timing medians."""
        last = self.rows[-1] if self.rows else {}
        return {
            "rank": self.ctx.rank,
            "host": hostname(),
            "train/loss": last.get("train/loss"),
            "train/accuracy": last.get("train/accuracy"),
            "samples_per_s": self._samples / self._seconds if self._seconds else 0.0,
            # Token data: the same whole-run mean in tokens (and MFU), so the end-of-run line shows one statistic.
            **(
                {k.partition("/")[2]: v for k, v in self.rates.row(self._tokens, self._seconds).items()}
                if self.rates
                else {}
            ),
            "samples": self._samples,  # trained on by this rank: summed over ranks, epochs × the train set
            "outputs": [logger.location for logger in self.loggers if logger.location],
            **self._save_costs(),
            **rank_timing(self.rows),
            # who arrived last at the sampled steps' collectives (every rank's rows say the same)
            **({"straggler": found} if (found := arrivals.straggler(self.rows)) else {}),
        }
