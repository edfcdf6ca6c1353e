"""Read W&B offline runs (``<dir>/wandb/offline-run-<stamp>-<id>/run-<id>.wandb``) without uploading.

Why: the W&B logger (a restarted run's last logged step), the tools and the tests need to check
what a run logged; wandb 0.31 has no ``wandb sync --view`` and no
``wandb.sdk.internal.datastore``, so we parse the file ourselves. Format, verified against wandb 0.31 files:
a 7-byte header (``:W&B``, magic 0xBEE1 little-endian, version byte 0), then LevelDB-log framing in 32 KiB
blocks counted from file offset 0 (the header sits inside the first block). Each chunk has a 7-byte header
(checksum uint32 LE, length uint16 LE, type 1=full 2=first 3=middle 4=last) and a block tail of < 7 bytes is
zero padding. The checksum is plain zlib.crc32 (IEEE) over type byte + data -- not LevelDB's masked crc32c.
Chunks carry serialized ``wandb_internal_pb2.Record`` messages; config values are stored unwrapped (no
``{"value": ...}``, that wrapping exists only in config.yaml / on the server), so we never unwrap them.
wandb-core (its own process group) buffers: the file grows only when a 32 KiB block fills, every
``x_transaction_log_flush_interval`` (15 s) and at finish(); what is unflushed is lost if the run dies
without finish(), and then there is no exit record.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

# wandb picks its generated protobuf module by protobuf version at import: mypy sees no members.
Record = Any  # wandb_internal_pb2.Record
HistoryItem = Any  # wandb_internal_pb2.HistoryItem
_new_record: Any = wandb_internal_pb2.Record  # type: ignore[attr-defined]

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # ident, magic, version
BLOCK = 32 * 1024
CHUNK_HDR = struct.Struct("<IHB")  # checksum, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
INTERNAL = "_wandb"  # W&B bookkeeping key in config/summary; not the user's data, so dropped


@dataclass
class OfflineRun:
    """One offline run directory as written to disk; config/summary merged, history one dict per logged step.

    One directory per attempt: a run continued after a restart or resume (same run_id) has several.
    """

    path: Path  # the offline-run-* directory
    run_id: str = ""
    name: str = ""  # display_name
    group: str = ""
    project: str = ""
    entity: str = ""
    job_type: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    # define_metric calls, by name (or glob, e.g. "time/*"): step_metric, summary (a sorted list of
    # aggregations), hidden, goal; the ones wandb-core expands from a glob are not repeated here.
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    exit_code: int | None = None  # None: no exit record (run still going, or killed before finish())


def iter_records(wandb_file: Path, tail_ok: bool = False) -> Iterator[Record]:
    """Yield every Record in a .wandb file; why: the single place that knows the on-disk framing.

    Raises ValueError naming the file and byte offset for a bad header/checksum/chunk order or a truncated
    file. ``tail_ok=True`` silently drops an incomplete record at the very end instead: wandb-core writes
    whole 32 KiB blocks as they fill (plus a flush every 15 s), so a running or killed run's file routinely
    stops mid-record, and that tail is merely unflushed, not corrupt.
    """
    path = Path(wandb_file)
    data = path.read_bytes()

    def bad(offset: int | None, why: str) -> ValueError:
        return ValueError(f"{path}: byte offset {offset}: {why}")

    if tail_ok and HEADER.startswith(data):  # created, header not (fully) written yet
        return
    if data[: len(HEADER)] != HEADER:
        raise bad(0, f"not a W&B offline file (header {data[: len(HEADER)]!r}, expected {HEADER!r})")
    off, start = len(HEADER), None  # start: offset of the first chunk of the pending record
    parts: list[bytes] = []
    while off < len(data):
        left = BLOCK - off % BLOCK
        if left < CHUNK_HDR.size:  # block trailer: zero padding, next chunk starts in the next block
            if data[off : off + left].strip(b"\0"):
                raise bad(off, "non-zero block padding")
            off += left
            continue
        if off + CHUNK_HDR.size > len(data):
            if tail_ok:  # unflushed tail of a live/killed run, see docstring
                return
            raise bad(off, f"truncated chunk header ({len(data) - off} of {CHUNK_HDR.size} bytes)")
        checksum, length, kind = CHUNK_HDR.unpack_from(data, off)
        body = data[off + CHUNK_HDR.size : off + CHUNK_HDR.size + length]
        if CHUNK_HDR.size + length > left:
            raise bad(off, f"chunk of {length} bytes crosses the 32 KiB block boundary")
        if len(body) < length:
            if tail_ok:
                return
            raise bad(off, f"truncated chunk ({len(body)} of {length} bytes)")
        if zlib.crc32(bytes([kind]) + body) != checksum:
            raise bad(off, "chunk checksum mismatch")
        if kind in (FULL, FIRST):
            if parts:
                raise bad(off, f"new record while the one started at {start} is unfinished")
            start = off
        elif kind in (MIDDLE, LAST):
            if start is None:
                raise bad(off, f"chunk type {kind} without a preceding first chunk")
        else:
            raise bad(off, f"unknown chunk type {kind}")
        parts.append(body)
        off += CHUNK_HDR.size + length
        if kind in (FULL, LAST):
            record = _new_record()
            try:
                record.ParseFromString(b"".join(parts))
            except Exception as exc:  # protobuf DecodeError
                raise bad(start, f"undecodable record: {exc}") from exc
            parts, start = [], None
            yield record
    if parts and not tail_ok:
        raise bad(start, "file ends inside a multi-chunk record")


def _decode(text: str) -> Any:
    """json-decode one value; why: W&B stores every config/summary/history value as a JSON string."""
    return json.loads(text) if text else None


def _apply(target: dict[str, Any], updates: Any, removes: Any = ()) -> None:
    """Apply config/summary update and remove items (``key`` or ``nested_key`` path) to a nested dict."""
    for item, drop in [(i, False) for i in updates] + [(i, True) for i in removes]:
        keys, node = list(item.nested_key) or [item.key], target
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                if drop:
                    break
                node[key] = {}
            node = node[key]
        else:
            if drop:
                node.pop(keys[-1], None)
            else:
                node[keys[-1]] = _decode(item.value_json)


def _history_value(item: HistoryItem) -> Any:
    """Value of one history item; why: the SDK fills value_json, the proto also allows a typed oneof."""
    kind = item.WhichOneof("value")
    if kind is None:
        return _decode(item.value_json)
    if kind == "none":
        return None
    value = getattr(item, kind)
    return json.loads(value) if kind == "json" else value


def _metric(record: Any) -> tuple[str, dict[str, Any]]:
    """One define_metric record as (name or glob, plain definition); later calls for a name merge."""
    summary = sorted(f.name for f, on in record.summary.ListFields() if on)
    definition: dict[str, Any] = {
        "step_metric": record.step_metric or None,
        "summary": summary,
        "hidden": record.options.hidden,
        "step_sync": record.options.step_sync,
    }
    if record.goal:
        definition["goal"] = "minimize" if record.goal == 1 else "maximize"
    return record.glob_name or record.name, definition


def read_run(run_dir: Path, tail_ok: bool = False) -> OfflineRun:
    """Read one offline run (an offline-run-* directory or its .wandb file); tail_ok as in iter_records."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        files = sorted(run_dir.glob("run-*.wandb"))
        if len(files) != 1:
            raise ValueError(f"{run_dir}: expected one run-*.wandb file, found {len(files)}")
        wandb_file = files[0]
    else:
        wandb_file, run_dir = run_dir, run_dir.parent
    run = OfflineRun(path=run_dir)
    for record in iter_records(wandb_file, tail_ok):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run  # a later run record (e.g. a rename) only overrides the fields it sets
            for attr, src in (
                ("run_id", "run_id"),
                ("name", "display_name"),
                ("group", "run_group"),
                ("project", "project"),
                ("entity", "entity"),
                ("job_type", "job_type"),
            ):
                setattr(run, attr, getattr(r, src) or getattr(run, attr))
            _apply(run.config, r.config.update)
            _apply(run.summary, r.summary.update)
        elif kind in ("config", "summary"):
            target = run.config if kind == "config" else run.summary
            _apply(target, getattr(record, kind).update, getattr(record, kind).remove)
        elif kind == "history":
            # Logged nested dicts arrive as nested_key paths; flatten them with "." as W&B's history does.
            row = {".".join(i.nested_key) or i.key: _history_value(i) for i in record.history.item}
            if record.history.HasField("step"):
                row.setdefault("_step", record.history.step.num)
            run.history.append(row)
        elif kind == "metric" and not record.metric.expanded_from_glob:
            name, definition = _metric(record.metric)
            run.metrics[name] = definition
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    run.config.pop(INTERNAL, None)
    run.summary.pop(INTERNAL, None)
    return run


def find_job_runs(root: Path, tail_ok: bool = False) -> list[tuple[Path, list[OfflineRun]]]:
    """(job dir, its runs) for a run dir, or for each job of a sweep dir (numbered subdirectories), in order."""
    root = Path(root)
    if (root / "wandb").is_dir() or any(root.glob("offline-run-*")):
        return [(root, find_runs(root, tail_ok))]
    jobs = [d for d in root.iterdir() if d.is_dir() and (d / "wandb").is_dir()] if root.is_dir() else []
    jobs.sort(key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))
    return [(job, find_runs(job, tail_ok)) for job in jobs]


def find_runs(root: Path, tail_ok: bool = False) -> list[OfflineRun]:
    """Every offline-run-* under ``root/wandb`` (or ``root`` itself if it is a wandb dir), sorted by name."""
    root = Path(root)
    base = root / "wandb" if (root / "wandb").is_dir() else root
    runs = [read_run(d, tail_ok) for d in sorted(base.glob("offline-run-*")) if d.is_dir()]
    return sorted(runs, key=lambda r: (r.name, str(r.path)))
