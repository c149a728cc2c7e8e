"""The audit runner on tiny random models: suite parsing, append-only resume after a kill, shards that
merge, refusal of a mismatched run directory, exact mode's two references, and audit -> report."""

import json

import pytest
import torch

from conftest import perturb_head, tiny_backbone, tiny_tokenizer
from lossless.audit import AuditConfig, interleave_domains, limit_per_domain, load_suite, run_audit
from lossless.cli import main
from lossless.errors import LosslessError
from lossless.exact import enable_exact
from lossless.model import OrthrusLM
from lossless.report import load_run, write_report

WORDS = ["w1 w2 w3", "w4 w5", "w9 w8 w7 w6", "w10 w11 w12", "w20 w21", "w30 w31 w32 w33"]


def tiny_loader(dtype, attn):
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = OrthrusLM(tiny_backbone("llama").to(dt), tokenizer=tiny_tokenizer(), k=4)
    perturb_head(model, 0.5)
    if attn == "exact":
        enable_exact(model)
    else:
        model.backbone.set_attn_implementation(attn)
    return model


def write_suite(path, n_domains=3, per_domain=2):
    rows = []
    for d in range(n_domains):
        for i in range(per_domain):
            rows.append({"id": f"d{d}-{i}", "domain": f"d{d}", "prompt": WORDS[(d * per_domain + i) % len(WORDS)]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(suite, **kw):
    return AuditConfig(model="tiny", suite=str(suite), dtypes=kw.pop("dtypes", ["fp32", "bf16"]),
                       attns=kw.pop("attns", ["sdpa"]), max_new_tokens=kw.pop("max_new_tokens", 12), **kw)


def test_suite_parses_jsonl_and_domain_json(tmp_path):
    jsonl = write_suite(tmp_path / "s.jsonl")
    rows = load_suite(jsonl)
    assert [r["id"] for r in rows] == ["d0-0", "d0-1", "d1-0", "d1-1", "d2-0", "d2-1"]
    as_json = tmp_path / "s.json"
    as_json.write_text(json.dumps({"poetry": ["a poem", "another"], "math": ["1+1?"]}))
    rows = load_suite(as_json)
    assert [(r["domain"], r["prompt"]) for r in rows] == [("poetry", "a poem"), ("poetry", "another"), ("math", "1+1?")]
    assert len({r["id"] for r in rows}) == 3
    assert [r["id"] for r in limit_per_domain(load_suite(jsonl), 1)] == ["d0-0", "d1-0", "d2-0"]
    # partial runs cover every domain: work is ordered round-robin over domains
    assert [r["id"] for r in interleave_domains(load_suite(jsonl))] == ["d0-0", "d1-0", "d2-0", "d0-1", "d1-1", "d2-1"]


@pytest.mark.parametrize("line, message", [
    ("{not json", "s.jsonl:2: invalid JSON"),
    ('{"id": "x", "domain": "d"}', "s.jsonl:2: expected an object"),
    ('{"id": "x", "prompt": "   "}', "s.jsonl:2: expected an object"),
])
def test_malformed_suite_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": "a", "domain": "d", "prompt": "w1"}\n' + line + "\n")
    with pytest.raises(LosslessError, match=message):
        load_suite(path)


def test_resume_after_a_kill_gives_no_duplicates_and_no_gaps(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite), out, load=tiny_loader, progress=False)
    path = out / "records.jsonl"
    full = path.read_text().splitlines()
    assert len(full) == 12
    # simulate a kill mid-write: three complete records and half of the fourth
    path.write_text("\n".join(full[:3]) + "\n" + full[3][: len(full[3]) // 2])
    result = run_audit(config(suite), out, load=tiny_loader, progress=False)
    assert result["new_records"] == 9
    lines = path.read_text().splitlines()
    keys = [json.loads(line)["key"] for line in lines]  # every line decodes: the torn tail was cut
    assert sorted(keys) == sorted(json.loads(line)["key"] for line in full) and len(set(keys)) == 12
    # rerunning a finished run records nothing
    assert run_audit(config(suite), out, load=tiny_loader, progress=False)["new_records"] == 0


def test_shards_split_the_work_and_report_merges_them(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    for i in range(3):
        run_audit(config(suite), out, shard=f"{i}/3", load=tiny_loader, progress=False)
    files = sorted(p.name for p in out.glob("records*.jsonl"))
    assert files == ["records.shard-0-of-3.jsonl", "records.shard-1-of-3.jsonl", "records.shard-2-of-3.jsonl"]
    records, info = load_run(out)
    assert len(records) == 12 == info["planned"]
    whole = tmp_path / "whole"
    run_audit(config(suite), whole, load=tiny_loader, progress=False)
    by_key = {r["key"]: r["orthrus_ids"] for r in load_run(whole)[0]}
    assert {r["key"]: r["orthrus_ids"] for r in records} == by_key


def test_a_run_directory_with_another_configuration_is_refused(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False, )
    before = (out / "records.jsonl").read_text()
    with pytest.raises(LosslessError, match="different configuration"):
        run_audit(config(suite, dtypes=["bf16"]), out, load=tiny_loader, progress=False)
    assert (out / "records.jsonl").read_text() == before  # nothing recorded is lost


def test_a_moved_suite_with_the_same_content_resumes(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)
    moved = tmp_path / "elsewhere" / "s.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(suite.read_bytes())
    run_audit(config(moved, dtypes=["fp32"]), out, load=tiny_loader, progress=False)  # nothing new to do
    moved.write_text(moved.read_text().replace("w1", "w2", 1))
    with pytest.raises(LosslessError, match="suite_sha256"):
        run_audit(config(moved, dtypes=["fp32"]), out, load=tiny_loader, progress=False)


def test_records_hold_the_documented_fields_and_fp32_matches(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)
    records, info = load_run(out)
    assert info["environment"]["torch"] == torch.__version__ and info["command"]
    for r in records:
        assert r["exact_match"] == (r["ar_ids"] == r["orthrus_ids"])
        assert r["exact_match"] is True  # fp32 on a tiny model: far from ties
        assert r["first_divergence"] is None and r["levenshtein"] == 0
        assert r["ref_log_ppl"] is not None and r["ref_log_ppl"] >= 0
        assert sum(a + 1 for a in r["accepted"]) == len(r["orthrus_ids"]) - 1


def test_exact_mode_is_compared_with_exact_and_stock_references(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["bf16"], attns=["exact"]), out, load=tiny_loader, progress=False)
    records, info = load_run(out)
    assert info["planned"] == len(records) == 12
    exact_ref = [r for r in records if r["reference_attn"] == "exact"]
    assert len(exact_ref) == 6 and all(r["exact_match"] for r in exact_ref)
    summary = write_report(out)
    labels = {c["label"]: c for c in summary["configs"]}
    assert labels["bf16/exact"]["exact_match_rate"] == 1.0 and "bf16/exact vs AR-sdpa" in labels


def test_audit_then_report_end_to_end_through_the_cli(tmp_path, monkeypatch, capsys):
    import lossless.models

    suite = write_suite(tmp_path / "s.jsonl")
    monkeypatch.setattr(lossless.models, "load_model", lambda spec, dtype, device, attn, head=None: tiny_loader(dtype, attn))
    out = tmp_path / "run"
    assert main(["audit", "--model", "tiny", "--suite", str(suite), "--dtypes", "fp32,bf16", "--max-new-tokens", "8",
                 "--out", str(out), "--no-progress"]) == 0
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "report.md" in printed and "fp32/sdpa: exact match" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert {c["dtype"] for c in summary["configs"]} == {"fp32", "bf16"}
    assert all(c["n"] == 6 for c in summary["configs"])
    assert (out / "report.md").read_text().count("|") > 10


def test_audit_cli_bad_input_exits_2(tmp_path, capsys):
    suite = write_suite(tmp_path / "s.jsonl")
    assert main(["audit", "--suite", str(suite), "--dtypes", "fp8", "--out", str(tmp_path / "r")]) == 2
    assert main(["audit", "--suite", str(suite), "--attn", "flash", "--out", str(tmp_path / "r")]) == 2
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("lossless: error:") for line in err)
