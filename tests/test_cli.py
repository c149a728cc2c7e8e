"""The command line: user errors exit 2 with one line on stderr and no traceback; `generate --json`
prints a parseable last line that agrees with the library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lossless
from lossless.decoding import kernels
from lossless.decoding.exact import cpu_multiplies_natively
from conftest import save_tiny_model_dir, tiny_orthrus
from lossless.cli import main

PROMPT = "w1 w5 w9 w3"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny llama with a word-level tokenizer, a tokenizer-less copy, a foreign head, a broken model."""
    root = tmp_path_factory.mktemp("cli")
    model = save_tiny_model_dir(root / "tiny-llama", "llama", seed=0)
    bare = save_tiny_model_dir(root / "no-tokenizer", "llama", seed=0, tokenizer=False)
    foreign = tiny_orthrus("llama", k=4, seed=1).save_head(root / "foreign-head")
    broken = root / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    return {"model": str(model), "bare": str(bare), "foreign": str(foreign), "broken": str(broken),
            "missing": str(root / "does-not-exist"), "nohead": str(root)}


def _gen(*args: str) -> list[str]:
    return ["generate", *args]


BAD_INPUTS = {
    # name: (argv builder, substring of the message)
    "unknown model name": (lambda d: _gen("--model", "no-such-model", PROMPT), "unknown model"),
    "missing model directory": (lambda d: _gen("--model", d["missing"], PROMPT), "unknown model"),
    "unreadable config": (lambda d: _gen("--model", d["broken"], PROMPT), "config.json"),
    "unknown dtype": (lambda d: _gen("--model", d["model"], "--dtype", "fp8", PROMPT), "unknown dtype"),
    "unknown attention kernel": (lambda d: _gen("--model", d["model"], "--attn", "flash", PROMPT), "attention"),
    "k zero": (lambda d: _gen("--model", d["model"], "--k", "0", PROMPT), "--k"),
    "k above the head's": (lambda d: _gen("--model", d["model"], "--k", "9", PROMPT), "--k"),
    "empty prompt": (lambda d: _gen("--model", d["model"], ""), "prompt is empty"),
    "blank prompt": (lambda d: _gen("--model", d["model"], "   "), "prompt is empty"),
    "no tokenizer": (lambda d: _gen("--model", d["bare"], PROMPT), "tokenizer"),
    "head for another backbone": (lambda d: _gen("--model", d["model"], "--head", d["foreign"], PROMPT),
                                  "another backbone"),
    "no head there": (lambda d: _gen("--model", d["model"], "--head", d["nohead"], PROMPT), "no head"),
    "max new tokens zero": (lambda d: _gen("--model", d["model"], "--max-new-tokens", "0", PROMPT),
                            "--max-new-tokens"),
    "past the context": (lambda d: _gen("--model", d["model"], "--max-new-tokens", "1000", PROMPT), "context"),
    "negative temperature": (lambda d: _gen("--model", d["model"], "--temperature", "-1", PROMPT), "--temperature"),
    "negative top-k": (lambda d: _gen("--model", d["model"], "--top-k", "-1", PROMPT), "--top-k"),
    "top-p zero": (lambda d: _gen("--model", d["model"], "--top-p", "0", PROMPT), "--top-p"),
}


def _assert_one_line_error(rc: int, out: str, err: str, needle: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err and "Traceback" not in out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("lossless: error: ")
    assert needle in lines[0]
    assert out == ""


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_a_one_line_message(dirs, capsys, case):
    argv, needle = BAD_INPUTS[case]
    rc = main(argv(dirs))
    captured = capsys.readouterr()
    _assert_one_line_error(rc, captured.out, captured.err, needle)


def _gpt2_dir(root: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    path = root / "tiny-gpt2"
    if not path.exists():
        GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=16, n_layer=1, n_head=2)).save_pretrained(path)
    return path


def _suite_prompt_file(root: Path) -> str:
    """A prompt file holding one audit-suite prompt, re-spaced and re-cased: training must refuse it."""
    from lossless import paths
    from lossless.training.distill import read_prompts

    prompt = read_prompts(paths.DEFAULT_SUITE)[7]["prompt"]
    path = root / "leaky.jsonl"
    path.write_text(json.dumps({"id": "x", "prompt": "  " + prompt.upper().replace(" ", "   ")}) + "\n")
    return str(path)


BAD_INPUTS_BEFORE_LOADING = {
    # name: (argv builder, substring of the message); none of these may load a model
    "unsupported architecture": (lambda d, t: _gen("--model", str(_gpt2_dir(t)), PROMPT), "llama, qwen3"),
    "train prompts missing": (lambda d, t: ["train", "--model", d["model"], "--out", str(t / "h"), "--prompts",
                                            str(t / "missing.jsonl")], "missing.jsonl"),
    "train prompts not JSONL": (lambda d, t: ["train", "--model", d["model"], "--out", str(t / "h"), "--prompts",
                                              d["broken"] + "/config.json"], "prompt"),
    "train data missing": (lambda d, t: ["train", "--model", d["model"], "--out", str(t / "h"), "--data",
                                         str(t / "nothing.txt")], "--data"),
    "train distill dir empty": (lambda d, t: ["train", "--model", d["model"], "--out", str(t / "h"), "--distill-dir",
                                              str(t / "nothing")], "lossless distill"),
    "train position weights length": (lambda d, t: ["train", "--model", d["model"], "--out", str(t / "h"), "--k", "4",
                                                    "--position-weights", "0,1"], "--position-weights"),
    "train position weights text": (lambda d, t: ["train", "--model", d["model"], "--out", str(t / "h"),
                                                  "--position-weights", "zero,one"], "--position-weights"),
    "train init head missing": (lambda d, t: ["train", "--model", d["model"], "--out", str(t / "h"), "--init-head",
                                              d["missing"]], "no head"),
    "train init head and resume": (lambda d, t: ["train", "--model", d["model"], "--out", str(t / "h"), "--init-head",
                                                 d["missing"], "--resume"], "--init-head"),
    "distill prompts missing": (lambda d, t: ["distill", "--model", d["model"], "--out", str(t / "r"), "--prompts",
                                              str(t / "missing.jsonl")], "missing.jsonl"),
    "distill prompts from the suite": (lambda d, t: ["distill", "--model", d["model"], "--out", str(t / "r"),
                                                     "--prompts", _suite_prompt_file(t)], "the audit suite"),
    "distill bad shard": (lambda d, t: ["distill", "--model", d["model"], "--out", str(t / "r"), "--shard", "3/2"],
                          "shard"),
    "probe empty text": (lambda d, t: ["probe", "--model", d["model"], " "], "empty"),
    "probe k one": (lambda d, t: ["probe", "--model", d["model"], "--k", "1", PROMPT], "--k"),
    "generate head missing": (lambda d, t: _gen("--model", d["model"], "--head", d["missing"], PROMPT), "no head"),
    "generate empty prompt": (lambda d, t: _gen("--model", d["model"], " "), "prompt is empty"),
    "generate top-p zero": (lambda d, t: _gen("--model", d["model"], "--top-p", "0", PROMPT), "--top-p"),
    "generate tree fused": (lambda d, t: _gen("--model", d["model"], "--tree", "8", "--cycle", "fused", PROMPT),
                            "two-pass"),
    "generate groups zero": (lambda d, t: _gen("--model", d["model"], "--cycle", "fused", "--groups", "0", PROMPT),
                             "--groups"),
    "audit groups zero": (lambda d, t: ["audit", "--model", d["model"], "--cycle", "fused", "--groups", "0",
                                        "--out", str(t / "run")], "--groups"),
    "audit suite missing": (lambda d, t: ["audit", "--model", d["model"], "--suite", str(t / "none.jsonl"),
                                          "--out", str(t / "run")], "none.jsonl"),
    "eval unknown kernel": (lambda d, t: ["eval", "--model", d["model"], "--attn", "flash", "--out", str(t / "e")],
                            "attention kernel"),
    "eval unknown task": (lambda d, t: ["eval", "--model", d["model"], "--tasks", "nope", "--out", str(t / "e")],
                          "nope"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS_BEFORE_LOADING))
def test_bad_input_is_refused_before_any_model_loads(dirs, tmp_path, capsys, monkeypatch, case):
    import lossless.decoding.models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(lossless.decoding.models, "_load_hf", no_loading)
    monkeypatch.setattr(lossless.decoding.models, "embedded_model_dir", no_loading)
    argv, needle = BAD_INPUTS_BEFORE_LOADING[case]
    args = argv(dirs, tmp_path)
    capsys.readouterr()  # what building the inputs printed (e.g. a save_pretrained progress bar) is not the CLI's
    rc = main(args)
    captured = capsys.readouterr()
    _assert_one_line_error(rc, captured.out, captured.err, needle)


def test_an_unsupported_backbone_is_named_in_the_library_too(tmp_path):
    from transformers import GPT2LMHeadModel

    from lossless.decoding.model import OrthrusLM

    with pytest.raises(lossless.LosslessError, match="supported families: llama, qwen3"):
        OrthrusLM(GPT2LMHeadModel.from_pretrained(_gpt2_dir(tmp_path)))


@pytest.mark.parametrize("device", [
    "not-a-device",
    pytest.param("cuda", marks=pytest.mark.skipif(torch.version.cuda is not None,
                                                  reason="torch is built with CUDA here; the bug is CPU-build only")),
])
def test_bad_device_exits_2_with_a_one_line_message(dirs, capsys, device):
    try:
        rc = main(_gen("--model", dirs["model"], "--device", device, PROMPT))
    except Exception as exc:  # what the CLI lets escape becomes a traceback
        pytest.fail(f"{type(exc).__name__} escaped the CLI: {exc}")
    captured = capsys.readouterr()
    _assert_one_line_error(rc, captured.out, captured.err, "device")


def test_the_installed_script_prints_no_traceback_on_bad_input(dirs):
    script = Path(sys.executable).with_name("lossless")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lossless"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = _gen("--model", dirs["model"], "--head", dirs["foreign"], PROMPT)
    proc = subprocess.run(cmd + argv, capture_output=True, text=True, env=env, timeout=120)
    _assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "another backbone")


# -------------------------------------------------------------------------------------------- generate
def _generate_json(capsys, *args: str) -> dict:
    rc = main(["generate", "--json", *args])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "Traceback" not in captured.err
    lines = captured.out.strip().splitlines()
    assert lines
    return json.loads(lines[-1])


def test_generate_json_prints_a_parseable_last_line_that_matches_the_library(dirs, capsys):
    out = {mode: _generate_json(capsys, "--model", dirs["model"], "--mode", mode, "--max-new-tokens", "12", PROMPT)
           for mode in ("orthrus", "ar")}
    for result in out.values():
        assert {"text", "token_ids", "stats", "finish_reason"} <= set(result)
        assert isinstance(result["text"], str) and result["text"]
        assert all(isinstance(t, int) for t in result["token_ids"])
        assert result["stats"]["new_tokens"] == len(result["token_ids"]) >= 1
        assert result["prompt_tokens"] == 4
    assert out["orthrus"]["token_ids"] == out["ar"]["token_ids"]
    assert out["orthrus"]["text"] == out["ar"]["text"]
    # the defaults: the fastest lossless configuration, and the output says what ran
    native_bf16 = cpu_multiplies_natively(torch.bfloat16)
    assert out["orthrus"]["config"] == {"dtype": "bf16" if native_bf16 else "fp32", "attn": "exact", "exact": True,
                                        "mode": "orthrus", "cycle": "two-pass", "k": 8, "tree": 0, "lookup": 16,
                                        "choice": None,  # an untrained head: its chain, chosen by no costs
                                        "versus_ar": "tokens",
                                        "kernels": f"{kernels.source_digest()}/{kernels.isa()}"}
    assert out["ar"]["config"]["mode"] == "ar" and out["ar"]["config"]["lookup"] == 0

    model = lossless.load_model(dirs["model"])
    lib = model.generate(PROMPT, mode="ar", max_new_tokens=12)
    assert lib.prompt_ids == [1, 5, 9, 3]
    assert out["ar"]["token_ids"] == lib.token_ids
    assert out["ar"]["finish_reason"] == lib.finish_reason
    assert out["ar"]["text"] == model.tokenizer.decode(lib.token_ids, skip_special_tokens=True)


def test_generate_streams_the_same_text_without_json(dirs, capsys):
    expected = _generate_json(capsys, "--model", dirs["model"], "--max-new-tokens", "12", PROMPT)
    rc = main(["generate", "--model", dirs["model"], "--max-new-tokens", "12", PROMPT])
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.out == expected["text"]
    summary = captured.err.strip().splitlines()[-1]
    assert summary.startswith(f"[orthrus k=8 chain + lookup 16, {expected['config']['dtype']} exact (kernels "
                              f"{kernels.build_name()}), AR's tokens |")
    assert f"{len(expected['token_ids'])} tokens" in summary


@pytest.mark.parametrize("args, want", [
    (["--attn", "sdpa", "--dtype", "fp32"], {"dtype": "fp32", "attn": "sdpa", "exact": False, "tree": 0, "lookup": 16,
                                             "versus_ar": "not guaranteed"}),
    (["--attn", "sdpa", "--mode", "ar"], {"attn": "sdpa", "mode": "ar", "versus_ar": "tokens"}),  # AR is AR
    # sampling: no tree, no lookup (an untrained head's chain: rejection sampling, AR's distribution)
    (["--temperature", "0.8"], {"attn": "exact", "tree": 0, "lookup": 0, "versus_ar": "distribution"}),
    (["--temperature", "0.8", "--tree", "4"], {"tree": 4, "versus_ar": "tokens"}),  # a sampled tree: AR's draws
    (["--tree", "--lookup", "0"], {"tree": 8, "lookup": 0, "versus_ar": "tokens"}),
    (["--tree", "0", "--lookup", "4"], {"tree": 0, "lookup": 4}),
    (["--cycle", "fused"], {"cycle": "fused", "k": 3, "tree": 0, "lookup": 16, "versus_ar": "tokens"}),
    (["--cycle", "fused", "--temperature", "0.8"], {"cycle": "fused", "versus_ar": "distribution"}),
])
def test_generate_says_which_configuration_ran(dirs, capsys, args, want):
    config = _generate_json(capsys, "--model", dirs["model"], "--max-new-tokens", "6", *args, PROMPT)["config"]
    assert {key: config[key] for key in want} == want


def test_costs_profiles_a_head_measures_the_cpu_and_generate_runs_what_they_choose(dirs, tmp_path, capsys, monkeypatch):
    from lossless.decoding import cycles

    monkeypatch.setattr(cycles, "cycles_dir", lambda: tmp_path / "cycles")  # not the kernels' cache: no rebuild
    monkeypatch.delenv("LOSSLESS_CYCLE", raising=False)
    rc = main(["costs", "--model", dirs["model"], "--profile"])
    captured = capsys.readouterr()
    _assert_one_line_error(rc, captured.out, captured.err, "untrained head")
    assert main(["costs", "--model", dirs["model"]]) == 0  # the costs, and the untrained head's chain
    assert "default: chain + lookup 16: the head is untrained" in capsys.readouterr().out
    source = tiny_orthrus("llama", seed=0)
    with torch.no_grad():
        for p in source.head_parameters().values():
            p.add_(0.05 * torch.randn_like(p))
    head = str(source.save_head(tmp_path / "head"))
    rc = main(["costs", "--model", dirs["model"], "--head", head, "--attn", "sdpa", "--profile"])
    captured = capsys.readouterr()
    _assert_one_line_error(rc, captured.out, captured.err, "--attn exact")
    rc = main(["costs", "--model", dirs["model"], "--head", head, "--profile", "--max-new-tokens", "1"])
    captured = capsys.readouterr()
    _assert_one_line_error(rc, captured.out, captured.err, "--max-new-tokens must be >= 2")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"prompt": "the cat the cat the"}) + "\n")
    rc = main(["costs", "--model", dirs["model"], "--head", head, "--profile", "--prompts", str(prompts),
               "--max-new-tokens", "6", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert len(out["choice"]["predicted"]) == 15 and out["choice"]["mode"] in ("ar", "orthrus")
    assert set(out["costs"]["rows"]) == {"1", "5", "9", "13", "17", "24", "32", "40"}
    assert Path(out["profile"]).exists() and out["costs"]["variant"] != "stock"
    generated = _generate_json(capsys, "--model", dirs["model"], "--head", head, "--max-new-tokens", "6", PROMPT)
    assert generated["config"]["choice"] == out["choice"]  # the costs measured once, read by the next process
    assert generated["config"]["mode"] == out["choice"]["mode"]
    rc = main(["generate", "--model", dirs["model"], "--head", head, "--max-new-tokens", "6", PROMPT])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0 and err[-2] == f"[default cycle: {out['choice']['why']}]"
    rc = main(["costs", "--model", dirs["model"], "--head", head])
    text = capsys.readouterr().out
    assert rc == 0 and "verify 17 rows" in text and f"default: {out['choice']['why']}" in text
    assert text.count("x") >= 15  # a predicted speed-up per candidate
    assert out["sampled"]["ar_below"] > 1 and f"sampled requests (--temperature): {out['sampled']['why']}" in text
    sampled = _generate_json(capsys, "--model", dirs["model"], "--head", head, "--max-new-tokens", "6",
                             "--temperature", "0.8", PROMPT)
    assert sampled["config"]["choice"] == out["sampled"]  # a sampled request's default, from the same costs


def test_auto_picks_exact_kernels_and_bf16_only_where_the_cpu_multiplies_bf16_natively(monkeypatch):
    from lossless.decoding import kernels, models

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    assert models.resolve_auto("auto", "auto", "cpu") == ("bf16", "exact", None)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert models.resolve_auto("auto", "auto", "cpu") == ("fp32", "exact", None)
    assert models.resolve_auto("fp16", "eager", "cpu") == ("fp16", "eager", None)  # explicit choices stand
    dtype, attn, note = models.resolve_auto("auto", "auto", "cuda")
    assert (dtype, attn) == ("fp32", "sdpa") and "CPU only" in note and "\n" not in note


def test_auto_cycle_speculates_only_where_it_stays_lossless_and_pays():
    from lossless.decoding.loop import auto_cycle
    from lossless.names import DEFAULT_LOOKUP, DEFAULT_TREE

    assert auto_cycle("orthrus", "two-pass", True, True, None, None) == (DEFAULT_TREE, DEFAULT_LOOKUP)
    assert auto_cycle("orthrus", "two-pass", True, False, None, None) == (0, DEFAULT_LOOKUP)  # untrained head
    assert auto_cycle("orthrus", "fused", True, True, None, None) == (0, DEFAULT_LOOKUP)
    assert auto_cycle("orthrus", "two-pass", False, True, None, None) == (0, 0)  # sampling
    assert auto_cycle("ar", "two-pass", True, True, None, None) == (0, 0)
    assert auto_cycle("orthrus", "two-pass", True, True, 12, 0) == (12, 0)


def test_generate_with_the_fused_cycle_equals_ar(dirs, capsys):
    ar = _generate_json(capsys, "--model", dirs["model"], "--mode", "ar", "--max-new-tokens", "12", PROMPT)
    fused = _generate_json(capsys, "--model", dirs["model"], "--cycle", "fused", "--max-new-tokens", "12", PROMPT)
    assert fused["token_ids"] == ar["token_ids"]
    assert fused["stats"]["forwards"] == 1 + fused["stats"]["steps"]  # one forward per cycle
    with pytest.raises(SystemExit) as exc:  # argparse's choices
        main(["generate", "--model", dirs["model"], "--cycle", "triple", PROMPT])
    assert exc.value.code == 2 and "--cycle" in capsys.readouterr().err


def test_generate_with_tree_and_lookup_equals_ar(dirs, capsys):
    ar = _generate_json(capsys, "--model", dirs["model"], "--mode", "ar", "--max-new-tokens", "24", PROMPT)
    both = _generate_json(capsys, "--model", dirs["model"], "--tree", "--lookup", "--max-new-tokens", "24", PROMPT)
    assert both["token_ids"] == ar["token_ids"]
    fused = _generate_json(capsys, "--model", dirs["model"], "--cycle", "fused", "--lookup", "--max-new-tokens", "24",
                           PROMPT)
    assert fused["token_ids"] == ar["token_ids"]
    # the README's form: bare --tree --lookup right before the prompt (neither option swallows it)
    readme = _generate_json(capsys, "--model", dirs["model"], "--max-new-tokens", "24", "--tree", "--lookup",
                            PROMPT)
    assert readme["token_ids"] == ar["token_ids"] and readme["prompt_tokens"] == both["prompt_tokens"]
    numbered = _generate_json(capsys, "--model", dirs["model"], "--max-new-tokens", "24", "--tree", "4", "--lookup", "8",
                              "--attn", "exact", PROMPT)
    assert numbered["token_ids"] == _generate_json(capsys, "--model", dirs["model"], "--mode", "ar", "--attn", "exact",
                                                   "--max-new-tokens", "24", PROMPT)["token_ids"]


def test_generate_json_with_sampling_is_reproducible(dirs, capsys):
    args = ("--model", dirs["model"], "--temperature", "1.0", "--seed", "7", "--max-new-tokens", "10", PROMPT)
    assert _generate_json(capsys, *args)["token_ids"] == _generate_json(capsys, *args)["token_ids"]


def test_every_option_of_every_command_is_explained():
    import argparse

    from lossless.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {action.dest}" for name, p in sub.choices.items() for action in p._actions
               if not isinstance(action, argparse._HelpAction) and not action.help]
    assert not missing
    assert "exact" in sub.choices["generate"].format_help()
