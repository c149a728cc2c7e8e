"""JSON Lines in and out, and atomic file writes: the one reader and the one writer the package uses.

`read_jsonl` gives line-numbered one-line errors for malformed input (or skips undecodable lines for
append-only files whose last line a killed run may have torn); `atomic_write` replaces a file in one
step, so a reader never sees half of it, and clears away the temporary files of failed and killed writes.
This module knows nothing of what the records mean.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from pathlib import Path
from typing import Iterable

from .errors import LosslessError


def read_jsonl(path: str | Path, *, skip_bad_lines: bool = False, what: str = "file") -> list[dict]:
    """The JSON objects of a JSONL file, blank lines skipped. A missing file, or a line that is not a
    JSON object, raises LosslessError naming `path:line` (unless `skip_bad_lines`: then it is dropped)."""
    path = Path(path)
    if not path.is_file():
        raise LosslessError(f"{what} {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if skip_bad_lines:
                continue
            raise LosslessError(f"{what} {path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            if skip_bad_lines:
                continue
            raise LosslessError(f"{what} {path}:{lineno}: expected a JSON object")
        rows.append(obj)
    return rows


def jsonl_text(rows: Iterable[dict], **dumps_kwargs) -> str:
    """One JSON object per line, each line ending in a newline."""
    return "".join(json.dumps(r, **dumps_kwargs) + "\n" for r in rows)


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8, or bytes) to `path` through a temporary file in the same directory,
    flushed to disk, an atomic rename and a flush of the directory: a reader sees the old file or the new
    one, never a torn one, and after a crash the rename itself is on disk.

    The temporary file (`.<name>.<pid>.tmp`) is removed when the write fails (a full or read-only disk,
    Ctrl-C); one a killed writer left (its pid is no live process) is removed by the next write of `path`."""
    path = Path(path)
    _remove_stale_tmps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename in it) to disk; filesystems that cannot are left as they are."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _remove_stale_tmps(path: Path) -> None:
    """Remove `path`'s temporary siblings left by writers that no longer run (another live writer's stays)."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.tmp")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return  # the write itself reports a missing or unreadable directory
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                (path.parent / name).unlink()
        except (PermissionError, OverflowError, ValueError):
            pass  # a live process of another user, or no pid this system can have: not ours to judge
