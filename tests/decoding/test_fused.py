"""The fused cycle on tiny random backbones: one forward verifies a block and drafts every possible next
block. Greedy fused == ar token for token (untrained head, oracle and always-wrong drafters, several k
and group counts); stopping rules and the cache invariant; no verify row sees a group row; each group
drafts what the two-pass draft view drafts from the same anchor; rejection sampling keeps the AR
distribution."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from conftest import NO_EOS, PROMPTS, ar_reference, perturb_head, tiny_orthrus
from lossless.decoding import loop as decoding
from lossless.decoding.loop import DecodeConfig, commit_cache, decode
from lossless.decoding.sampling import SamplingConfig, sample
from test_decoding import N_SAMPLES, SAMPLING_PROMPT, _chi2_pvalue, oracle_drafter, spread_model  # noqa: F401

N_NEW = 40


def fused(**kw) -> DecodeConfig:
    return DecodeConfig(cycle="fused", **kw)


@pytest.fixture(scope="module")
def models():
    return {fam: tiny_orthrus(fam, k=8) for fam in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def perturbed():
    """Heads that draft something other than the AR view, so blocks are partly accepted."""
    out = {}
    for fam in ("llama", "qwen3"):
        model = tiny_orthrus(fam, k=8)
        perturb_head(model, 0.3)
        out[fam] = model
    return out


# ------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("K,groups", [(1, None), (2, None), (4, None), (8, None), (4, 2), (8, 3), (8, 1)])
def test_fused_greedy_equals_ar_greedy_token_for_token(models, perturbed, family, K, groups):
    for model in (models[family], perturbed[family]):
        for prompt in PROMPTS:
            ar = decode(model, prompt, "ar", DecodeConfig(max_new_tokens=N_NEW, eos_ids=NO_EOS))
            state = decode(model, prompt, "orthrus", fused(max_new_tokens=N_NEW, k=K, groups=groups, eos_ids=NO_EOS))
            assert state.generated == ar.generated
            assert state.finished == "length"
            # one forward per cycle after the prefill; each commits its accepted drafts plus one AR token
            assert state.stats.forwards == 1 + state.stats.steps
            assert sum(state.stats.accepted) + state.stats.steps == N_NEW - 1
            assert all(0 <= a <= K - 1 for a in state.stats.accepted)


def test_fused_accepts_drafts_when_the_head_drafts_well(models, family):
    """With the untrained head (the AR projections themselves) the first draft is often the AR token:
    the fused cycle really verifies group drafts, it is not a slow AR loop."""
    model = models[family]
    accepted = []
    for prompt in PROMPTS:
        accepted += decode(model, prompt, "orthrus", fused(max_new_tokens=N_NEW, eos_ids=NO_EOS)).stats.accepted
    assert sum(accepted) > 0


@pytest.mark.parametrize("K", [2, 4, 8])
def test_oracle_drafter_accepts_every_draft_with_one_forward_per_block(models, family, K):
    model = models[family]
    for prompt in PROMPTS[:2]:
        ref = ar_reference(model, prompt, N_NEW)
        state = decode(model, prompt, "orthrus", fused(max_new_tokens=N_NEW, k=K, eos_ids=NO_EOS),
                       drafter=oracle_drafter(ref))
        assert state.generated == ref
        assert state.stats.accepted[:-1] == [K - 1] * (len(state.stats.accepted) - 1)
        assert state.stats.forwards == 1 + state.stats.steps


@pytest.mark.parametrize("K", [2, 4, 8])
def test_always_wrong_drafter_matches_ar_and_accepts_nothing(models, family, K):
    model = models[family]
    vocab = model.config.vocab_size
    for prompt in PROMPTS[:2]:
        ref = ar_reference(model, prompt, N_NEW)
        state = decode(model, prompt, "orthrus", fused(max_new_tokens=N_NEW, k=K, eos_ids=NO_EOS),
                       drafter=oracle_drafter(ref, wrong=True, vocab=vocab))
        assert state.generated == ref
        assert state.stats.accepted == [0] * (N_NEW - 1)


# ------------------------------------------------------------------------------------------ stopping
@pytest.mark.parametrize("i", [3, 5, 7])
def test_eos_inside_an_accepted_block_stops_right_after_it(models, family, i):
    model = models[family]
    for prompt in PROMPTS:
        ref = ar_reference(model, prompt, N_NEW)
        if ref[i] not in ref[:i]:
            break
    else:
        pytest.fail(f"no prompt emits a first-time token at index {i}")
    cfg = fused(max_new_tokens=N_NEW, k=8, eos_ids=(ref[i],))
    state = decode(model, prompt, "orthrus", cfg, drafter=oracle_drafter(ref))
    assert state.generated == ref[: i + 1] and state.finished == "eos"
    assert state.stats.steps == 1  # the first block (drafts 1..7) held the EOS
    assert state.cache.get_seq_length() == len(state.tokens) - 1
    assert decode(model, prompt, "orthrus", dataclasses.replace(cfg)).generated == state.generated


@pytest.mark.parametrize("max_new_tokens,K", [(7, 4), (1, 4), (2, 8), (5, 4), (9, 8), (12, 8), (13, 3)])
def test_max_new_tokens_reached_mid_block(models, family, max_new_tokens, K):
    model = models[family]
    prompt = PROMPTS[0]
    ref = ar_reference(model, prompt, N_NEW)
    asked = []
    state = decode(model, prompt, "orthrus", fused(max_new_tokens=max_new_tokens, k=K, eos_ids=NO_EOS),
                   drafter=oracle_drafter(ref, log=asked))
    assert state.generated == ref[:max_new_tokens] and state.finished == "length"
    assert all(g + k <= max_new_tokens for g, k in asked)  # no drafts asked for past the end
    own = decode(model, prompt, "orthrus", fused(max_new_tokens=max_new_tokens, k=K, eos_ids=NO_EOS))
    assert own.generated == ref[:max_new_tokens]


# ---------------------------------------------------------------------------------------- the cache
def _cache_tensors(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_holds_every_committed_token_but_the_last_after_every_cycle(perturbed, family, temperature):
    model = perturbed[family]
    lengths = []
    real = decoding.fused_cycle

    def checking_cycle(m, state, cfg, k, draws, drafter=None):
        kept = real(m, state, cfg, k, draws, drafter)
        lengths.append((state.cache.get_seq_length(), len(state.tokens) - 1))
        return kept

    cfg = fused(max_new_tokens=N_NEW, eos_ids=NO_EOS, sampling=SamplingConfig(temperature=temperature, seed=3))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoding, "fused_cycle", checking_cycle)
        state = decode(model, PROMPTS[0], "orthrus", cfg)
    assert lengths and all(a == b for a, b in lengths)
    assert any(a < 7 for a in state.stats.accepted)  # rejections happened, so crops did real work
    # the cropped cache equals the AR cache of the committed tokens: no group row was ever written
    fresh, _ = model.prefill(state.tokens[:-1])
    for got, want in zip(_cache_tensors(state.cache), _cache_tensors(fresh)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_no_verify_row_sees_a_group_row(perturbed, family):
    """Perturbing everything group rows are made of (mask embedding, draft-view weights, anchors) leaves
    the verify logits and the cache bitwise unchanged."""
    model = perturbed[family]
    cache, _ = model.prefill(PROMPTS[3])
    block = [7, 8, 9, 10]
    pos = cache.get_seq_length()

    def run(m, anchors):
        c = copy.deepcopy(cache)
        logits, groups = m.verify_and_draft(c, block, anchors, 3)
        return logits, groups, _cache_tensors(c)

    logits, groups, written = run(model, [0, 1, 2, 3])
    other = copy.deepcopy(model)
    perturb_head(other, 2.0, seed=99)
    for m, anchors in ((other, [0, 1, 2, 3]), (model, [1, 3]), (other, [2])):
        logits2, groups2, written2 = run(m, anchors)
        assert torch.equal(logits2, logits)
        assert all(torch.equal(a, b) for a, b in zip(written, written2))
    assert not torch.equal(run(other, [0, 1, 2, 3])[1], groups)  # the groups did change
    # and the verify rows are a verify pass: same logits (to rounding) as the plain AR view
    plain = model.verify(copy.deepcopy(cache), block)
    torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-4)
    assert written[0].shape[-2] == pos + len(block)


def groups_and_two_pass(model, block: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(a fused forward's group n logits, the two-pass draft pass anchored at block position n) for every n.
    Group n sees the cache and the block's keys before pos+n: the same keys as the draft view's pass over
    [anchor, MASK x width] from the cache cropped to pos+n."""
    cache, _ = model.prefill(PROMPTS[0])
    pos = cache.get_seq_length()
    _, groups = model.verify_and_draft(copy.deepcopy(cache), block, list(range(len(block))), 4)
    pairs = []
    for n in range(len(block)):
        c = copy.deepcopy(cache)
        if n:
            model.verify(c, block[:n])  # the AR keys of block positions < n
        commit_cache(c, pos + n + 1)
        embeds = model.block_embeddings(torch.tensor([block[n]]), 5)
        with torch.no_grad():
            two_pass = model.draft_hidden(embeds, torch.arange(pos + n, pos + n + 5)[None], c)  # [5, V]
        pairs.append((groups[n], two_pass[1:]))
    return pairs


def test_each_group_drafts_what_the_draft_view_drafts_from_its_anchor(perturbed, family):
    for fused_rows, two_pass in groups_and_two_pass(perturbed[family], [11, 12, 13, 14, 15]):
        torch.testing.assert_close(fused_rows, two_pass, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------- rejection sampling
def _first_two_fused(model, seeds: range) -> tuple[dict, list[int]]:
    from collections import Counter

    counts: Counter = Counter()
    accepted = []
    for seed in seeds:
        # token 1 comes from the prefill, token 2 from the first fused cycle (an AR step that drafts),
        # token 3 from the second, whose one draft went through rejection sampling
        cfg = fused(max_new_tokens=4, k=2, eos_ids=NO_EOS, sampling=SamplingConfig(temperature=1.0, seed=seed))
        state = decode(model, SAMPLING_PROMPT, "orthrus", cfg)
        counts[tuple(state.generated[1:3])] += 1
        accepted.append(state.stats.accepted[1])
    return counts, accepted


def _ar_tokens_2_3(model, seeds: range):
    from collections import Counter

    counts: Counter = Counter()
    for seed in seeds:
        cfg = DecodeConfig(max_new_tokens=3, eos_ids=NO_EOS, sampling=SamplingConfig(temperature=1.0, seed=seed))
        counts[tuple(decode(model, SAMPLING_PROMPT, "ar", cfg).generated[1:3])] += 1
    return counts


@pytest.fixture(scope="module")
def ar_tokens_2_3(spread_model):  # noqa: F811
    return _ar_tokens_2_3(spread_model, range(0, N_SAMPLES))


def test_fused_rejection_sampling_matches_ar_sampling_in_distribution(spread_model, ar_tokens_2_3):  # noqa: F811
    counts, accepted = _first_two_fused(spread_model, range(N_SAMPLES, 2 * N_SAMPLES))
    assert _chi2_pvalue(ar_tokens_2_3, counts) > 1e-3
    assert 0.05 < sum(accepted) / len(accepted) < 0.95  # drafts were both accepted and rejected


def test_chi2_check_has_power_against_uncorrected_fused_sampling(spread_model, ar_tokens_2_3, monkeypatch):  # noqa: F811
    """Negative control: keep every group draft (token 3 ~ q, no rejection step); the test must reject."""

    def accept_everything(drafts, q, logits, sampling, draws, first):
        return len(drafts), sample(sampling.probs(logits[len(drafts)]), draws.at(first + len(drafts)))

    monkeypatch.setattr(decoding, "accept_sampling", accept_everything)
    counts, _ = _first_two_fused(spread_model, range(2 * N_SAMPLES, 3 * N_SAMPLES))
    assert _chi2_pvalue(ar_tokens_2_3, counts) < 1e-3


def test_bad_cycle_and_groups_are_refused(models):
    from lossless.errors import LosslessError

    with pytest.raises(LosslessError, match="unknown cycle"):
        decode(models["llama"], PROMPTS[0], "orthrus", DecodeConfig(cycle="triple"))
    with pytest.raises(LosslessError, match="groups"):
        decode(models["llama"], PROMPTS[0], "orthrus", fused(groups=0))


# ------------------------------------------------------------------------------------------- exact mode
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_exact_fused_equals_exact_ar_bitwise_in_half_precision(family, dtype):
    """In exact mode the verify rows of a fused forward (beside dozens of group rows) compute bitwise what
    single steps compute, so fused equals AR token for token in bf16 and fp16."""
    from lossless.decoding.model import OrthrusLM
    from conftest import tiny_backbone

    model = OrthrusLM(tiny_backbone(family).to(dtype), k=8)  # the untrained head: drafts right now and then
    model.set_attn("exact")
    accepted = []
    for prompt in ([1, 5, 9, 3], list(range(2, 60, 3))):
        ar = decode(model, prompt, "ar", DecodeConfig(max_new_tokens=40, eos_ids=NO_EOS))
        for k, groups in ((8, None), (4, 2)):
            state = decode(model, prompt, "orthrus", fused(max_new_tokens=40, k=k, groups=groups, eos_ids=NO_EOS))
            assert state.generated == ar.generated
            accepted += state.stats.accepted
    assert any(a > 0 for a in accepted) and 0 in accepted  # blocks were accepted and rejected
    # and the verify rows are bitwise the single-step logits
    cache, _ = model.prefill(PROMPTS[3])
    logits, _ = model.verify_and_draft(copy.deepcopy(cache), [7, 8, 9, 10], [0, 1, 2, 3], 7)
    single = copy.deepcopy(cache)
    steps = torch.stack([model.step(single, t) for t in [7, 8, 9, 10]])
    assert torch.equal(logits, steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_exact_draft_view_runs_the_fixed_order_kernels(family, dtype):
    """In exact mode the draft view's attention runs the exact kernel too: a group's draft rows are bitwise
    the two-pass draft pass's, however many other rows share the forward (so drafts, and what rejection
    sampling does with them, are the same on any CPU), and they are the stock draft view's to rounding."""
    from lossless.decoding.model import OrthrusLM
    from conftest import tiny_backbone

    model = OrthrusLM(tiny_backbone(family).to(dtype), k=8)
    perturb_head(model, 0.3)
    block = [11, 12, 13, 14, 15]
    stock = groups_and_two_pass(model, block)
    model.set_attn("exact")
    exact = groups_and_two_pass(model, block)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.1)
    for (fused_rows, two_pass), (stock_rows, _) in zip(exact, stock):
        assert torch.equal(fused_rows, two_pass)
        torch.testing.assert_close(fused_rows.float(), stock_rows.float(), **tol)
    # the draft pass runs as one kernel call (two kernels a layer): the module path's bits, the cache as it was
    from conftest import StackCalls
    from lossless.decoding.exact import layer_modules

    cache, _ = model.prefill(PROMPTS[0])
    keys = [layer.keys.clone() for layer in cache.layers]
    with StackCalls(model) as calls:
        fused_pass = model.draft(cache, 7, 8)
    with layer_modules():
        module_pass = model.draft(cache, 7, 8)
    assert calls == [8] and torch.equal(fused_pass, module_pass)
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, keys))
