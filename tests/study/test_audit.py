"""The audit runner on tiny random models: suite parsing, compressed records that resume after a kill, on a
moved checkout and across machines, shards (also by rank under accelerate launch) that merge, plans, reference
reuse, one head per study, refusal of a mismatched run directory, exact mode's two references, audit -> report."""

import gzip
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import free_port, perturb_head, save_tiny_model_dir, tiny_backbone, tiny_tokenizer
from lossless.study.audit import (AuditConfig, interleave_domains, limit_per_domain, load_suite, locate_head, parse_config,
                            run_audit)
from lossless.decoding import kernels
from lossless.decoding.head import stored_head_digest
from lossless.study.records import read_records
from lossless.cli import main
from lossless.errors import LosslessError
from lossless.decoding.model import OrthrusLM
from lossless.study.report import load_run, write_report

WORDS = ["w1 w2 w3", "w4 w5", "w9 w8 w7 w6", "w10 w11 w12", "w20 w21", "w30 w31 w32 w33"]


def tiny_loader(dtype, attn):
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = OrthrusLM(tiny_backbone("llama").to(dt), tokenizer=tiny_tokenizer(), k=4)
    perturb_head(model, 0.5)
    if attn == "exact":
        model.set_attn("exact")
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


def plain_file(out, writer="all"):
    return out / "records" / f"{writer}.jsonl"


def segments(out):
    return sorted((out / "records").glob("*.jsonl.gz"))


def test_records_rest_in_compressed_segments_and_a_killed_run_resumes(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite), out, load=tiny_loader, progress=False)
    assert plain_file(out).read_text() == "" and len(segments(out)) == 1  # a clean stop compresses
    full = gzip.decompress(segments(out)[0].read_bytes()).decode().splitlines()
    assert len(full) == 12
    # a kill mid-write, before any roll: three complete items in the plain file and half of the fourth
    segments(out)[0].unlink()
    plain_file(out).write_text("\n".join(full[:3]) + "\n" + full[3][: len(full[3]) // 2])
    result = run_audit(config(suite), out, load=tiny_loader, progress=False)
    assert result["new_records"] == 9
    keys = [r["key"] for r in read_records(out)]
    assert sorted(keys) == sorted(json.loads(line)["key"] for line in full) and len(set(keys)) == 12
    # rerunning a finished run records nothing
    assert run_audit(config(suite), out, load=tiny_loader, progress=False)["new_records"] == 0


def test_a_kill_between_compressing_and_emptying_the_plain_file_loses_and_repeats_nothing(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)
    lines = gzip.decompress(segments(out)[0].read_bytes()).decode()
    plain_file(out).write_text(lines)  # the segment was written, the plain file not yet emptied
    assert run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)["new_records"] == 0
    assert len(read_records(out)) == 6 and plain_file(out).read_text() == ""
    assert len(segments(out)) == 1  # the repeated lines were dropped, not rolled into a second segment


def test_a_truncated_segment_loses_only_its_tail(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)
    seg = segments(out)[0]
    raw = seg.read_bytes()
    seg.write_bytes(raw[: len(raw) // 2])
    assert len(read_records(out)) < 6
    assert run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)["new_records"] > 0
    assert len(read_records(out)) == 6


def test_a_moved_checkout_and_another_machines_records_merge(tmp_path):
    """Shard 0 runs here, shard 1 on 'another machine' (a copy of the run directory elsewhere); its
    committed segments arrive by copy, and the merged run is the whole run, resumable with nothing to do."""
    suite = write_suite(tmp_path / "s.jsonl")
    here, there = tmp_path / "a" / "run", tmp_path / "b" / "run"
    run_audit(config(suite), here, shard="0/2", load=tiny_loader, progress=False)
    shutil.copytree(here, there)  # a checkout on another machine
    run_audit(config(suite), there, shard="1/2", load=tiny_loader, progress=False)
    for seg in segments(there):
        if not (here / "records" / seg.name).exists():
            shutil.copy(seg, here / "records" / seg.name)
    records, info = load_run(here)
    assert len(records) == 12 == info["planned"]
    whole = tmp_path / "whole"
    run_audit(config(suite), whole, load=tiny_loader, progress=False)
    assert {r["key"]: r["orthrus_ids"] for r in records} == {r["key"]: r["orthrus_ids"] for r in load_run(whole)[0]}
    assert run_audit(config(suite), here, load=tiny_loader, progress=False)["new_records"] == 0


def test_shards_split_the_work_and_report_merges_them(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    for i in range(3):
        run_audit(config(suite), out, shard=f"{i}/3", load=tiny_loader, progress=False)
    writers = sorted({p.name.split(".")[0] for p in segments(out)})
    assert writers == ["shard-0-of-3", "shard-1-of-3", "shard-2-of-3"]
    records, info = load_run(out)
    assert len(records) == 12 == info["planned"]
    whole = tmp_path / "whole"
    run_audit(config(suite), whole, load=tiny_loader, progress=False)
    by_key = {r["key"]: r["orthrus_ids"] for r in load_run(whole)[0]}
    assert {r["key"]: r["orthrus_ids"] for r in records} == by_key


def test_a_plan_runs_configuration_by_configuration_with_per_domain_limits(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    cfg = config(suite, configs=["fp32/sdpa", "bf16/sdpa:1"])
    result = run_audit(cfg, out, load=tiny_loader, progress=False)
    assert result["planned_records"] == 6 + 3
    keys = [json.loads(line)["key"] for line in gzip.decompress(segments(out)[0].read_bytes()).decode().splitlines()]
    assert keys == ["d0-0|fp32|sdpa", "d1-0|fp32|sdpa", "d2-0|fp32|sdpa", "d0-1|fp32|sdpa", "d1-1|fp32|sdpa",
                    "d2-1|fp32|sdpa", "d0-0|bf16|sdpa", "d1-0|bf16|sdpa", "d2-0|bf16|sdpa"]
    for bad in ("bf16", "bf16/flash", "bf16/sdpa:0", "bf16/sdpa:x", "fp8/sdpa"):
        with pytest.raises(LosslessError):
            parse_config(bad)


def test_exact_mode_reuses_the_stock_reference_of_an_earlier_configuration(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, configs=["bf16/sdpa", "bf16/exact"]), out, load=tiny_loader, progress=False)
    by_key = {r["key"]: r for r in load_run(out)[0]}
    assert len(by_key) == 6 * 3
    for pid in ("d0-0", "d1-1", "d2-0"):
        stock, vs_stock = by_key[f"{pid}|bf16|sdpa"], by_key[f"{pid}|bf16|exact|ref-sdpa"]
        assert vs_stock["reference_reused"] and not stock["reference_reused"]
        assert vs_stock["ar_ids"] == stock["ar_ids"] and vs_stock["ref_log_ppl"] == stock["ref_log_ppl"]
        assert vs_stock["orthrus_ids"] == by_key[f"{pid}|bf16|exact"]["orthrus_ids"]
    # alone, exact mode computes the stock reference itself, and gets the same tokens
    alone = tmp_path / "alone"
    run_audit(config(suite, configs=["bf16/exact"]), alone, load=tiny_loader, progress=False)
    for r in load_run(alone)[0]:
        assert not r["reference_reused"]
        assert r["ar_ids"] == by_key[r["key"]]["ar_ids"]


def test_one_study_keeps_one_head(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)
    assert json.loads((out / "run.json").read_text())["config"]["head_digest"] == "untrained"
    assert {r["head"] for r in read_records(out)} == {"untrained"}

    def other_head(dtype, attn):
        model = tiny_loader(dtype, attn)
        model.head_digest = "0123456789abcdef"
        return model

    with pytest.raises(LosslessError, match="one study keeps one head"):
        run_audit(config(suite, dtypes=["fp32"]), out, load=other_head, progress=False)


def test_a_pinned_head_is_found_by_its_digest(tmp_path, monkeypatch):
    import lossless.paths

    heads = tmp_path / "heads"
    model = tiny_loader("fp32", "sdpa")
    model.save_head(heads / "tiny")
    old = heads / "tiny-v1"
    perturb_head(model, 0.1, seed=7)
    model.save_head(old)
    digest = stored_head_digest(old)
    assert digest != stored_head_digest(heads / "tiny")
    monkeypatch.setattr(lossless.paths, "HEADS_DIR", heads)
    assert locate_head("tiny", None, digest) == old
    assert locate_head("tiny", None, stored_head_digest(heads / "tiny")) == heads / "tiny"
    with pytest.raises(LosslessError, match="no directory"):
        locate_head("tiny", None, "0123456789abcdef")
    # the digest is the stored head's, whatever dtype the model is loaded in
    loaded = {dt: OrthrusLM(tiny_backbone("llama").to(getattr(torch, dt)), k=4) for dt in ("float32", "bfloat16")}
    for m in loaded.values():
        m.load_head(old)
    assert {m.head_digest for m in loaded.values()} == {digest}


def test_a_rank_sharded_run_under_accelerate_launch_equals_the_unsharded_run(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "tiny-model")
    suite = write_suite(tmp_path / "s.jsonl")
    args = ["audit", "--model", str(model_dir), "--head", "none", "--suite", str(suite), "--dtypes", "fp32",
            "--max-new-tokens", "8", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--main_process_port", str(free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "lossless", *args, "--out", str(tmp_path / "ranks")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[:3000]  # the first rank's complaint comes first
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    writers = sorted({p.name.split(".")[0] for p in segments(tmp_path / "ranks")})
    assert writers == ["shard-0-of-2", "shard-1-of-2"]
    ranks, whole = load_run(tmp_path / "ranks")[0], load_run(tmp_path / "whole")[0]
    assert len(whole) == 6
    assert {r["key"]: r["orthrus_ids"] for r in ranks} == {r["key"]: r["orthrus_ids"] for r in whole}


def test_a_run_directory_with_another_configuration_is_refused(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False, )
    before = read_records(out)
    with pytest.raises(LosslessError, match="different configuration"):
        run_audit(config(suite, dtypes=["bf16"]), out, load=tiny_loader, progress=False)
    assert read_records(out) == before  # nothing recorded is lost


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
    # every record names the exact kernels that decoded it (source digest and variant); stock ones name none
    build = f"{kernels.source_digest()}/{kernels.isa()}"
    assert {r["kernels"] for r in records} == {build}
    assert {(r["reference_attn"], r["reference_kernels"]) for r in records} == {("exact", build), ("sdpa", None)}
    summary = write_report(out)
    labels = {c["label"]: c for c in summary["configs"]}
    assert labels["bf16/exact"]["exact_match_rate"] == 1.0 and "bf16/exact vs AR-sdpa" in labels


def test_exact_pairs_of_an_earlier_kernel_build_are_decoded_again_beside_the_old_records(tmp_path, monkeypatch):
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    cfg = lambda: config(suite, configs=["bf16/sdpa", "bf16/exact"])  # noqa: E731
    run_audit(cfg(), out, load=tiny_loader, progress=False)
    old = load_run(out)[0]
    today = kernels.source_digest()
    # the kernel sources change: the same command decodes every exact pair again, and only those
    monkeypatch.setattr(kernels, "source_digest", lambda: "0123456789abcdef")
    again = run_audit(cfg(), out, load=tiny_loader, progress=False)
    assert again["new_records"] == 12
    assert run_audit(cfg(), out, load=tiny_loader, progress=False)["new_records"] == 0  # and then it is done
    records = read_records(out)
    assert len(records) == 6 + 12 + 12
    new = [r for r in records if str(r.get("kernels") or r.get("reference_kernels") or "").startswith("0123")]
    assert len(new) == 12 and all(r["kernels"].startswith("0123456789abcdef/") for r in new)
    # the new exact AR reference is decoded by the new build; the stock one is still reused from bf16/sdpa
    assert all(not r["reference_reused"] for r in new if r["reference_attn"] == "exact")
    assert all(r["reference_reused"] for r in new if r["reference_attn"] == "sdpa")
    # same machine, same kernels: the same tokens as before
    by_key = {r["key"]: r for r in old}
    assert all(r["orthrus_ids"] == by_key[r["key"]]["orthrus_ids"] for r in new)
    # the report names both builds, pools neither, and counts each planned pair once
    summary = write_report(out)
    labels = {c["label"]: c["n"] for c in summary["configs"]}
    assert labels == {"bf16/sdpa": 6, f"bf16/exact (kernels {today[:8]})": 6, "bf16/exact (kernels 01234567)": 6,
                      f"bf16/exact (kernels {today[:8]}) vs AR-sdpa": 6, "bf16/exact (kernels 01234567) vs AR-sdpa": 6}
    assert summary["n_records"] == 30 and summary["n_decoded_again"] == 12
    md = (out / "report.md").read_text()
    assert "18 of 18 planned pairs done (complete). 12 more records hold pairs decoded again" in md
    assert md.count("Not pooled:") == 2


def test_audit_then_report_end_to_end_through_the_cli(tmp_path, monkeypatch, capsys):
    import lossless.decoding.models

    suite = write_suite(tmp_path / "s.jsonl")
    monkeypatch.setattr(lossless.decoding.models, "load_model", lambda spec, dtype, device, attn, head=None: tiny_loader(dtype, attn))
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


def test_a_fused_audit_records_its_cycle_beside_two_pass_records(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl")
    two_pass, fused = tmp_path / "two-pass", tmp_path / "fused"
    run_audit(config(suite, dtypes=["fp32"]), two_pass, load=tiny_loader, progress=False)
    run_audit(config(suite, dtypes=["fp32"], candidates=["orthrus-fused"], groups=2), fused, load=tiny_loader,
              progress=False)
    records = load_run(fused)[0]
    assert len(records) == 6 and all(r["cycle"] == "fused" and r["key"].endswith("|fused") for r in records)
    assert all(r["exact_match"] for r in records)  # fp32 on a tiny model
    by_prompt = {r["prompt_id"]: r["ar_ids"] for r in load_run(two_pass)[0]}
    assert {r["prompt_id"]: r["ar_ids"] for r in records} == by_prompt  # the same references
    summary = write_report(fused)
    assert [c["label"] for c in summary["configs"]] == ["fp32/sdpa fused"]
    assert summary["configs"][0]["cycle"] == "fused"
    with pytest.raises(LosslessError, match="candidates"):  # one run directory, one set of candidates
        run_audit(config(suite, dtypes=["fp32"]), fused, load=tiny_loader, progress=False)


def test_sigterm_stops_a_run_cleanly_with_its_records_compressed(tmp_path):
    """`kill` (SIGTERM) mid-run: the finished items are rolled into a segment, none is lost or torn."""
    import signal
    import threading

    suite = write_suite(tmp_path / "s.jsonl", per_domain=4)
    out = tmp_path / "run"
    calls = []
    before = signal.getsignal(signal.SIGTERM)

    def slow_loader(dtype, attn):
        model = tiny_loader(dtype, attn)
        real = model.prefill

        def prefill(ids):
            calls.append(1)
            if len(calls) == 5:  # a few items in: the process is told to stop
                threading.Timer(0.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
                time.sleep(0.5)
            return real(ids)

        model.prefill = prefill
        return model

    with pytest.raises(KeyboardInterrupt):
        run_audit(config(suite, dtypes=["fp32"]), out, load=slow_loader, progress=False)
    assert plain_file(out).read_text() == "" and len(segments(out)) == 1
    done = len(read_records(out))
    assert 0 < done < 12
    assert run_audit(config(suite, dtypes=["fp32"]), out, load=tiny_loader, progress=False)["new_records"] == 12 - done
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone again


def test_a_second_signal_during_the_last_roll_does_not_cut_it_short(tmp_path, monkeypatch):
    """A launcher forwards the `kill` its workers also got: the second SIGTERM lands while the stopping
    process compresses its records. The roll completes, then the stop goes on."""
    import signal

    import lossless.study.records as records_mod

    store = records_mod.RecordStore(tmp_path / "run", "shard-1-of-2")
    real_compress = records_mod.gzip.compress

    def compress_while_killed(data, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # the second signal, delivered mid-roll
        return real_compress(data, **kw)

    monkeypatch.setattr(records_mod.gzip, "compress", compress_while_killed)
    with pytest.raises(KeyboardInterrupt):
        with store.session():
            store.append([{"key": "a", "v": 1}, {"key": "b", "v": 2}])
            raise KeyboardInterrupt  # the first signal stopped the run
    assert store.plain.read_text() == ""
    assert [r["key"] for r in read_records(tmp_path / "run", at_rest=True)] == ["a", "b"]


def test_roll_all_commits_what_another_writer_left_and_a_live_writer_keeps_appending(tmp_path):
    """Records a killed rank left in its plain file reach the segments through `report --at-rest`; a writer
    still running keeps appending to the same (emptied in place) file and loses nothing."""
    from lossless.study.records import RecordStore, roll_all

    run = tmp_path / "run"
    dead, live = RecordStore(run, "shard-1-of-2"), RecordStore(run, "shard-0-of-2")
    dead.append([{"key": "d1"}])
    live.append([{"key": "l1"}])
    inode = live.plain.stat().st_ino
    assert len(roll_all(run)) == 2 and read_records(run, at_rest=True) == [{"key": "l1"}, {"key": "d1"}]
    live.append([{"key": "l2"}])  # the running writer's next item
    assert live.plain.stat().st_ino == inode and live.plain.read_text() == '{"key":"l2"}\n'
    assert roll_all(run) and roll_all(run) == []  # nothing left to roll the second time
    assert sorted(r["key"] for r in read_records(run, at_rest=True)) == ["d1", "l1", "l2"]


def test_decoding_keeps_the_top_tokens_its_margins_come_from():
    from lossless.decoding.loop import DecodeConfig, decode
    from lossless.text import encode_prompt

    model = tiny_loader("bf16", "sdpa")
    ids = encode_prompt(model.tokenizer, "w1 w2 w3")
    for mode in ("ar", "orthrus"):
        state = decode(model, ids, mode, DecodeConfig(max_new_tokens=10, record_margins=True))
        assert len(state.tops) == len(state.margins) == len(state.generated) == 10
        for tok, margin, top in zip(state.generated, state.margins, state.tops):
            assert top[0][0] == tok  # greedy: the committed token is the top one
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert margin == top[0][1] - top[1][1]


def test_a_diverging_record_carries_both_sides_top_tokens_at_the_divergence():
    from lossless.study.audit import Reference, pair_record
    from lossless.study.candidates import CandidateRun

    def tops(ids, runner_up):
        return [[[t, 5.0], [runner_up, 4.96875], [9, 1.0]] for t in ids]

    ref = Reference([1, 2, 3, 4], [0.03125] * 4, 0.5, 4, 0.1, tops=tops([1, 2, 3, 4], 7))
    run = CandidateRun([1, 2, 7, 4], 0.05, 3, [0.03125] * 4, tops=tops([1, 2, 7, 4], 3))
    prompt = {"id": "p", "domain": "d", "prompt": "x"}
    r = pair_record(prompt, [5, 6], "bf16", "sdpa", "sdpa", 4, ref, run)
    assert r["first_divergence"] == 2
    assert r["ref_top_at_divergence"] == [[3, 5.0], [7, 4.9688], [9, 1.0]]
    assert r["orthrus_top_at_divergence"][:2] == [[7, 5.0], [3, 4.9688]]
    same = pair_record(prompt, [5, 6], "bf16", "sdpa", "sdpa", 4, ref, CandidateRun([1, 2, 3, 4], 0.05))
    assert same["first_divergence"] is None and same["ref_top_at_divergence"] is None
    reused = pair_record(prompt, [5, 6], "bf16", "sdpa", "sdpa", 4,
                         Reference.from_record({**r, "ar_ids": [1, 2, 3, 4]}), run)
    assert reused["ref_top_at_divergence"] is None and reused["orthrus_top_at_divergence"] is not None
