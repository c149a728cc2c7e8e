"""The package's layout holds: imports go one way. Decoding uses only the shared top-level modules; the
study, training and evaluation use decoding (and the shared modules), never the other way round."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lossless"
JOBS = ("decoding", "study", "training", "evaluation")
SHARED = ("errors", "names", "paths", "jsonio", "dtypes", "text", "stats", "plots")


def imported(path: Path) -> set[str]:
    """Absolute names (lossless.x.y) of the package modules a file imports, lazy imports included."""
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # e.g. ("lossless", "study")
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level + 1])
                name = ".".join(base + ([node.module] if node.module else []))
                out.update([name] if node.module else [f"{name}.{a.name}" for a in node.names])
            elif node.module and node.module.startswith("lossless"):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lossless"))
    return out


def _job(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in JOBS else None


LIMITED = sorted(p for p in PACKAGE.rglob("*.py") if p.parent.name == "decoding" or
                 (p.parent == PACKAGE and p.stem in SHARED))


@pytest.mark.parametrize("path", LIMITED, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_decoding_and_the_shared_modules_import_no_job_above_them(path):
    rel = path.relative_to(PACKAGE)
    job = rel.parts[0] if rel.parts[0] in JOBS else None
    used = {_job(name) for name in imported(path)} - {None, job}
    if job == "decoding" or (job is None and rel.stem in SHARED):
        assert not used, f"{rel} imports {sorted(used)}"


def test_the_shared_modules_and_the_jobs_are_where_the_map_says():
    for name in SHARED:
        assert (PACKAGE / f"{name}.py").is_file(), name
    for job in JOBS:
        assert (PACKAGE / job / "__init__.py").is_file(), job


def test_no_writers_temporary_file_is_tracked():
    """An atomic writer's temporary (`.NAME.PID.tmp`) left by a killed run is ignored by git, and none is committed."""
    import subprocess

    root = PACKAGE.parents[1]
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    assert [f for f in tracked.stdout.splitlines() if f.endswith(".tmp")] == []
    probe = "results/full-study/records/.shard-0-of-2.20261130T220506.jsonl.gz.22687.tmp"
    ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=root)
    assert ignored.returncode == 0, "a writer's temporary file would not be ignored"
