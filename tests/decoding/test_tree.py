"""Candidate trees in the two-pass cycle (greedy): the verify pass checks the top drafts and their
runners-up in one forward and keeps the longest path the AR view agrees with. Tree decoding == ar token
for token on tiny random backbones in fp32; a path through runner-up candidates is accepted and its cache
rows land where the chain's would; the tree is the most probable set of paths; bad requests are refused."""

from __future__ import annotations

import pytest
import torch

from conftest import NO_EOS, PROMPTS, ar_reference, assert_stops_at_length_and_at_eos, plain_and_noisy_models
from lossless.decoding.loop import DecodeConfig, build_tree, decode
from lossless.errors import LosslessError
from lossless.decoding.sampling import SamplingConfig

N_NEW = 40


@pytest.fixture(scope="module")
def models():
    return plain_and_noisy_models()


def test_the_tree_holds_the_most_probable_paths_parents_first():
    sure = [[0.99, 0.01]] * 7
    assert build_tree(7, sure) == tuple((0,) * n for n in range(1, 8))  # sure top drafts: the authors' chain
    scores = [[0.88, 0.08, 0.03, 0.01], [0.40, 0.15, 0.07, 0.04], [0.32, 0.15, 0.08, 0.05], [0.2, 0.19, 0.09, 0.04]]
    tree = build_tree(16, scores)
    assert len(tree) == 16 and len(set(tree)) == 16
    for i, p in enumerate(tree):  # prefix-closed, parents before children
        assert len(p) == 1 or p[:-1] in tree[:i]

    def score(path):
        out = 1.0
        for j, r in enumerate(path):
            out *= scores[j][r]
        return out

    # no path left out scores above a path taken (among the paths whose parent was taken)
    left_out = [p + (r,) for p in ((),) + tree for r in range(4) if len(p) < 4 and p + (r,) not in tree]
    assert max(score(p) for p in left_out) <= min(score(p) for p in tree)
    assert {(0,), (0, 0), (0, 1), (1,)} <= set(tree)
    assert all(len(p) <= 2 for p in build_tree(50, scores[:2]))
    assert build_tree(3, []) == ()


@pytest.mark.parametrize("nodes", [1, 6, 16, 40])
def test_tree_greedy_equals_ar_greedy_token_for_token(models, family, nodes):
    for model in models[family]:
        for prompt in PROMPTS:
            ar = ar_reference(model, prompt, N_NEW)
            state = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=N_NEW, tree=nodes, eos_ids=NO_EOS))
            assert state.generated == ar
            # a draft and a verify forward per cycle; a last cycle with one token left to go only verifies
            assert 2 * state.stats.steps <= state.stats.forwards <= 1 + 2 * state.stats.steps
            assert sum(state.stats.accepted) + state.stats.steps == N_NEW - 1


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_tree_stops_at_max_new_tokens_and_at_eos_inside_a_path(models, max_new):
    assert_stops_at_length_and_at_eos(models["llama"][0], PROMPTS, max_new, 20, 3, tree=16)


def test_a_path_of_runner_up_drafts_is_accepted_and_its_cache_rows_are_kept(models, monkeypatch):
    """A drafter whose top draft at block position 1 is always wrong but whose runner-up is right, and
    whose top drafts at positions 2.. are right: the chain accepts nothing, the tree accepts whole paths
    through a runner-up (rows that are not the first ones of the verify block), and the output is AR's."""
    model = models["qwen3"][0]
    prompt = PROMPTS[0]
    ref = prompt + ar_reference(model, prompt, N_NEW)
    vocab = model.config.vocab_size

    def draft(cache, last_token, k):
        n = cache.get_seq_length() + 1  # committed tokens; the next one is ref[n]
        logits = torch.zeros(k - 1, vocab)
        for j in range(k - 1):
            right = ref[n + j] if n + j < len(ref) else 0
            logits[j, right] = 5.0
            if j == 0:
                logits[j, (right + 1) % vocab] = 5.5  # a wrong top draft, the right token is the runner-up
        return logits

    monkeypatch.setattr(model, "draft", draft)
    chain = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=N_NEW, eos_ids=NO_EOS))
    tree = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=N_NEW, tree=16, eos_ids=NO_EOS))
    assert chain.generated == tree.generated == ref[len(prompt):]
    assert set(chain.stats.accepted) == {0}
    assert min(tree.stats.accepted[:-1]) >= 2  # every cycle took a path through the runner-up (the last is cut)
    # the cache holds what AR's cache holds for the committed tokens
    ar = decode(model, prompt, "ar", DecodeConfig(max_new_tokens=N_NEW, eos_ids=NO_EOS))
    for a, b in zip(ar.cache.layers, tree.cache.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cfg,needle", [
    (DecodeConfig(tree=8, cycle="fused"), "two-pass"),
    (DecodeConfig(tree=-1), "--tree"),
])
def test_bad_tree_requests_are_refused(models, cfg, needle):
    with pytest.raises(LosslessError, match=needle):
        decode(models["llama"][0], PROMPTS[0], "orthrus", cfg)


def test_tree_visibility_of_a_chain_is_causal_and_a_tree_sees_only_its_ancestors():
    """The one mask builder behind verify_tree and the fused cycle's verify rows."""
    from lossless.decoding.dualview import tree_visibility

    chain, depth = tree_visibility([-1, 0, 1, 2, 3], 3)
    assert torch.equal(chain, torch.ones(5, 8, dtype=torch.bool).tril(3)) and depth == [0, 1, 2, 3, 4]
    visible, depth = tree_visibility([-1, 0, 0, 1, 2], 2)  # root; two children; a grandchild under each
    assert depth == [0, 1, 1, 2, 2]
    assert visible[:, :2].all()
    assert [row.nonzero().flatten().tolist() for row in visible[:, 2:]] == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]
