"""Crash safety of the record store and of atomic writes: what a kill at the wrong moment must not lose or leave."""

import contextlib
import errno
import fcntl
import gzip
import json
import os
import stat
import subprocess
import sys
import types

import pytest

import lossless.jsonio as jsonio
import lossless.study.records as records_mod
from lossless.jsonio import atomic_write
from lossless.study.records import RecordStore, read_records


def _plain_with_torn_tail(run, writer="all", n=3):
    """A writer's plain file as a kill mid-append leaves it: `n` complete records, then half of one more."""
    store_dir = run / "records"
    store_dir.mkdir(parents=True)
    lines = "".join(json.dumps({"key": f"k{i}", "v": i}) + "\n" for i in range(n))
    (store_dir / f"{writer}.jsonl").write_text(lines + '{"key": "torn", "v"')
    return store_dir / f"{writer}.jsonl"


class _KilledAfterTruncate:
    """A locked file whose first write after a truncation dies, as a process killed at that moment would."""

    def __init__(self, f):
        self._f, self._truncated = f, False

    def truncate(self, *args):
        self._truncated = True
        out = self._f.truncate(*args)
        self._f.flush()
        return out

    def write(self, data):
        if self._truncated:
            raise KeyboardInterrupt("killed between truncating and writing")
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_a_kill_while_repairing_the_plain_file_loses_no_complete_record(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _plain_with_torn_tail(run)
    real_locked = records_mod._locked

    @contextlib.contextmanager
    def locked_then_killed(path):
        with real_locked(path) as f:
            yield _KilledAfterTruncate(f)

    monkeypatch.setattr(records_mod, "_locked", locked_then_killed)
    with pytest.raises(KeyboardInterrupt):
        RecordStore(run, "all")  # the repair on opening cuts the torn tail off
    assert [r["key"] for r in read_records(run)] == ["k0", "k1", "k2"]

    # the next start finishes the repair: nothing lost, nothing doubled, the torn line gone
    monkeypatch.setattr(records_mod, "_locked", real_locked)
    store = RecordStore(run, "all")
    assert [r["key"] for r in read_records(run)] == ["k0", "k1", "k2"]
    assert [r["key"] for r in read_records(run, at_rest=True)] == ["k0", "k1", "k2"]
    assert store.plain.read_text() == "" and len(store.segments()) == 1


def test_repair_keeps_unrolled_lines_and_drops_rolled_ones(tmp_path):
    run = tmp_path / "run"
    plain = _plain_with_torn_tail(run, n=4)
    seg = run / "records" / "all.20260101T000000.jsonl.gz"
    rolled = gzip.compress(b'{"key": "k0", "v": 0}\n{"key": "k1", "v": 1}\n')  # gzip stamps the time: keep these bytes
    seg.write_bytes(rolled)
    store = RecordStore(run, "all")
    assert plain.read_text() == ""
    assert [r["key"] for r in read_records(run, at_rest=True)] == ["k0", "k1", "k2", "k3"]
    assert seg.read_bytes() == rolled  # never rewritten
    assert len(store.segments()) == 2


def test_a_pair_decoded_by_another_kernel_build_is_a_new_record_and_the_variant_is_not(tmp_path):
    store = RecordStore(tmp_path, "all")
    rows = [{"key": "p|bf16|exact", "kernels": None, "v": 0},            # before records named their kernels
            {"key": "p|bf16|exact", "kernels": "aaaa/avx512bf16", "v": 1},
            {"key": "p|bf16|exact", "kernels": "aaaa/avx2", "v": 2},     # same sources, same bits: a duplicate
            {"key": "p|bf16|exact|ref-sdpa", "reference_kernels": None, "kernels": "bbbb/avx2", "v": 3},
            {"key": "p|bf16|exact", "kernels": "bbbb/scalar", "v": 4},
            {"key": "p|bf16|sdpa", "v": 5}, {"key": "p|bf16|sdpa", "v": 6}]
    store.append(rows)
    store.roll()
    store.append([{"key": "p|bf16|exact", "kernels": "bbbb/avx512", "v": 7}])  # already rolled: dropped on reopening
    RecordStore(tmp_path, "all")
    assert [r["v"] for r in read_records(tmp_path)] == [0, 1, 3, 4, 5]
    assert [records_mod.record_id(r) for r in read_records(tmp_path)] == [
        "p|bf16|exact", "p|bf16|exact@aaaa", "p|bf16|exact|ref-sdpa@bbbb", "p|bf16|exact@bbbb", "p|bf16|sdpa"]
    assert not (tmp_path / "records" / "all.jsonl").read_text()


def test_a_clean_plain_file_is_left_as_it_is_on_opening(tmp_path):
    run = tmp_path / "run"
    (run / "records").mkdir(parents=True)
    plain = run / "records" / "all.jsonl"
    plain.write_text('{"key": "a"}\n{"key": "b"}\n')
    store = RecordStore(run, "all")
    assert plain.read_text() == '{"key": "a"}\n{"key": "b"}\n' and store.segments() == []


def _unlock_watch(monkeypatch, path, seen):
    """Make `records._locked` note the file's size on disk (through a separate descriptor) and whether it
    was fsynced, at the moment the lock is released."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(fd)
        return real_fsync(fd)

    def flock(fd, op):
        if op == fcntl.LOCK_UN:
            other = os.open(path, os.O_RDONLY)
            try:
                seen.append((os.fstat(other).st_size, fd in synced))
            finally:
                os.close(other)
        return fcntl.flock(fd, op)

    fake = types.SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_UN=fcntl.LOCK_UN)
    monkeypatch.setattr(records_mod, "fcntl", fake)
    monkeypatch.setattr(records_mod.os, "fsync", fsync)


def test_what_a_failing_block_wrote_is_on_disk_before_the_lock_is_released(tmp_path, monkeypatch):
    path = tmp_path / "w.jsonl"
    seen = []
    _unlock_watch(monkeypatch, path, seen)
    with pytest.raises(RuntimeError):
        with records_mod._locked(path) as f:
            f.write(b'{"key": "a"}\n')
            raise RuntimeError("the body failed after writing")
    assert seen == [(13, True)]


def test_what_a_block_wrote_is_on_disk_before_the_lock_is_released(tmp_path, monkeypatch):
    path = tmp_path / "w.jsonl"
    seen = []
    _unlock_watch(monkeypatch, path, seen)
    with records_mod._locked(path) as f:
        f.write(b'{"key": "a"}\n')
    assert seen == [(13, True)]


def test_atomic_write_fsyncs_the_directory_after_the_rename(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("old")
    real_fsync = os.fsync
    synced = []

    def fsync(fd):
        st = os.fstat(fd)
        synced.append((stat.S_ISDIR(st.st_mode), st.st_ino, target.read_text()))
        return real_fsync(fd)

    monkeypatch.setattr(jsonio.os, "fsync", fsync)
    atomic_write(target, "new")
    directory = os.stat(tmp_path).st_ino
    assert (True, directory, "new") in synced  # the directory, once the rename had happened
    assert synced[0][0] is False  # the data itself first


def _tmps(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_a_failing_atomic_write_leaves_no_temporary_file_and_the_old_contents(tmp_path, monkeypatch):
    target = tmp_path / "seg.jsonl.gz"
    target.write_bytes(b"old")

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonio.os, "fsync", full_disk)
    with pytest.raises(OSError) as exc:
        atomic_write(target, b"new" * 1000)
    assert exc.value.errno == errno.ENOSPC
    assert _tmps(tmp_path) == [] and target.read_bytes() == b"old"


def test_a_write_interrupted_by_ctrl_c_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonio.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, "{}")
    assert _tmps(tmp_path) == [] and not target.exists()


# above PID_MAX_LIMIT (2**22 on 64-bit Linux): no process can have it
NO_SUCH_PID = 2**22 + 1


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write_and_a_live_ones_kept(tmp_path):
    with pytest.raises(ProcessLookupError):
        os.kill(NO_SUCH_PID, 0)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        target = tmp_path / "run.json"
        dead_tmp = tmp_path / f".run.json.{NO_SUCH_PID}.tmp"
        live_tmp = tmp_path / f".run.json.{live.pid}.tmp"
        other_target_tmp = tmp_path / f".report.md.{NO_SUCH_PID}.tmp"
        for p in (dead_tmp, live_tmp, other_target_tmp):
            p.write_text("half of a file")
        atomic_write(target, "{}")
        assert target.read_text() == "{}"
        assert not dead_tmp.exists()  # a killed writer's leftover
        assert live_tmp.read_text() == "half of a file"  # a writer still at work
        assert other_target_tmp.exists()  # another file's: its own next write clears it
        assert _tmps(tmp_path) == sorted([live_tmp.name, other_target_tmp.name])
    finally:
        live.kill()
        live.wait()
