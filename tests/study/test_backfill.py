"""Backfilling top tokens at the divergence: records from before audits kept them get them by decoding each
pair again up to its divergence, on the machine that made it; only what reproduces the recorded tokens is kept."""

import shutil

import pytest
import torch

from lossless.cli import main
from lossless.study.audit import AuditConfig, run_audit
from lossless.study.backfill import BACKFILL_DIR, FIELDS, annotations, apply, consistent, run_backfill
from lossless.study.records import RecordStore, read_records, record_id
from lossless.study.report import load_run, write_report
from test_audit import tiny_loader, write_suite

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def twin_loader(dtype, attn):
    """A tiny model whose LM head has a near twin of every other row: greedy choices are near ties, so a
    verify's block shape flips some of them, and bf16 and fp16 audits diverge."""
    model = tiny_loader("fp32", attn)
    w = model.backbone.lm_head.weight
    with torch.no_grad():
        half = w.shape[0] // 2
        noise = torch.randn(w[:half].shape, generator=torch.Generator().manual_seed(0))
        w[half: 2 * half] = w[:half] * (1 + 1e-3 * noise)
    return model.to(DTYPES[dtype])


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """An audit whose records carry top tokens, and the same run as it would be had they not been kept."""
    root = tmp_path_factory.mktemp("backfill")
    suite = write_suite(root / "s.jsonl")
    cfg = AuditConfig(model="tiny", suite=str(suite), configs=["bf16/sdpa", "fp16/sdpa"], max_new_tokens=24)
    run_audit(cfg, root / "full", load=twin_loader, progress=False)
    full = read_records(root / "full")
    assert sum(not r["exact_match"] for r in full) >= 3, "the twin head makes some pairs diverge"
    return root, full


def old_run(root, full, name, change=lambda rs: rs):
    """A copy of the run whose records hold no top tokens (as records made before they were kept)."""
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    (out / "records").mkdir(parents=True)
    shutil.copy(root / "full" / "run.json", out / "run.json")
    store = RecordStore(out, "all")
    store.append(change([{k: v for k, v in r.items() if k not in FIELDS} for r in full]))
    store.roll()
    return out


def test_backfilled_tops_are_the_ones_the_audit_recorded_and_a_rerun_does_nothing(audited):
    root, full = audited
    out = old_run(root, full, "old")
    diverging = [r for r in full if not r["exact_match"]]
    before = write_report(out, html=False)
    assert before["top_tokens"] == {"diverging": len(diverging), "recorded": 0, "backfilled": 0,
                                    "not_reproduced": 0, "missing": len(diverging)}
    result = run_backfill(out, progress=False, load=twin_loader)
    assert result["backfilled"] == len(diverging) and result["not_reproduced"] == 0 and result["left"] == {}
    by_id = {record_id(r): r for r in full}
    records, _ = load_run(out)
    for r in records:
        if not r["exact_match"]:
            assert r["tops_backfilled"] is True
            for f in FIELDS:
                assert r[f] == by_id[record_id(r)][f] and r[f] is not None
        else:
            assert "tops_backfilled" not in r and r.get("ref_top_at_divergence") is None
    summary = write_report(out, at_rest=True)
    assert summary["top_tokens"]["backfilled"] == len(diverging) and summary["top_tokens"]["missing"] == 0
    assert summary["backfill_segments"] == [p.name for p in sorted((out / BACKFILL_DIR).glob("*.gz"))]
    assert f"decoded again up to the divergence for {len(diverging)}" in (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert "not recorded" not in page.split("<script")[0]
    # resumes: everything is done
    again = run_backfill(out, progress=False, load=twin_loader)
    assert again["backfilled"] == 0 and again["already_done"] == len(diverging)
    # the run's summary with the tops recorded equals the backfilled one but for the counts of where they came from
    recorded = write_report(root / "full", root / "full-report", html=False)
    assert {k: v for k, v in summary.items() if k not in ("top_tokens", "backfill_segments", "record_segments",
                                                          "report_id")} == \
        {k: v for k, v in recorded.items() if k != "report_id"}


def test_a_pair_that_does_not_reproduce_keeps_no_tops_and_other_machines_pairs_are_left(audited, capsys):
    root, full = audited
    diverging = [record_id(r) for r in full if not r["exact_match"]]
    wrong, elsewhere = diverging[0], diverging[1]

    wrong_candidate = diverging[2]
    div = {record_id(r): r["first_divergence"] for r in full}

    def change(rs):
        for r in rs:
            if record_id(r) == wrong:  # the recorded margin at the divergence is not the one a decode gives
                r["ar_margins"] = [m + 1.0 for m in r["ar_margins"]]
            if record_id(r) == wrong_candidate:  # the candidate's recorded token at the divergence is not its own
                r["orthrus_ids"] = r["orthrus_ids"][: div[wrong_candidate]] + [r["ar_ids"][div[wrong_candidate]] + 1]
            if record_id(r) == elsewhere:
                r["machine"] = "another CPU, torch 2.13.0+cpu, 1 thread"
        return rs

    out = old_run(root, full, "changed", change)
    result = run_backfill(out, progress=False, load=twin_loader)
    assert result["not_reproduced"] == 2 and result["backfilled"] == len(diverging) - 3
    assert annotations(out)[wrong_candidate]["reproduced"] is False
    assert result["left"] == {"machine another CPU, torch 2.13.0+cpu, 1 thread": 1}
    notes = annotations(out)
    assert notes[wrong]["reproduced"] is False and "ref_top_at_divergence" not in notes[wrong]
    assert elsewhere not in notes
    summary = write_report(out, html=False)
    assert summary["top_tokens"]["not_reproduced"] == 2 and summary["top_tokens"]["missing"] == 1
    by_id = {record_id(r): r for r in load_run(out)[0]}
    assert by_id[wrong]["tops_backfilled"] is False and by_id[wrong].get("ref_top_at_divergence") is None


def test_a_record_holding_the_candidates_tops_only_gets_the_references_and_keeps_its_own(audited):
    """A record whose AR reference was reused from a record made before tops were kept holds the candidate's side
    only: the backfill fills in the reference's side, and the candidate's table stays the record's own."""
    root, full = audited
    by_id = {record_id(r): r for r in full}
    diverging = [i for i, r in by_id.items() if not r["exact_match"]]

    def keep_candidate_side(rs):
        for r in rs:
            r["orthrus_top_at_divergence"] = by_id[record_id(r)]["orthrus_top_at_divergence"]
        return rs

    out = old_run(root, full, "half", keep_candidate_side)
    before = write_report(out, html=False)["top_tokens"]
    assert before["missing"] == len(diverging) and before["recorded"] == 0
    result = run_backfill(out, progress=False, load=twin_loader)
    assert result["backfilled"] == len(diverging) and result["not_reproduced"] == 0
    for r in load_run(out)[0]:
        if record_id(r) in diverging:
            assert r["tops_backfilled"] is True
            assert r["ref_top_at_divergence"] == by_id[record_id(r)]["ref_top_at_divergence"] is not None
            assert r["orthrus_top_at_divergence"] == by_id[record_id(r)]["orthrus_top_at_divergence"]
    # a note whose candidate table is not the record's own is not shown
    r = by_id[diverging[0]]
    note = dict(annotations(out)[diverging[0]])
    note["orthrus_top_at_divergence"] = [note["orthrus_top_at_divergence"][0], [note["orthrus_top_at_divergence"][1][0],
                                         note["orthrus_top_at_divergence"][1][1]]] + [[0, -1e9]]
    half = {k: v for k, v in r.items() if k != "ref_top_at_divergence"}
    shown = apply([half], {diverging[0]: note})[0]
    assert shown["tops_backfilled"] is False and shown.get("ref_top_at_divergence") is None


def test_a_note_whose_tables_disagree_with_the_records_margins_is_not_shown(audited):
    root, full = audited
    out = old_run(root, full, "tampered")
    run_backfill(out, progress=False, load=twin_loader)
    notes = annotations(out)
    r = next(r for r in full if not r["exact_match"])
    bad = dict(notes[record_id(r)])
    top = [list(t) for t in bad["ref_top_at_divergence"]]
    top[1][1] = top[0][1] - (r["ref_margin_at_divergence"] + 0.5)  # a runner-up the recorded margin rules out
    bad["ref_top_at_divergence"] = top
    assert consistent(r, notes[record_id(r)]) and not consistent(r, bad)
    chosen = r["orthrus_ids"][r["first_divergence"]]
    without = [t for t in notes[record_id(r)]["orthrus_top_at_divergence"] if t[0] != chosen]
    assert not consistent(r, {**notes[record_id(r)], "orthrus_top_at_divergence": without})  # the chosen token leads
    shown = apply([{k: v for k, v in r.items() if k not in FIELDS}], {record_id(r): bad})[0]
    assert shown["tops_backfilled"] is False and shown.get("ref_top_at_divergence") is None


def test_shards_side_by_side_split_the_pairs_and_together_do_them_all(audited):
    root, full = audited
    out = old_run(root, full, "shards")
    diverging = {record_id(r) for r in full if not r["exact_match"]}
    first = run_backfill(out, progress=False, load=twin_loader, shard="0/2")
    second = run_backfill(out, progress=False, load=twin_loader, shard="1/2")
    assert first["backfilled"] + second["backfilled"] == len(diverging) and min(first["backfilled"], second["backfilled"]) >= 1
    assert set(annotations(out)) == diverging
    assert sorted(p.name.split(".")[0] for p in (out / BACKFILL_DIR).glob("*.gz")) == ["tops-shard-0-of-2", "tops-shard-1-of-2"]
    assert run_backfill(out, progress=False, load=twin_loader)["backfilled"] == 0


def test_backfill_cli_bad_input_exits_2(tmp_path, capsys):
    assert main(["backfill", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["backfill", str(tmp_path), "--limit", "0"]) == 2
    assert main(["backfill", str(tmp_path), "--shard", "2/2"]) == 2
    assert main(["backfill", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no run.json" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
