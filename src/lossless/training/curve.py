"""Learning curves of draft-head training: held-out tokens per cycle against training tokens seen.

Reads one or more training logs (`lossless train --log`, one JSON record per step) and writes, to an
output directory:
- `learning_curve.png`: held-out tokens per cycle (two-pass, greedy) against sequence tokens seen, log
  x axis, one line per log, with each log's fitted trend;
- `learning_curve.md`: per log, a table of every evaluation (step, tokens, loss averaged since the
  previous evaluation, held-out tokens per cycle and the share of cycles accepting at least j drafts,
  top-1 agreement with the teacher by block position),
  and the fitted trend `tokens per cycle = a + b * log10(tokens)` (statsmodels OLS) with its prediction,
  and 95% interval, for ten times the tokens seen so far.

The fit is a description of the points, not a law: with few evaluations its interval is wide, and it
cannot see a ceiling the head has not reached yet.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import LosslessError
from ..jsonio import atomic_write, read_jsonl

METRIC = "heldout_tokens_per_step"
FORCED = "forced_tokens_per_cycle"  # teacher-forced on fixed blocks of held-out sequences, where the run has them


def evaluations(history: list[dict]) -> list[dict]:
    """The evaluation rows of a log: each with the mean loss of the steps since the previous one."""
    rows, losses = [], []
    for rec in history:
        losses.append(rec["loss"])
        if METRIC in rec:
            rows.append({"step": rec["step"], "tokens": rec.get("tokens", 0), "positions": rec.get("positions", 0),
                         "loss": sum(losses) / len(losses), METRIC: rec[METRIC], FORCED: rec.get(FORCED),
                         "agree": rec.get("agree"),
                         "accepted": acceptance(rec.get("heldout_accepted"))})
            losses = []
    return rows


def acceptance(hist: list[int] | None) -> list[float] | None:
    """From drafts accepted per cycle (a histogram), the share of cycles that accepted at least j+1 drafts,
    for each draft position j."""
    if not hist or not sum(hist):
        return None
    total = sum(hist)
    return [sum(hist[j + 1:]) / total for j in range(len(hist) - 1)]


def fit_trend(rows: list[dict]) -> dict | None:
    """OLS of tokens per cycle on log10(tokens); None with fewer than 3 evaluations."""
    points = [(r["tokens"], r[METRIC]) for r in rows if r["tokens"] > 0]
    if len(points) < 3:
        return None
    import numpy as np
    import statsmodels.api as sm

    x = np.log10([p[0] for p in points])
    y = np.array([p[1] for p in points])
    fit = sm.OLS(y, sm.add_constant(x)).fit()
    ten_x = math.log10(points[-1][0] * 10)
    pred = fit.get_prediction(np.array([[1.0, ten_x]])).summary_frame(alpha=0.05)
    return {"a": float(fit.params[0]), "b": float(fit.params[1]), "b_ci95": [float(v) for v in fit.conf_int()[1]],
            "tokens_now": int(points[-1][0]), "tokens_10x": int(points[-1][0] * 10),
            "predicted_10x": float(pred["mean"].iloc[0]),
            "predicted_10x_ci95": [float(pred["obs_ci_lower"].iloc[0]), float(pred["obs_ci_upper"].iloc[0])]}


def write_curve(logs: list[str | Path], out: str | Path, labels: list[str] | None = None) -> dict:
    """Table, fit and plot of the logs into `out`; returns {label: {"evaluations", "trend"}}."""
    from ..plots import new_figure, save_figure

    if not logs:
        raise LosslessError("no training logs given")
    labels = labels or [Path(p).stem if Path(p).stem != "log" else Path(p).parent.name for p in logs]
    curves = {}
    for label, path in zip(labels, logs):
        rows = evaluations(read_jsonl(path, what="training log"))
        if not rows:
            raise LosslessError(f"{path} holds no evaluation yet (train with --eval-every and --eval-prompts)")
        curves[label] = {"evaluations": rows, "trend": fit_trend(rows)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = new_figure(7.0, 4.2)
    for label, c in curves.items():
        rows = [r for r in c["evaluations"] if r["tokens"] > 0]
        line = ax.plot([r["tokens"] for r in rows], [r[METRIC] for r in rows], "o-", label=label)[0]
        t = c["trend"]
        if t:
            xs = [rows[0]["tokens"], t["tokens_10x"]]
            ax.plot(xs, [t["a"] + t["b"] * math.log10(x) for x in xs], ":", color=line.get_color(),
                    label=f"{label}: trend, 10x -> {t['predicted_10x']:.2f}")
        forced = [r for r in rows if r[FORCED] is not None]
        if forced:
            ax.plot([r["tokens"] for r in forced], [r[FORCED] for r in forced], "s--", color=line.get_color(),
                    markersize=4, label=f"{label}: teacher-forced, held-out sequences")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen (sequence tokens)")
    ax.set_ylabel("held-out tokens per cycle (two-pass)")
    ax.set_title("Draft head learning curve")
    ax.legend(fontsize=8)
    save_figure(fig, out / "learning_curve.png")
    atomic_write(out / "learning_curve.md", render(curves))
    return curves


def render(curves: dict) -> str:
    lines = ["# Draft-head learning curve", "",
             "Held-out tokens per cycle: two-pass greedy Orthrus on held-out prompts (fp32), at each evaluation.",
             "Draft j accepted: the share of those cycles that accepted at least j drafts (j = 1..4).",
             "Forced: tokens per cycle teacher-forced on the same blocks of held-out sequences at every evaluation",
             "(the AR view's greedy responses to prompts no head trains on), where the run has them.",
             "Agreement: how often the draft's argmax equals the teacher's, by block position, on the training",
             "blocks since the previous evaluation.", ""]
    for label, c in curves.items():
        lines += [f"## {label}", "", "| step | tokens | loss | tokens/cycle | forced | held-out: draft j accepted | "
                  "training: agreement by position |", "|---:|---:|---:|---:|---:|---|---|"]
        for r in c["evaluations"]:
            agree = " ".join(f"{a:.2f}" for a in r["agree"]) if r["agree"] else ""
            accepted = " ".join(f"{a:.2f}" for a in r["accepted"][:4]) if r["accepted"] else ""
            forced = f"{r[FORCED]:.3f}" if r[FORCED] is not None else ""
            lines.append(f"| {r['step']} | {r['tokens']:,} | {r['loss']:.3f} | {r[METRIC]:.3f} | {forced} | {accepted} "
                         f"| {agree} |")
        t = c["trend"]
        lines.append("")
        if t:
            lines.append(f"Trend: tokens/cycle = {t['a']:.3f} + {t['b']:.3f} x log10(tokens) (slope 95% CI "
                         f"[{t['b_ci95'][0]:.3f}, {t['b_ci95'][1]:.3f}]). At 10x the tokens seen "
                         f"({t['tokens_10x']:,}) it predicts {t['predicted_10x']:.2f} tokens per cycle "
                         f"(95% prediction interval [{t['predicted_10x_ci95'][0]:.2f}, {t['predicted_10x_ci95'][1]:.2f}]).")
        else:
            lines.append("Trend: fewer than 3 evaluations, no fit yet.")
        lines.append("")
    return "\n".join(lines)
