"""The lm-evaluation-harness model and `lossless eval`, on a tiny random Llama with a word-level tokenizer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_model_dir
from lm_eval.api.instance import Instance  # the harness is part of the test extra

from lossless.cli import main
from lossless.decoding.loop import DecodeConfig, decode
from lossless.errors import LosslessError
from lossless.evaluation.report import render_table, summarise
from lossless.evaluation.tasks import (
    arith_items,
    arith_results,
    capitals_items,
    capitals_results,
    extract_code,
    first_integer,
    humaneval_problems,
    humaneval_results,
    resolve_tasks,
    write_tasks,
)
from lossless.evaluation.harness import LosslessLM
from lossless.text import cut_at_stops
from lossless.stats import paired_bootstrap

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def lm(model_dir):
    return LosslessLM(model=str(model_dir), mode="ar", dtype="fp32", progress=False)


def _req(kind, args, idx=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=idx)


def _manual_logprob(lm, context, continuation):
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logits = lm.lm.backbone(input_ids=ids).logits[0].float()
    logp = F.log_softmax(logits, -1)
    n = len(context)
    rows = logp[n - 1: n - 1 + len(continuation)]
    return float(sum(rows[i, t] for i, t in enumerate(continuation))), rows.argmax(-1).tolist()


# ------------------------------------------------------------------------------------ log-likelihoods
def test_loglikelihood_matches_a_direct_computation(lm):
    ctx, cont = "w1 w2 w3 w4", " w5 w6 w7"
    (got, greedy), = lm.loglikelihood([_req("loglikelihood", (ctx, cont))], disable_tqdm=True)
    c_ids, k_ids = lm.tok_encode(ctx), lm.tok_encode(ctx + cont)[len(lm.tok_encode(ctx)):]
    assert len(k_ids) == 3
    want, argmaxes = _manual_logprob(lm, c_ids, k_ids)
    assert got == pytest.approx(want, abs=1e-4)
    assert greedy == (argmaxes == k_ids)
    assert got < 0


def test_loglikelihood_is_greedy_on_the_greedy_continuation(lm):
    ctx = "w9 w8 w7"
    c_ids = lm.tok_encode(ctx)
    state = decode(lm.lm, c_ids, "ar", DecodeConfig(max_new_tokens=3, eos_ids=(-1,)))
    cont = " " + lm.tokenizer.decode(state.generated)
    (_, greedy), = lm.loglikelihood([_req("loglikelihood", (ctx, cont))], disable_tqdm=True)
    assert greedy is True


def test_loglikelihood_rolling_scores_every_token_after_the_prefix(lm):
    text = "w3 w1 w4 w1 w5 w9 w2 w6"
    (got,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))], disable_tqdm=True)
    ids = lm.tok_encode(text)
    want, _ = _manual_logprob(lm, [lm.prefix_token_id], ids)
    assert got == pytest.approx(want, abs=1e-4)


# ------------------------------------------------------------------------------------------ generation
def test_generate_until_cuts_at_the_stop_string_and_stops_early(lm):
    ctx = "w5 w6 w7"
    free = lm.generate_one(ctx, {"max_gen_toks": 12})
    words = free.split()
    assert len(words) >= 6
    # a stop word from the middle whose first occurrence is there (so the cut lands mid-generation)
    i = next(i for i in range(3, len(words) - 1) if words.index(words[i]) == i)
    stop = " " + words[i]
    got = lm.generate_one(ctx, {"until": [stop], "max_gen_toks": 12})
    assert got == free.split(stop)[0]
    last = lm.generations[-1]
    assert last["finish"] == "stop" and len(last["token_ids"]) < 12


def test_orthrus_and_ar_answer_the_same_requests_identically_in_fp32(model_dir):
    ar = LosslessLM(model=str(model_dir), mode="ar", dtype="fp32", progress=False)
    orth = LosslessLM(model=str(model_dir), mode="orthrus", dtype="fp32", k=4, progress=False)
    reqs = [_req("generate_until", (f"w{i} w{i + 1} w{i + 2}", {"until": ["w50"], "max_gen_toks": 10}), i)
            for i in range(1, 6)]
    assert orth.generate_until(reqs, disable_tqdm=True) == ar.generate_until(reqs, disable_tqdm=True)
    assert all(g["stats"]["steps"] < len(g["token_ids"]) for g in orth.generations if len(g["token_ids"]) > 4)


def test_cut_at_stops_uses_the_earliest_stop():
    assert cut_at_stops("a b\nc```d", ["```", "\n"]) == "a b"
    assert cut_at_stops("abc", []) == "abc"


def test_bad_model_arguments_are_refused(model_dir):
    with pytest.raises(LosslessError, match="unknown mode"):
        LosslessLM(model=str(model_dir), mode="fast")
    with pytest.raises(LosslessError, match="unknown model argument"):
        LosslessLM(model=str(model_dir), temprature=0.5)


# ----------------------------------------------------------------------------------------------- tasks
def test_the_arithmetic_set_is_reproducible_and_well_formed():
    a, b = arith_items(), arith_items()
    assert a == b and len(a) == 250
    assert len({x["question"] for x in a}) == 250
    assert all(int(x["answer"]) >= 0 for x in a)
    assert len({x["kind"] for x in a}) == 8
    assert arith_items(50, seed=1) != arith_items(50, seed=2)


def test_arith_and_capitals_scoring():
    assert first_integer(" 1,234 apples") == "1234" and first_integer("none") is None
    doc = {"answer": "42"}
    assert arith_results(doc, [" 42\n"])["exact_match"] == 1.0
    assert arith_results(doc, [" 41 or 42"])["exact_match"] == 0.0
    cap = next(c for c in capitals_items() if c["country"] == "Ukraine")
    assert capitals_results(cap, [" Kyiv."])["exact_match"] == 1.0
    assert capitals_results(cap, [" Kiev"])["exact_match"] == 1.0
    assert capitals_results(cap, [" Lviv"])["exact_match"] == 0.0


def test_humaneval_scoring_runs_the_tests():
    problems = humaneval_problems()
    assert len(problems) == 164
    p = problems[0]
    good = "```python\n" + p["prompt"] + p["canonical_solution"] + "```\nSome prose."
    bad = "```python\n" + p["prompt"] + "    return not True\n```"
    assert humaneval_results(p, [good]) == {"pass@1": 1.0}
    assert humaneval_results(p, [bad]) == {"pass@1": 0.0}
    assert humaneval_results(p, ["I cannot help with that."]) == {"pass@1": 0.0}
    assert extract_code("```py\nx = 1\n```") == "x = 1\n" and extract_code("x = 2") == "x = 2"


def test_resolve_tasks():
    assert resolve_tasks("arith,lossless_capitals,arith") == ["lossless_arith", "lossless_capitals"]
    with pytest.raises(LosslessError, match="unknown task"):
        resolve_tasks("mmlu")


def test_written_tasks_use_local_json_with_absolute_paths(tmp_path):
    d = write_tasks(tmp_path / "t")
    for name in ("lossless_humaneval", "lossless_arith", "lossless_capitals"):
        text = (d / f"{name}.yaml").read_text()
        assert "dataset_path: json" in text
        for line in text.splitlines():
            if line.strip().startswith(("test:", "shots:")):
                assert Path(json.loads(line.split(":", 1)[1])).is_absolute()
    assert "unsafe_code: true" in (d / "lossless_humaneval.yaml").read_text()


def test_paired_bootstrap_covers_a_planted_score_difference():
    rng = np.random.default_rng(7)
    ar = rng.random(500) < 0.4
    flip = rng.random(500) < 0.15  # orthrus gains 15 points on items AR got wrong, loses none
    orth = ar | flip
    res = paired_bootstrap(ar.astype(float), orth.astype(float), seed=0)
    lo, hi = res["ci95"]
    planted = float(orth.mean() - ar.mean())
    assert lo <= planted <= hi and lo > 0


# ------------------------------------------------------------------------------------------ end to end
def test_lossless_eval_runs_a_local_task_end_to_end(model_dir, tmp_path, capsys):
    out = tmp_path / "ev"
    rc = main(["eval", "--model", str(model_dir), "--tasks", "arith,capitals", "--modes", "ar,orthrus",
               "--dtypes", "fp32", "--k", "4", "--limit", "2", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads((out / "summary.json").read_text())
    got = {(r["task"], r["mode"], r["dtype"]): r for r in summary["results"]}
    assert set(got) == {(t, m, "fp32") for t in ("arith", "capitals") for m in ("ar", "orthrus")}
    assert all(r["n"] == 2 for r in got.values())
    for p in summary["paired"]:
        assert p["n"] == 2 and p["generations_differ"] == 0 and p["diff"] == 0.0  # fp32: same tokens
        assert p["score_changed"] == 0 and p["score_changed_ci95"][0] == 0.0 < p["score_changed_ci95"][1]
    for m in ("ar", "orthrus"):
        assert (out / "harness" / f"{m}_fp32" / "samples_arith.jsonl").exists()
    assert "| arith | fp32 |" in (out / "report.md").read_text()
    assert (out / "scores.png").stat().st_size > 1000
    assert summary["commands"] == [f"lossless eval --model {model_dir} --tasks arith,capitals --modes ar,orthrus "
                                   f"--dtypes fp32 --k 4 --limit 2 --out {out} --no-progress"]


def test_summarise_needs_only_the_harness_files(tmp_path):
    for mode, scores in (("ar", [1, 0, 0, 1]), ("orthrus", [1, 1, 0, 1])):
        run = tmp_path / "harness" / f"{mode}_bf16"
        run.mkdir(parents=True)
        res = {"results": {"lossless_arith": {"exact_match,none": sum(scores) / 4, "exact_match_stderr,none": 0.25}},
               "lossless": {"mode": mode, "dtype": "bf16", "attn": "sdpa", "command": f"lossless eval --modes {mode}"}}
        (run / "results_arith.json").write_text(json.dumps(res))
        (run / "samples_arith.jsonl").write_text("".join(
            json.dumps({"doc_id": i, "exact_match": float(x), "resps": [[f" {x}"]]}) + "\n" for i, x in enumerate(scores)))
    summary = summarise(tmp_path)
    (p,) = summary["paired"]
    assert (p["task"], p["n"], p["ar"], p["orthrus"]) == ("arith", 4, 0.5, 0.75)
    assert p["generations_differ"] == 1 and p["score_changed"] == 1 and p["diff"] == 0.25
    assert summary["commands"] == ["lossless eval --modes ar", "lossless eval --modes orthrus"]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (tmp_path / "report.md").read_text().startswith(render_table(summary))
    assert (tmp_path / "scores.png").exists()
    from lossless.study.htmlreport import unpack

    (item,) = unpack((tmp_path / "report.html").read_text())["items"]  # the one item whose responses differ
    assert (item["key"], item["ar"], item["orthrus"], item["ar_score"], item["orthrus_score"]) == \
        ("arith|bf16|orthrus|1", " 0", " 1", 0.0, 1.0)


def test_lm_eval_cli_finds_the_registered_model(model_dir, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    lm_eval_bin = Path(sys.executable).with_name("lm_eval")
    cmd = [str(lm_eval_bin)] if lm_eval_bin.exists() else [sys.executable, "-m", "lm_eval"]
    proc = subprocess.run(cmd + ["--model", "lossless", "--model_args",
                                 f"model={model_dir},mode=orthrus,dtype=fp32,k=4,progress=false",
                                 "--tasks", "lossless_capitals", "--include_path", str(tasks), "--limit", "2",
                                 "--output_path", str(tmp_path / "out")],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lossless_capitals" in proc.stdout and "exact_match" in proc.stdout
    assert list((tmp_path / "out").rglob("results_*.json"))


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, needle", [
    (["--tasks", "mmlu"], "unknown task"),
    (["--tasks", "humaneval"], "--confirm-run-unsafe-code"),
    (["--tasks", "arith", "--modes", "fast"], "unknown mode"),
    (["--tasks", "arith", "--dtypes", "fp8"], "unknown dtype"),
    (["--tasks", "arith", "--limit", "0"], "--limit"),
])
def test_eval_bad_input_exits_2(model_dir, tmp_path, capsys, argv, needle):
    rc = main(["eval", "--model", str(model_dir), "--out", str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err


def test_eval_without_the_harness_names_the_extra(model_dir, tmp_path):
    code = ("import sys; sys.modules['lm_eval'] = None; from lossless.cli import main; "
            f"sys.exit(main(['eval', '--model', {str(model_dir)!r}, '--tasks', 'arith', '--out', {str(tmp_path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2
    assert "lossless[eval]" in proc.stderr and "Traceback" not in proc.stderr
