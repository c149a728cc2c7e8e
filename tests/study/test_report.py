"""The audit report: shard merging, the summary's numbers, report.md and plots from a fake run dir."""

import json
import math

import pytest

from lossless.errors import LosslessError
from lossless.study.report import config_label, load_run, write_report

# bf16 outcomes per prompt (prompts 0-3 are math_word, 4-7 poetry): 3 of 8 match
BF16_MATCH = [True, False, True, False, False, True, False, False]


def _record(i, dtype, match, attn="sdpa", reference_attn="sdpa"):
    domain = "math_word" if i < 4 else "poetry"
    pid = f"{domain}-{i:03d}"
    ar = list(range(20))
    orth = ar if match else ar[:10] + [99] * 10
    return {"key": f"{pid}|{dtype}|{attn}", "prompt_id": pid, "domain": domain, "dtype": dtype, "attn": attn,
            "reference_attn": reference_attn, "k": 8, "max_new_tokens": 128, "ar_ids": ar, "orthrus_ids": orth,
            "exact_match": match, "first_divergence": None if match else 10 * (i + 1),
            "levenshtein": 0 if match else 5,
            "ref_margin_at_divergence": None if match else [0.0, 0.0625, 0.125, 2.0, 8.0][i % 5],
            "orthrus_margin_at_divergence": None, "ref_log_ppl": 0.1 if match else 0.3,
            "response_length": 20, "accepted": [3, 2], "tokens_per_step": 2.0 + 0.5 * (i % 2),
            "ar_forwards": 20, "orthrus_forwards": 9, "ar_seconds": 1.0, "orthrus_seconds": 0.5}


def _lines(recs):
    return "".join(json.dumps(r) + "\n" for r in recs)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    shard0 = [_record(i, "bf16", BF16_MATCH[i]) for i in range(6)] + [_record(i, "fp32", True) for i in range(4)]
    # shard 1 repeats prompts 4 and 5 with the opposite outcome: the first occurrence (shard 0) must win
    shard1 = ([_record(i, "bf16", not BF16_MATCH[i]) for i in (4, 5)]
              + [_record(i, "bf16", BF16_MATCH[i]) for i in (6, 7)]
              + [_record(i, "fp32", True) for i in range(4, 8)])
    (d / "records.shard-0-of-2.jsonl").write_text(_lines(shard0))
    torn = json.dumps(_record(0, "fp16", False))[:57]  # a write interrupted mid-line
    (d / "records.shard-1-of-2.jsonl").write_text(_lines(shard1) + torn)
    (d / "run.json").write_text(json.dumps({"planned": 24, "command": "lossless audit --out run",
                                            "config": {"model": "tiny", "k": 8}}))
    return d


def test_load_run_merges_shards_drops_duplicates_and_torn_line(run_dir):
    records, info = load_run(run_dir)
    keys = [r["key"] for r in records]
    assert len(keys) == len(set(keys)) == 16
    assert info["planned"] == 24
    by_key = {r["key"]: r for r in records}
    assert by_key["poetry-004|bf16|sdpa"]["exact_match"] is BF16_MATCH[4]
    assert by_key["poetry-005|bf16|sdpa"]["exact_match"] is BF16_MATCH[5]
    assert not any(r["dtype"] == "fp16" for r in records)


def test_write_report_files_and_summary_schema(run_dir, tmp_path):
    out = tmp_path / "report"
    summary = write_report(run_dir, out)
    assert (out / "report.md").is_file()
    assert (out / "config_match_rate.png").stat().st_size > 0
    assert (out / "domain_match_rate.png").stat().st_size > 0
    for name in summary["plots"]:
        assert (out / name).is_file()
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    assert set(summary) >= {"n_records", "planned", "configs", "domains", "regression", "ppl", "replication"}
    assert summary["n_records"] == 16 and summary["planned"] == 24
    for c in summary["configs"]:
        assert set(c) >= {"dtype", "attn", "reference_attn", "n", "exact_match_rate", "ci95",
                          "mean_tokens_per_step", "mean_first_divergence", "mean_levenshtein"}
    for rows in summary["domains"].values():
        for d in rows:
            assert set(d) == {"domain", "n", "exact_match_rate", "ci95", "mean_first_divergence",
                              "mean_tokens_per_step"}
    assert set(summary["ppl"]["bf16/sdpa"]) >= {"matching_mean_ppl", "diverging_mean_ppl"}
    assert summary["replication"]["bf16_exact_match"]["authors_checkpoint"]["rate"] == 0.45


def test_summary_rates_match_hand_computed_values(run_dir):
    summary = write_report(run_dir)
    configs = {c["label"]: c for c in summary["configs"]}
    assert set(configs) == {"bf16/sdpa", "fp32/sdpa"}
    bf16, fp32 = configs["bf16/sdpa"], configs["fp32/sdpa"]
    assert bf16["n"] == 8 and bf16["exact_match_rate"] == pytest.approx(3 / 8)
    assert bf16["ci95"] == pytest.approx([0.1368, 0.6943], abs=1e-4)  # Wilson 3/8
    assert bf16["mean_first_divergence"] == pytest.approx((20 + 40 + 50 + 70 + 80) / 5)
    assert bf16["mean_levenshtein"] == pytest.approx(5 * 5 / 8)
    assert bf16["mean_tokens_per_step"] == pytest.approx(2.25)
    assert fp32["n"] == 8 and fp32["exact_match_rate"] == 1.0 and fp32["mean_first_divergence"] is None
    domains = {d["domain"]: d for d in summary["domains"]["bf16/sdpa"]}
    assert domains["math_word"]["exact_match_rate"] == pytest.approx(0.5)
    assert domains["poetry"]["exact_match_rate"] == pytest.approx(0.25)
    assert domains["poetry"]["n"] == 4
    ppl = summary["ppl"]["bf16/sdpa"]
    assert ppl["matching_mean_ppl"] == pytest.approx(math.exp(0.1))
    assert ppl["diverging_mean_ppl"] == pytest.approx(math.exp(0.3))
    assert summary["ppl"]["fp32/sdpa"]["diverging_mean_ppl"] is None
    # too few pairs / no variation: reported, not raised
    assert "error" in summary["regression"]["bf16/sdpa"]
    assert "all 8 pairs match" in summary["regression"]["fp32/sdpa"]["error"]


def test_report_markdown_shows_progress_tables_and_published_figures(run_dir):
    write_report(run_dir)
    md = (run_dir / "report.md").read_text()
    assert "16 of 24 planned pairs done" in md
    assert "37.5% [13.7, 69.4]" in md
    assert "45% ± 3%" in md and "43% ± 3%" in md and "-8.1 [-10.5, -5.7]" in md and "1.28" in md
    assert "![" in md and "config_match_rate.png" in md
    assert "Not fit" in md


def test_report_without_run_json_counts_pairs(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "records.jsonl").write_text(_lines([_record(i, "bf16", BF16_MATCH[i], reference_attn="eager")
                                             for i in range(8)]))
    summary = write_report(d)
    assert summary["planned"] is None
    assert [c["label"] for c in summary["configs"]] == [config_label("bf16", "sdpa", "eager")]
    assert "8 pairs." in (d / "report.md").read_text()


def test_missing_or_empty_run_dir_raises_lossless_error(tmp_path):
    with pytest.raises(LosslessError, match="does not exist"):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LosslessError, match="no records"):
        write_report(tmp_path / "empty")


def test_plots_without_divergences_are_skipped(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "records.jsonl").write_text(_lines([_record(i, "fp32", True) for i in range(8)]))
    summary = write_report(d)
    assert "config_match_rate.png" in summary["plots"] and "domain_match_rate.png" in summary["plots"]
    assert "ref_margin_at_divergence.png" not in summary["plots"]
    assert "first_divergence.png" not in summary["plots"]
    assert not (d / "first_divergence.png").exists()


def _exact_mode_records(i, sdpa_reference_reused):
    """One exact-mode candidate run of prompt i, as `audit_prompt` records it: one record per reference
    kernel (exact AR, stock-SDPA AR), both carrying the run's seconds."""
    own = {**_record(i, "bf16", True, attn="exact", reference_attn="exact"), "ar_seconds": 2.0,
           "orthrus_seconds": 0.75, "reference_reused": False}
    vs_sdpa = {**_record(i, "bf16", False, attn="exact", reference_attn="sdpa"), "ar_seconds": 1.0,
               "orthrus_seconds": 0.75, "reference_reused": sdpa_reference_reused}
    vs_sdpa["key"] += "|ref-sdpa"
    return [own, vs_sdpa]


def _hours(summary):
    return {c["label"]: round(c["compute_hours"] * 3600, 9) for c in summary["configs"]}


def test_an_exact_mode_runs_time_is_counted_once_and_a_reused_reference_not_again(tmp_path):
    """The full study's shape: bf16/sdpa pairs compute the stock AR reference, the exact-mode item reuses
    it and computes exact AR. Per prompt: stock AR 1.0 s + its candidate 0.5 s + exact AR 2.0 s + the exact
    candidate 0.75 s, counted once each."""
    d = tmp_path / "run"
    d.mkdir()
    recs = [{**_record(i, "bf16", True), "reference_reused": False} for i in range(4)]
    recs += [r for i in range(4) for r in _exact_mode_records(i, sdpa_reference_reused=True)]
    (d / "records.jsonl").write_text(_lines(recs))
    summary = write_report(d)
    assert _hours(summary) == {"bf16/sdpa": 4 * 1.5, "bf16/exact": 4 * 2.75, "bf16/exact vs AR-sdpa": 0.0}
    configs = {c["label"]: c for c in summary["configs"]}
    assert configs["bf16/exact"]["mean_seconds_per_pair"] == pytest.approx(2.75)
    assert configs["bf16/exact vs AR-sdpa"]["mean_seconds_per_pair"] == 0.0
    assert sum(_hours(summary).values()) == 4 * (1.0 + 0.5 + 2.0 + 0.75)


def test_an_exact_mode_run_that_computed_the_stock_reference_counts_it_where_it_was_compared(tmp_path):
    """`make exact-fast`'s shape: no stock configuration, so each exact item computes stock AR itself."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "records.jsonl").write_text(_lines([r for i in range(3) for r in _exact_mode_records(i, False)]))
    summary = write_report(d)
    assert _hours(summary) == {"bf16/exact": 3 * 2.75, "bf16/exact vs AR-sdpa": 3 * 1.0}


def test_a_reference_several_candidates_share_is_counted_once_even_unflagged(tmp_path):
    """Early candidate records did not mark the reference reused after the first candidate: the same
    computation (same prompt, dtype, kernel, machine) must not be summed once per candidate."""
    d = tmp_path / "run"
    d.mkdir()
    recs = []
    for i in range(2):
        for cand in ("oracle", "prompt-lookup"):
            r = {**_record(i, "bf16", True), "candidate": cand, "machine": "m", "reference_reused": False,
                 "ar_seconds": 3.0, "orthrus_seconds": 0.25}
            r["key"] += f"|{cand}"
            recs.append(r)
    (d / "records.jsonl").write_text(_lines(recs))
    summary = write_report(d)
    assert sum(_hours(summary).values()) == 2 * (3.0 + 2 * 0.25)
    # another machine's computation of the same reference is its own cost
    recs[1]["machine"] = "other"
    (d / "records.jsonl").write_text(_lines(recs))
    assert sum(_hours(write_report(d)).values()) == 2 * (3.0 + 2 * 0.25) + 3.0


@pytest.mark.parametrize("content", [b'{"planned": 24, "comm', b"[1, 2]", b"\xff\xfe{"],
                         ids=["torn", "not-an-object", "not-utf8"])
def test_a_torn_run_json_is_a_one_line_error_naming_it(run_dir, capsys, content):
    """A missing run.json is allowed (old runs); a broken one is not silently read as {}."""
    from lossless.cli import main

    (run_dir / "run.json").write_bytes(content)
    with pytest.raises(LosslessError, match="run.json in .* is not"):
        load_run(run_dir)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(run_dir) in err and "run.json" in err and "lossless audit" in err


def test_summary_is_rebuilt_byte_for_byte_whatever_files_hold_the_records(run_dir, tmp_path):
    """The same records, split differently across writers and compressed segments, give the same bytes."""
    import gzip
    import random

    records, info = load_run(run_dir)
    first = write_report(run_dir, tmp_path / "a")
    other = tmp_path / "other"
    (other / "records").mkdir(parents=True)
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    half = len(shuffled) // 2
    (other / "records" / "m1.20260101T000000.jsonl.gz").write_bytes(gzip.compress(_lines(shuffled[:half]).encode()))
    (other / "records" / "m2.jsonl").write_text(_lines(shuffled[half:]))
    (other / "run.json").write_text((run_dir / "run.json").read_text())
    second = write_report(other, tmp_path / "b")
    assert first == second
    assert (tmp_path / "a" / "summary.json").read_bytes() == (tmp_path / "b" / "summary.json").read_bytes()


def test_the_at_rest_report_first_rolls_what_a_killed_writer_left_in_its_plain_file(run_dir, tmp_path, capsys):
    """`lossless report --at-rest` (what `make study-report` runs before a commit) counts every record: a
    rank killed before its last roll leaves them in its plain file, and they are rolled into a segment."""
    import gzip

    from lossless.cli import main

    records, _ = load_run(run_dir)
    other = tmp_path / "other"
    (other / "records").mkdir(parents=True)
    (other / "run.json").write_text((run_dir / "run.json").read_text())
    (other / "records" / "shard-0-of-2.20260101T000000.jsonl.gz").write_bytes(gzip.compress(_lines(records[:3]).encode()))
    (other / "records" / "shard-1-of-2.jsonl").write_text(_lines(records[3:]))
    assert main(["report", str(other), "--at-rest", "--out", str(tmp_path / "out")]) == 0
    assert "rolled unrolled records" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["n_records"] == len(records) and (other / "records" / "shard-1-of-2.jsonl").read_text() == ""
    assert len(summary["record_segments"]) == 2


# Numbers from the logistic-regression fits go through BLAS, whose last digits depend on the CPU (another
# machine's rebuild differed at the 16th significant digit); everything else is plain Python arithmetic on
# the records and must match exactly: counts, rates, intervals of rates, decisions, texts.
FIT_SECTIONS = ("regression",)
FIT_REL_TOL = 1e-6


def _differences(rebuilt, committed, path="", fit=False):
    """Paths where `rebuilt` and `committed` (parsed JSON) differ: exactly, except floats inside a fit."""
    if isinstance(committed, dict) and isinstance(rebuilt, dict):
        if rebuilt.keys() != committed.keys():
            return [f"{path}: keys {sorted(rebuilt.keys() ^ committed.keys())}"]
        return [d for k in committed for d in
                _differences(rebuilt[k], committed[k], f"{path}/{k}", fit or (not path and k in FIT_SECTIONS))]
    if isinstance(committed, list) and isinstance(rebuilt, list):
        if len(rebuilt) != len(committed):
            return [f"{path}: length {len(rebuilt)} vs {len(committed)}"]
        return [d for i, (a, b) in enumerate(zip(rebuilt, committed)) for d in _differences(a, b, f"{path}/{i}", fit)]
    if fit and type(committed) is float and type(rebuilt) is float:
        return [] if math.isclose(rebuilt, committed, rel_tol=FIT_REL_TOL, abs_tol=1e-300) else [
            f"{path}: {rebuilt!r} vs {committed!r} (beyond relative {FIT_REL_TOL})"]
    return [] if type(rebuilt) is type(committed) and rebuilt == committed else [f"{path}: {rebuilt!r} vs {committed!r}"]


def test_fit_numbers_may_move_in_their_last_digits_but_nothing_else_may():
    committed = {"n": 3, "rate": 0.5, "regression": {"m": {"coef": [-3.708044924379725, 1e-19], "converged": True}}}
    moved = json.loads(json.dumps(committed))
    moved["regression"]["m"]["coef"] = [-3.708044924379724, 1.0000000000001e-19]
    assert _differences(moved, committed) == []
    for change in ({"rate": 0.5000000000000001}, {"n": 4}, {"n": 3.0},
                   {"regression": {"m": {"coef": [-3.71, 1e-19], "converged": True}}},
                   {"regression": {"m": {"coef": [-3.708044924379725, 1e-19], "converged": False}}}):
        assert _differences({**committed, **change}, committed), change


def test_the_committed_study_summary_is_rebuilt_from_its_records(tmp_path):
    """From the segments the committed summary names (a running study may have rolled newer ones since):
    exactly, but for the last digits of the regression fits (see `FIT_SECTIONS`)."""
    import shutil

    from lossless.paths import REPO_ROOT

    study = REPO_ROOT / "results" / "full-study"
    committed = (study / "summary.json").read_bytes()
    segments = json.loads(committed)["record_segments"]
    assert segments, "the study's records are committed under results/full-study/records"
    copy = tmp_path / "study"
    (copy / "records").mkdir(parents=True)
    shutil.copy(study / "run.json", copy / "run.json")
    for name in segments:
        shutil.copy(study / "records" / name, copy / "records" / name)
    notes = json.loads(committed).get("backfill_segments", [])  # top tokens decoded again after the audit
    (copy / "backfill").mkdir()
    for name in notes:
        shutil.copy(study / "backfill" / name, copy / "backfill" / name)
    write_report(copy, tmp_path / "out", at_rest=True)
    rebuilt = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert _differences(rebuilt, json.loads(committed)) == []


def test_report_counts_flips_where_the_two_tokens_trade_places(tmp_path):
    """Of the diverging pairs whose both sides' top tokens are known, the report counts those where the
    candidate's token is the reference's runner-up and the reference's token the candidate's, tied logits in
    either place; pairs with a side unknown, or a single top token, are left out."""
    d = tmp_path / "run"
    d.mkdir()
    # every pair parts at token 10: the reference decodes 10 there, the candidate 99
    tops = [([[10, 3.0], [99, 2.9]], [[99, 3.1], [10, 3.0]]),               # they trade places
            ([[99, 3.0], [10, 3.0]], [[99, 3.1], [10, 3.0], [7, 1.0]]),     # a tie the reference broke its way
            ([[10, 3.0], [99, 2.9]], [[99, 3.1], [8, 3.05], [10, 3.0]]),    # the candidate's runner-up is new
            ([[10, 3.0], [7, 2.95], [99, 2.9]], [[99, 3.1], [10, 3.0]]),   # 99 is the reference's third
            ([[10, 3.0], [7, 2.9]], [[99, 3.1], [10, 3.0]]),                # 99 is not among the reference's
            ([[10, 3.0], [99, 2.9]], None),                                 # the candidate's side unknown
            ([[10, 3.0]], [[99, 3.1], [10, 3.0]]),                          # one top token of the reference's
            ([[10, 3.0], [99, 2.9]], [[99, 3.1], [10, 3.0]])]               # the candidate ended before (below)
    recs = []
    for i, (ref, cand) in enumerate(tops):
        r = _record(i, "bf16", False)
        r.update(first_divergence=10, ref_top_at_divergence=ref, orthrus_top_at_divergence=cand)
        recs.append(r)
    recs[-1]["orthrus_ids"] = recs[-1]["orthrus_ids"][:10]
    recs += [_record(i, "bf16", True) for i in range(8, 10)]
    (d / "records.jsonl").write_text(_lines(recs))
    (d / "run.json").write_text(json.dumps({"planned": 10, "config": {"model": "tiny", "k": 8}}))
    summary = write_report(d, tmp_path / "report", html=False, tokenizer=None)
    (bf16,) = summary["configs"]
    margins = bf16["margin_at_divergence"]
    assert margins["n_diverging"] == 8 and margins["n_tops_known"] == 5 and margins["trade_places"] == 2
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Where pairs part" in text
    row = next(line for line in text.splitlines() if line.startswith("| orthrus | bf16/sdpa |"))
    assert "| 2/5 |" in row
