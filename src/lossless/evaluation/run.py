"""`lossless eval`: task scores of `ar` and `orthrus` side by side, through lm-evaluation-harness.

For every dtype, task and mode the harness runs our registered model (`harness.py`) on the same items
and writes its own outputs (`harness/<mode>_<dtype>/results_<task>.json`, `samples_<task>.jsonl`; an
Orthrus run with the fused cycle is named `orthrus-fused`). Generations are cached per (task, mode,
dtype) in SQLite, so a killed run resumes where it stopped. Every command that wrote into the directory
is appended to `command.txt`.

Owns: the run's configuration (`EvalConfig`), the order of the work, the layout of the output directory
and the `lossless` entry each results file carries (model, mode, cycle, dtype, attn, k, command).

Does not know: how the model answers a request (`harness.py`), how tasks are built and scored
(`tasks.py`), or what is summarised from the outputs: after every run it calls
`report.summarise`, which rebuilds summary.json, report.md and scores.png from the files alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..dtypes import dtype_name
from ..errors import LosslessError
from .report import summarise
from .tasks import TASKS, UNSAFE, resolve_tasks, short_name, write_tasks
from ..jsonio import jsonl_text
from ..names import MODES
from ..paths import check_writable_dir, write_atomically

CHAT_TASKS = {"lossless_humaneval"}  # asked in the instruct model's chat template; the rest are few-shot text


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise LosslessError("lossless eval needs lm-evaluation-harness: pip install 'lossless[eval]'") from None


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise LosslessError(f"unknown mode(s) {', '.join(bad) or repr(text)}: use ar, orthrus or ar,orthrus")
    return list(dict.fromkeys(modes))


def mode_label(mode: str, cycle: str = "two-pass") -> str:
    """How a run is named in directories and summaries: `ar`, `orthrus` (two-pass) or `orthrus-fused`."""
    return mode if mode == "ar" or cycle == "two-pass" else f"{mode}-{cycle}"


def run_dir_name(mode: str, dtype: str) -> str:
    return f"{mode}_{dtype}"


@dataclass
class EvalConfig:
    """What `lossless eval` runs: the model and its loading options, and the tasks x modes x dtypes grid."""

    model: str = "smollm2-135m"
    tasks: list[str] = field(default_factory=lambda: list(TASKS))  # short or full names (tasks.TASKS)
    modes: list[str] = field(default_factory=lambda: ["ar", "orthrus"])
    dtypes: list[str] = field(default_factory=lambda: ["bf16"])
    attn: str = "sdpa"
    head: str | None = None
    k: int | None = None  # block size (None: the head's k)
    cycle: str = "two-pass"  # the Orthrus cycle ("fused": one forward per cycle)
    groups: int | None = None  # fused: draft groups per forward (None = all)
    limit: int | None = None  # items per task (None = all)
    confirm_unsafe: bool = False  # allow tasks that run model-written code (humaneval)
    device: str = "cpu"


def run_eval(cfg: EvalConfig, out: str | Path, command: list[str] | None = None, progress: bool = True) -> dict:
    """Run every (dtype, task, mode) of `cfg` through the harness into `out`, then summarise the whole
    directory (`report.summarise`, whose summary is returned)."""
    _require_lm_eval()
    tasks = resolve_tasks(cfg.tasks)
    unsafe = [t for t in tasks if short_name(t) in UNSAFE]
    if unsafe and not cfg.confirm_unsafe:
        raise LosslessError(f"{', '.join(map(short_name, unsafe))} runs model-written code on this machine: "
                            "pass --confirm-run-unsafe-code to allow it")
    if cfg.limit is not None and cfg.limit < 1:
        raise LosslessError(f"--limit must be at least 1, got {cfg.limit}")
    if cfg.k is not None and cfg.k < 1:
        raise LosslessError(f"--k must be >= 1, got {cfg.k}")
    if cfg.groups is not None and cfg.groups < 1:
        raise LosslessError(f"--groups must be >= 1, got {cfg.groups}")
    out = check_writable_dir(out)  # before any work, also when every item is cached already
    out.mkdir(parents=True, exist_ok=True)
    task_dir = write_tasks(out / "tasks")
    cmd_file, cmd = out / "command.txt", " ".join(command or sys.argv)
    if cmd not in (cmd_file.read_text().splitlines() if cmd_file.exists() else []):
        with cmd_file.open("a") as f:  # several processes (e.g. one per dtype) may share a directory
            f.write(cmd + "\n")

    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = TaskManager(include_path=str(task_dir))
    with quiet_harness(progress):
        _run_grid(cfg, out, manager, tasks, cmd, progress)
    return summarise(out)


def _git_commit_hash() -> str | None:
    """lm-eval's record of the working directory's git commit, without git's complaint on stderr outside a
    repository (lm-eval runs `git describe` with stderr inherited)."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
        return done.stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError, OSError):
        return get_commit_from_path(Path.cwd())


@contextlib.contextmanager
def quiet_harness(progress: bool):
    """What the harness prints on its own while it runs: never git's stderr; without `progress`, no progress
    bars either (lm-eval's request building and cache checks, the datasets library's split generation), all
    of which are tqdm bars that lm-eval gives no switch for."""
    import tqdm.std
    from lm_eval import evaluator

    original_git, original_init = evaluator.get_git_commit_hash, tqdm.std.tqdm.__init__
    evaluator.get_git_commit_hash = _git_commit_hash
    if not progress:
        def silent_init(self, *args, **kwargs):
            kwargs["disable"] = True
            original_init(self, *args, **kwargs)

        tqdm.std.tqdm.__init__ = silent_init
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original_git
        tqdm.std.tqdm.__init__ = original_init


def _run_grid(cfg: EvalConfig, out: Path, manager, tasks: list[str], cmd: str, progress: bool) -> None:
    """Every (dtype, task, mode) through the harness, each run's files written as it finishes."""
    import lm_eval
    from lm_eval.utils import handle_non_serializable

    from .harness import LosslessLM

    for dtype in cfg.dtypes:
        lm = LosslessLM(model=cfg.model, mode=cfg.modes[0], dtype=dtype, attn=cfg.attn, head=cfg.head, k=cfg.k,
                        cycle=cfg.cycle, groups=cfg.groups, device=cfg.device, progress=progress)
        for task in tasks:
            for mode in cfg.modes:
                lm.mode = mode
                label = mode_label(mode, cfg.cycle)
                run = out / "harness" / run_dir_name(label, dtype)
                run.mkdir(parents=True, exist_ok=True)
                res = lm_eval.simple_evaluate(
                    model=lm, tasks=[task], task_manager=manager, limit=cfg.limit, log_samples=True,
                    confirm_run_unsafe_code=cfg.confirm_unsafe, apply_chat_template=task in CHAT_TASKS,
                    use_cache=str(out / "cache" / f"{short_name(task)}_{label}_{dtype}"),
                    bootstrap_iters=1000, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
                samples = res.pop("samples", {}).get(task, [])
                write_atomically(run / f"samples_{short_name(task)}.jsonl",
                             jsonl_text(samples, default=handle_non_serializable, ensure_ascii=False))
                res["lossless"] = {"model": cfg.model, "mode": label, "cycle": cfg.cycle, "dtype": dtype,
                                   "attn": cfg.attn, "limit": cfg.limit, "k": lm.block_size,
                                   "chat_template": task in CHAT_TASKS, "command": cmd}
                write_atomically(run / f"results_{short_name(task)}.json",
                                 json.dumps(res, default=handle_non_serializable, indent=1))
                summarise(out)


def parse_dtype_list(text: str) -> list[str]:
    dtypes = [dtype_name(d.strip()) for d in text.split(",") if d.strip()]
    if not dtypes:
        raise LosslessError("--dtypes needs at least one of fp32, bf16, fp16")
    return list(dict.fromkeys(dtypes))
