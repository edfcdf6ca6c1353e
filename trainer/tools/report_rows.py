"""The sweep report's numbers: each job's files reduced to one row of statistics.

Kept apart from reading the files (report.py) and from showing the rows (report_table.py,
report_plot.py) so every number the report shows is computed, and defined in LEGEND, in one place.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from trainer.arrivals import straggler_line
from trainer.comm_math import hidden_time
from trainer.errors import ConfigError
from trainer.tools.report_layout import Units, bucket_layout, cap_in_use, mark_same_layouts, other_units

LEGEND = """\
- bucket_mb: the strategy's `bucket_cap_mb` as configured; `auto (5)`: the cap `bucket_cap_mb=auto`
  chose from its timed trials and built the buckets with (summary.json's `sync.bucket_cap_mb_in_use`).
  Each run chooses for itself: a point whose repeats chose differently shows each choice, `auto (5|1)`,
  and each layout they built, `2: 8.44 4.33 MB | 4: 4.24 4.20 4.20 0.14 MB`, in job order.
- step ms: per rank the median of `time/step_s` over its training rows; the job's value is the
  median over ranks. A row's `time/step_s` is its sampled step's (one step in
  `trainer.sample_every_n_steps`, the one before the row: docs/metrics.md), not a mean.
- samples/s (median row): sum over ranks of the median of each rank's `throughput/samples_per_s`
  (ranks work concurrently), over the same rows as step ms. It is window wall-clock, every step
  since the previous row and the time between steps included, so it need not equal global batch /
  step ms (the rate of the sampled steps alone): the report says so in a note when the two differ
  by more than a fifth. The end-of-run line's throughput is another figure, the whole-run mean (all
  samples over the training time, evaluations and the first slow steps included): the two can differ.
- profiled rows (trainer.profile=true): a row carrying `trainer/profiled_steps` held steps the
  profiler recorded, and its window the profiler's start and the trace's writing. Step ms,
  samples/s, sync %, MB/step, exposed ms and hidden ms leave such rows out, so a profiled job's
  numbers describe its unprofiled steps; `report --timelines` draws the profiled steps only, and
  prints their median step beside the table's. A rank whose every row was profiled keeps them (a
  note names the job: its numbers include the profiler's cost).
- sync %: per rank sum(time/sync_s) / sum(time/step_s), then the mean over ranks. It is the time in
  the strategy's after_backward hook: DDP all-reduces inside backward, so for ddp it is ~0 and
  its communication is counted in time/backward_s (marked with a dagger).
- MB/step: `comm/bytes_per_step` in MB (10^6 bytes): per rank the median over its rows, then the
  median over ranks. What the strategy sends per optimizer step; `-` when it sends nothing (none),
  `n/m` (not measured) when it sends but no row measured it (trainer.sample_every_n_steps=0).
- inter-node MB/step (network.gpus_per_node > 1 only): `comm/inter_node_bytes_per_step` in MB, taken as
  MB/step is: the part of MB/step sent in collectives whose group spans emulated nodes, what crosses
  the slow link between them.
- exposed ms: `time/comm_exposed_s`, the communication not hidden under backward, per step: per rank
  the median over the rows that carry it (one step in `trainer.sample_every_n_steps` is measured), then
  the median over ranks; `-` for a job that sends nothing, `n/m` when no row has it.
- link ms (network=<preset> only): `time/comm_exposed_link_s`, what the step would have waited for if
  only the emulated link cost time (docs/metrics.md#the-links-ideal), taken as exposed ms is; exposed
  ms minus it is the strategy's own queueing and host work around the link.
- buckets: the gradient buckets the strategy really built (summary.json's `sync.bucket_sizes_bytes`;
  DDP's as rebuilt after its first iteration; zero's one flat buffer): their number, then their
  sizes in MB (past 4 buckets the smallest-largest and the total). Strategies without buckets
  name what they have instead: manual its flat gradient buffers (`1 buffer: 12.77 MB`, from
  `sync.buffer_sizes_bytes`; `+ 3 grads in place`: gradients all-reduced alone, in no buffer,
  `sync.num_reduced_in_place`), fsdp its wrapped units (`5 units: ...`, `sync.unit_bytes`: each
  unit's parameters as gathered); `- (sends nothing)` for a job without communication (none).
  `same as`: an earlier cap of the sweep built exactly these buckets, for jobs that differ in
  nothing else; such jobs are the same configuration, and their difference is noise.
- compute / hidden / exposed ms (the plot's right-hand bars): exposed = exposed ms; hidden =
  median `time/comm_s` (per rank over its rows, then over ranks) minus exposed, communication
  that ran under backward; compute = step ms minus exposed. A job's bar is compute with exposed
  on top: together the step. Hidden ran during compute, so it is drawn inside the compute piece
  (a narrower bar, no taller than compute), not added to the step.
- points (when jobs repeat, `+repeat=...`): the jobs that differ only in `repeat`; step ms is the
  median of their job medians, spread the min-max of those medians. Spreads that overlap mean the
  sweep cannot tell those points apart.
- peak RSS MB / peak CUDA MB: the maximum of `memory/rss_mb` / `memory/cuda_max_allocated_mb` over
  every row of every rank (the CUDA column only when some job ran on CUDA).
- opt state MB: the maximum of `memory/optimizer_state_mb` (MiB of optimizer state a rank holds;
  ~1/N of ddp's under zero and fsdp) over every row of every rank; `-` when no row has it.
- mem MB/rank: the maximum of `memory/peak_mb` over every row of every rank: the sampled step's
  total (parameters, gradients, optimizer state, communication buffers and activations at their
  peaks, added up on CPU; the allocator's peak on CUDA: docs/metrics.md#memory); `-` when no row
  has it (runs logged before it existed).
- predicted MB/rank (report --memory only): the memory predictor's total per rank for the job's own
  overrides at its number of ranks (`python -m trainer.tools.memory`, docs/memory.md), beside what
  the run measured.
- train loss: the last row, the mean over ranks of each rank's last training row's `train/loss` (the
  end-of-run report's train/loss (last row), the same number).
- eval acc: the last eval row's `eval/accuracy` (identical on all ranks; rank 0's is taken).
- slowest / fastest: the ranks with the highest / lowest median step time.
- status: `incomplete` when the job dir has no (readable) summary.json, i.e. the job did not
  finish: its numbers are shown in parentheses, are not valid results, and are not plotted."""
HIDDEN_OVERRIDES = ("run_name", "hydra.")  # naming, not an experimental variable
REPEAT_KEY = "repeat"  # `+repeat=1,2,3`: the same point again, interleaved with the others
CAP_KEY = "sync.bucket_cap_mb"
PROFILED_KEY = "trainer/profiled_steps"  # the row's window held steps the profiler recorded
RATE_TOLERANCE = 0.2  # samples/s this far from global batch / step ms is said in a note


@dataclass
class Job:
    name: str
    summary: dict[str, Any] | None  # None: no readable summary.json, the job did not finish
    config: dict[str, Any]
    overrides: list[str]
    rows: dict[int, list[dict[str, Any]]]  # rank -> its JSONL rows, in file order


@dataclass
class RankStats:
    rank: int
    step_ms: float | None
    samples_per_s: float | None
    sync_share: float | None
    train_loss: float | None
    timed_steps: int
    bytes_per_step: float | None = None
    comm_exposed_ms: float | None = None
    comm_exposed_link_ms: float | None = None
    inter_node_bytes_per_step: float | None = None
    peak_rss_mb: float | None = None
    peak_cuda_mb: float | None = None
    opt_state_mb: float | None = None
    comm_ms: float | None = None
    step_memory_mb: float | None = None
    profiled_rows: int = 0  # rows left out of the timings: their window held profiled steps
    profiled_only: bool = False  # every training row was profiled: the timings are theirs


@dataclass
class JobRow:
    job: str
    status: str
    overrides: str
    sync: str
    model: str
    bucket_cap_mb: float | None  # a number of MiB; None for no buckets or a non-numeric setting
    bucket_setting: str  # as configured: "" (no buckets), "25", "auto"
    ranks: list[RankStats]
    step_ms: float | None
    samples_per_s: float | None
    sync_share_pct: float | None
    train_loss: float | None
    eval_accuracy: float | None
    slowest: RankStats | None
    fastest: RankStats | None
    mb_per_step: float | None = None
    comm_exposed_ms: float | None = None
    comm_exposed_link_ms: float | None = None  # on an emulated link: the link's ideal
    inter_node_mb_per_step: float | None = None  # network.gpus_per_node > 1: the bytes across nodes
    peak_rss_mb: float | None = None
    peak_cuda_mb: float | None = None
    opt_state_mb: float | None = None
    comm_ms: float | None = None
    step_memory_mb: float | None = None  # the largest memory/peak_mb of any rank's rows
    predicted_memory_mb: float | None = None  # report --memory: the memory predictor's total per rank
    bucket_sizes: tuple[int, ...] | None = None  # what the strategy built, in bytes; None: no buckets
    units: Units | None = None  # no buckets, but manual's flat buffers or fsdp's units
    cap_in_use_mb: float | None = None  # the cap bucket_cap_mb=auto chose (this run's own); None for a fixed cap
    same_buckets_as: str = ""  # "cap 5": an earlier cap of the sweep built the same buckets
    repeat: str = ""  # the `repeat` override's value, "" when the sweep has none
    context: str = ""  # the differing overrides besides the cap and the repeat
    global_batch: int | None = None  # samples per optimizer step, all ranks (summary.json)
    link: str = ""  # the emulated link (network=<preset>), "" for none
    straggler: str = ""  # summary.json's persistent straggler, said ("" for none)

    @property
    def profiled_rows(self) -> int:
        """Rows of all ranks left out of the timings because the profiler recorded in their window."""
        return sum(r.profiled_rows for r in self.ranks)

    @property
    def profiled_only(self) -> bool:
        """Some rank had no unprofiled row: its timings include the profiler's cost."""
        return any(r.profiled_only for r in self.ranks)

    @property
    def step_rate(self) -> float | None:
        """Global batch / step ms: the samples per second of the sampled steps alone."""
        if self.global_batch is None or not self.step_ms:
            return None
        return self.global_batch / (self.step_ms / 1000.0)

    @property
    def hidden_comm_ms(self) -> float | None:
        """Communication that ran under backward (comm minus exposed); 0 when all of it was exposed."""
        if self.comm_ms is None or self.comm_exposed_ms is None:
            return None
        return hidden_time(self.comm_ms, self.comm_exposed_ms)

    @property
    def compute_ms(self) -> float | None:
        """The step without the exposed communication; the whole step when the job sent nothing."""
        if self.step_ms is None:
            return None
        if self.comm_exposed_ms is None:
            return self.step_ms if self.mb_per_step is None else None  # sent bytes, timed none: unknown
        return max(0.0, self.step_ms - self.comm_exposed_ms)


def _median(values: Sequence[float | None], scale: float = 1.0) -> float | None:
    """The median of the values present, times scale (a unit change); None if none is present."""
    present = [v for v in values if v is not None]
    return scale * statistics.median(present) if present else None


def _max(values: Sequence[float | None]) -> float | None:
    return max((v for v in values if v is not None), default=None)


def _column(rows: Sequence[dict[str, Any]], key: str) -> list[float | None]:
    """One metric from the rows that carry it (ddp's sampled timings are absent from the others)."""
    return [float(row[key]) for row in rows if isinstance(row.get(key), int | float)]


def rank_stats(rank: int, rows: Sequence[dict[str, Any]]) -> RankStats:
    """A rank's medians over its training rows, the profiled ones left out (the profiler slows their
    steps and their window) unless every row was profiled; its peaks over every row."""
    trained = [row for row in rows if "train/loss" in row]
    train = [row for row in trained if PROFILED_KEY not in row] or trained
    step = [row["time/step_s"] for row in train if "time/step_s" in row]
    timed = [row for row in train if "time/step_s" in row and "time/sync_s" in row]
    step_total = sum(row["time/step_s"] for row in timed)
    return RankStats(
        rank=rank,
        step_ms=_median(step, 1000.0),
        samples_per_s=_median(_column(train, "throughput/samples_per_s")),
        sync_share=sum(row["time/sync_s"] for row in timed) / step_total if step_total > 0 else None,
        train_loss=trained[-1]["train/loss"] if trained else None,
        timed_steps=len(step),
        bytes_per_step=_median(_column(train, "comm/bytes_per_step")),
        comm_exposed_ms=_median(_column(train, "time/comm_exposed_s"), 1000.0),
        comm_exposed_link_ms=_median(_column(train, "time/comm_exposed_link_s"), 1000.0),
        inter_node_bytes_per_step=_median(_column(train, "comm/inter_node_bytes_per_step")),
        peak_rss_mb=_max(_column(rows, "memory/rss_mb")),
        peak_cuda_mb=_max(_column(rows, "memory/cuda_max_allocated_mb")),
        opt_state_mb=_max(_column(rows, "memory/optimizer_state_mb")),
        comm_ms=_median(_column(train, "time/comm_s"), 1000.0),
        step_memory_mb=_max(_column(rows, "memory/peak_mb")),
        profiled_rows=len(trained) - len(train),
        profiled_only=bool(trained) and all(PROFILED_KEY in row for row in trained),
    )


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _bucket(setting: Any) -> tuple[float | None, str]:
    """A strategy's bucket_cap_mb as a number for the plot's x axis (None if absent or "auto") and as shown."""
    if setting is None:
        return None, ""
    if isinstance(setting, int | float) and not isinstance(setting, bool):
        return float(setting), format(setting, "g")
    return None, str(setting)


def value_of(overrides: Sequence[str], key: str) -> str:
    """The value the overrides give `key` (`+repeat=2` -> "2" for `repeat`); "" when none sets it."""
    return next((o.split("=", 1)[1] for o in overrides if "=" in o and override_key(o) == key), "")


def emulated_link(config: dict[str, Any], world_size: int) -> str:
    """The job's emulated link as its sync line names it, with its time_scale (`100gbe (alpha 15 us,
    beta 10 GB/s), time_scale 25`); "" for network=none or a config without the key."""
    network = config.get("network") or {}
    if network.get("preset", "none") == "none":
        return ""
    from trainer.sync.network import Network  # imports torch: only for a job on an emulated link

    keys = {f.name for f in fields(Network)}
    chosen = Network(**{k: v for k, v in network.items() if k in keys})
    try:
        link = replace(chosen, time_scale=1.0).link(max(1, world_size))
    except (ConfigError, KeyError):  # a preset or combination this code no longer knows: its name alone
        link = None
    scale = f", time_scale {chosen.time_scale:g}" if chosen.time_scale != 1 else ""
    return (chosen.preset if link is None else link.describe()) + scale


def job_row(job: Job, overrides: Sequence[str]) -> JobRow:
    sync_cfg = job.config.get("sync") or {}
    sync = str(sync_cfg.get("_target_", "")).rpartition(".")[0].rpartition(".")[2]  # trainer.sync.ddp.DDPSync -> ddp
    bucket_cap_mb, bucket_setting = _bucket(sync_cfg.get("bucket_cap_mb"))  # any strategy with buckets
    ranks = [rank_stats(rank, rows) for rank, rows in job.rows.items()]
    timed = [r for r in ranks if r.step_ms is not None]
    samples = [r.samples_per_s for r in ranks if r.samples_per_s is not None]
    share = _mean([r.sync_share for r in ranks])
    evals = [row for row in job.rows[min(job.rows)] if "eval/accuracy" in row] if job.rows else []
    return JobRow(
        job=job.name,
        status="incomplete" if job.summary is None else "ok",
        overrides=" ".join(overrides),
        sync=sync,
        model=str((job.config.get("model") or {}).get("_target_", "")).rpartition(".")[2],
        bucket_cap_mb=bucket_cap_mb,
        bucket_setting=bucket_setting,
        ranks=ranks,
        step_ms=_median([r.step_ms for r in timed]),
        samples_per_s=sum(samples) if samples else None,
        sync_share_pct=None if share is None else 100.0 * share,
        train_loss=_mean([r.train_loss for r in ranks]),
        eval_accuracy=evals[-1]["eval/accuracy"] if evals else None,
        slowest=max(timed, key=_step_ms, default=None),
        fastest=min(timed, key=_step_ms, default=None),
        mb_per_step=_median([r.bytes_per_step for r in ranks], 1e-6),
        comm_exposed_ms=_median([r.comm_exposed_ms for r in ranks]),
        comm_exposed_link_ms=_median([r.comm_exposed_link_ms for r in ranks]),
        inter_node_mb_per_step=_median([r.inter_node_bytes_per_step for r in ranks], 1e-6),
        peak_rss_mb=_max([r.peak_rss_mb for r in ranks]),
        peak_cuda_mb=_max([r.peak_cuda_mb for r in ranks]),
        opt_state_mb=_max([r.opt_state_mb for r in ranks]),
        step_memory_mb=_max([r.step_memory_mb for r in ranks]),
        comm_ms=_median([r.comm_ms for r in ranks]),
        bucket_sizes=bucket_layout(job.summary),
        units=other_units(job.summary),
        cap_in_use_mb=cap_in_use(job.summary),
        repeat=value_of(job.overrides, REPEAT_KEY),
        context=" ".join(o for o in overrides if override_key(o) not in (REPEAT_KEY, CAP_KEY)),
        global_batch=(job.summary or {}).get("global_batch_size"),
        link=emulated_link(job.config, len(job.rows)),
        straggler=(straggler_line((job.summary or {}).get("straggler", {})) or "").strip(),
    )


def _step_ms(stats: RankStats) -> float:
    """Sort key over ranks that have a step time (the caller filters the others out)."""
    assert stats.step_ms is not None
    return stats.step_ms


def override_key(override: str) -> str:
    """`+sync.bucket_cap_mb=5` -> `sync.bucket_cap_mb`: the key an override sets, however it adds or deletes."""
    return override.split("=", 1)[0].lstrip("+~")


def differing_overrides(per_job: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each job's overrides whose value is not the same in every job (one job: all of them)."""
    shown = [[o for o in job if not override_key(o).startswith(HIDDEN_OVERRIDES)] for job in per_job]
    if len(shown) <= 1:
        return shown
    values = [{override_key(o): o for o in job} for job in shown]
    keys = {k for v in values for k in v if len({job.get(k) for job in values}) > 1}
    return [[o for o in job if override_key(o) in keys] for job in shown]


def job_names(jobs: Sequence[str]) -> str:
    """`job 0`, `jobs 0 and 1`, `jobs 0, 1 and 2`."""
    if len(jobs) == 1:
        return f"job {jobs[0]}"
    return f"jobs {', '.join(jobs[:-1])} and {jobs[-1]}"


def profiled_sentences(rows: Sequence[JobRow]) -> list[str]:
    """Why a profiled job's table and its timeline differ: the rows the timings leave out, or that
    a rank had none other to keep."""
    lines = []
    left_out = [r.job for r in rows if r.profiled_rows]
    if left_out:
        lines.append(
            f"note: {job_names(left_out)} ran under the profiler (trainer.profile=true): step ms and samples/s "
            "leave out the rows that held profiled steps, which the profiler slows; a timeline draws "
            "only those steps, so its step times are not the table's"
        )
    only = [r.job for r in rows if r.profiled_only]
    if only:
        lines.append(
            f"note: {job_names(only)}: every row held profiled steps, so step ms and samples/s include the "
            "profiler's cost (for rows without them: a smaller trainer.log_every_n_steps or more steps)"
        )
    return lines


def rate_sentence(rows: Sequence[JobRow]) -> str | None:
    """One line when samples/s does not follow from step ms (global batch / step ms) for some job: the
    two measure different time, and the reader is told which."""
    off = [
        r
        for r in rows
        if r.status == "ok"
        and r.step_rate is not None
        and r.samples_per_s is not None
        and abs(r.samples_per_s / r.step_rate - 1) > RATE_TOLERANCE
    ]
    if not off:
        return None
    each = [
        f"job {r.job} ({r.samples_per_s:.0f}; {r.global_batch} samples / {r.step_ms:.2f} ms: {r.step_rate:.0f})"
        for r in off
    ]
    return (
        f"note: samples/s does not follow from step ms for {', '.join(each)}: samples/s is wall-clock over "
        "every step since the previous row, the time between steps included; step ms is one sampled step per row"
    )


def build_rows(jobs: Sequence[Job]) -> list[JobRow]:
    shown = differing_overrides([job.overrides for job in jobs])
    rows = [job_row(job, overrides) for job, overrides in zip(jobs, shown, strict=True)]
    mark_same_layouts(rows)
    return rows
