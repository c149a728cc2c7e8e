"""Candidate decoders in the audit, on tiny random models: every built-in equals the AR reference in fp32 (and the
oracle in exact mode), one reference serves every candidate of an item, a wrong decoder is caught, a user's
`module:function` is loaded and audited, and bad names, import paths or kernels give one line and exit 2."""

import json

import pytest

from lossless.study import audit
from lossless.study.audit import run_audit
from lossless.study.candidates import BUILTIN, parse_candidates
from lossless.cli import main
from lossless.errors import LosslessError
from lossless.study.report import load_run, write_report
from test_audit import config, tiny_loader, write_suite

USER_MODULE = '''
from lossless.decoding.loop import DecodeConfig, decode


def greedy(model, prompt_ids, max_new_tokens):
    """A correct decoder: our AR loop."""
    return decode(model, prompt_ids, "ar", DecodeConfig(max_new_tokens=max_new_tokens)).generated


def greedy_exact(model, prompt_ids, max_new_tokens):
    """The same, declared to run the model's exact-mode passes."""
    return greedy(model, prompt_ids, max_new_tokens)


greedy_exact.lossless_exact = True


def off_by_one(model, prompt_ids, max_new_tokens):
    """A wrong decoder: greedy, but every token shifted by one."""
    return [(t + 1) % 64 for t in greedy(model, prompt_ids, max_new_tokens)]
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_decoders.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_decoders"


def test_every_builtin_candidate_equals_the_ar_reference_in_fp32(tmp_path, monkeypatch):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    references = []
    real = audit.compute_reference
    monkeypatch.setattr(audit, "compute_reference", lambda *a: references.append(1) or real(*a))
    names = [n for n, c in BUILTIN.items() if not c.engine]  # llama.cpp's: tests/study/test_llamacpp.py
    result = run_audit(config(suite, dtypes=["fp32"], candidates=names), out, load=tiny_loader, progress=False)
    assert result["planned_records"] == result["new_records"] == 6 * len(names)
    assert len(references) == 6  # one reference per item, shared by every candidate
    computed = [r["prompt_id"] for r in load_run(out)[0] if not r["reference_reused"]]
    assert sorted(computed) == sorted(set(computed)) and len(computed) == 6  # its cost is counted once
    records = load_run(out)[0]
    assert all(r["exact_match"] for r in records), [r["key"] for r in records if not r["exact_match"]]
    by_key = {r["key"]: r for r in records}
    assert {by_key[f"d0-0|fp32|sdpa{s}"]["candidate"] for s in ("", "|fused", "|oracle", "|prompt-lookup")} == \
        {"orthrus", "orthrus-fused", "oracle", "prompt-lookup"}
    for r in records:
        decode_loop = r["candidate"] in ("orthrus", "orthrus-fused", "orthrus-tree", "orthrus-lookup", "orthrus-tree-lookup",
                                        "oracle")
        assert (r["accepted"] is not None) == decode_loop and (r["tokens_per_step"] is not None) == decode_loop
        assert r["orthrus_forwards"] >= 1 and r["ar_ids"] == by_key[f"{r['prompt_id']}|fp32|sdpa"]["ar_ids"]
    oracle = [r for r in records if r["candidate"] == "oracle"]
    # all drafts right: every cycle accepts its whole block (but the last, cut by the length limit)
    assert all(a == r["k"] - 1 for r in oracle for a in r["accepted"][:-1])
    summary = write_report(out)
    assert {c["candidate"] for c in summary["configs"]} == set(names)
    assert all(c["exact_match_rate"] == 1.0 for c in summary["configs"])
    assert "candidate_match_rate.png" in summary["plots"] and "## Candidates" in (out / "report.md").read_text()


def test_the_oracle_equals_exact_ar_in_exact_mode(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, configs=["bf16/exact"], candidates=["oracle"]), out, load=tiny_loader, progress=False)
    records = load_run(out)[0]
    assert len(records) == 12 and all(r["key"].endswith("|oracle") for r in records)
    assert all(r["exact_match"] for r in records if r["reference_attn"] == "exact")


def test_a_wrong_candidate_is_caught_and_a_users_candidate_is_audited(tmp_path, user_module):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    names = [f"{user_module}:greedy", f"{user_module}:off_by_one"]
    run_audit(config(suite, dtypes=["fp32"], candidates=names), out, load=tiny_loader, progress=False)
    summary = write_report(out)
    rates = {c["candidate"]: c for c in summary["configs"]}
    assert rates[f"{user_module}:greedy"]["exact_match_rate"] == 1.0
    wrong = rates[f"{user_module}:off_by_one"]
    assert wrong["exact_match_rate"] == 0.0 and wrong["n"] == 6 and wrong["margin_at_divergence"]["n_diverging"] == 6
    records = [r for r in load_run(out)[0] if r["candidate"].endswith("off_by_one")]
    assert all(r["first_divergence"] == 0 and r["key"].endswith("|my_decoders:off_by_one") for r in records)
    assert all(r["accepted"] is None and r["orthrus_forwards"] is None for r in records)


def test_fused_cycle_on_the_command_line_is_the_orthrus_fused_candidate(tmp_path, monkeypatch):
    import lossless.decoding.models

    suite = write_suite(tmp_path / "s.jsonl")
    monkeypatch.setattr(lossless.decoding.models, "load_model", lambda spec, dtype, device, attn, head=None: tiny_loader(dtype, attn))
    out = tmp_path / "run"
    args = ["audit", "--model", "tiny", "--suite", str(suite), "--dtypes", "fp32", "--max-new-tokens", "8",
            "--out", str(out), "--no-progress"]
    assert main([*args, "--cycle", "fused"]) == 0
    assert json.loads((out / "run.json").read_text())["config"]["candidates"] == ["orthrus-fused"]
    assert all(r["key"].endswith("|fused") for r in load_run(out)[0])
    # a run directory made before candidates (its run.json names the cycle) resumes under the same command
    info = json.loads((out / "run.json").read_text())
    del info["config"]["candidates"]
    info["config"]["cycle"] = "fused"
    (out / "run.json").write_text(json.dumps(info))
    assert main([*args, "--candidates", "orthrus-fused"]) == 0
    assert main([*args, "--candidates", "orthrus"]) == 2


@pytest.mark.parametrize("argv, message", [
    (["--candidates", "medusa"], "unknown candidate 'medusa'"),
    (["--candidates", "no_such_module_xyz:run"], "cannot import module 'no_such_module_xyz'"),
    (["--candidates", "json:no_such_function"], "module 'json' has no 'no_such_function'"),
    (["--candidates", "json:__doc__"], "is not callable"),
    (["--candidates", ":run"], "expected module:function"),
    (["--candidates", "orthrus,prompt-lookup", "--attn", "exact"], "cannot drive the exact kernels"),
    (["--candidates", ","], "needs at least one value"),
])
def test_bad_candidates_give_one_line_and_exit_2(tmp_path, capsys, argv, message):
    suite = write_suite(tmp_path / "s.jsonl")
    assert main(["audit", "--suite", str(suite), "--out", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lossless: error:") and message in err[0]
    assert not (tmp_path / "r").exists()  # refused before any model loads or anything is written


def test_candidate_names_are_checked_by_the_library_too():
    assert parse_candidates("orthrus, oracle,orthrus") == ["orthrus", "oracle"]
    with pytest.raises(LosslessError, match="unknown candidate"):
        parse_candidates(["orthrus", "eagle"])


def test_a_users_decoder_runs_under_exact_kernels_only_if_it_says_so(tmp_path, capsys, user_module):
    suite = write_suite(tmp_path / "s.jsonl")
    args = ["audit", "--suite", str(suite), "--attn", "exact", "--dtypes", "fp32"]
    assert main([*args, "--out", str(tmp_path / "r1"), "--candidates", f"{user_module}:greedy"]) == 2
    err = capsys.readouterr().err
    assert "greedy.lossless_exact = True" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r1" / "run.json").exists()
    out = tmp_path / "r2"
    run_audit(config(suite, configs=["fp32/exact"], candidates=[f"{user_module}:greedy_exact"]), out,
              load=tiny_loader, progress=False)
    assert all(r["exact_match"] for r in load_run(out)[0])
