"""conf/sync/'s options, each built as train.py builds it and asked what its step sends.

The scaling model learns the strategies from conf/sync/ alone: a strategy's module (with its
schedule(), trainer/comm_schedule.py) and its YAML put it in `python -m trainer.scaling`. No list
of names lives in trainer/scaling/.
"""

from __future__ import annotations

from trainer.comm_schedule import Buckets, Nothing, Schedule
from trainer.setup.config import sync_options
from trainer.setup.instantiate import instantiate


def schedules() -> tuple[dict[str, Schedule], list[str]]:
    """Each option's schedule by name, plainest first (`plainness`; a tie in file order), and the
    options whose strategy does not say what its step sends (SyncStrategy.schedule), in file order."""
    described: dict[str, Schedule] = {}
    silent: list[str] = []
    for name, node in sync_options().items():
        try:
            described[name] = instantiate(node).schedule()
        except NotImplementedError:
            silent.append(name)
    ordered = sorted(described, key=lambda name: plainness(described[name]))
    return {name: described[name] for name in ordered}, silent


def plainness(schedule: Schedule) -> tuple[int, bool, bool, bool]:
    """Where a strategy's rows go in the table: nothing sent, then buckets, then units; within them
    a replicated optimizer before a sharded one, buckets sent after backward before those sent
    during it, ddplab's bucket rule before DDP's."""
    sends, sharded = schedule.sends, schedule.optimizer_shard is not None
    if isinstance(sends, Buckets):
        return 1, sharded, sends.overlap, sends.rule == "ddp"
    return (0 if isinstance(sends, Nothing) else 2), sharded, False, False
