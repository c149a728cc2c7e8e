"""Statistics for the trajectory audit: interval estimates, sequence distances and the match model.

Owns: Wilson intervals for match rates, the first-divergence index and token-level Levenshtein
distance between two token-id lists, the logistic regression `match ~ log_ppl + length + C(domain)`
(statsmodels), and a paired bootstrap for per-item score differences.

Does not know: how trajectories are produced, where records live on disk, or how results are shown.
Records are plain dicts with the audit's field names (`exact_match`, `ref_log_ppl`,
`response_length`, `domain`); everything else is lists of numbers.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% normal quantile

# A fitted probability this close to 0 or 1 means the MLE is running off to infinity (separation).
_SATURATED = 1e-9
# L2 penalty of the fallback fit, per unit variance of each predictor (so it is scale-free).
_RIDGE_ALPHA = 1e-3
_MIN_N = 10


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; `(0.0, 1.0)` when there are no trials."""
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} is outside [0, n={n}]")
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # the bounds are exact at the edges; pin them so rounding never leaves 0 or 1 outside the interval
    lo = 0.0 if successes == 0 else max(0.0, center - half)
    hi = 1.0 if successes == n else min(1.0, center + half)
    return (lo, hi)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where `a` and `b` differ; the shorter length if one is a strict
    prefix of the other; None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    if len(a) == len(b):
        return None
    return min(len(a), len(b))


def levenshtein(a: Sequence[int], b: Sequence[int]) -> int:
    """Token-level edit distance (insertions, deletions, substitutions each cost 1)."""
    if len(a) < len(b):
        a, b = b, a  # keep the rows as short as the shorter sequence
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def bootstrap_mean(values: Sequence[float], n_boot: int = 2000, seed: int = 0) -> dict:
    """Percentile bootstrap of the mean of per-item values: {"mean": ..., "ci95": [lo, hi]}."""
    d = np.asarray(values, dtype=float)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"bootstrap_mean needs a 1-D sequence of at least one value, got shape {d.shape}")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"mean": float(d.mean()), "ci95": [float(lo), float(hi)]}


def paired_bootstrap(a: Sequence[float], b: Sequence[float], n_boot: int = 2000, seed: int = 0) -> dict:
    """Percentile bootstrap of mean(b) - mean(a) for paired per-item scores (items resampled jointly)."""
    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired scores must be two 1-D sequences of equal length, got {x.shape} and {y.shape}")
    if x.size == 0:
        raise ValueError("paired_bootstrap needs at least one item")
    out = bootstrap_mean(y - x, n_boot, seed)
    return {"diff": out["mean"], "ci95": out["ci95"]}


# --- logistic regression -------------------------------------------------------------------------

def _records_frame(records):
    """DataFrame with columns match (0/1), log_ppl, length, domain; rows with a missing field dropped."""
    import pandas as pd

    rows = []
    for r in records:
        match = r.get("exact_match")
        log_ppl = r.get("ref_log_ppl")
        length = r.get("response_length")
        if match is None or log_ppl is None or length is None:
            continue
        if not math.isfinite(float(log_ppl)):
            continue
        rows.append({"match": int(bool(match)), "log_ppl": float(log_ppl), "length": float(length),
                     "domain": str(r.get("domain", "?"))})
    return pd.DataFrame(rows, columns=["match", "log_ppl", "length", "domain"])


def _drop_constant_terms(formula: str, df) -> tuple[str, list[str], list[str]]:
    """Remove right-hand-side terms whose variable takes a single value (they are collinear with the
    intercept). Returns (formula to fit, kept terms, notes on what was dropped)."""
    lhs, rhs = (s.strip() for s in formula.split("~", 1))
    kept, notes = [], []
    for term in (t.strip() for t in rhs.split("+")):
        if not term:
            continue
        m = re.fullmatch(r"C\((\w+)\)", term)
        var = m.group(1) if m else term
        if var in df.columns and df[var].nunique() < 2:
            what = "level" if m else "value"
            notes.append(f"dropped {term}: only one {what} present")
            continue
        kept.append(term)
    return f"{lhs} ~ {' + '.join(kept) if kept else '1'}", kept, notes


def _slopes(names: Sequence[str]) -> list[str]:
    """The plain numeric terms we report (not the intercept, not categorical dummies)."""
    return [n for n in names if n != "Intercept" and not n.startswith("C(") and ":" not in n]


def _coef_table(names, params, bse, z=Z95) -> dict:
    names, params, bse = list(names), np.asarray(params, dtype=float), np.asarray(bse, dtype=float)
    out = {}
    for name in _slopes(names):
        i = names.index(name)
        est, se = float(params[i]), float(bse[i])
        p = math.erfc(abs(est / se) / math.sqrt(2)) if se > 0 else float("nan")
        out[name] = {"estimate": est, "ci95": [est - z * se, est + z * se], "p_value": p}
    return out


def _mle_is_sound(res, warned: list) -> str | None:
    """Why an MLE fit cannot be trusted, or None if it can."""
    from statsmodels.tools.sm_exceptions import PerfectSeparationWarning

    if any(issubclass(w.category, PerfectSeparationWarning) for w in warned):
        return "perfect separation"
    if not np.all(np.isfinite(res.params)) or not np.all(np.isfinite(res.bse)):
        return "non-finite estimates (singular information matrix)"
    p = np.asarray(res.predict())
    if np.any((p < _SATURATED) | (p > 1 - _SATURATED)):
        return "(quasi-)perfect separation: some fitted probabilities are 0 or 1"
    if not res.mle_retvals.get("converged", False):
        return "maximum likelihood did not converge"
    return None


def _ridge_fit(formula: str, df) -> dict:
    """L2-penalised logistic fit (statsmodels GLM elastic net with L1_wt=0), intercept unpenalised and
    each slope penalised per unit variance of its column. Standard errors come from the inverse of the
    penalised information matrix, so the intervals are approximate."""
    import statsmodels.api as sm
    import statsmodels.formula.api as smf

    model = smf.glm(formula, df, family=sm.families.Binomial())
    X = np.asarray(model.exog, dtype=float)
    y = np.asarray(model.endog, dtype=float)
    n = X.shape[0]
    names = list(model.exog_names)
    alpha = np.array([0.0 if nm == "Intercept" else _RIDGE_ALPHA * max(X[:, j].var(), 1e-12)
                      for j, nm in enumerate(names)])
    res = model.fit_regularized(method="elastic_net", alpha=alpha, L1_wt=0.0)
    beta = np.asarray(res.params, dtype=float)
    p = 1.0 / (1.0 + np.exp(-(X @ beta)))
    info = X.T @ (X * (p * (1 - p))[:, None]) + n * np.diag(alpha)
    cov = np.linalg.inv(info)
    bse = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    grad = X.T @ (y - p) / n - alpha * beta  # gradient of the penalised objective; ~0 at the optimum
    eps = 1e-12
    llf = float(np.sum(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)))
    ybar = y.mean()
    llnull = float(n * (ybar * math.log(ybar) + (1 - ybar) * math.log(1 - ybar)))
    return {"coef": _coef_table(names, beta, bse), "converged": bool(np.max(np.abs(grad)) < 1e-4),
            "pseudo_r2": 1.0 - llf / llnull}


def logistic_regression(records, formula: str = "match ~ log_ppl + length + C(domain)") -> dict:
    """Fit P(exact match) on the reference's log response perplexity, response length and domain.

    Columns available to `formula`: match (0/1 from exact_match), log_ppl (ref_log_ppl), length
    (response_length), domain. Terms whose variable is constant (one domain, all lengths equal) are
    dropped and said so in "note". Returns
    {"formula", "n", "method", "coef": {term: {"estimate", "ci95": [lo, hi], "p_value"}}, "converged",
    "pseudo_r2"[, "note"]}; when the MLE separates or is singular, an L2-penalised fit is reported
    instead (method "l2-penalised", see "note"). When no fit is possible the result is
    {"formula", "n", "error": reason}; this function does not raise for data problems.
    """
    import statsmodels.formula.api as smf
    from statsmodels.tools.sm_exceptions import PerfectSeparationError

    df = _records_frame(records)
    n = len(df)
    base = {"formula": formula, "n": n}
    n_match = int(df["match"].sum())
    if n and n_match in (0, n):
        which = "match" if n_match == n else "diverge"
        return {**base, "error": f"all {n} pairs {which}: the outcome does not vary"}
    if n < _MIN_N:
        return {**base, "error": f"too few pairs with perplexity and length recorded (n={n}, need {_MIN_N})"}
    try:
        fit_formula, kept, notes = _drop_constant_terms(formula, df)
    except ValueError as exc:
        return {**base, "error": f"bad formula: {exc}"}
    base["formula"] = fit_formula
    if not kept:
        return {**base, "error": "no predictor varies; " + "; ".join(notes)}
    dropped = len(records) - n
    if dropped:
        notes.append(f"{dropped} records without ref_log_ppl/response_length left out")

    reason = None
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            res = smf.logit(fit_formula, df).fit(disp=0, maxiter=200)
            reason = _mle_is_sound(res, warned)
    except (PerfectSeparationError, np.linalg.LinAlgError) as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'singular'}"
    except Exception as exc:  # patsy/statsmodels raise assorted errors for unusable designs
        return {**base, "error": f"cannot fit: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}

    if reason is None:
        out = {**base, "method": "mle", "coef": _coef_table(res.model.exog_names, res.params, res.bse),
               "converged": True, "pseudo_r2": float(res.prsquared)}
        if notes:
            out["note"] = "; ".join(notes)
        return out

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ridge = _ridge_fit(fit_formula, df)
    except Exception as exc:
        return {**base, "error": f"{reason}; penalised fallback failed too ({type(exc).__name__})"}
    notes.insert(0, f"MLE unusable ({reason}); reporting an L2-penalised fit (alpha={_RIDGE_ALPHA} per unit "
                    "variance), estimates shrunk toward 0, CIs approximate")
    return {**base, "method": "l2-penalised", **ridge, "note": "; ".join(notes)}
