"""Where the project's shipped data lives: the prompt suite, training and held-out prompts, heads; and where
what it makes on a machine is kept (`cache_dir`).

In a source checkout (an editable install) they are the checkout's `suites/`, `data/` and `heads/`; a
wheel carries copies of the same files under `lossless/_shipped/` (see pyproject.toml), so an install
finds them without the checkout.

It also knows whether an output place can be written: `check_writable_dir` refuses, before any work, a
directory on a read-only or full file system (or a file in its place); `write_atomically` writes a file in
one step and leaves no temporary file when the disk fills up; `exclusive_lock` keeps a second process out of
a directory another one is writing. It knows locations only, not file formats.
"""

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
_SHIPPED = PACKAGE_DIR / "_shipped"  # present in a wheel install only
REPO_ROOT = PACKAGE_DIR.parents[1]  # the source checkout (meaningful in an editable install only)
ROOT = _SHIPPED if _SHIPPED.is_dir() else REPO_ROOT
SUITES_DIR = ROOT / "suites"
DATA_DIR = ROOT / "data"
HEADS_DIR = ROOT / "heads"
DEFAULT_SUITE = SUITES_DIR / "default.jsonl"
TRAIN_PROMPTS = DATA_DIR / "train_prompts.jsonl"
HELDOUT_PROMPTS = DATA_DIR / "heldout_prompts.jsonl"


def cache_dir() -> Path:
    """Where converted models, built kernels, distillation data and peers' files are kept ($LOSSLESS_CACHE)."""
    return Path(os.environ.get("LOSSLESS_CACHE", Path.home() / ".cache" / "lossless"))


def require(path: Path, what: str) -> Path:
    """`path` if it exists; else a LosslessError saying the install lacks `what` (never a silent skip)."""
    if not path.exists():
        from .errors import LosslessError

        raise LosslessError(f"{what} ({path}) is missing from this install: reinstall lossless, or pass the file")
    return path


# ------------------------------------------------------------------------------- writing output places
# errno values that mean "this place cannot take the write" rather than a bug: the disk (or quota) is full,
# or the place is read-only or not ours. The CLI turns them into one line that says what to do.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
WRITE_FAULTS = DISK_FULL | NOT_WRITABLE


def write_fault(path: str | Path, exc: OSError, option: str = "--out") -> str:
    """One line saying why `path` could not be written (`exc`, an OSError) and what to do about it."""
    reason = exc.strerror or str(exc)
    if exc.errno in DISK_FULL:
        return f"no space left to write {path} ({reason}): free space and rerun"
    if exc.errno == errno.EROFS:
        return f"{path} is on a read-only file system: make it writable or choose another {option}"
    return f"cannot write {path} ({reason}): fix its permissions or choose another {option}"


def check_writable_dir(path: str | Path, option: str = "--out") -> Path:
    """Refuse, before any work, an output directory that cannot be written: a file in its place, a
    read-only or full file system, no permission. Missing directories are created for the check (a
    probe file is written and removed) and removed again, so a refusal later leaves nothing behind."""
    from .errors import LosslessError

    path = Path(path)
    # processes of one launch (ranks, shards) check the same folder at once: a folder another one made, or
    # removed again between our steps, is looked at afresh rather than refused
    for attempt in range(20):
        existing, missing = path, []
        while not existing.exists():
            if existing.is_symlink():
                raise LosslessError(f"{option} {path}: {existing} is a broken symbolic link; remove it or choose "
                                    f"another {option}")
            missing.append(existing)
            existing = existing.parent
        if not existing.is_dir():
            if not existing.exists():
                continue  # removed meanwhile
            what = path if existing == path else existing
            raise LosslessError(f"{option} {path}: {what} is a file, not a directory; choose another {option}")
        try:
            _probe(path, missing)
            return path
        except (FileExistsError, FileNotFoundError) as exc:
            if attempt == 19:
                raise LosslessError(write_fault(path, exc, option)) from None
        except OSError as exc:
            raise LosslessError(write_fault(path, exc, option)) from None
    raise LosslessError(f"{option} {path}: other processes keep creating and removing it; rerun when they are done")


def _probe(path: Path, missing: list[Path]) -> None:
    """Make the missing folders, write, fsync and remove a probe file in `path`, remove the folders made."""
    created: list[Path] = []
    probe = path / f".lossless-write-check.{os.getpid()}"
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
                created.append(d)
            except FileExistsError:
                if not d.is_dir():
                    raise
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)
    finally:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()


def make_dir(path: str | Path) -> Path:
    """`path.mkdir(parents=True, exist_ok=True)` that also stands the processes of one launch checking the
    same new folder (`check_writable_dir` makes and removes it): a folder made and removed again between
    mkdir's steps (the folder itself, or a parent between making it and making the folder in it) is made
    afresh. A file or a broken link in its place is still an error."""
    path = Path(path)
    for attempt in range(1000):
        try:
            path.mkdir(parents=True, exist_ok=True)
            return path
        except (FileExistsError, FileNotFoundError):  # there when mkdir tried, gone (or not a folder) when it looked
            try:
                here = os.lstat(path).st_mode
            except FileNotFoundError:
                here = None
            if attempt == 999 or (here is not None and not stat.S_ISDIR(here) and not path.is_dir()):
                raise
    raise AssertionError("unreachable")  # the last attempt returns or raises


def write_atomically(path: str | Path, data: str | bytes) -> Path:
    """`jsonio.atomic_write` (which leaves no temporary file when it fails), with a failure's error naming
    `path` rather than the temporary file."""
    from .jsonio import atomic_write

    path = Path(path)
    try:
        return atomic_write(path, data)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


@contextlib.contextmanager
def exclusive_lock(path: str | Path, busy: str):
    """Hold an exclusive `flock` on the file `path` (created, holding this process's id) for the block, or
    raise LosslessError(busy.format(pid=the holder's id)) at once when another process holds it. The file
    is removed when the block ends."""
    from .errors import LosslessError

    path = Path(path)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # its folder went meanwhile (another process of one launch checking it: see
            make_dir(path.parent)  # check_writable_dir); once the lock is in, it stays
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode("ascii", errors="replace").strip() or "unknown"
            os.close(fd)
            raise LosslessError(busy.format(pid=holder)) from None
        try:  # the holder may have removed the file between our open and our lock: lock the new one then
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # the pid is for the message only
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # under the lock: a process waiting on the old file sees it gone and retries
        os.close(fd)
