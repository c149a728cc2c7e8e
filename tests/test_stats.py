"""Statistics of the audit: Wilson intervals, sequence distances, the match regression, paired bootstrap."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossless.stats import first_divergence, levenshtein, logistic_regression, paired_bootstrap, wilson_interval


@pytest.mark.parametrize("k, n, lo, hi", [
    (45, 100, 0.3561, 0.5475),
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (5, 10, 0.2366, 0.7634),
])
def test_wilson_interval_known_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)


def test_wilson_interval_edges_are_exact_and_empty_is_uninformative():
    assert wilson_interval(0, 7)[0] == 0.0
    assert wilson_interval(7, 7)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 3], None),
    ([], [], None),
    ([], [4], 0),
    ([1, 2], [1, 2, 3], 2),
    ([1, 2, 3], [1, 2], 2),
    ([1, 9, 3], [1, 2, 3], 1),
    ([5], [6], 0),
])
def test_first_divergence_edge_cases(a, b, expected):
    assert first_divergence(a, b) == expected


@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 3], 0),
    ([], [], 0),
    ([], [1, 2, 3], 3),
    ([1, 2], [1, 2, 3, 4], 2),
    ([1, 2, 3], [1, 7, 3], 1),
    ([1, 2, 3], [1, 2, 9, 3], 1),
    ([1, 2, 3, 4], [2, 3, 4, 5], 2),
])
def test_levenshtein_edge_cases(a, b, expected):
    assert levenshtein(a, b) == expected


tokens = st.lists(st.integers(0, 5), max_size=12)


@settings(max_examples=200, deadline=None)
@given(tokens, tokens)
def test_levenshtein_is_a_bounded_symmetric_distance(a, b):
    d = levenshtein(a, b)
    assert d == levenshtein(b, a)
    assert (d == 0) == (a == b)
    assert abs(len(a) - len(b)) <= d <= max(len(a), len(b))
    fd = first_divergence(a, b)
    assert (fd is None) == (a == b)


def _synthetic_records(n=600, coef=-8.0, intercept=1.0, seed=0):
    """match ~ Bernoulli(logistic(coef * log_ppl + intercept)); length and domain carry no effect."""
    rng = np.random.default_rng(seed)
    domains = ["code", "poetry", "math_word"]
    recs = []
    for i in range(n):
        log_ppl = float(rng.exponential(0.15))
        p = 1.0 / (1.0 + math.exp(-(coef * log_ppl + intercept)))
        recs.append({"exact_match": bool(rng.random() < p), "ref_log_ppl": log_ppl,
                     "response_length": int(rng.integers(16, 129)), "domain": domains[i % 3]})
    return recs


def test_logistic_regression_recovers_planted_log_ppl_effect():
    res = logistic_regression(_synthetic_records())
    assert "error" not in res, res
    assert res["n"] == 600 and res["converged"] and res["method"] == "mle"
    lp = res["coef"]["log_ppl"]
    lo, hi = lp["ci95"]
    assert lp["estimate"] < 0 and hi < 0
    assert lo <= -8 <= hi or -12 < lp["estimate"] < -5.3
    assert lp["p_value"] < 1e-6
    assert set(res["coef"]) == {"log_ppl", "length"}
    assert 0 < res["pseudo_r2"] < 1


def test_logistic_regression_reports_error_when_all_pairs_match():
    recs = _synthetic_records(n=50)
    for r in recs:
        r["exact_match"] = True
    res = logistic_regression(recs)
    assert set(res) == {"formula", "n", "error"}
    assert "match" in res["error"]


def test_logistic_regression_reports_error_when_too_few_pairs():
    res = logistic_regression(_synthetic_records(n=5))
    assert "error" in res and res["n"] == 5


def test_logistic_regression_drops_constant_terms_and_single_domain():
    recs = _synthetic_records(n=200, seed=1)
    for r in recs:
        r["domain"], r["response_length"] = "code", 128
    res = logistic_regression(recs)
    assert res["formula"] == "match ~ log_ppl"
    assert "C(domain)" in res["note"] and "length" in res["note"]
    assert res["coef"]["log_ppl"]["estimate"] < 0


def test_logistic_regression_falls_back_to_penalised_fit_on_separation():
    recs = _synthetic_records(n=300, seed=2)
    for r in recs:
        if r["domain"] == "code":
            r["exact_match"] = True  # a domain that always matches separates its dummy
    res = logistic_regression(recs)
    assert "error" not in res, res
    assert res["method"] == "l2-penalised" and "separation" in res["note"]
    assert res["coef"]["log_ppl"]["estimate"] < 0
    assert all(math.isfinite(v) for v in res["coef"]["log_ppl"]["ci95"])


def test_paired_bootstrap_covers_planted_difference():
    rng = np.random.default_rng(0)
    a = rng.normal(0.0, 1.0, 400)
    b = a + 0.3 + rng.normal(0.0, 0.5, 400)
    res = paired_bootstrap(a, b, n_boot=2000, seed=1)
    lo, hi = res["ci95"]
    assert res["diff"] == pytest.approx(float(np.mean(b) - np.mean(a)))
    assert lo <= 0.3 <= hi and lo > 0


def test_paired_bootstrap_includes_zero_without_difference():
    rng = np.random.default_rng(3)
    a = rng.normal(0.0, 1.0, 300)
    b = a + rng.normal(0.0, 0.5, 300)
    lo, hi = paired_bootstrap(a, b, seed=0)["ci95"]
    assert lo < 0 < hi


def test_paired_bootstrap_is_seeded_and_rejects_unpaired_input():
    a, b = [0, 1, 0, 1, 1], [1, 1, 1, 0, 1]
    assert paired_bootstrap(a, b, seed=5) == paired_bootstrap(a, b, seed=5)
    with pytest.raises(ValueError):
        paired_bootstrap([1, 2], [1, 2, 3])
