"""`lossless eval`: task scores of `ar` and `orthrus` side by side, through lm-evaluation-harness.

For every dtype, task and mode the harness runs our registered model on the same items and writes its
own outputs (`harness/<mode>_<dtype>/results_<task>.json`, `samples_<task>.jsonl`). Generations are
cached per (task, mode, dtype) in SQLite, so a killed run resumes where it stopped. `summary.json` and
`report.md` are rebuilt from every harness output in the directory: per task and dtype, the AR score,
the Orthrus score, their paired-bootstrap difference, and how many items' generations differed.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
from pathlib import Path

from .dtypes import dtype_name
from .errors import LosslessError
from .jsonio import atomic_write, jsonl_text, read_jsonl
from .names import MODES
from .stats import paired_bootstrap, wilson_interval

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


def _metric(result: dict) -> tuple[str, float, float | None]:
    """The task's main metric from a harness results entry: (name, value, stderr)."""
    for key, value in result.items():
        if "," in key and not key.split(",")[0].endswith("_stderr") and isinstance(value, (int, float)):
            name, filt = key.split(",", 1)
            stderr = result.get(f"{name}_stderr,{filt}")
            return name, float(value), float(stderr) if isinstance(stderr, (int, float)) else None
    raise LosslessError(f"no metric in harness results: {sorted(result)}")


def mode_label(mode: str, cycle: str = "two-pass") -> str:
    """How a run is named in directories and summaries: `ar`, `orthrus` (two-pass) or `orthrus-fused`."""
    return mode if mode == "ar" or cycle == "two-pass" else f"{mode}-{cycle}"


def run_dir_name(mode: str, dtype: str) -> str:
    return f"{mode}_{dtype}"


def run_eval(model: str, tasks: list[str], modes: list[str], dtypes: list[str], out: str | Path, *,
             attn: str = "sdpa", head: str | None = None, k: int | None = None, cycle: str = "two-pass",
             groups: int | None = None, limit: int | None = None,
             confirm_unsafe: bool = False, device: str = "cpu", progress: bool = True,
             command: list[str] | None = None) -> dict:
    """Run every (dtype, task, mode) through the harness, then summarise the whole directory."""
    _require_lm_eval()
    from .evaltasks import UNSAFE, resolve_tasks, short_name, write_tasks

    tasks = resolve_tasks(tasks)
    unsafe = [t for t in tasks if short_name(t) in UNSAFE]
    if unsafe and not confirm_unsafe:
        raise LosslessError(f"{', '.join(map(short_name, unsafe))} runs model-written code on this machine: "
                            "pass --confirm-run-unsafe-code to allow it")
    if limit is not None and limit < 1:
        raise LosslessError(f"--limit must be at least 1, got {limit}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    task_dir = write_tasks(out / "tasks")
    cmd_file, cmd = out / "command.txt", " ".join(command or sys.argv)
    if cmd not in (cmd_file.read_text().splitlines() if cmd_file.exists() else []):
        with cmd_file.open("a") as f:  # several processes (e.g. one per dtype) may share a directory
            f.write(cmd + "\n")

    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    from .harness import LosslessLM

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = TaskManager(include_path=str(task_dir))
    for dtype in dtypes:
        lm = LosslessLM(model=model, mode=modes[0], dtype=dtype, attn=attn, head=head, k=k, cycle=cycle,
                        groups=groups, device=device, progress=progress)
        for task in tasks:
            for mode in modes:
                lm.mode = mode
                label = mode_label(mode, cycle)
                run = out / "harness" / run_dir_name(label, dtype)
                run.mkdir(parents=True, exist_ok=True)
                res = lm_eval.simple_evaluate(
                    model=lm, tasks=[task], task_manager=manager, limit=limit, log_samples=True,
                    confirm_run_unsafe_code=confirm_unsafe, apply_chat_template=task in CHAT_TASKS,
                    use_cache=str(out / "cache" / f"{short_name(task)}_{label}_{dtype}"),
                    bootstrap_iters=1000, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
                samples = res.pop("samples", {}).get(task, [])
                atomic_write(run / f"samples_{short_name(task)}.jsonl",
                             jsonl_text(samples, default=handle_non_serializable, ensure_ascii=False))
                res["lossless"] = {"model": model, "mode": label, "cycle": cycle, "dtype": dtype, "attn": attn,
                                   "limit": limit,
                                   "k": k or lm.lm.k, "chat_template": task in CHAT_TASKS, "command": cmd}
                atomic_write(run / f"results_{short_name(task)}.json",
                              json.dumps(res, default=handle_non_serializable, indent=1))
                summarise(out)
    return summarise(out)


# ------------------------------------------------------------------------------------------ summary
def _load_run(path: Path) -> tuple[dict, dict[int, dict]]:
    res = json.loads(path.read_text())
    samples = {}
    sp = path.with_name(path.name.replace("results_", "samples_").replace(".json", ".jsonl"))
    if sp.exists():
        samples = {int(s["doc_id"]): s for s in read_jsonl(sp)}
    return res, samples


def _response(sample: dict) -> str:
    resps = sample.get("resps") or [[""]]
    first = resps[0]
    return first[0] if isinstance(first, list) else str(first)


def summarise(out: str | Path) -> dict:
    """summary.json and report.md from every harness output under `out/harness`."""
    out = Path(out)
    runs: dict[tuple[str, str, str], tuple[dict, dict]] = {}
    rows = []
    commands: list[str] = []
    for path in sorted((out / "harness").glob("*/results_*.json")):
        res, samples = _load_run(path)
        info = res.get("lossless", {})
        task_full = next(iter(res.get("results", {})), None)
        if task_full is None:
            continue
        task = task_full.removeprefix("lossless_")
        metric, score, stderr = _metric(res["results"][task_full])
        runs[(task, info.get("mode"), info.get("dtype"))] = (res, samples)
        if info.get("command") and info["command"] not in commands:
            commands.append(info["command"])
        rows.append({"task": task, "mode": info.get("mode"), "dtype": info.get("dtype"), "attn": info.get("attn"),
                     "metric": metric, "score": score, "stderr": stderr, "n": len(samples)})
    paired = []
    for (task, mode, dtype), (_, or_samples) in sorted(runs.items()):
        if mode == "ar" or (task, "ar", dtype) not in runs:
            continue
        _, ar_samples = runs[(task, "ar", dtype)]
        metric = next(r["metric"] for r in rows if r["task"] == task and r["dtype"] == dtype)
        ids = sorted(set(ar_samples) & set(or_samples))
        if not ids:
            continue
        a = [float(ar_samples[i][metric]) for i in ids]
        b = [float(or_samples[i][metric]) for i in ids]
        boot = paired_bootstrap(a, b, n_boot=5000, seed=0)
        differ = sum(_response(ar_samples[i]) != _response(or_samples[i]) for i in ids)
        changed = sum(x != y for x, y in zip(a, b))
        paired.append({"task": task, "dtype": dtype, "mode": mode, "metric": metric, "n": len(ids),
                       "ar": sum(a) / len(a), "orthrus": sum(b) / len(b), "diff": boot["diff"],
                       "ci95": boot["ci95"], "generations_differ": differ, "score_changed": changed,
                       # when no item changes, the bootstrap interval collapses to [0, 0]; this one does not:
                       # the share of items whose score can change, hence a bound on |diff| for 0/1 metrics
                       "score_changed_ci95": list(wilson_interval(changed, len(ids)))})
    summary = {"results": rows, "paired": paired,
               "environment": {"python": platform.python_version(), "machine": platform.machine(),
                               "processor": platform.processor() or platform.machine()}}
    summary["commands"] = commands  # the commands that wrote the results summarised (all runs: command.txt)
    atomic_write(out / "summary.json", json.dumps(summary, indent=1))
    plot = plot_paired(summary, out / "scores.png")
    atomic_write(out / "report.md", render_table(summary) + (f"\n![AR vs Orthrus]({plot.name})\n" if plot else ""))
    return summary


def plot_paired(summary: dict, path: Path) -> Path | None:
    """AR and Orthrus scores per task and dtype, and the paired difference with its 95% interval."""
    from .report import _new_figure

    rows = summary["paired"]
    if not rows:
        return None
    fig, ax = _new_figure(max(5.0, 1.3 * len(rows) + 2), 4.0)
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["ar"] for r in rows], width=0.4, label="ar", color="#7a9cc6")
    ax.bar([x + 0.2 for x in xs], [r["orthrus"] for r in rows], width=0.4, label="orthrus", color="#e09f5a")
    ax.set_xticks(list(xs), [f"{r['task']}\n{r['dtype']} n={r['n']}" for r in rows])
    ax.set_ylabel("score")
    ax.set_ylim(0, 1.05)
    diff_ax = ax.twinx()
    diff_ax.errorbar(list(xs), [r["diff"] for r in rows],
                     yerr=[[r["diff"] - r["ci95"][0] for r in rows], [r["ci95"][1] - r["diff"] for r in rows]],
                     fmt="ko", capsize=4, label="orthrus - ar, 95% CI")
    diff_ax.axhline(0.0, color="k", lw=0.6, ls=":")
    lim = max(0.1, *(abs(v) for r in rows for v in r["ci95"])) * 1.2
    diff_ax.set_ylim(-lim, lim)
    diff_ax.set_ylabel("difference")
    handles = ax.get_legend_handles_labels()
    extra = diff_ax.get_legend_handles_labels()
    ax.legend(handles[0] + extra[0], handles[1] + extra[1], loc="upper left", fontsize=8)
    ax.set_title("Task scores: AR vs Orthrus (paired bootstrap interval of the difference)")
    fig.savefig(path, dpi=110)
    return path


def render_table(summary: dict) -> str:
    lines = ["# AR vs Orthrus task scores", ""]
    for c in summary.get("commands", []):
        lines += [f"Command: `{c}`", ""]
    lines += ["| task | dtype | metric | n | AR | Orthrus | Orthrus - AR [95% CI] | generations differ "
              "| scores differ [95% CI of the share] |",
              "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for p in summary["paired"]:
        lo, hi = p["ci95"]
        cycle = "" if p.get("mode", "orthrus") == "orthrus" else f" ({p['mode']})"
        lines.append(f"| {p['task']}{cycle} | {p['dtype']} | {p['metric']} | {p['n']} | {p['ar']:.3f} | {p['orthrus']:.3f} "
                     f"| {p['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {p['generations_differ']} "
                     f"| {p['score_changed']} [{p['score_changed_ci95'][0]:.1%}, {p['score_changed_ci95'][1]:.1%}] |")
    lines += ["", "The difference's interval is a paired bootstrap over items (5,000 resamples); it collapses to",
              "[0, 0] when no item's score changes, so the last column also gives a Wilson 95% interval for the",
              "share of items whose score differs between the modes (for 0/1 metrics, a bound on |difference|).",
              "\"generations differ\" counts items whose response text differs.", "",
              "| task | mode | dtype | metric | n | score | stderr |", "|---|---|---|---|---:|---:|---:|"]
    for r in summary["results"]:
        se = f"{r['stderr']:.3f}" if r["stderr"] is not None else "-"
        lines.append(f"| {r['task']} | {r['mode']} | {r['dtype']} | {r['metric']} | {r['n']} | {r['score']:.3f} | {se} |")
    return "\n".join(lines) + "\n"


def parse_dtype_list(text: str) -> list[str]:
    dtypes = [dtype_name(d.strip()) for d in text.split(",") if d.strip()]
    if not dtypes:
        raise LosslessError("--dtypes needs at least one of fp32, bf16, fp16")
    return list(dict.fromkeys(dtypes))
