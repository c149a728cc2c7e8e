"""Every configuration against one reference (default fp32 AR), skipped record lines said out loud, one id per
report, and plots written in one step."""

import json

import pytest

from lossless.cli import main
from lossless.errors import LosslessError
from lossless.stats import wilson_interval
from lossless.study.report import write_report

BASE = list(range(100, 120))


def _rec(i, dtype, attn, ar, cand, reference_attn=None):
    domain = "code" if i < 3 else "poetry"
    pid = f"{domain}-{i}"
    ref = reference_attn or attn
    return {"key": f"{pid}|{dtype}|{attn}|{ref}", "prompt_id": pid, "domain": domain, "dtype": dtype, "attn": attn,
            "reference_attn": ref, "k": 8, "max_new_tokens": 20, "ar_ids": ar, "orthrus_ids": cand,
            "exact_match": ar == cand, "first_divergence": None, "levenshtein": 0, "ref_log_ppl": 0.2,
            "response_length": len(ar), "tokens_per_step": 2.0, "ar_seconds": 1.0, "orthrus_seconds": 0.5}


def _parted(at, tail=7):
    return BASE[:at] + [tail] * (len(BASE) - at)


def _records():
    """Six prompts. fp32/sdpa: AR = candidate = BASE. bf16/sdpa: AR parts from fp32 at token 7 on prompts 3-5,
    its candidate also parts at token 3 on prompt 0. bf16/exact: AR = candidate, parting from fp32 at 5 on prompt 5."""
    out = []
    for i in range(6):
        out.append(_rec(i, "fp32", "sdpa", BASE, BASE))
        ar = BASE if i < 3 else _parted(7)
        out.append(_rec(i, "bf16", "sdpa", ar, _parted(3, 9) if i == 0 else ar))
        exact = BASE if i < 5 else _parted(5)
        out.append(_rec(i, "bf16", "exact", exact, exact))
    return out


@pytest.fixture
def run(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return d


def _rows(summary):
    return {c["label"]: c for c in summary["reference_comparison"]["configs"]}


def test_every_configuration_is_compared_with_fp32_ar_by_default(run, tmp_path):
    summary = write_report(run, tmp_path / "out", html=False)
    section = summary["reference_comparison"]
    assert section["reference"] == {"dtype": "fp32", "attn": "sdpa", "label": "fp32/sdpa AR", "n_prompts": 6}
    rows = _rows(summary)
    bf16 = rows["bf16/sdpa"]
    assert (bf16["ar"]["n_equal"], bf16["candidate"]["n_equal"], bf16["n"]) == (3, 2, 6)
    assert bf16["ar"]["ci95"] == list(wilson_interval(3, 6)) and bf16["candidate"]["rate"] == pytest.approx(2 / 6)
    assert bf16["ar"]["mean_common_prefix"] == pytest.approx((20 * 3 + 7 * 3) / 6)
    assert bf16["candidate"]["mean_common_prefix"] == pytest.approx((3 + 20 + 20 + 7 * 3) / 6)
    assert {d["domain"]: d["ar"]["n_equal"] for d in bf16["domains"]} == {"code": 3, "poetry": 0}
    exact = rows["bf16/exact"]
    assert (exact["ar"]["n_equal"], exact["candidate"]["n_equal"]) == (5, 5)
    assert rows["fp32/sdpa"]["is_reference"] and not bf16["is_reference"]
    assert rows["fp32/sdpa"]["candidate"]["rate"] == 1.0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Against one reference: fp32/sdpa AR" in md and "50.0% [" in md and "(the reference)" in md
    assert "reference_match_rate.png" in summary["plots"] and (tmp_path / "out" / "reference_match_rate.png").is_file()


def test_a_chosen_reference_and_one_the_run_lacks(run, tmp_path, capsys):
    rows = _rows(write_report(run, tmp_path / "a", html=False, reference="bf16/exact"))
    assert rows["bf16/exact"]["is_reference"] and rows["fp32/sdpa"]["ar"]["n_equal"] == 5
    with pytest.raises(LosslessError, match="fp16/sdpa: the run has no such AR reference; it has bf16/exact, "
                                            "bf16/sdpa, fp32/sdpa"):
        write_report(run, tmp_path / "b", html=False, reference="fp16/sdpa")
    assert main(["report", str(run), "--out", str(tmp_path / "c"), "--reference", "fp16/sdpa"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "fp16/sdpa" in err and "Traceback" not in err
    assert main(["report", str(run), "--out", str(tmp_path / "d")]) == 0
    assert "against fp32/sdpa AR:" in capsys.readouterr().out


def test_a_run_without_fp32_has_no_reference_section(run, tmp_path):
    no_fp32 = tmp_path / "no-fp32"
    no_fp32.mkdir()
    (no_fp32 / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records() if r["dtype"] != "fp32"))
    summary = write_report(no_fp32, tmp_path / "out", html=False)
    assert summary["reference_comparison"] is None
    assert "Against one reference" not in (tmp_path / "out" / "report.md").read_text()


def test_lines_that_are_not_records_are_counted_and_said(run, tmp_path, capsys):
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    lines.insert(2, "{not json at all\n")
    lines.insert(5, '{"no": "key"}\n')
    (run / "records.jsonl").write_text("".join(lines) + '{"key": "torn')  # a torn last line is not corrupt
    summary = write_report(run, tmp_path / "out", html=False)
    assert summary["corrupt_lines"] == ["records.jsonl:3", "records.jsonl:6"] and summary["n_records"] == 18
    assert "**2 record line(s) could not be read and were skipped**" in (tmp_path / "out" / "report.md").read_text()
    assert main(["report", str(run), "--out", str(tmp_path / "cli")]) == 0
    assert "skipped 2 record line(s)" in capsys.readouterr().err


def test_the_files_of_one_report_carry_one_id_that_follows_the_records(run, tmp_path):
    out = tmp_path / "out"
    summary = write_report(run, out, tokenizer=None)
    rid = summary["report_id"]
    assert len(rid) == 16
    assert json.loads((out / "summary.json").read_text())["report_id"] == rid
    assert rid in (out / "report.md").read_text() and rid in (out / "report.html").read_text()
    assert write_report(run, tmp_path / "again", html=False)["report_id"] == rid  # the same records, the same id
    with (run / "records.jsonl").open("a") as f:
        f.write(json.dumps(_rec(9, "fp32", "sdpa", BASE, BASE)) + "\n")
    assert write_report(run, tmp_path / "more", html=False)["report_id"] != rid


def test_a_plot_that_fails_mid_write_leaves_the_previous_file(run, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    out = tmp_path / "out"
    write_report(run, out, html=False)
    before = (out / "config_match_rate.png").read_bytes()

    def half_then_fail(self, target, **kw):
        target.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    with pytest.raises(OSError):
        write_report(run, out, html=False)
    assert (out / "config_match_rate.png").read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_exact_rows_of_different_kernel_builds_are_named_not_pooled(tmp_path):
    records = []
    for i in range(6):
        records.append(_rec(i, "fp32", "sdpa", BASE, BASE))
        new = _rec(i, "bf16", "exact", BASE, BASE)
        if i >= 2:  # prompts 2-5 decoded again by today's kernels; prompts 0-1 only by earlier ones
            new = {**new, "kernels": "1a2b3c4d5e6f/avx512bf16", "reference_kernels": "1a2b3c4d5e6f/avx2"}
        records.append(new)
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_report(run, tmp_path / "out", tokenizer=None)
    labels = {c["label"]: c["n"] for c in summary["configs"]}
    # the variant (avx512bf16 or avx2) changes no bit, so it does not split; the source digest does
    assert labels == {"bf16/exact (earlier kernels)": 2, "bf16/exact (kernels 1a2b3c4d)": 4, "fp32/sdpa": 6}
    assert summary["kernel_versions"] == ["bf16/exact holds records of 2 kernel builds (1a2b3c4d, earlier kernels), "
                                          "reported separately"]
    assert "Not pooled: bf16/exact holds records of 2 kernel builds" in (tmp_path / "out" / "report.md").read_text()
    assert "bf16/exact (kernels 1a2b3c4d)" in (tmp_path / "out" / "report.html").read_text()
    # one build only: the names stay as they were
    one = tmp_path / "one"
    one.mkdir()
    (one / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["prompt_id"][-1] in "2345"))
    assert {c["label"] for c in write_report(one, tmp_path / "out1", html=False)["configs"]} == {"bf16/exact",
                                                                                                   "fp32/sdpa"}
