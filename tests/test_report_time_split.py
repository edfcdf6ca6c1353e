"""The report's right-hand panel: each job's bar is as tall as its step (compute + exposed comm), and
the communication hidden under backward is drawn inside the compute piece, never stacked on top of
it (which would count the same milliseconds twice). Expected numbers are worked by hand from the
hand-written rows; the bars are read back from the matplotlib figure."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.axes import Axes
from matplotlib.container import BarContainer

from tests.report_helpers import DDP, MANUAL, NONE, comm_keys, train_row, write_job
from trainer.tools.report import find_jobs
from trainer.tools.report_plot import plot
from trainer.tools.report_plot_time import COMPUTE, EXPOSED, HIDDEN, UNTIMED, Split, split
from trainer.tools.report_rows import JobRow, build_rows


@pytest.fixture
def rows(tmp_path: Path) -> list[JobRow]:
    """ddp: step 100 ms, comm 30 of which 10 exposed -> compute 90, hidden 20, exposed 10.
    manual: step 80, comm 25 all exposed -> compute 55, hidden 0, exposed 25. none: all compute (50).
    manual again: step 60, bytes sent but no row timed them -> split unknown.
    ddp again: step 40, comm 70 of which 5 exposed -> hidden 65 measured, more than compute (35)."""
    root = tmp_path / "sweep"
    jobs = [
        (DDP, "sync=ddp", 0.100, comm_keys(1e6, 0.030, 0.010)),
        (MANUAL, "sync=manual", 0.080, comm_keys(1e6, 0.025, 0.025)),
        (NONE, "sync=none", 0.050, {}),
        (MANUAL, "sync=manual +x=1", 0.060, comm_keys(1e6)),
        (DDP, "sync=ddp +x=2", 0.040, comm_keys(1e6, 0.070, 0.005)),
    ]
    for num, (target, overrides, step_s, comm) in enumerate(jobs):
        job_rows = [train_row(10, step_s, 0.0, 100, 1.0, comm)]
        write_job(root / str(num), [job_rows, job_rows], target, overrides.split())
    return build_rows(find_jobs(root))


def _bars(ax: Axes) -> dict[str, list[tuple[float, float, float, float]]]:
    """Each labelled set of bars as (left, right, bottom, top) in data units, in job order."""
    out = {}
    for container in ax.containers:
        assert isinstance(container, BarContainer)
        out[container.get_label()] = [
            (p.get_x(), p.get_x() + p.get_width(), p.get_y(), p.get_y() + p.get_height()) for p in container
        ]
    return out


def test_split_numbers(rows: list[JobRow]) -> None:
    assert [split(r) for r in rows] == [
        Split(pytest.approx(90.0), pytest.approx(10.0), pytest.approx(20.0)),
        Split(pytest.approx(55.0), pytest.approx(25.0), 0.0),
        Split(50.0, 0.0, 0.0),
        None,
        Split(pytest.approx(35.0), pytest.approx(5.0), pytest.approx(35.0)),  # hidden drawn no taller than compute
    ]


def test_each_bar_is_the_step_and_hidden_comm_sits_inside_compute(rows: list[JobRow]) -> None:
    ax = plot(rows, "title").axes[2]
    bars = _bars(ax)
    assert list(bars) == [COMPUTE, EXPOSED, HIDDEN, UNTIMED]
    compute, exposed = bars[COMPUTE], bars[EXPOSED]
    timed = [r for r in rows if split(r) is not None]
    assert len(compute) == len(exposed) == len(timed) == 4
    for row, c, e in zip(timed, compute, exposed, strict=True):
        assert c[2] == 0.0 and e[2] == pytest.approx(c[3])  # exposed sits on compute ...
        assert e[3] == pytest.approx(row.step_ms)  # ... and the bar's top is the step, nothing above it
        assert (c[0], c[1]) == (e[0], e[1])
    # The hidden bars: jobs 0 and 4 (the others hid nothing), narrower than compute and within it.
    for h, c in zip(bars[HIDDEN], [compute[0], compute[3]], strict=True):
        assert c[0] < h[0] < h[1] < c[1]
        assert c[2] <= h[2] < h[3] == pytest.approx(c[3])
    assert [h[3] - h[2] for h in bars[HIDDEN]] == [pytest.approx(20.0), pytest.approx(35.0)]
    # A job whose communication was not timed: one grey bar of its step, not a guess at its split.
    (untimed,) = bars[UNTIMED]
    assert untimed[2] == 0.0 and untimed[3] == pytest.approx(60.0) and untimed[0] < 3 < untimed[1]
    tallest = max(top for drawn in bars.values() for *_, top in drawn)
    assert tallest == pytest.approx(max(r.step_ms or 0.0 for r in rows))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [COMPUTE, EXPOSED, HIDDEN, UNTIMED]
