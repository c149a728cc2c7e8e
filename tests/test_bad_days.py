"""Bad input and a bad environment, across the commands: every refusal is one line `lossless: error: ...`
with exit code 2 and no traceback, comes before any model loads (where it can), writes nothing that blocks
the next run, and the corrected command then gets past the checks. Full disks and read-only folders are
real (a small tmpfs, a read-only bind mount) where this process may mount them, else simulated."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lossless.decoding.models
import lossless.paths
from conftest import save_tiny_model_dir, tiny_orthrus
from lossless.cli import main
from lossless.jsonio import read_jsonl

PROMPT = "w1 w5 w9 w3"
PAGE = 4096


# ------------------------------------------------------------------------------------------- mounts
def _mount(*args: str) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _mounted(path: Path) -> bool:
    """Whether something is mounted at `path` (a bind mount too, which os.path.ismount does not see)."""
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == str(path) for line in f)
    except OSError:
        return os.path.ismount(path)


def _umount(path: Path) -> None:
    """Unmount everything mounted at `path`."""
    while _mounted(path):
        if subprocess.run(["umount", "-l", str(path)], capture_output=True).returncode:
            break


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "64k"):
    """A tmpfs of `size` at `path` (None when this process cannot mount)."""
    path.mkdir(parents=True, exist_ok=True)
    if not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)):
        yield None
        return
    try:
        yield path
    finally:
        _umount(path)


def fill(path: Path, free_pages: int = 0) -> Path:
    """Fill the file system of `path` until `free_pages` pages are left."""
    st = os.statvfs(path)
    filler = path / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(st.f_bavail * st.f_frsize - free_pages * PAGE, 0))
    return filler


def _checkpoint(path: Path) -> Path:
    import torch

    torch.save({"step": 0, "head": {}, "optimizer": {}, "scheduler": {}, "history": []}, path)
    return path


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A full folder and a read-only folder: real mounts when possible (`real` says which)."""
    root = tmp_path_factory.mktemp("places")
    full, ro, ro_src = root / "full", root / "ro", root / "ro-src"
    ro.mkdir()
    ro_src.mkdir()
    (ro_src / "existing").mkdir()
    _checkpoint(ro_src / "existing" / "checkpoint.pt")  # a run to resume, in a folder that cannot take its saves
    with tmpfs(full) as mounted:
        real_full = mounted is not None
        if real_full:
            fill(full)
        real_ro = _mount("--bind", str(ro_src), str(ro)) and _mount("-o", "remount,bind,ro", str(ro))
        if not real_ro:
            _umount(ro)
            (ro / "existing").mkdir(exist_ok=True)
            _checkpoint(ro / "existing" / "checkpoint.pt")
        try:
            yield {"full": full, "ro": ro, "real": real_full and real_ro}
        finally:
            _umount(ro)


@pytest.fixture
def faulty_places(places, monkeypatch):
    """Without mounts, the write check's probe file raises what the real places would."""
    if not places["real"]:
        real_open = open

        def fake_open(file, *args, **kwargs):
            p = str(file)
            for key, code in (("full", errno.ENOSPC), ("ro", errno.EROFS)):
                if p.startswith(str(places[key]) + os.sep):
                    raise OSError(code, os.strerror(code), p)
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(lossless.paths, "open", fake_open, raising=False)
    return places


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """Inputs shared by the cases: a tiny model directory, good and broken files of every kind."""
    root = tmp_path_factory.mktemp("bad-days")
    model = save_tiny_model_dir(root / "model")
    suite = root / "suite.jsonl"
    suite.write_text("".join(json.dumps({"id": f"d0-{i}", "domain": "d0", "prompt": p}) + "\n"
                             for i, p in enumerate(["w1 w2 w3", "w4 w5", "w9 w8 w7 w6"])))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(["w7 w8", "w3 w1 w2"])))
    empty = root / "empty.jsonl"
    empty.write_text("\n")
    latin1 = root / "latin1.jsonl"
    latin1.write_bytes('{"id": "x", "domain": "d", "prompt": "café w1"}\n'.encode("latin-1"))
    latin1_txt = root / "latin1.txt"
    latin1_txt.write_bytes("un café, w1 w2 w3 w4 w5 w6 w7 w8 w9 w10".encode("latin-1"))
    head = tiny_orthrus("llama", k=4).save_head(root / "head-latin1")
    (head / "head.json").write_bytes((head / "head.json").read_text().replace('"k":', '"note": "café", "k":', 1)
                                     .encode("latin-1"))
    a_file = root / "a-file"
    a_file.write_text("not a directory\n")
    ckpt = root / "torn-run"
    ckpt.mkdir()
    (ckpt / "checkpoint.pt").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    torn_run = root / "torn-audit"
    torn_run.mkdir()
    (torn_run / "run.json").write_text("")
    torn_meta = root / "torn-distill"
    torn_meta.mkdir()
    (torn_meta / "meta.json").write_text('{"model": ')
    logdir = root / "logdir"
    logdir.mkdir()
    return {"root": root, "model": str(model), "suite": str(suite), "prompts": str(prompts), "empty": str(empty),
            "latin1": str(latin1), "latin1_txt": str(latin1_txt), "head_latin1": str(head),
            "file": str(a_file), "ckpt": str(ckpt), "torn_run": str(torn_run),
            "torn_meta": str(torn_meta), "logdir": str(logdir)}


class ReachedLoading(Exception):
    """Raised where a model would load: the command got past every check."""


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise ReachedLoading

    monkeypatch.setattr(lossless.decoding.models, "_load_hf", refuse)
    monkeypatch.setattr(lossless.decoding.models, "embedded_model_dir", refuse)


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors exit through SystemExit
        return exc.code


def assert_one_line_error(rc, out: str, err: str, needle: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err and "Traceback" not in out
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("lossless: error: "), err
    assert needle in lines[0], lines[0]
    return lines[0]


def leftovers(*roots: Path) -> list[Path]:
    """What a refused run may not leave: temporary files, an audit's run.json, a lock file."""
    found = []
    for root in roots:
        for p in Path(root).rglob("*"):
            if p.name.endswith(".tmp") or p.name.startswith(".lock") or p.name.startswith(".lossless-write-check"):
                found.append(p)
    return found


# ------------------------------------------------------------------------------------------- the table
def _gen(d, *a):
    return ["generate", "--model", d["model"], *a, PROMPT]


def _audit(d, t, *a, out=None):
    return ["audit", "--model", d["model"], "--head", "none", "--suite", d["suite"], "--dtypes", "fp32",
            "--max-new-tokens", "4", "--no-progress", *a, "--out", str(out or t / "run")]


def _train(d, t, *a, out=None):
    return ["train", "--model", d["model"], "--prompts", d["prompts"], "--k", "4", "--steps", "2",
            "--eval-prompts", "0", "--max-new-tokens", "8", "--no-progress", *a, "--out", str(out or t / "head")]


def _distill(d, t, *a, out=None, prompts=None):
    return ["distill", "--model", d["model"], "--prompts", prompts or d["prompts"], "--max-new-tokens", "4",
            "--no-progress", *a, "--out", str(out or t / "responses")]


def _eval(d, t, *a, out=None):
    return ["eval", "--model", d["model"], "--tasks", "arith", "--dtypes", "fp32", "--limit", "1", "--no-progress",
            *a, "--out", str(out or t / "ev")]


def _fault(key, *sub):
    return lambda p: str(Path(p[key], *sub))


# name: (argv(d, t, p) -> list, needle, corrected argv or None, loads a model first)
CASES = {
    # generate
    "generate temperature nan": (lambda d, t, p: _gen(d, "--temperature", "nan"), "--temperature", None, False),
    "generate top-k nan": (lambda d, t, p: _gen(d, "--top-k", "nan"), "--top-k", None, False),
    "generate max-new-tokens not an integer": (lambda d, t, p: _gen(d, "--max-new-tokens", "1e3"), "--max-new-tokens",
                                               lambda d, t, p: _gen(d, "--max-new-tokens", "3"), False),
    "generate seed negative": (lambda d, t, p: _gen(d, "--seed", "-1"), "--seed", None, False),
    "generate temperature inf": (lambda d, t, p: _gen(d, "--temperature", "inf"), "--temperature", None, False),
    "generate k not a number": (lambda d, t, p: _gen(d, "--k", "abc"), "--k 'abc'", None, False),
    "generate unknown mode (argparse)": (lambda d, t, p: _gen(d, "--mode", "fast"), "--mode", None, False),
    "generate head.json not UTF-8": (lambda d, t, p: _gen(d, "--head", d["head_latin1"]), "corrupt head config", None,
                                     False),
    # audit
    "audit max-new-tokens zero": (lambda d, t, p: _audit(d, t, "--max-new-tokens", "0"), "--max-new-tokens",
                                  lambda d, t, p: _audit(d, t), False),
    "audit k zero": (lambda d, t, p: _audit(d, t, "--k", "0"), "--k", lambda d, t, p: _audit(d, t, "--k", "2"), False),
    "audit limit-per-domain zero": (lambda d, t, p: _audit(d, t, "--limit-per-domain", "0"), "--limit-per-domain",
                                    lambda d, t, p: _audit(d, t, "--limit-per-domain", "1"), False),
    "audit limit-per-domain negative": (lambda d, t, p: _audit(d, t, "--limit-per-domain", "-1"), "--limit-per-domain",
                                        None, False),
    "audit groups not a number": (lambda d, t, p: _audit(d, t, "--cycle", "fused", "--groups", "nan"), "--groups",
                                  None, False),
    "audit suite not UTF-8": (lambda d, t, p: _audit(d, t, "--suite", d["latin1"]), "not UTF-8", None, False),
    "audit out is a file": (lambda d, t, p: _audit(d, t, out=d["file"]), "is a file",
                            lambda d, t, p: _audit(d, t), False),
    "audit corrupt run.json": (lambda d, t, p: _audit(d, t, out=d["torn_run"]), "is corrupt", None, False),
    "audit read-only out": (lambda d, t, p: _audit(d, t, out=_fault("ro", "run")(p)), "read-only",
                            lambda d, t, p: _audit(d, t), False),
    "audit full disk": (lambda d, t, p: _audit(d, t, out=_fault("full", "run")(p)), "no space left", None, False),
    "audit missing --out (argparse)": (lambda d, t, p: _audit(d, t)[:-2], "--out", None, False),
    "audit k above the head's": (lambda d, t, p: _audit(d, t, "--k", "9"), "head's k", None, True),
    "audit prompt past the context": (lambda d, t, p: _audit(d, t, "--max-new-tokens", "256"), "context", None, True),
    # report
    "report out is a file": (lambda d, t, p: ["report", d["torn_run"], "--out", d["file"]], "is a file", None, False),
    "report read-only out": (lambda d, t, p: ["report", d["torn_run"], "--out", _fault("ro", "rep")(p)], "read-only",
                             None, False),
    "report full disk": (lambda d, t, p: ["report", d["torn_run"], "--out", _fault("full", "rep")(p)],
                         "no space left", None, False),
    # train
    "train lr nan": (lambda d, t, p: _train(d, t, "--lr", "nan"), "--lr", lambda d, t, p: _train(d, t, "--lr", "1e-3"),
                     False),
    "train lr negative": (lambda d, t, p: _train(d, t, "--lr", "-1"), "--lr", None, False),
    "train lr zero": (lambda d, t, p: _train(d, t, "--lr", "0"), "--lr", None, False),
    "train steps zero": (lambda d, t, p: _train(d, t, "--steps", "0"), "--steps",
                         lambda d, t, p: _train(d, t, "--steps", "1"), False),
    "train seqs-per-step zero": (lambda d, t, p: _train(d, t, "--seqs-per-step", "0"), "--seqs-per-step", None, False),
    "train anchors zero": (lambda d, t, p: _train(d, t, "--anchors", "0"), "--anchors", None, False),
    "train warmup negative": (lambda d, t, p: _train(d, t, "--warmup", "-1"), "--warmup", None, False),
    "train position-decay inf": (lambda d, t, p: _train(d, t, "--position-decay", "inf"), "--position-decay", None,
                                 False),
    "train position-weights nan": (lambda d, t, p: _train(d, t, "--position-weights", "nan,1,1"), "--position-weights",
                                   lambda d, t, p: _train(d, t, "--position-weights", "0,1,1"), False),
    "train stop-at zero": (lambda d, t, p: _train(d, t, "--stop-at", "0"), "--stop-at", None, False),
    "train eval-tokens zero": (lambda d, t, p: _train(d, t, "--eval-tokens", "0"), "--eval-tokens", None, False),
    "train out is a file": (lambda d, t, p: _train(d, t, out=d["file"]), "is a file", None, False),
    "train read-only out": (lambda d, t, p: _train(d, t, out=_fault("ro", "head")(p)), "read-only",
                            lambda d, t, p: _train(d, t), False),
    "train resume read-only": (lambda d, t, p: _train(d, t, "--resume", out=_fault("ro", "existing")(p)), "read-only",
                               None, False),
    "train full disk": (lambda d, t, p: _train(d, t, out=_fault("full", "head")(p)), "no space left", None, False),
    "train resume torn checkpoint": (lambda d, t, p: _train(d, t, "--resume", out=d["ckpt"]), "corrupt checkpoint",
                                     None, False),
    "train log is a directory": (lambda d, t, p: _train(d, t, "--log", d["logdir"]), "is a directory", None, False),
    "train read-only publish": (lambda d, t, p: _train(d, t, "--publish", _fault("ro", "pub")(p)), "read-only", None,
                                False),
    "train prompts not UTF-8": (lambda d, t, p: _train(d, t, "--prompts", d["latin1"]), "not UTF-8", None, False),
    "train data not UTF-8": (lambda d, t, p: _train(d, t, "--data", d["latin1_txt"]), "not UTF-8", None, False),
    # distill
    "distill batch zero": (lambda d, t, p: _distill(d, t, "--batch", "0"), "--batch",
                           lambda d, t, p: _distill(d, t, "--batch", "2"), False),
    "distill max-new-tokens zero": (lambda d, t, p: _distill(d, t, "--max-new-tokens", "0"), "--max-new-tokens", None,
                                    False),
    "distill empty prompt file": (lambda d, t, p: _distill(d, t, prompts=d["empty"]), "holds no prompts",
                                  lambda d, t, p: _distill(d, t), False),
    "distill prompts not UTF-8": (lambda d, t, p: _distill(d, t, prompts=d["latin1"]), "not UTF-8", None, False),
    "distill corrupt meta.json": (lambda d, t, p: _distill(d, t, out=d["torn_meta"]), "is corrupt", None, False),
    "distill read-only out": (lambda d, t, p: _distill(d, t, out=_fault("ro", "r")(p)), "read-only",
                              lambda d, t, p: _distill(d, t), False),
    "distill full disk": (lambda d, t, p: _distill(d, t, out=_fault("full", "r")(p)), "no space left", None, False),
    # probe
    "probe k not a number": (lambda d, t, p: ["probe", "--model", d["model"], "--k", "nan", PROMPT], "--k", None, False),
    "probe text past the context": (lambda d, t, p: ["probe", "--model", d["model"], "--dtype", "fp32", "--k", "2",
                                                     " ".join(["w1"] * 300)], "context", None, True),
    # eval
    "eval limit nan": (lambda d, t, p: _eval(d, t, "--limit", "nan"), "--limit", None, False),
    "eval full disk": (lambda d, t, p: _eval(d, t, out=_fault("full", "ev")(p)), "no space left", None, False),
    "eval k zero": (lambda d, t, p: _eval(d, t, "--k", "0"), "--k", None, False),
    "eval out is a file": (lambda d, t, p: _eval(d, t, out=d["file"]), "is a file", None, False),
    "eval read-only out": (lambda d, t, p: _eval(d, t, out=_fault("ro", "ev")(p)), "read-only", None, False),
    # tasks
    "tasks out is a file": (lambda d, t, p: ["tasks", "--out", d["file"]], "is a file", None, False),
    "tasks read-only out": (lambda d, t, p: ["tasks", "--out", _fault("ro", "tasks")(p)], "read-only", None, False),
    "tasks out under a file": (lambda d, t, p: ["tasks", "--out", str(Path(d["file"], "tasks"))], "is a file", None,
                               False),
    "tasks full disk": (lambda d, t, p: ["tasks", "--out", _fault("full", "tasks")(p)], "no space left", None, False),
    # curve
    "curve log not UTF-8": (lambda d, t, p: ["curve", d["latin1"], "--out", str(t / "c")], "not UTF-8", None, False),
    "curve full disk": (lambda d, t, p: ["curve", d["prompts"], "--out", _fault("full", "c")(p)], "no space left",
                        None, False),
    "curve read-only out": (lambda d, t, p: ["curve", d["prompts"], "--out", _fault("ro", "c")(p)], "read-only", None,
                            False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_or_environment_is_one_line_and_blocks_nothing(case, d, faulty_places, tmp_path, capsys,
                                                                  monkeypatch, request):
    argv, needle, corrected, loads = CASES[case]
    monkeypatch.setenv("LOSSLESS_CACHE", str(tmp_path / "cache"))
    if not loads:
        request.getfixturevalue("no_loading")
    before = {p: p.read_bytes() for p in Path(d["root"]).rglob("*") if p.is_file()}
    capsys.readouterr()
    rc = run_cli(argv(d, tmp_path, faulty_places))
    captured = capsys.readouterr()
    assert_one_line_error(rc, captured.out, captured.err, needle)
    # nothing half-written: no temporary or lock file, no run.json of a refused audit, the inputs untouched
    assert not leftovers(tmp_path, d["root"], faulty_places["full"], faulty_places["ro"])
    assert not list(tmp_path.rglob("run.json"))
    assert {p: p.read_bytes() for p in Path(d["root"]).rglob("*") if p.is_file()} == before
    if corrected is not None:  # the corrected command gets past every check, to where the model loads
        request.getfixturevalue("no_loading")
        with pytest.raises(ReachedLoading):
            main(corrected(d, tmp_path, faulty_places))


def test_the_table_covers_every_command_and_enough_cases():
    commands = {argv.split()[0] for argv in CASES}
    assert commands == {"generate", "audit", "report", "train", "distill", "probe", "eval", "tasks", "curve"}
    assert len(CASES) >= 40


def test_every_numeric_option_refuses_nan(capsys):
    """Each int or float option of every command refuses 'nan' in one line, before anything runs."""
    import argparse

    from lossless.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if getattr(action.type, "__name__", "") in ("integer", "number"):
                positional = {"generate": ["x"], "probe": ["x"], "curve": ["log", "--out", "o"]}.get(name, [])
                required = ["--out", "o"] if name in ("distill", "train", "audit", "eval") else []
                # a bare --tree/--lookup takes its default and leaves a word that is not a number to the prompt
                value = "-5" if action.option_strings[0] in ("--tree", "--lookup") else "nan"
                rc = run_cli([name, action.option_strings[0], value, *required, *positional])
                captured = capsys.readouterr()
                assert_one_line_error(rc, captured.out, captured.err, action.option_strings[0])
                checked += 1
            else:
                assert action.type not in (int, float), f"{name} {action.dest} takes unchecked numbers"
    assert checked >= 30


# -------------------------------------------------------------------------------------- audit state
def test_a_refused_audit_leaves_the_folder_for_the_corrected_command(d, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(_audit(d, tmp_path, "--k", "9", out=out)) == 2  # refused once the head's k is known
    assert not (out / "run.json").exists()
    capsys.readouterr()
    assert main(_audit(d, tmp_path, "--k", "2", out=out)) == 0  # not "a different configuration"
    assert json.loads((out / "run.json").read_text())["config"]["k"] == 2
    assert not leftovers(out)  # the lock file is gone; nothing but run.json and records
    from lossless.study.records import record_files

    assert all(f.parent.name == "records" for f in record_files(out))


def _held_lock_process(lock: Path):
    code = ("import sys, time; from lossless.paths import exclusive_lock\n"
            f"with exclusive_lock({str(lock)!r}, 'busy {{pid}}'):\n"
            "    print('locked', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_audit_into_the_same_folder_is_refused(d, tmp_path, capsys, no_loading):
    out = tmp_path / "run"
    out.mkdir()
    holder = _held_lock_process(out / ".lock")  # another process writing the run
    try:
        rc = run_cli(_audit(d, tmp_path, out=out))
        line = assert_one_line_error(rc, *capsys.readouterr(), f"another audit is writing {out} (pid {holder.pid})")
        assert "use another --out" in line
        with pytest.raises(ReachedLoading):  # another shard's writer is not in the way
            main(_audit(d, tmp_path, "--shard", "1/2", out=out))
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(ReachedLoading):  # the holder is gone: the next audit proceeds
        main(_audit(d, tmp_path, out=out))


def test_one_shard_writer_at_a_time_within_one_process(d, tmp_path, capsys, no_loading):
    """flock is per open file: a lock held through another descriptor of this process conflicts too."""
    out = tmp_path / "run"
    out.mkdir()
    with lossless.paths.exclusive_lock(out / ".lock-shard-0-of-2", "busy {pid}"):
        rc = run_cli(_audit(d, tmp_path, "--shard", "0/2", out=out))
        assert_one_line_error(rc, *capsys.readouterr(), f"shard 0/2 of {out} (pid {os.getpid()})")
    assert not (out / ".lock-shard-0-of-2").exists()


# --------------------------------------------------------------------------------- faults mid-run
@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "64k") as disk:
        if disk is None:
            pytest.skip("this process cannot mount a tmpfs")
        yield disk


def test_a_full_disk_during_an_audit_keeps_the_finished_items(d, tmp_path, small_disk, capsys):
    out = small_disk / "run"
    filler = fill(small_disk, free_pages=3)  # the lock, run.json and one page of records
    rc = run_cli(_audit(d, tmp_path, "--max-new-tokens", "40", out=out))
    assert_one_line_error(rc, *capsys.readouterr(), "no space left")
    assert not [p for p in small_disk.rglob("*") if p.name.endswith(".tmp")]
    assert json.loads((out / "run.json").read_text())  # whole, never emptied
    from lossless.study.records import read_records

    kept = {r["key"] for r in read_records(out)}
    filler.unlink()  # space is freed: the same command resumes
    assert main(_audit(d, tmp_path, "--max-new-tokens", "40", out=out)) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["new_records"] == 3 - len(kept)
    assert {r["key"] for r in read_records(out)} >= kept and len(read_records(out)) == 3


def test_a_full_disk_at_run_json_leaves_a_reusable_folder(d, tmp_path, small_disk, capsys):
    out = small_disk / "run"
    filler = fill(small_disk, free_pages=1)  # the write check passes, the lock takes the page, run.json fails
    rc = run_cli(_audit(d, tmp_path, out=out))
    assert_one_line_error(rc, *capsys.readouterr(), "no space left")
    assert not (out / "run.json").exists() and not leftovers(small_disk)
    filler.unlink()
    assert main(_audit(d, tmp_path, out=out)) == 0


def test_a_full_disk_during_training_removes_the_temporary_checkpoint(d, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOSSLESS_CACHE", str(tmp_path / "cache"))
    with tmpfs(tmp_path / "disk", "64k") as disk:
        if disk is None:  # simulated: the checkpoint's write starts, then the disk is full
            import builtins

            import lossless.training.train

            disk = tmp_path / "disk"

            class Full:
                def __init__(self, f):
                    self.f = f

                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    self.f.close()

                def write(self, data):
                    self.f.write(bytes(data[:100]))
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(lossless.training.train, "open", lambda *a, **k: Full(builtins.open(*a, **k)), raising=False)
        out = disk / "head"
        argv = _train(d, tmp_path, "--seqs-per-step", "1", "--anchors", "2", "--save-every", "1", out=out)
        rc = run_cli(argv)
        line = assert_one_line_error(rc, *capsys.readouterr(), "no space left")
        assert not [p for p in disk.rglob("*") if p.name.endswith(".tmp")]  # the disk is not kept full
        if _mounted(disk):
            subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        else:
            monkeypatch.undo()
            monkeypatch.setenv("LOSSLESS_CACHE", str(tmp_path / "cache"))
        if "--resume" in line:
            argv = [*argv, "--resume"]
        assert main(argv) == 0
        assert (out / "head.json").exists() and (out / "checkpoint.pt").exists()


def test_a_full_disk_during_distillation_resumes(d, tmp_path, capsys, monkeypatch):
    """(Simulated) the second batch's records do not fit: the first batch's are kept, the rerun adds the rest."""
    from lossless.study.records import RecordStore

    real_append, calls = RecordStore.append, []

    def append(self, records):
        calls.append(len(records))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_append(self, records)

    monkeypatch.setattr(RecordStore, "append", append)
    out = tmp_path / "responses"
    rc = run_cli(_distill(d, tmp_path, "--batch", "1", out=out))
    line = assert_one_line_error(rc, *capsys.readouterr(), f"no space left to write {out}")
    assert "resumes where it stopped" in line
    monkeypatch.setattr(RecordStore, "append", real_append)
    assert main(_distill(d, tmp_path, "--batch", "1", out=out)) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 1


def test_a_truncated_checkpoint_is_named_by_the_library(tmp_path):
    from lossless.errors import LosslessError
    from lossless.training.train import read_checkpoint

    path = tmp_path / "checkpoint.pt"
    import torch

    torch.save({"step": 1, "head": {}, "optimizer": {}, "scheduler": {}, "history": []}, path)
    assert read_checkpoint(path)["step"] == 1
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(LosslessError, match="corrupt checkpoint"):
        read_checkpoint(path)


# ------------------------------------------------------------------------------------------ eval quiet
def test_eval_without_progress_prints_nothing_on_stderr(d, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside any git checkout: lm-eval's `git describe` would complain here
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    start = time.perf_counter()
    rc = main(_eval(d, tmp_path, "--modes", "ar", "--k", "4", "--limit", "2"))
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    assert captured.err == "", captured.err
    assert time.perf_counter() - start < 60


def test_a_training_log_in_a_folder_not_yet_made_is_written(d, tmp_path, capsys):
    """The up-front writability check makes and removes missing folders; the log's folder is made when the
    log is first written."""
    log = tmp_path / "not" / "yet" / "log.jsonl"
    assert main(_train(d, tmp_path, "--log", str(log))) == 0, capsys.readouterr().err
    assert log.is_file() and read_jsonl(log)


def test_processes_of_one_launch_check_one_new_folder_at_once(tmp_path):
    """Ranks of `accelerate launch` check, make and lock in the same --out together: one's folder, made or
    removed between the other's steps, is no refusal. In memory (/dev/shm) where there is one, so that the checks are quick enough
    to meet."""
    import tempfile

    shm = Path("/dev/shm")
    tmp_path = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    go = tmp_path / "go"
    code = ("import os, sys, time; from pathlib import Path\n"
            "from lossless.paths import check_writable_dir, exclusive_lock, make_dir\n"
            "root = Path(sys.argv[1]); out = root / 'new' / 'out'\n"
            "while not (root / 'go').exists(): time.sleep(0.001)\n"
            "end = time.monotonic() + 2\n"
            "while time.monotonic() < end:\n"
            "    check_writable_dir(out); make_dir(out)  # what an audit's rank does before its lock\n"
            "    with exclusive_lock(out / f'.lock-{os.getpid()}', 'busy {pid}'): pass\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    time.sleep(3)  # every process imported and waiting
    go.touch()
    errors = [p.communicate(timeout=120)[1] for p in procs]
    if tmp_path.parent == shm:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert [p.returncode for p in procs] == [0, 0, 0], errors


@pytest.mark.parametrize("race", [FileExistsError, FileNotFoundError])
def test_a_folder_another_rank_makes_and_removes_meanwhile_is_made_afresh(tmp_path, monkeypatch, race):
    """A rank making --out while another checks it: mkdir finds the folder there and gone when it looks
    (FileExistsError), or its parent gone between making it and making the folder in it (FileNotFoundError).
    Made afresh, and the lock taken in it; a file or a broken link in its place is still refused."""
    from lossless.paths import exclusive_lock, make_dir

    target = tmp_path / "new" / "out"
    real = os.mkdir
    raced = []

    def racing(path, mode=0o777):
        if Path(path) == target and len(raced) < 3:  # another process's check made it and removed it again
            raced.append(path)
            code = errno.EEXIST if race is FileExistsError else errno.ENOENT
            raise race(code, os.strerror(code), str(path))
        return real(path, mode)

    monkeypatch.setattr(os, "mkdir", racing)
    assert make_dir(target) == target and target.is_dir() and len(raced) == 3
    target.rmdir()
    raced.clear()
    with exclusive_lock(target / ".lock", "busy {pid}") as lock:
        assert lock.is_file() and len(raced) == 3
    monkeypatch.setattr(os, "mkdir", real)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        make_dir(tmp_path / "file")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        make_dir(tmp_path / "dangling")
