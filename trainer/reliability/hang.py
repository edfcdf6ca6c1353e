"""Reading the ranks' snapshots of a failed collective (trainer/reliability/flight.py) into three lines.

torch's own reader (torch.distributed.flight_recorder.fr_trace) expects nccl's dumps: on gloo's it
stops at a missing key, so the lab reads the records itself, by the same rule. Each rank numbers
the collectives of a process group 1, 2, 3, ... as it launches them; ranks in step launch the same
collective under the same number. So the first number at which the ranks' records differ is where
it went wrong: the ranks that have no record under it never entered that collective, and those with
another record there entered a different one (a desync). Each record is placed in its step by the
rank's step starts and named by the communication object's launches (bucket or unit), both kept
beside torch's records; a record the lab did not launch (DDP's reducer, FSDP2) keeps torch's name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

LAB_CODE = ("/trainer/", "/models/", "/data/", "/train.py")
NOT_WHERE = ("/trainer/reliability/flight.py", "/trainer/reliability/exits.py")  # the report's own frames
_DTYPES = {"Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Double": "float64", "Long": "int64"}


def group_name(group: Any) -> str:
    """The name torch's recorder gives a process group (None: the default one)."""
    chosen = group if group is not None else dist.group.WORLD
    return "?" if chosen is None else str(chosen.group_name)


def groups_here() -> dict[str, list[int]]:
    """The global ranks of each process group this rank is in, by torch's name for it. Two ranks'
    groups of one name can differ (a mesh's replicate groups, one per shard position): records are
    compared only between ranks that name the same members."""
    world = dist.distributed_c10d._world
    return {str(name): sorted(world.pg_group_ranks.get(pg, {})) for pg, name in world.pg_names.items()}


# What a backend runs a lab's collective as, where it has no kernel of its own (gloo: a reduce_scatter
# is an all_reduce of the whole buffer): the launch record still names it.
_RUNS_AS = {"reduce_scatter": "all_reduce"}


def _kind(profiling_name: str) -> str:
    """'gloo:all_reduce', 'nccl:_reduce_scatter_base', 'nccl:allgather' -> the lab's kind."""
    name = profiling_name.split(":")[-1].replace("_", "").lower()
    for kind, words in (
        ("all_reduce", ("allreduce",)),
        ("reduce_scatter", ("reducescatter",)),
        ("all_gather", ("allgather",)),
        ("broadcast", ("broadcast",)),
    ):
        if any(w in name for w in words):
            return kind
    return profiling_name.split(":")[-1]


@dataclass(frozen=True)
class Record:
    """One collective as one rank launched it."""

    seq: int
    kind: str
    numel: int
    dtype: str
    step: int | None
    label: str | None  # the lab's bucket or unit; None: not launched by the lab's communication object
    group: str = ""  # torch's description of its process group ("default_pg", a mesh dimension's name)
    group_id: str = ""  # torch's name of it (the key of the records)

    def same(self, other: Record) -> bool:
        named = self.label is None or other.label is None or (self.label == other.label and self.step == other.step)
        return self.kind == other.kind and self.numel == other.numel and named

    def describe(self, with_step: bool = True) -> str:
        what = f"{self.kind} of bucket {self.label}" if self.label is not None else self.kind
        if self.label is not None and not self.label.isdigit():
            what = f"{self.kind} of {self.label}"
        size = f"{self.dtype}[{self.numel:,}]"
        step = f"step {self.step}'s " if with_step and self.step is not None else ""
        number = f"#{self.seq} " if self.seq >= 0 else ""  # -1: a collective a rank never launched
        return f"{number}{step}{what} ({size})"


def records(dump: dict[str, Any]) -> dict[str, dict[int, Record]]:
    """A rank's records by group and sequence number, each placed in its step and named."""
    steps: list[tuple[int, int]] = dump.get("steps", [])
    launches: list[tuple[Any, ...]] = dump.get("launches", [])
    out: dict[str, dict[int, Record]] = {}
    for e in dump.get("fr", {}).get("entries", []):
        if e.get("is_p2p") or str(e.get("profiling_name", "")).startswith("c10d:"):
            continue  # point-to-point, or the generic hook's copy of a backend's own record
        sizes = [s for s in (e.get("input_sizes") or []) + (e.get("output_sizes") or [])]
        numels = {math.prod(s) for s in sizes} or {0}
        kind = _kind(str(e.get("profiling_name", "")))
        group = str(e.get("process_group", ("?",))[0])
        t = int(e.get("time_created_ns") or 0)
        step = next((s for s, start in reversed(steps) if start <= t), None)
        launch = next(
            (
                (lk, str(b))
                for lt, lk, ln, b, lg in reversed(launches)
                if lt <= t and kind in (lk, _RUNS_AS.get(lk)) and ln in numels and lg == group and b is not None
            ),
            None,
        )
        label = None
        if launch is not None:  # the lab's name for it: its bucket or unit, and the kind it launched
            kind, label = launch
        first_in = (e.get("input_sizes") or [[0]])[0]
        dtype = _DTYPES.get((e.get("input_dtypes") or ["?"])[0], str((e.get("input_dtypes") or ["?"])[0]))
        desc = str((e.get("process_group") or ("?", "?"))[-1])
        out.setdefault(group, {})[int(e["collective_seq_id"])] = Record(
            int(e["collective_seq_id"]), kind, math.prod(first_in), dtype, step, label, desc, group
        )
    return out


def where(stack: list[tuple[str, int, str]]) -> str | None:
    """The innermost frame of the lab's own code in a stack (outermost first)."""
    for filename, line, name in reversed(stack):
        if any(p in filename for p in LAB_CODE) and not any(filename.endswith(n) for n in NOT_WHERE):
            return f"{_short(filename)}:{line} in {name}"
    return None


def _short(filename: str) -> str:
    for root in ("trainer/", "models/", "data/", "train.py"):
        i = filename.rfind("/" + root)
        if i >= 0:
            return filename[i + 1 :]
    return filename


_FAULT = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')


def last_words(log: Path) -> str | None:
    """A rank that died: Python's own last words in its log file (faulthandler: a fatal signal), or None."""
    if not log.is_file():
        return None
    text = log.read_text(encoding="utf-8", errors="replace")
    i = text.rfind("Fatal Python error:")
    if i < 0:
        return None
    lines = text[i:].splitlines()
    what = lines[0].removeprefix("Fatal Python error:").strip().rstrip(".")
    frames = [(m[1], int(m[2]), m[3]) for m in map(_FAULT.match, lines) if m]  # innermost first
    top = where(list(reversed(frames)))
    return f"{what.lower()}" + (f" at {top}" if top else "")


def explain(
    dumps: dict[int, dict[str, Any] | None], world_size: int, logs: Path | None = None, dumps_dir: Path | None = None
) -> list[str]:
    """At most three lines: the collective and who never came (or came to another), where those
    were, and where the snapshots are."""
    have = {r: d for r, d in dumps.items() if d is not None}
    if not have:
        return ["hang report: no rank left a snapshot"]
    recs = {r: records(d) for r, d in have.items()}
    dead = sorted(set(range(world_size)) - set(have))
    found = _first_difference(recs, have) or _last_common(recs, dead)
    if found is None:
        return ["collective failed: the snapshots hold no collective"]
    group, seq, came, other, absent = found
    rec = came[0][1]
    missing = sorted(absent + dead)
    said = _own_records_say(recs) if dead else None  # a peer that died of it says nothing: the survivors' own records
    if said is not None:
        r, rec, what = said
        group, came, other, missing = rec.group_id, [(r, rec)], [], dead
    step = rec.step if rec.step is not None else max(d["step"] for d in have.values())
    on = _group_desc(have, group, rec.group, came[0][0])
    head = f"collective failed at step {step}: {rec.describe(False)} on {on}"
    if said is not None:
        head += f", {what}; rank {_ranks(dead)} died"
    else:
        head += f", entered by rank {_ranks([r for r, _ in came])}"
        if missing:
            head += f"; rank {_ranks(missing)} never entered it"
    for r, orec in other:
        head += f"; rank {r} never entered it: its #{orec.seq} was {orec.describe()[len(str(orec.seq)) + 2 :]}"
    if not missing and not other:
        head += " (every rank: none is missing, and it did not complete)"
    lines = [head]
    about = missing + [r for r, _ in other]
    parts = []
    for r in about[:3]:
        if r in have:
            mine = recs[r].get(group, {})
            last = mine[max(mine)].describe() if mine else "none"
            at = where(have[r]["stack"]) or "outside the lab's code"
            raised = have[r].get("error")  # its own failure (a crash), or its side of the collective's
            note = f" (it raised {raised.split(':')[0]})" if raised else ""
            parts.append(f"rank {r} was in step {have[r]['step']} at {at}{note}, its last collective {last}")
        else:
            words = last_words(logs / f"train_rank{r}.log") if logs is not None else None
            why = f"it died ({words})" if words else "it died or could not answer"
            parts.append(f"rank {r} left no snapshot: {why}")
    if len(about) > 3:
        parts.append(f"{len(about) - 3} more")
    if parts:
        lines.append("; ".join(parts))
    if dumps_dir is not None:
        run = dumps_dir.parent
        lines.append(f"snapshots: {dumps_dir} (read again: python -m trainer.tools.hang {run})")
    return lines


def _first_difference(
    recs: dict[int, dict[str, dict[int, Record]]], have: dict[int, dict[str, Any]]
) -> tuple[str, int, list[tuple[int, Record]], list[tuple[int, Record]], list[int]] | None:
    """(group, sequence number, [(rank, record) of the collective], [(rank, another record)], [ranks
    without a record]) at the first number where the ranks of a group differ; None if none does."""
    best = None
    for group in sorted({g for r in recs.values() for g in r}, key=lambda g: (g != "0", g)):
        for members in _instances(have, group):
            found = _differ(group, {r: recs[r].get(group, {}) for r in members if r in recs})
            if found is not None and (best is None or found[1] < best[1]):
                best = found
    return best


def _instances(have: dict[int, dict[str, Any]], group: str) -> list[list[int]]:
    """The groups of this name, each as its ranks that left a snapshot (a name a rank's snapshot lacks
    the members of: every rank that recorded it)."""
    seen = {tuple(d.get("groups", {}).get(group, ())) for d in have.values()} - {()}
    if not seen:
        return [sorted(have)]
    return [[r for r in members if r in have] for members in sorted(seen)]


def _differ(
    group: str, by_rank: dict[int, dict[int, Record]]
) -> tuple[str, int, list[tuple[int, Record]], list[tuple[int, Record]], list[int]] | None:
    """The first number at which these ranks of one group differ, as _first_difference says it."""
    top = max((max(s) for s in by_rank.values() if s), default=0)
    low = max((min(s) for s in by_rank.values() if s), default=0)  # every rank still holds from here
    for seq in range(low, top + 1):
        at = {r: s.get(seq) for r, s in by_rank.items()}
        held = [(r, rec) for r, rec in at.items() if rec is not None]
        absent = [r for r, rec in at.items() if rec is None]
        if not held or (not absent and all(rec.same(held[0][1]) for _, rec in held)):
            continue
        first = _behind(held, by_rank, seq)
        came = [(r, rec) for r, rec in held if rec.same(first)]
        other = [(r, rec) for r, rec in held if not rec.same(first)]
        return (group, seq, came, other, absent)
    return None


def _behind(held: list[tuple[int, Record]], by_rank: dict[int, dict[int, Record]], seq: int) -> Record:
    """Of the records ranks hold at one number, the collective: the one whose ranks launch the others'
    records later (a rank that skipped one is ahead of them); then the earliest step, the most ranks."""

    def score(candidate: Record) -> tuple[int, int, int]:
        holders = [r for r, rec in held if rec.same(candidate)]
        others = [rec for _, rec in held if not rec.same(candidate)]
        later = [rec for r in holders for n, rec in by_rank[r].items() if n > seq]
        ahead = sum(any(o.same(x) for x in later) for o in others)
        return (-ahead, candidate.step if candidate.step is not None else -1, -len(holders))

    return min((rec for _, rec in held), key=score)


def _own_records_say(recs: dict[int, dict[str, dict[int, Record]]]) -> tuple[int, Record, str] | None:
    """(rank, record, what it did) where a rank's own records show it alone went wrong: a collective of
    the lab's it launched every step and skipped at one, or sent once at another size. What a peer
    that died of it (gloo aborts a rank that receives more than it expects) can no longer say."""
    for rank, groups in sorted(recs.items()):
        for by_seq in groups.values():
            ordered = [r for r in sorted(by_seq.values(), key=lambda r: r.seq) if r.label not in (None, "control")]
            found = _skipped(ordered) or _resized(ordered)
            if found is not None:
                rec, what = found
                return rank, rec, what.format(rank=rank)
    return None


def _skipped(ordered: list[Record]) -> tuple[Record, str] | None:
    """A step whose collectives are the step before's with one left out (the newest step: so far)."""
    by_step: dict[int, list[Record]] = {}
    for rec in ordered:
        if rec.step is not None:
            by_step.setdefault(rec.step, []).append(rec)
    steps = sorted(s for s in by_step if s > 1)  # step 1 has agreements of its own
    for before, now in zip(steps, steps[1:], strict=False):
        expected = [(r.kind, r.label) for r in by_step[before]]
        got = [(r.kind, r.label) for r in by_step[now]]
        done = now != steps[-1]
        if got == (expected if done else expected[: len(got)]):
            continue
        for i in range(len(expected)):
            rest = expected[:i] + expected[i + 1 :]
            if got == (rest if done else rest[: len(got)]):
                gone = by_step[before][i]
                rec = Record(-1, gone.kind, gone.numel, gone.dtype, now, gone.label, gone.group, gone.group_id)
                return rec, f"skipped by rank {{rank}} (launched at step {before}; at step {now} it went on)"
    return None


def _resized(ordered: list[Record]) -> tuple[Record, str] | None:
    """A collective sent once at another size than before and after it (or than before, as the newest)."""
    named: dict[tuple[str, str | None], list[Record]] = {}
    for rec in ordered:
        named.setdefault((rec.kind, rec.label), []).append(rec)
    for series in named.values():
        for i in range(1, len(series)):
            before, now = series[i - 1].numel, series[i].numel
            after = series[i + 1].numel if i + 1 < len(series) else before
            if now != before and after == before:
                usual = f"{series[i].dtype}[{before:,}]"
                return series[i], f"sent by rank {{rank}} at this size once (its others of it: {usual})"
    return None


def _last_common(
    recs: dict[int, dict[str, dict[int, Record]]], dead: list[int]
) -> tuple[str, int, list[tuple[int, Record]], list[tuple[int, Record]], list[int]] | None:
    """The ranks that left a snapshot agree: their newest collective of the default group (or of the
    first group any holds) is the one that failed, with whoever is dead."""
    groups = sorted({g for r in recs.values() for g in r}, key=lambda g: (g != "0", g))
    if not groups:
        return None
    group = groups[0]
    seq = max(max(r.get(group, {0: None})) for r in recs.values())
    came = [(rank, r[group][seq]) for rank, r in sorted(recs.items()) if seq in r.get(group, {})]
    return (group, seq, came, [], []) if came else None


def _group_desc(have: dict[int, dict[str, Any]], group: str, desc: str, rank: int) -> str:
    if desc == "default_pg":
        return "the default group"
    members = have.get(rank, {}).get("groups", {}).get(group) or sorted(have)
    return f"group {desc or group} (ranks {_ranks(list(members))})"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}, {ranks[1]}, ... ({len(ranks)} ranks)"
