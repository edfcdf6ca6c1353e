"""The data-parallel training loop.

Trainer(...), then resume_from_checkpoint() from a checkpoint when trainer.resume finds one; then fit():
    for each epoch:
        sampler.set_epoch(epoch)                  # a new shuffle, the same permutation on every rank
        for each optimizer step (a SIGTERM waits for the iteration to end):
            k micro-batches: forward, backward    # all but the last under sync.no_sync()
            sync.after_backward()                 # from here the gradients are equal on every rank
            optimizer.step(); lr schedule step    # the optimizer step skipped if on_nonfinite=skip says so
            then, as due, on every rank at the same step: a logged row (one host sync), the replica
            check, evaluation (sums all-reduced), a checkpoint
    evaluate; rank 0 writes checkpoints/step-<n>.pt, last.pt, summary.json; every rank waits at a barrier
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from data.base import DataModule, ResumableSampler
from trainer import arrivals
from trainer.core import DistContext, TrainSettings
from trainer.errors import from_leaves
from trainer.logger.base import MetricLogger, resumed_at
from trainer.loop.faulty_step import FaultyStepRunner
from trainer.loop.lm import compile_model, end_of_run_sample, token_rates, write_vocab
from trainer.loop.metrics import Window, evaluate
from trainer.loop.profiling import StepProfiler, send_timeline
from trainer.loop.progress import logging_above, progress_bar
from trainer.loop.rows import TrainRows, sync_facts
from trainer.loop.step import StepRunner
from trainer.loop.step_math import (
    epoch_of,
    global_batch_size,
    is_due,
    steps_per_epoch,
    total_steps,
)
from trainer.loop.summary import gather_summary, parameter_layout, write_json
from trainer.measures import MemoryProbe
from trainer.reliability import fault as faults
from trainer.reliability import flight, resume
from trainer.reliability.exits import StepBoundary, Terminated
from trainer.reliability.flight import Flight
from trainer.reliability.guards import NonFiniteCheck, check_replicas
from trainer.reliability.save_cost import SaveCost
from trainer.reliability.sharded import InFlight, checkpoint_group
from trainer.sample_budget import BUDGET_NUMBERS
from trainer.sync.base import SyncStrategy
from trainer.sync.master import DTYPES, cast_parameters
from trainer.windows import EVAL, ROW

log = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A training step raised; the message names the step and the rank."""


class Trainer:
    """Holds the run's state (model, optimizer, step) and runs fit() on every rank."""

    def __init__(
        self,
        *,
        settings: TrainSettings,
        ctx: DistContext,
        model: nn.Module,
        data: DataModule,
        sync: SyncStrategy,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], Optimizer],
        schedule_factory: Callable[..., Callable[[int], float]],
        loggers: Sequence[MetricLogger],
        run_dir: Path,
        config: dict[str, Any],
        network: str | None = None,
    ) -> None:
        self.settings = settings
        self.ctx = ctx
        self.model = model.to(ctx.device)  # unwrapped: evaluation and checkpoints use it
        # trainer.param_dtype=bf16|fp16: the strategy wraps, buckets and reduces 16-bit parameters and
        # gradients; the optimizer steps fp32 copies (trainer/sync/master.py)
        cast_parameters(self.model, DTYPES[settings.param_dtype])
        self.sync = sync
        if settings.compile:  # in place, before the strategy wraps it: state_dict keys stay the model's
            compile_model(self.model)
        self.train_model = sync.wrap(self.model)
        self.optimizer = sync.build_optimizer(self.model, optimizer_factory)
        with from_leaves():  # e.g. a batch too large for the world size
            self.train_loader = data.train_loader(ctx.rank, ctx.world_size, settings.seed, device=ctx.device)
            # trainer.eval_max_samples: the split's first n samples, cut before sharding, so every
            # world size evaluates the same windows.
            subset = settings.eval_max_samples
            self.val_loader = data.val_loader(ctx.rank, ctx.world_size, device=ctx.device, max_samples=subset)
        assert isinstance(self.train_loader.sampler, ResumableSampler)
        self._sampler = self.train_loader.sampler  # shuffles per epoch; skips ahead on resume
        # Every rank runs as many steps as the rank with the most batches (data.drop_last=false may
        # leave some a batch short: they pair the others' collectives, StepRunner.backward_without_data).
        self._uneven = not data.drop_last
        most = max(data.train_batches(ctx.world_size))
        self.steps_per_epoch = steps_per_epoch(most, settings.grad_accum_steps, keep_partial=self._uneven)
        self._val_batches = max(data.val_batches(ctx.world_size, settings.eval_max_samples))
        if settings.eval_max_samples is not None and settings.eval_max_samples > data.val_size():
            log.info(
                "trainer.eval_max_samples=%d is more than the validation split's %d samples: evaluating them all",
                settings.eval_max_samples,
                data.val_size(),
            )
        self.total_steps = total_steps(settings.max_steps, settings.num_epochs, self.steps_per_epoch)
        self.scheduler = LambdaLR(self.optimizer, schedule_factory(total_steps=self.total_steps))
        self.global_batch_size = global_batch_size(data.batch_size, settings.grad_accum_steps, ctx.world_size)
        self.loggers = list(loggers)
        self.run_dir = run_dir
        self.config = config
        self.step = 0
        self.epoch = 0
        # The one instrument, which the builder gave the strategy's communication object: it watches
        # the sampled step (trainer/observer.py), memory included.
        self.observer = sync.comm.observer
        self.observer.probe = MemoryProbe(self.model, self.optimizer, sync.comm.held, sync.gathers_parameters)
        self.observer.last_step = self.total_steps
        self._window = Window(ctx.device)
        self._nonfinite = NonFiniteCheck(ctx.device)
        self._row_step = 0  # the step of the previous row (a window's steps: the sample budget's)
        self._batches: Iterator[Any] | None = None  # the current epoch's batches
        self.data = data
        rates = token_rates(self.model, data, ctx.device, settings)
        self._rows = TrainRows(ctx, sync, self.loggers, rates, network)
        # trainer.fault (a testing aid) attaches around the step path only when it is configured.
        runner = FaultyStepRunner if settings.fault.configured else StepRunner
        self.runner = runner(
            settings=settings,
            ctx=ctx,
            model=self.model,
            train_model=self.train_model,
            empty_inputs=torch.zeros((0, *data.input_shape), dtype=data.input_dtype, device=ctx.device),
            sync=sync,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            observer=self.observer,
            window=self._window,
        )
        # The hang report's rings and watcher (trainer/reliability/flight.py): with the Flight Recorder only.
        launches = flight.recorded() if ctx.world_size > 1 else 0
        self.flight = Flight(ctx.store if launches else None, ctx.rank, ctx.world_size, self.run_dir, launches)
        sync.comm.launches = self.flight.launches if launches else None
        self._checkpoint_step: int | None = None  # the newest checkpoint this run can resume from
        self.finished_before = False  # resumed at its last step: a re-run of a finished run, nothing to train
        self._loggers_from: int | None = None  # the step the loggers continue after (resume), if they must be told
        self.step_boundary = StepBoundary(settings.step_grace_s)  # entered by every iteration of train()
        # checkpoint_async: the save in flight, its collectives on a gloo group of their own (every rank makes it)
        timeout = dt.timedelta(seconds=settings.collective_timeout_s)
        self._saves = InFlight(checkpoint_group(timeout)) if settings.checkpoint_async else None

    def resume_from_checkpoint(self) -> None:
        """trainer.resume: continue from a checkpoint if there is one (every rank, a collective)."""
        state = self._state()
        s = self.settings
        choice = resume.resume_choice(s.resume, s.checkpoint)  # trainer.checkpoint=false: `auto` finds none
        if resume.resume_if_any(self.ctx, self.run_dir, choice, state, self.config):
            self.step, self.epoch = state.step, state.epoch
            self._row_step = state.step
            self._checkpoint_step = state.step
            self.finished_before = state.step >= self.total_steps
            self._loggers_from = state.step
            resumed_at(self.loggers, state.step)  # the JSONL drops the interrupted attempt's later rows
            # The next pass over this epoch starts where the checkpoint stopped: skip the sample
            # indices of the micro-batches already trained on (no data is read to get there).
            self._sampler.skip_next(state.batches_into_epoch * self.data.batch_size)
            return
        # Training starts over at step 0, as before in this run dir (a restart, trainer.resume=never):
        # the JSONL drops the earlier attempt's (or run's) rows, so each step is there once.
        if self.ctx.attempt > 0 or choice == "never":
            self._loggers_from = 0
            resumed_at(self.loggers, 0)  # the JSONL drops the earlier attempt's (or run's) rows: each step once
        line = resume.start_over_line(self.ctx.attempt, s.checkpoint, self.run_dir)
        if line is not None:
            log.info("%s", line)  # every rank's log file; rank 0's console

    def attach_loggers(self, loggers: Sequence[MetricLogger]) -> None:
        """Loggers started after the resume (train.py starts none for a finished run: no empty W&B
        run, no rewritten JSONL), told where the run continues as the resume would have told them."""
        self.loggers.extend(loggers)  # the same list the rows write to
        if self._loggers_from is not None:
            resumed_at(loggers, self._loggers_from)

    def _state(self) -> resume.TrainState:
        """What a checkpoint holds of this trainer (the objects themselves, not copies)."""
        into_epoch = (self.step - self.epoch * self.steps_per_epoch) * self.settings.grad_accum_steps
        return resume.TrainState(
            self.model,
            self.optimizer,
            self.scheduler,
            self.sync.checkpointing,
            self.step,
            self.epoch,
            into_epoch,
            self.total_steps,
            self.data.batch_size,
            self.settings.grad_accum_steps,
            vocab=self.data.vocabulary(),
            grad_scaler=self.runner.scaler,
        )

    def fit(self) -> dict[str, Any]:
        """Train for total_steps optimizer steps; returns the job summary (the same on every rank)."""
        if self.finished_before:
            return self._summary_before()
        log.info(
            "training %d steps: %d rank(s) x batch %d x %d micro-batch(es) = global batch %d, %d steps/epoch",
            self.total_steps,
            self.ctx.world_size,
            self.train_loader.batch_size,
            self.settings.grad_accum_steps,
            self.global_batch_size,
            self.steps_per_epoch,
        )
        write_vocab(self.ctx, self.run_dir, self.data.vocabulary())
        started = time.perf_counter()
        show_bar = self.settings.progress_bar and self.ctx.is_main_process
        bar = progress_bar(self.total_steps, self.step, show_bar)  # a resumed run starts at its step
        # Rank 0 gives the loggers that keep pictures (W&B) the timeline once the profiled steps are done.
        send = partial(send_timeline, self.run_dir, self.loggers) if self.ctx.is_main_process else None
        profiler = StepProfiler(
            self.settings.profile,
            self.ctx.device,
            self.ctx.rank,
            self.run_dir / "profiler",
            self.observer,
            on_traces=send,
            wait_for_parameters=self.sync.wait_for_parameters,
            comm=self.sync.comm,
        )
        try:
            with bar, logging_above(bar), profiler:
                self.train(self.total_steps, bar, profiler)
            final_eval = self.evaluate()
        except BaseException as err:  # a collective that failed: the first rank to fail says which, and who never came
            # torchrun's SIGTERM (a peer died) can land while the failure unwinds: the failure is its context.
            failure = err.__context__ if isinstance(err, Terminated) and not err.interrupted else err
            if isinstance(failure, Exception):
                self.flight.failed(failure)
            raise
        finally:
            self.flight.close()  # no collective of the steps is left to fail: the watcher stops
        return self._finish(final_eval, time.perf_counter() - started)

    def _summary_before(self) -> dict[str, Any]:
        """A re-run of a finished run trains, evaluates and writes nothing: one line says so and how to
        train more; the summary is the run's own summary.json, as its rank 0 wrote it ({} if it has none)."""
        s = self.settings
        log.info("%s", resume.finished_line(self.step, s.max_steps, s.num_epochs))
        kept: list[Any] = [None]
        path = self.run_dir / "summary.json"
        if self.ctx.is_main_process and path.is_file():
            kept[0] = json.loads(path.read_text(encoding="utf-8"))
        dist.broadcast_object_list(kept, src=0)  # rank 0's file: the same summary on every rank, as fit() gives
        return kept[0] or {}

    def train(self, until_step: int, bar: tqdm | None = None, profiler: StepProfiler | None = None) -> None:
        """Run optimizer steps, logging and evaluating as configured, until `step == until_step`.

        Callable repeatedly (the overhead benchmark times it): it continues mid-epoch where it
        stopped, and time spent outside it is not counted in a logging window that starts here.
        """
        self.model.train()
        if self._window.num_steps == 0:
            self._window.started = time.perf_counter()
        try:
            while self.step < until_step:
                # A SIGTERM waits for the whole iteration, its periodic events included: then every
                # rank stops having run the same collectives, at the same step.
                with self.step_boundary:
                    self.run_iteration(bar, profiler)
            self.sync.wait_for_parameters()  # the caller may read the parameters now
        except Terminated as stop:
            failure = stop.__context__  # the step failed after the signal: a peer had stopped or died
            if isinstance(failure, Exception) and not stop.interrupted:
                self.flight.failed(failure)  # torchrun stops the survivors of a killed rank: which collective
            saved = self.settings.checkpoint_on_sigterm and resume.stop_together(
                self.ctx, lambda: self.step, self._write_checkpoint, self._one_more_step
            )
            self.wait_for_saves()  # a save in flight is finished before the job goes
            self._say_stopped(stop, saved)
            raise

    def _say_stopped(self, stop: Terminated, saved: bool) -> None:
        """One line for the job (rank 0's console; every rank's log file): where it stopped, what is kept."""
        if saved:
            last = f"checkpoint written at step {self._checkpoint_step} (trainer.checkpoint_on_sigterm)"
        elif self._checkpoint_step is not None:
            last = f"last checkpoint step {self._checkpoint_step}"
        else:
            last = "no checkpoint" if self.settings.checkpoint else "no checkpoint (trainer.checkpoint=false)"
        how = "interrupted" if stop.interrupted else f"terminated by signal (exit code {stop.code})"
        resume_hint = (
            "resume with the same command"
            if self._checkpoint_step is not None
            else "nothing to resume from: the same command starts over at step 0"
        )
        line = f"{how} at step {self.step}; {last}; {resume_hint}"
        # Console: rank 0 speaks for an interrupt every rank received; for a SIGTERM every rank
        # says it (a launcher may have stopped only some).
        log.log(logging.WARNING if self.ctx.is_main_process or not stop.interrupted else logging.INFO, line)
        stop.reported = True

    def run_iteration(self, bar: tqdm | None = None, profiler: StepProfiler | None = None) -> None:
        """One optimizer step and whatever is due after it."""
        if self._batches is None:  # a new epoch: a new shuffle, the same on every rank
            self._sampler.set_epoch(self.epoch)
            self._batches = iter(self.train_loader)
            if self._uneven:  # None once this rank's batches run out: StepRunner pairs the others' collectives
                self._batches = itertools.chain(self._batches, itertools.repeat(None))
        self.flight.step_started(self.step + 1)
        try:
            self.runner.run(self._batches, self.step + 1)
        except Exception as err:  # say where: the step, and this rank
            raise StepFailed(f"step {self.step + 1} on rank {self.ctx.rank}: {type(err).__name__}: {err}") from err
        self.step += 1
        if self.step % self.steps_per_epoch == 0:
            self.epoch += 1
            self._batches = None
        if profiler is not None:
            profiler.step(self.step)
        if bar is not None:
            bar.update(1)
        self._after_step(bar)

    def _after_step(self, bar: tqdm | None) -> None:
        """What happens between steps: every periodic event, each on every rank at the same step."""
        s = self.settings
        if self._saves is not None:
            self._saves.poll()  # rank 0 publishes a save that has finished writing (no collective)
        if is_due(self.step, s.log_every_n_steps, self.total_steps):
            checking = s.on_nonfinite == "raise"
            budget, sampled_s = self.observer.budget, self.observer.take_host_times()
            budgeted = budget.active and self.observer.every > 0  # something to space out
            # who arrived last at the sampled step's collectives: each rank's times (trainer/arrivals.py)
            comparing = self.observer.every > 0 and self.ctx.world_size > 1
            agreeing = checking or budgeted or comparing  # the row's one collective carries all three
            answers = self._nonfinite.previous() if agreeing else None  # the last row's, not read yet
            totals = self._window.totals(scale=self.runner.scale(), answers=answers)  # the row's one host read
            if agreeing:  # the last row's answers raise if bad; this row's are sent (its one collective)
                more: list[int] = []
                if budgeted:  # this window: its time, its steps, the host time of those sampled
                    budget.window(time.perf_counter() - self._window.started, self.step - self._row_step, sampled_s)
                    more = budget.mine()
                if comparing:
                    more += self.observer.arrivals()
                first_bad = totals[2] if checking else -1
                others = self._nonfinite.at_row(first_bad, self._window.extra.get("answers"), more)
                self._split_row_answers(others, budgeted, comparing)
            self._row_step = self.step
            epoch = epoch_of(self.step, self.steps_per_epoch)
            loss = self._rows.log(self.step, epoch, self._window, totals, self.observer, self.runner)
            if bar is not None:
                # Rank 0's own loss, not the job's (the mean over ranks the summary prints as train/loss).
                bar.set_postfix_str(f"rank 0 loss {loss:.4f} (last row)", refresh=False)  # drawn at the next update
        every = s.check_replicas_every_n_steps
        if every and self.sync.keeps_replicas_equal and self.step % every == 0:
            self.sync.wait_for_parameters()
            check_replicas(self.model, self.step)
        if s.eval_every_n_steps and self.step % s.eval_every_n_steps == 0 and self.step < self.total_steps:
            self.evaluate()
            self._window.started = time.perf_counter()  # evaluation is not training time
        if s.checkpoint_every_n_steps and self.step % s.checkpoint_every_n_steps == 0 and self.step < self.total_steps:
            self.save_checkpoint()
            self._window.started = time.perf_counter()  # nor is writing checkpoints

    def _split_row_answers(self, others: list[float], budgeted: bool, comparing: bool) -> None:
        """The previous row's numbers, every rank's in rank order: the budget's to the budget, the
        arrival times to the observer's next row (none where that row sent none: the first row, a
        checkpoint's check)."""
        width = len(others) // self.ctx.world_size
        by_rank = [others[r * width : (r + 1) * width] for r in range(self.ctx.world_size)]
        used = BUDGET_NUMBERS if budgeted else 0
        if budgeted:
            self.observer.budget.agree([n for numbers in by_rank for n in numbers[:used]])
        if comparing and width == used + arrivals.WIDTH:
            self.observer.late = arrivals.late_row([[int(n) for n in numbers[used:]] for numbers in by_rank])

    def wait_for_saves(self) -> None:
        """trainer.checkpoint_async: until the save in flight is written and published."""
        if self._saves is not None:
            self._saves.wait()

    def _check_finite(self) -> None:
        """on_nonfinite=raise, before a checkpoint: stop every rank if any saw a non-finite loss so far."""
        if self.settings.on_nonfinite == "raise":
            self._nonfinite.now(self._window.totals()[2])

    def save_checkpoint(self) -> None:
        """checkpoints/step-<step>.pt and last.pt (rank 0), after checking the state is worth keeping."""
        self._check_finite()
        self._write_checkpoint()

    def _write_checkpoint(self) -> None:
        with SaveCost(self.ctx.device) as cost:  # the step's wait for the save, and this rank's peak memory in it
            resume.save(
                self.ctx,
                self.run_dir / "checkpoints",
                self.settings.keep_checkpoints,
                self._state(),
                self.config,
                self.settings.checkpoint_format,
                self._saves,
                faults.in_save(self.settings.fault, self.ctx.rank, self.step, self.ctx.attempt),
            )
        self._checkpoint_step = self.step
        self._rows.log_checkpoint(self.step, epoch_of(self.step, self.steps_per_epoch), cost.metrics())

    def _one_more_step(self) -> bool:
        """For a SIGTERM that found the ranks a step apart: one more step, unless training is over."""
        if self.step >= self.total_steps:
            return False
        self.run_iteration()
        return True

    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the validation split (its first trainer.eval_max_samples), exact over
        those samples on every rank."""
        runner = self.runner
        # Between steps: the observer never samples it, the rows' comm/* stay per training step.
        metrics = evaluate(
            self.model, self.val_loader, self.ctx.device, runner.autocast, self._val_batches, runner.empty_inputs
        )
        if metrics:
            for logger in self.loggers:
                epoch = epoch_of(self.step, self.steps_per_epoch)
                logger.log({"step": self.step, "epoch": epoch, ROW: EVAL, **metrics})
        return metrics

    def _finish(self, final_eval: dict[str, float], wall_s: float) -> dict[str, Any]:
        if self.settings.checkpoint:
            self.save_checkpoint()  # before the summary, which reports what the saves cost each rank
        else:
            self._check_finite()  # as before a final checkpoint: a non-finite loss ends the run as an error
        self.wait_for_saves()  # the end of training waits for the last save
        self._rows.show_sync_line()  # a run that ended before its layout settled still says what it did
        mine = self._rows.rank_record()
        facts = {
            "sync": sync_facts(self.sync, self._rows.network, trials=True),
            "model": parameter_layout(self.model),
            "steps": self.step,
        }
        facts["epochs"] = self.step / self.steps_per_epoch
        facts |= {"global_batch_size": self.global_batch_size, "wall_time_s": wall_s, **final_eval}
        # Every rank: an FSDP forward gathers on all
        sample = end_of_run_sample(self.model, self.data, self.settings.end_sample_tokens)
        if sample is not None:
            facts["sample"] = sample
        summary = gather_summary(mine, self.ctx, str(self.run_dir), facts)
        for logger in self.loggers:
            logger.log_summary(summary | {"rank": mine})  # W&B: rank 0's run makes "ranks" a table
        if self.ctx.is_main_process:
            write_json(self.run_dir / "summary.json", summary)
        dist.barrier()  # nobody reads rank 0's files (or tears down) before they are complete
        return summary
