"""Prompt lookup beside the drafts (greedy, two-pass): tokens copied from where the context's last tokens
occurred before are verified with the drafts, or alone when the match is long. Lookup decoding == ar token
for token on tiny random backbones in fp32 (whose greedy outputs repeat themselves, so lookups hit), a
long match skips the draft pass, the lookup finds the most recent longest match, bad requests are refused."""

from __future__ import annotations

import pytest
import torch

from conftest import (NO_EOS, PROMPTS, ar_reference, assert_stops_at_length_and_at_eos, plain_and_noisy_models,
                      tiny_orthrus)
from lossless.decoding import loop as decoding
from lossless.decoding.loop import DecodeConfig, decode, lookup_proposal
from lossless.errors import LosslessError
from lossless.decoding.sampling import SamplingConfig

N_NEW = 48
REPEATING = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]  # a prompt that invites copying


@pytest.fixture(scope="module")
def models():
    return plain_and_noisy_models()


def test_lookup_takes_the_most_recent_occurrence_of_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]
    assert lookup_proposal(tokens, 3) == ([2, 5, 6], 3)  # 5 6 7 at 4 (not 0) is the most recent
    assert lookup_proposal(tokens, 1) == ([2], 3)
    assert lookup_proposal([9, 8, 1, 2, 4, 4, 1, 2], 3) == ([4, 4, 1], 2)  # no 3-token match: 2 tokens
    assert lookup_proposal([9, 1, 8, 3, 1], 3) == ([8, 3, 1], 1)
    assert lookup_proposal([1, 2, 3, 4], 4) == ([], 0)  # nothing occurred before
    assert lookup_proposal([1, 2, 1, 2], 0) == ([], 0)
    # a copy that reaches the context's end runs on into itself: a repeating span repeats
    assert lookup_proposal([9, 1, 8, 3, 1], 5) == ([8, 3, 1, 8, 3], 1)
    assert lookup_proposal([4, 1, 2, 3, 1, 2, 3], 8) == ([1, 2, 3, 1, 2, 3, 1, 2], 3)
    assert lookup_proposal([7, 7], 4) == ([7, 7, 7, 7], 1)


@pytest.mark.parametrize("tree", [0, 8])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_lookup_greedy_equals_ar_greedy_token_for_token(models, family, tree, n):
    alone = 0
    for model in models[family]:
        for prompt in (*PROMPTS, REPEATING):
            ar = ar_reference(model, prompt, N_NEW)
            state = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=N_NEW, tree=tree, lookup=n,
                                                                   eos_ids=NO_EOS))
            assert state.generated == ar
            assert sum(state.stats.accepted) + state.stats.steps == N_NEW - 1
            assert state.stats.steps <= state.stats.forwards <= 1 + 2 * state.stats.steps
            alone += 2 * state.stats.steps - (state.stats.forwards - 1)  # cycles without a draft pass
    assert alone > 0  # long matches were verified alone


@pytest.mark.parametrize("n", [1, 4, 16])
def test_fused_lookup_equals_ar_greedy_and_verifies_copies_in_its_one_forward(models, family, n):
    copied = 0
    for model in models[family]:
        for prompt in (*PROMPTS, REPEATING):
            ar = ar_reference(model, prompt, N_NEW)
            state = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=N_NEW, cycle="fused", lookup=n,
                                                                   eos_ids=NO_EOS))
            assert state.generated == ar
            assert state.stats.forwards == 1 + state.stats.steps  # still one forward per cycle
            copied += max(state.stats.accepted) > 2  # more than the fused block's two drafts: a copy was verified
    assert (copied > 0) == (n > 2)  # a copy replaces the drafts only when it is longer than they are


def test_a_right_lookup_commits_a_long_span_in_one_forward_and_leaves_ar_s_cache(models):
    """The tiny model's greedy output cycles; once a cycle has been generated, every lookup copies the rest
    of it: far more tokens per cycle than the chain of drafts, the output and the cache are AR's."""
    model = models["llama"][1]
    prompt = PROMPTS[0]  # the greedy output ends in a loop of three tokens
    ref = ar_reference(model, prompt, N_NEW)
    chain = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=N_NEW, eos_ids=NO_EOS))
    looked = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=N_NEW, lookup=16, eos_ids=NO_EOS))
    assert looked.generated == chain.generated == ref
    assert looked.stats.steps < chain.stats.steps and max(looked.stats.accepted) > 8  # past the draft block
    ar = decode(model, prompt, "ar", DecodeConfig(max_new_tokens=N_NEW, eos_ids=NO_EOS))
    for a, b in zip(ar.cache.layers, looked.cache.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)


def test_a_wrong_lookup_costs_no_token(models, monkeypatch):
    """A lookup that always copies the wrong tokens, verified alone or beside the drafts: still AR's output."""
    model = models["qwen3"][0]
    vocab = model.config.vocab_size
    monkeypatch.setattr(decoding, "lookup_proposal",
                        lambda tokens, n: ([(t + 1) % vocab for t in tokens[-n:]][:n], 3 if len(tokens) % 2 else 1))
    for prompt in (*PROMPTS, REPEATING):
        state = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=N_NEW, lookup=6, eos_ids=NO_EOS))
        assert state.generated == ar_reference(model, prompt, N_NEW)


def test_a_cycle_with_nothing_beside_its_chain_is_the_chain_cycle_bit_for_bit(family, monkeypatch):
    """bf16, no context match: every lookup cycle is a bare chain, verified by the plain causal verify (never the
    tree-mask path), so tokens and every committed margin equal the chain cycle's to the bit."""
    model = tiny_orthrus(family, k=8)
    model.backbone.to(torch.bfloat16)
    monkeypatch.setattr(decoding, "lookup_proposal", lambda tokens, n: ([], 0))
    monkeypatch.setattr(model, "verify_tree", lambda *a: pytest.fail("a chain went through verify_tree"))
    for prompt in (*PROMPTS, REPEATING):
        runs = [decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=N_NEW, eos_ids=NO_EOS, lookup=n,
                                                              record_margins=True)) for n in (0, 16)]
        assert runs[0].generated == runs[1].generated and runs[0].margins == runs[1].margins
        assert runs[0].stats.accepted == runs[1].stats.accepted


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_lookup_stops_at_max_new_tokens_and_at_eos_inside_a_span(models, max_new):
    assert_stops_at_length_and_at_eos(models["llama"][0], (*PROMPTS, REPEATING), max_new, 30, 20, lookup=16)


@pytest.mark.parametrize("cycle", [dict(), dict(tree=4), dict(cycle="fused")], ids=["chain", "tree", "fused"])
def test_lookup_samples_too_and_one_seed_gives_one_text(models, monkeypatch, cycle):
    """Sampled, a copied span is verified as candidates (a copy kept where it is the token AR's draw at its
    position chooses, `accept_sampling` without q): a repeating prompt's copies are tried and some taken, the
    request ends where it should, and one seed gives the same tokens again (the draws' distribution:
    test_decoding.py)."""
    model = models["llama"][0]
    seen = []
    real = decoding.accept_sampling

    def counting(d, q, *rest):
        seen.append((len(d), q is None))
        return real(d, q, *rest)
    monkeypatch.setattr(decoding, "accept_sampling", counting)
    for seed in range(8):  # until a seed's tokens repeat the prompt's pattern (a draw may leave it at once)
        cfg = DecodeConfig(max_new_tokens=24, eos_ids=NO_EOS, lookup=8,
                           sampling=SamplingConfig(temperature=0.3, seed=seed), **cycle)
        runs = [decode(model, REPEATING * 3, "orthrus", cfg) for _ in range(2)]
        assert runs[0].generated == runs[1].generated and len(runs[0].generated) == 24
        if any(n > 0 and copied for n, copied in seen):  # (a copy went through AR's draws)
            break
    assert any(n > 0 and copied for n, copied in seen)
    assert sum(runs[0].stats.accepted) > 0


@pytest.mark.parametrize("cfg,needle", [
    (DecodeConfig(lookup=8, tree=8, cycle="fused"), "two-pass"),
    (DecodeConfig(lookup=-1), "--lookup"),
])
def test_bad_lookup_requests_are_refused(models, cfg, needle):
    with pytest.raises(LosslessError, match=needle):
        decode(models["llama"][0], PROMPTS[0], "orthrus", cfg)


def test_a_tree_or_lookup_with_a_given_drafter_is_refused(models):
    with pytest.raises(LosslessError, match="drafter"):
        decode(models["llama"][0], PROMPTS[0], "orthrus", DecodeConfig(lookup=8),
               drafter=lambda model, state, k, sampling, generator: ([], None))
