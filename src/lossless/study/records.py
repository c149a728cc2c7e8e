"""Audit records that outlive a machine: append-only JSONL while running, gzip segments at rest.

A run directory keeps its per-pair records under `records/`:

- each writer (one process: the whole run, or one shard) appends finished items to its own plain file
  `records/<writer>.jsonl`, flushed and fsynced after every item, so a kill loses at most the item in
  flight and a torn last line is cut off on the next start (its complete lines are rolled into a segment
  before the plain file is emptied, so a kill at any moment leaves them on disk);
- `roll()` (every few minutes while running, and at every clean stop) compresses what the plain file
  holds into a new, never-rewritten segment `records/<writer>.<UTC time>.jsonl.gz` and empties the plain
  file. Segments are what is committed: a run continues on any machine from a checkout, and records
  written by several machines (different writer names or times) merge by file name, without conflicts.

Readers take every segment and plain file in name order; the first record seen for an id wins, so a
kill between writing a segment and emptying the plain file (which leaves both) costs nothing. A record's id
(`record_id`) is its key, plus the source digest of the exact kernels that decoded it where it names them: a
pair decoded again by another kernel build is a new record beside the old one, never a duplicate of it.

A plain file is appended to, rolled and repaired under an exclusive `flock`, and emptied in place, so any
process may roll any writer's plain file, even while that writer runs (`roll_all`, which the at-rest
report uses: records a killed process left unrolled reach the committed segments too).

Older run directories keep `records*.jsonl` at the top level; they are read too.

This module knows files and keys only; what a record holds is the audit's business.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

from ..jsonio import atomic_write

RECORDS_DIR = "records"
_LEGACY = re.compile(r"records(\.shard-(\d+)-of-(\d+))?\.jsonl$")


def writer_name(shard: tuple[int, int]) -> str:
    """`all` for an unsharded run, `shard-i-of-n` for one shard."""
    i, n = shard
    return "all" if n == 1 else f"shard-{i}-of-{n}"


def _lines(path: Path) -> Iterator[str]:
    """Complete lines of a plain or gzip file; a torn tail (killed mid-write, or a truncated segment) ends
    the iteration quietly."""
    if path.suffix == ".gz":
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                for line in f:
                    if line.endswith("\n"):
                        yield line
        except (EOFError, OSError, gzip.BadGzipFile):
            return
    else:
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.endswith("\n"):
                    yield line


def record_id(rec: dict) -> str:
    """A record's identity: its key, then `@<kernel source digest>` when it names the exact kernels that decoded
    it (`kernels` or `reference_kernels`, "<digest>/<variant>": the variant never changes a bit, so it is not
    part of the id). Records from before records named their kernels, and stock-kernel records, are their key."""
    build = rec.get("kernels") or rec.get("reference_kernels")
    return str(rec["key"]) + (f"@{str(build).split('/')[0]}" if build else "")


def _parse(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) and "key" in rec else None


def record_files(run_dir: str | Path, at_rest: bool = False, folder: str = RECORDS_DIR) -> list[Path]:
    """Every file holding records of a run: legacy top-level files first (unsharded, then shards in index
    order), then `records/` in name order (each writer's segments chronologically, its plain file last).
    `at_rest`: only the compressed segments, i.e. what a checkout of the committed records holds. `folder`:
    another store of the run directory kept the same way (e.g. the backfill's), without legacy files."""
    run_dir = Path(run_dir)

    def legacy_order(p: Path):
        m = _LEGACY.match(p.name)
        return (0, 0, p.name) if not m.group(1) else (int(m.group(3)), int(m.group(2)), p.name)

    legacy = sorted((p for p in run_dir.glob("records*.jsonl") if p.is_file() and _LEGACY.match(p.name)),
                    key=legacy_order) if folder == RECORDS_DIR else []
    store = run_dir / folder
    current = sorted(p for p in store.glob("*.jsonl*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz"))) \
        if store.is_dir() else []
    # a writer's plain file (`w.jsonl`) holds its newest records: read it after its segments (`w.<time>.jsonl.gz`)
    current.sort(key=lambda p: (p.name.split(".")[0], p.name.endswith(".jsonl"), p.name))
    if at_rest:
        return [p for p in current if p.name.endswith(".gz")]
    return legacy + current


def read_records(run_dir: str | Path, at_rest: bool = False, corrupt: list | None = None,
                 folder: str = RECORDS_DIR) -> list[dict]:
    """All records of a run, deduplicated by `record_id` (first seen wins), in file order (`at_rest`: see
    `record_files`). A complete line that is not a record (not JSON, or no key) is skipped; with `corrupt`, one
    entry (file name, line number) is appended per such line, so the caller can say so. A torn last line (a
    writer killed mid-line) is not corrupt: it is the normal end of a killed run's file."""
    out, seen = [], set()
    for path in record_files(run_dir, at_rest, folder):
        for lineno, line in enumerate(_lines(path), 1):
            rec = _parse(line)
            if rec is None:
                if corrupt is not None and line.strip():
                    corrupt.append((path.name, lineno))
                continue
            if (rid := record_id(rec)) not in seen:
                seen.add(rid)
                out.append(rec)
    return out


class RecordStore:
    """One writer's records: repair its plain file on opening, append items, roll them into segments."""

    def __init__(self, run_dir: str | Path, writer: str, roll_seconds: float | None = None,
                 folder: str = RECORDS_DIR):
        """roll_seconds: `append` also rolls once this long has passed since the last roll (None: never)."""
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / folder
        self.writer = writer
        self.plain = self.dir / f"{writer}.jsonl"
        self.roll_seconds = roll_seconds
        self._last_roll = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._repair()

    def _repair(self) -> None:
        """Cut a torn last line off this writer's plain file, and drop lines a segment already holds.

        The lines kept are rolled into a new segment before the plain file is emptied, never written back
        into it: a kill at any moment leaves them on disk (in the plain file, the segment, or both)."""
        if not self.plain.exists():
            return
        with _locked(self.plain) as f:
            original = data = f.read()
            if data and not data.endswith(b"\n"):
                data = data[: data.rfind(b"\n") + 1]
            rolled = {record_id(r) for seg in self.segments() for r in map(_parse, _lines(seg)) if r is not None}
            kept = [ln for ln in data.decode("utf-8", errors="replace").splitlines(keepends=True)
                    if (r := _parse(ln)) is not None and record_id(r) not in rolled]
            if "".join(kept).encode("utf-8") != original:
                if kept:
                    _write_segment(self.plain, self.writer, kept)
                _rewrite(f, b"")

    def segments(self) -> list[Path]:
        return sorted(self.dir.glob(f"{self.writer}.*.jsonl.gz"))

    def append(self, records: list[dict]) -> None:
        """Write one item's records in one write, then flush and fsync: the item is wholly done or wholly
        to redo after a kill."""
        payload = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode("utf-8")
        with _locked(self.plain) as f:
            f.seek(0, os.SEEK_END)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        if self.roll_seconds is not None and time.monotonic() - self._last_roll > self.roll_seconds:
            self.roll()

    @contextlib.contextmanager
    def session(self):
        """The records of one run: however it ends (finished, failed, Ctrl-C, or SIGTERM, which `kill`,
        schedulers and session ends send and which here stops the run like Ctrl-C), what the plain file
        holds is rolled into a segment. The item in flight is dropped, never half-written."""
        restore = _stop_cleanly_on_sigterm()
        try:
            yield self
        finally:
            # a second signal (a launcher forwarding the `kill` its workers also got, a second Ctrl-C) must
            # not cut the last roll short: the records would stay in the plain file, outside the segments
            try:
                with _signals_deferred():
                    self.roll()
            finally:
                restore()

    def roll(self) -> Path | None:
        """Move the plain file's records into a new gzip segment; returns it (None when there was nothing)."""
        self._last_roll = time.monotonic()
        return _roll(self.plain, self.writer)


def roll_all(run_dir: str | Path, folder: str = RECORDS_DIR) -> list[Path]:
    """Roll every writer's plain file of a run into a segment (safe beside running writers); returns the
    new segments."""
    store = Path(run_dir) / folder
    plains = sorted(store.glob("*.jsonl")) if store.is_dir() else []
    return [seg for p in plains if (seg := _roll(p, p.name[: -len(".jsonl")])) is not None]


def _roll(plain: Path, writer: str) -> Path | None:
    if not plain.exists() or plain.stat().st_size == 0:
        return None
    with _locked(plain) as f:
        lines = [ln for ln in f.read().decode("utf-8", errors="replace").splitlines(keepends=True)
                 if ln.endswith("\n")]
        if not lines:
            return None
        seg = _write_segment(plain, writer, lines)
        # only now forget them; a kill before this line leaves duplicates that readers drop
        _rewrite(f, b"")
    return seg


def _write_segment(plain: Path, writer: str, lines: list[str]) -> Path:
    """A new segment of `writer` beside `plain` holding `lines`, written atomically (whole or absent)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    seg = plain.parent / f"{writer}.{stamp}.jsonl.gz"
    n = 1
    while seg.exists():  # two rolls within a second
        n += 1
        seg = plain.parent / f"{writer}.{stamp}-{n}.jsonl.gz"
    # mtime=0: the same records always compress to the same bytes
    payload = gzip.compress("".join(lines).encode("utf-8"), compresslevel=9, mtime=0)
    return atomic_write(seg, payload)


@contextlib.contextmanager
def _locked(path: Path):
    """The file open for reading and writing (created if missing), at offset 0, under an exclusive lock.
    What the block wrote is flushed and fsynced before the lock is released, whether it ended or raised:
    the next holder of the lock reads it from disk."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield f
        finally:
            try:
                f.flush()
                os.fsync(f.fileno())
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _rewrite(f, data: bytes) -> None:
    """Replace a locked file's contents in place (same inode, so writers waiting on the lock see them)."""
    f.seek(0)
    f.truncate()
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


@contextlib.contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM arriving inside the block are held and delivered (re-raised) after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])


def _stop_cleanly_on_sigterm():
    """Make SIGTERM raise KeyboardInterrupt in the main thread. Returns a function restoring the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, previous)
