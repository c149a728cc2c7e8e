"""The `lossless eval` summary: read a directory's harness outputs, pair AR with Orthrus, write
summary.json, report.md, scores.png and report.html (the items whose generations differ, side by side).

Owns: reading `harness/<mode>_<dtype>/results_<task>.json` and `samples_<task>.jsonl`, picking a task's
main metric, pairing each Orthrus run with the AR run of the same task and dtype item by item, the
summary schema, the markdown layout and the plot.

Does not know: how the outputs were made (lm-evaluation-harness, its cache, the decoding modes, which
command or process wrote which file; that is `run.py`), how tasks are scored (`tasks.py`),
or any statistics beyond calling `lossless.stats`. It reads files only, so a directory can be summarised
again at any time (`run_eval` does so after every run).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from ..errors import LosslessError
from ..study.htmlreport import write_eval_html
from ..jsonio import atomic_write, read_jsonl
from ..stats import paired_bootstrap, wilson_interval


def _metric(result: dict) -> tuple[str, float, float | None]:
    """The task's main metric from a harness results entry: (name, value, stderr)."""
    for key, value in result.items():
        if "," in key and not key.split(",")[0].endswith("_stderr") and isinstance(value, (int, float)):
            name, filt = key.split(",", 1)
            stderr = result.get(f"{name}_stderr,{filt}")
            return name, float(value), float(stderr) if isinstance(stderr, (int, float)) else None
    raise LosslessError(f"no metric in harness results: {sorted(result)}")


def _load_run(path: Path) -> tuple[dict, dict[int, dict]]:
    """A harness results file and its samples (by doc_id; none when the samples file is missing)."""
    res = json.loads(path.read_text())
    samples = {}
    sp = path.with_name(path.name.replace("results_", "samples_").replace(".json", ".jsonl"))
    if sp.exists():
        samples = {int(s["doc_id"]): s for s in read_jsonl(sp)}
    return res, samples


def _prompt(sample: dict) -> str:
    """The text the model was given for an item (the first request's context)."""
    args = sample.get("arguments") or [[""]]
    first = args[0] if isinstance(args, list) and args else ""
    return str(first[0] if isinstance(first, (list, tuple)) and first else first)


def _response(sample: dict) -> str:
    resps = sample.get("resps") or [[""]]
    first = resps[0]
    return first[0] if isinstance(first, list) else str(first)


def summarise(out: str | Path) -> dict:
    """summary.json, report.md and scores.png from every harness output under `out/harness`; returns
    the summary."""
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
    paired, items = [], []
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
        differing = [i for i in ids if _response(ar_samples[i]) != _response(or_samples[i])]
        differ = len(differing)
        items += [{"key": f"{task}|{dtype}|{mode}|{i}", "task": task, "dtype": dtype, "mode": mode, "doc_id": i,
                   "prompt": _prompt(ar_samples[i]), "target": str(ar_samples[i].get("target", "")),
                   "ar": _response(ar_samples[i]), "orthrus": _response(or_samples[i]),
                   "ar_score": float(ar_samples[i][metric]), "orthrus_score": float(or_samples[i][metric])}
                  for i in differing]
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
    markdown = render_table(summary) + (f"\n![AR vs Orthrus]({plot.name})\n" if plot else "")
    atomic_write(out / "report.md", markdown)
    notes = [] if runs and all(samples for _, samples in runs.values()) else [
        "Some runs have no samples file (samples_<task>.jsonl): their items cannot be compared here."]
    write_eval_html(out, markdown, [(plot.name, "AR vs Orthrus")] if plot else [], items, notes)
    return summary


def plot_paired(summary: dict, path: Path) -> Path | None:
    """AR and Orthrus scores per task and dtype, and the paired difference with its 95% interval."""
    from ..plots import new_figure, save_figure

    rows = summary["paired"]
    if not rows:
        return None
    fig, ax = new_figure(max(5.0, 1.3 * len(rows) + 2), 4.0)
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
    save_figure(fig, path)
    return path


def render_table(summary: dict) -> str:
    """report.md's text (without the plot): the paired AR/Orthrus table, then every run's score."""
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
