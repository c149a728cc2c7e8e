"""Audit records that outlive a machine: append-only JSONL while running, gzip segments at rest.

A run directory keeps its per-pair records under `records/`:

- each writer (one process: the whole run, or one shard) appends finished items to its own plain file
  `records/<writer>.jsonl`, flushed and fsynced after every item, so a kill loses at most the item in
  flight and a torn last line is cut off on the next start;
- `roll()` (every few minutes while running, and at every clean stop) compresses what the plain file
  holds into a new, never-rewritten segment `records/<writer>.<UTC time>.jsonl.gz` and empties the plain
  file. Segments are what is committed: a run continues on any machine from a checkout, and records
  written by several machines (different writer names or times) merge by file name, without conflicts.

Readers take every segment and plain file in name order; the first record seen for a key wins, so a
kill between writing a segment and emptying the plain file (which leaves both) costs nothing.

Older run directories keep `records*.jsonl` at the top level; they are read too.

This module knows files and keys only; what a record holds is the audit's business.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

from .jsonio import atomic_write

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


def _parse(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) and "key" in rec else None


def record_files(run_dir: str | Path, at_rest: bool = False) -> list[Path]:
    """Every file holding records of a run: legacy top-level files first (unsharded, then shards in index
    order), then `records/` in name order (each writer's segments chronologically, its plain file last).
    `at_rest`: only the compressed segments, i.e. what a checkout of the committed records holds."""
    run_dir = Path(run_dir)

    def legacy_order(p: Path):
        m = _LEGACY.match(p.name)
        return (0, 0, p.name) if not m.group(1) else (int(m.group(3)), int(m.group(2)), p.name)

    legacy = sorted((p for p in run_dir.glob("records*.jsonl") if p.is_file() and _LEGACY.match(p.name)),
                    key=legacy_order)
    store = run_dir / RECORDS_DIR
    current = sorted(p for p in store.glob("*.jsonl*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz"))) \
        if store.is_dir() else []
    # a writer's plain file (`w.jsonl`) holds its newest records: read it after its segments (`w.<time>.jsonl.gz`)
    current.sort(key=lambda p: (p.name.split(".")[0], p.name.endswith(".jsonl"), p.name))
    if at_rest:
        return [p for p in current if p.name.endswith(".gz")]
    return legacy + current


def read_records(run_dir: str | Path, at_rest: bool = False) -> list[dict]:
    """All records of a run, deduplicated by key (first seen wins), in file order (`at_rest`: see
    `record_files`)."""
    out, seen = [], set()
    for path in record_files(run_dir, at_rest):
        for line in _lines(path):
            rec = _parse(line)
            if rec is not None and rec["key"] not in seen:
                seen.add(rec["key"])
                out.append(rec)
    return out


class RecordStore:
    """One writer's records: repair its plain file on opening, append items, roll them into segments."""

    def __init__(self, run_dir: str | Path, writer: str, roll_seconds: float | None = None):
        """roll_seconds: `append` also rolls once this long has passed since the last roll (None: never)."""
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / RECORDS_DIR
        self.writer = writer
        self.plain = self.dir / f"{writer}.jsonl"
        self.roll_seconds = roll_seconds
        self._last_roll = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._repair()

    def _repair(self) -> None:
        """Cut a torn last line off this writer's plain file, and drop lines a segment already holds."""
        if not self.plain.exists():
            return
        data = self.plain.read_bytes()
        if data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
        rolled = {r["key"] for seg in self.segments() for r in map(_parse, _lines(seg)) if r is not None}
        kept = [ln for ln in data.decode("utf-8", errors="replace").splitlines(keepends=True)
                if (r := _parse(ln)) is not None and r["key"] not in rolled]
        new = "".join(kept).encode("utf-8")
        if new != self.plain.read_bytes():
            atomic_write(self.plain, new)

    def segments(self) -> list[Path]:
        return sorted(self.dir.glob(f"{self.writer}.*.jsonl.gz"))

    def append(self, records: list[dict]) -> None:
        """Write one item's records in one write, then flush and fsync: the item is wholly done or wholly
        to redo after a kill."""
        with self.plain.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
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
            self.roll()
            restore()

    def roll(self) -> Path | None:
        """Move the plain file's records into a new gzip segment; returns it (None when there was nothing)."""
        self._last_roll = time.monotonic()
        if not self.plain.exists() or self.plain.stat().st_size == 0:
            return None
        lines = list(_lines(self.plain))
        if not lines:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        seg = self.dir / f"{self.writer}.{stamp}.jsonl.gz"
        n = 1
        while seg.exists():  # two rolls within a second
            n += 1
            seg = self.dir / f"{self.writer}.{stamp}-{n}.jsonl.gz"
        # mtime=0: the same records always compress to the same bytes
        payload = gzip.compress("".join(lines).encode("utf-8"), compresslevel=9, mtime=0)
        atomic_write(seg, payload)
        # only now forget them; a kill before this line leaves duplicates that readers drop
        atomic_write(self.plain, b"")
        return seg


def _stop_cleanly_on_sigterm():
    """Make SIGTERM raise KeyboardInterrupt in the main thread. Returns a function restoring the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, previous)
