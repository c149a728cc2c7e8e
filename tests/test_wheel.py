"""A wheel install (not editable) carries its data: the default suite, the training and held-out
prompts and the shipped head are found from site-packages, so `generate`, `audit` on the default suite
and training's suite-overlap check run without the source checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import save_tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def _run(cmd, cwd, env, ok=True):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv holding only the built wheel; the test venv's packages are visible after it."""
    root = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
          str(REPO)], root, env)
    wheel = next((root / "dist").glob("lossless-*.whl"))
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, env)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root,
                     env).stdout.strip())
    # torch, transformers, ... from the test venv, after the new venv's own packages (a plain path line:
    # that venv's .pth hooks, such as an editable lossless, are not run)
    (site / "zz_parent_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-build-isolation",
          str(wheel)], root, env)
    work = root / "work"  # run outside the checkout
    work.mkdir()
    return {"python": python, "lossless": venv / "bin" / "lossless", "site": site, "env": env, "work": work,
            "model": save_tiny_model_dir(root / "tiny-llama")}


def test_the_wheel_imports_its_own_copy_and_finds_its_data(installed):
    code = ("import json, lossless; from lossless import paths; print(json.dumps([lossless.__file__, "
            "str(paths.DEFAULT_SUITE), str(paths.TRAIN_PROMPTS), str(paths.HELDOUT_PROMPTS), "
            "str(paths.HEADS_DIR / 'smollm2-135m' / 'head.json'), str(paths.HEADS_DIR / 'smollm2-135m' / 'cycles.json')]))")
    out = json.loads(_run([str(installed["python"]), "-c", code], installed["work"], installed["env"]).stdout)
    for path in out:
        assert Path(path).is_file(), path
        assert Path(path).is_relative_to(installed["site"]), path


def test_the_wheel_generates(installed):
    proc = _run([str(installed["lossless"]), "generate", "--model", str(installed["model"]), "--max-new-tokens", "5",
                 "--json", "w1 w5 w9"], installed["work"], installed["env"])
    assert len(json.loads(proc.stdout.splitlines()[-1])["token_ids"]) == 5


def test_the_wheel_audits_the_default_suite(installed):
    out = installed["work"] / "run"
    _run([str(installed["lossless"]), "audit", "--model", str(installed["model"]), "--dtypes", "fp32",
          "--limit-per-domain", "1", "--max-new-tokens", "3", "--no-progress", "--out", str(out)],
         installed["work"], installed["env"])
    run = json.loads((out / "run.json").read_text())
    assert Path(run["config"]["suite"]).is_relative_to(installed["site"])
    from lossless.study.records import read_records

    domains = {r["domain"] for r in read_records(out)}
    assert len(domains) == 12
    # the report's page is built from the wheel's own templates, with the wheel's suite's prompts
    _run([str(installed["lossless"]), "report", str(out)], installed["work"], installed["env"])
    page = (out / "report.html").read_text()
    from lossless.study.htmlreport import unpack

    data = unpack(page)
    assert "class Viewer" in page and len(data["prompts"]) == 12 and data["notes"] == []


def test_the_wheel_refuses_training_prompts_from_the_default_suite(installed):
    suite = installed["site"] / "lossless" / "_shipped" / "suites" / "default.jsonl"
    prompts = installed["work"] / "overlap.jsonl"
    prompts.write_text(suite.read_text().splitlines()[0] + "\n")
    proc = _run([str(installed["lossless"]), "train", "--model", str(installed["model"]), "--out",
                 str(installed["work"] / "head"), "--prompts", str(prompts)], installed["work"], installed["env"],
                ok=False)
    assert proc.returncode == 2 and "also appear in the audit suite" in proc.stderr, proc.stderr


def test_the_wheel_decodes_in_exact_mode_with_its_own_kernel_source(installed):
    """The kernels' C++ source ships in the wheel, and a wheel install builds and runs them (a tree with lookup
    in exact mode: the same tokens as exact AR)."""
    assert (installed["site"] / "lossless" / "decoding" / "exact_kernels.cpp").is_file()
    ids = {}
    for mode in (["--mode", "ar"], ["--tree", "8", "--lookup", "16"]):
        proc = _run([str(installed["lossless"]), "generate", "--model", str(installed["model"]), "--attn", "exact",
                     "--max-new-tokens", "12", "--json", *mode, "w1 w5 w9 w1 w5"], installed["work"], installed["env"])
        ids[mode[0]] = json.loads(proc.stdout.splitlines()[-1])["token_ids"]
    assert ids["--mode"] == ids["--tree"] and len(ids["--mode"]) == 12
