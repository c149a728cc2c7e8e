"""JSON Lines in and out, and atomic file writes: the one reader and the one writer the package uses.

`read_jsonl` gives line-numbered one-line errors for malformed input (or skips undecodable lines for
append-only files whose last line a killed run may have torn); `atomic_write` replaces a file in one
step, so a reader never sees half of it. This module knows nothing of what the records mean.
"""

from __future__ import annotations

import json
import os
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
    flushed to disk, and an atomic rename: a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
