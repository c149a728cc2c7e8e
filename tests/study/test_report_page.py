"""report.html in a real browser: Debian's Chromium driven by Playwright, on pages of small real audits (tiny
random models) and on the committed full study's page. The page loads from disk with no console errors and no
network, filters and sorting change the rows, a permalink opens its pair with both diverging tokens marked, runs
with no divergences or only fp32 render, and a torn or empty run gives a page or a one-line error.

Without a Chromium these tests skip, except where LOSSLESS_BROWSER_TESTS=required (CI sets it): there they fail."""

import base64
import gzip
import json
import os
import shutil
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from conftest import tiny_tokenizer
from lossless.study import htmlreport
from lossless.study.audit import run_audit
from lossless.cli import main
from lossless.study.report import write_report
from lossless.study.records import read_records
from test_audit import config, tiny_loader, write_suite

REPO = Path(__file__).resolve().parents[2]
SAMPLER = '''
from lossless.decoding.loop import DecodeConfig, decode
from lossless.decoding.sampling import SamplingConfig


def hot(model, prompt_ids, max_new_tokens):
    """Sampling at temperature 2: a decoder that parts from greedy decoding."""
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=2.0, seed=0))
    return decode(model, prompt_ids, "ar", cfg).generated
'''
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str | None:
    return os.environ.get("LOSSLESS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    path = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        path = None
    if path is None:
        if os.environ.get("LOSSLESS_BROWSER_TESTS") == "required":
            pytest.fail("browser tests are required here, but Chromium or Playwright is missing")
        pytest.skip("no Chromium (apt-get install chromium) or no Playwright (pip install playwright)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """One opened report.html: the page, the console errors it logged and the requests it made."""

    def __init__(self, browser, path: Path, fragment: str = ""):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.resolve().as_uri() + (f"#{fragment}" if fragment else ""))
        self.page.wait_for_selector("body[data-ready='1']", timeout=60_000)

    def rows(self) -> list[list[str]]:
        return self.page.eval_on_selector_all("#pairs tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")

    def count(self) -> str:
        return self.page.inner_text("#count")

    def close(self):
        self.page.close()


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """A real audit of six prompts in fp32 and bf16 with Orthrus and a sampling decoder, and its report."""
    import sys

    tmp = tmp_path_factory.mktemp("page")
    (tmp / "hot_decoders.py").write_text(SAMPLER)
    sys.path.insert(0, str(tmp))
    try:
        suite = write_suite(tmp / "s.jsonl")
        out = tmp / "run"
        run_audit(config(suite, candidates=["orthrus", "hot_decoders:hot"]), out, load=tiny_loader, progress=False)
    finally:
        sys.path.remove(str(tmp))
    write_report(out, tokenizer=tiny_tokenizer())
    records = read_records(out)
    assert any(not r["exact_match"] for r in records)  # the sampler parts from greedy decoding somewhere
    return out, records


def _key_fragment(key: str) -> str:
    return urllib.parse.quote(key, safe="")


# ---- the page's data, without a browser -----------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), max_size=30))
def test_rejoin_finds_the_first_common_run_after_the_divergence(a, b):
    div = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    found = htmlreport.rejoin(a, b, div, min_run=3)
    if div is None:
        assert found is None
        return
    if found is not None:
        i, j, n = found
        assert i >= div and j >= div and n >= 3 and a[i:i + n] == b[j:j + n]
    else:  # no run of 3 equal tokens anywhere after the divergence
        assert not any(a[i:i + 3] == b[j:j + 3] and len(a[i:i + 3]) == 3
                       for i in range(div, len(a)) for j in range(div, len(b)))


def test_page_data_stores_each_sequence_once_and_candidates_as_tails(audited):
    out, records = audited
    labels = {r["key"]: f"{r['dtype']}/{r['attn']}" for r in records}
    data = htmlreport.page_data(records, labels, {}, tiny_tokenizer(), [])
    p = data["pairs"]
    assert len(p["key"]) == len(records) and len(data["seqs"]) == len({tuple(s) for s in data["seqs"]})
    for i, r in enumerate(records):
        ref = data["seqs"][p["ref"][i]]
        assert ref == r["ar_ids"]
        cand = ref if p["tail"][i] < 0 else ref[: p["div"][i]] + data["seqs"][p["tail"][i]]
        assert cand == r["orthrus_ids"] and bool(p["match"][i]) == r["exact_match"]
    packed = htmlreport.pack(data)
    assert json.loads(gzip.decompress(base64.b64decode(packed))) == json.loads(json.dumps(data))
    page = htmlreport.unpack((out / "report.html").read_text())
    assert page["pairs"]["key"] == [r["key"] for r in sorted(records, key=lambda r: r["key"])]
    assert page["prompts"] == {f"d{d}-{i}": p for d in range(3) for i, p in enumerate(
        [json.loads(x)["prompt"] for x in (out.parent / "s.jsonl").read_text().splitlines()][2 * d: 2 * d + 2])}


# ---- in the browser -------------------------------------------------------------------------------------
def test_the_page_of_a_real_audit_loads_offline_with_no_console_errors(browser, audited):
    out, records = audited
    page = Page(browser, out / "report.html")
    try:
        assert page.errors == []
        assert all(url.startswith(("file:", "data:", "blob:")) for url in page.requests), page.requests
        assert len(page.rows()) == len(records) and page.count() == f"{len(records)} of {len(records)} pairs"
        assert "Configurations" in page.page.inner_text("#overview")
        assert page.page.eval_on_selector_all("#overview img", "imgs => imgs.every(i => i.complete && i.naturalWidth > 0)")
    finally:
        page.close()


def test_filters_change_the_visible_rows(browser, audited):
    out, records = audited
    page = Page(browser, out / "report.html")
    try:
        diverged = [r for r in records if not r["exact_match"]]
        page.page.select_option("#f-status", "diverged")
        assert len(page.rows()) == len(diverged) and all(row[4] == "no" for row in page.rows())
        page.page.select_option("#f-status", "")
        page.page.select_option("#f-candidate", label="hot_decoders:hot")
        assert sorted(row[0] + row[2] for row in page.rows()) == sorted(
            r["prompt_id"] + f"{r['dtype']}/{r['attn']}" for r in records if r["candidate"] == "hot_decoders:hot")
        page.page.select_option("#f-candidate", "")
        page.page.select_option("#f-config", label="bf16/sdpa")
        assert {row[2] for row in page.rows()} == {"bf16/sdpa"} and len(page.rows()) == sum(r["dtype"] == "bf16" for r in records)
        page.page.select_option("#f-config", "")
        margins = sorted(r["ref_margin_at_divergence"] for r in diverged if r["ref_margin_at_divergence"] is not None)
        lo = margins[len(margins) // 2]
        page.page.fill("#f-mmin", str(lo))
        assert len(page.rows()) == sum(m >= lo for m in margins)
        page.page.fill("#f-mmin", "")
        page.page.select_option("#f-domain", label="d1")
        assert {row[1] for row in page.rows()} == {"d1"}
        page.page.fill("#f-search", "d1-0")
        assert {row[0] for row in page.rows()} == {"d1-0"}
        assert page.errors == []
    finally:
        page.close()


def test_sorting_by_a_column_orders_the_rows(browser, audited):
    out, records = audited
    page = Page(browser, out / "report.html")
    try:
        page.page.click("#pairs th[data-col='lev']")
        lev = [int(row[7]) for row in page.rows()]
        assert lev == sorted(lev)
        page.page.click("#pairs th[data-col='lev']")
        assert [int(row[7]) for row in page.rows()] == sorted(lev, reverse=True)
        # the overview's tables sort too: the configurations table by its "n" column, then back
        table = page.page.locator("#overview table").first
        heads = table.locator("thead th").all_inner_texts()
        col = heads.index("exact match [95% CI]")
        table.locator("thead th").nth(col).click()
        cells = table.locator(f"tbody tr td:nth-child({col + 1})").all_inner_texts()
        rates = [float(c.split("%")[0]) for c in cells]
        assert rates == sorted(rates) and len(rates) == 4
        table.locator("thead th").nth(col).click()
        cells = table.locator(f"tbody tr td:nth-child({col + 1})").all_inner_texts()
        assert [float(c.split("%")[0]) for c in cells] == sorted(rates, reverse=True)
    finally:
        page.close()


def test_a_permalink_opens_its_pair_with_both_diverging_tokens_marked(browser, audited):
    out, records = audited
    tok = tiny_tokenizer()
    r = max((r for r in records if not r["exact_match"]), key=lambda r: r["first_divergence"])
    page = Page(browser, out / "report.html", _key_fragment(r["key"]))
    try:
        panel = page.page.locator("aside#pair")
        assert panel.is_visible() and r["key"] in panel.locator("h2").inner_text()
        marked = panel.locator(".t.div").all_inner_texts()
        div = r["first_divergence"]
        assert marked == [tok.decode([r["ar_ids"][div]]), tok.decode([r["orthrus_ids"][div]])]
        assert f"diverged at token {div}" in panel.inner_text()
        assert "w" in page.page.inner_text(".prompt")  # the suite's prompt text
        # the reference's top tokens at the divergence, its own token first
        top_rows = panel.locator(".tops table").first.locator("tr.chosen td").all_inner_texts()
        assert top_rows[1] == str(r["ar_ids"][div])
        # clicking a row moves the permalink
        other = next(x for x in records if x["key"] != r["key"])
        page.page.click(f"#pairs tbody tr[data-key='{other['key']}']")
        assert urllib.parse.unquote(page.page.evaluate("location.hash.slice(1)")) == other["key"]
        assert other["key"] in panel.locator("h2").inner_text()
        page.page.check("#tok-toggle")
        assert "tokens" in panel.get_attribute("class")
        assert page.errors == []
    finally:
        page.close()


def test_a_pair_is_shown_against_the_reports_reference_too(browser, tmp_path):
    from lossless.stats import first_divergence
    from test_backfill import twin_loader

    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, configs=["fp32/sdpa", "bf16/sdpa"], max_new_tokens=24), out, load=twin_loader,
              progress=False)
    write_report(out, tokenizer=tiny_tokenizer())
    records = read_records(out)
    fp32 = {r["prompt_id"]: r["ar_ids"] for r in records if r["dtype"] == "fp32"}
    apart = [r for r in records if r["dtype"] == "bf16" and r["ar_ids"] != fp32[r["prompt_id"]]]
    assert apart, "the twin head's near ties make bf16 AR part from fp32 AR somewhere"
    r = apart[0]
    x = fp32[r["prompt_id"]]
    page = Page(browser, out / "report.html", _key_fragment(r["key"]))
    try:
        panel = page.page.locator("aside#pair")
        assert "Against fp32/sdpa AR, the report's reference" in panel.inner_text()
        said = panel.locator("p.against").inner_text()
        assert f"the pair's AR reference: parts from fp32/sdpa AR at token {first_divergence(r['ar_ids'], x)} " in said
        cand = "equal to fp32/sdpa AR." if r["orthrus_ids"] == x else \
            f"parts from fp32/sdpa AR at token {first_divergence(r['orthrus_ids'], x)} "
        assert f"the candidate: {cand}" in said
        if r["orthrus_ids"] != x:  # both continuations from there, each with its token at that position marked
            assert panel.locator(".side").last.locator(".t.xdiv").count() == 2
        # a pair of the reference configuration itself is already shown against it
        own = next(q for q in records if q["dtype"] == "fp32")
        page.page.goto((out / "report.html").resolve().as_uri() + "#" + _key_fragment(own["key"]))
        assert "is equal to fp32/sdpa AR, the report's reference" in panel.inner_text()
        assert page.errors == []
    finally:
        page.close()


def test_runs_with_no_divergence_and_only_fp32_render(browser, tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)
    write_report(out, tokenizer=None)  # no tokenizer: ids shown, and the page says so
    page = Page(browser, out / "report.html")
    try:
        assert page.errors == [] and len(page.rows()) == 6 and all(row[4] == "yes" for row in page.rows())
        assert "tokens show as ids" in page.page.inner_text("#notes")
        page.page.select_option("#f-status", "diverged")
        assert page.rows() == [] and page.count() == "0 of 6 pairs"
        key = read_records(out)[0]["key"]
        page.page.goto((out / "report.html").resolve().as_uri() + "#" + _key_fragment(key))
        assert "identical" in page.page.inner_text("aside#pair")
        page.page.goto((out / "report.html").resolve().as_uri() + "#no%7Csuch%7Ckey")
        assert "No pair with key no|such|key" in page.page.inner_text("aside#pair")
        assert page.errors == []
    finally:
        page.close()


def test_a_torn_record_line_still_gives_a_page_and_no_records_a_one_line_error(browser, tmp_path, capsys):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)
    with (out / "records" / "all.jsonl").open("a") as f:
        f.write('{"key": "torn|fp32|sdpa", "ar_ids": [1, 2')  # a kill mid-write
    assert main(["report", str(out)]) == 0
    assert str(out / "report.html") in capsys.readouterr().out
    page = Page(browser, out / "report.html")
    try:
        assert page.errors == [] and len(page.rows()) == 6
    finally:
        page.close()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lossless: error: no records") and not (empty / "report.html").exists()


def test_the_committed_full_study_page_opens_every_pair(browser):
    path = REPO / "results" / "full-study" / "report.html"
    assert path.stat().st_size < 5 * 1024 * 1024
    page = Page(browser, path)
    try:
        summary = json.loads((REPO / "results" / "full-study" / "summary.json").read_text())
        assert page.errors == [] and page.count() == f"{summary['n_records']} of {summary['n_records']} pairs"
        page.page.select_option("#f-status", "diverged")
        diverged = sum(c["n"] - c["n_match"] for c in summary["configs"])
        assert page.count() == f"{diverged} of {summary['n_records']} pairs"
    finally:
        page.close()


def test_an_evaluation_page_shows_the_items_whose_responses_differ_side_by_side(browser, tmp_path):
    from lossless.evaluation.report import summarise

    for mode, answers in (("ar", ["12", "7", "30"]), ("orthrus", ["12", "8", "31"])):
        run = tmp_path / "harness" / f"{mode}_bf16"
        run.mkdir(parents=True)
        res = {"results": {"lossless_arith": {"exact_match,none": 0.5}},
               "lossless": {"mode": mode, "dtype": "bf16", "attn": "sdpa", "command": f"lossless eval --modes {mode}"}}
        (run / "results_arith.json").write_text(json.dumps(res))
        (run / "samples_arith.jsonl").write_text("".join(json.dumps(
            {"doc_id": i, "exact_match": float(a in ("12", "8")), "resps": [[a]], "target": "t",
             "arguments": [[f"question {i}", {"until": ["\\n"]}]]}) + "\n" for i, a in enumerate(answers)))
    summarise(tmp_path)
    page = Page(browser, tmp_path / "report.html")
    try:
        assert page.errors == [] and page.count() == "2 of 2 items"
        page.page.check("#f-changed")
        assert [row[3] for row in page.rows()] == ["1"]  # item 2 differs in text, not in score
        page.page.goto((tmp_path / "report.html").resolve().as_uri() + "#" + _key_fragment("arith|bf16|orthrus|1"))
        panel = page.page.locator("aside#pair")
        assert "question 1" in panel.inner_text() and panel.locator(".t.div").all_inner_texts() == ["7", "8"]
        assert page.errors == []
    finally:
        page.close()
