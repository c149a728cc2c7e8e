"""Decoding exactness on tiny random backbones: orthrus == ar (greedy), rejection sampling matches ar
sampling in distribution, and the stopping rules and cache invariant hold inside accepted blocks."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import NO_EOS, PROMPTS, ar_reference, perturb_head, tiny_backbone, tiny_orthrus
from lossless.decoding import loop as decoding
from lossless.decoding.loop import DecodeConfig, decode, model_drafter
from lossless.decoding.model import OrthrusLM
from lossless.decoding.sampling import SamplingConfig, argmax, sample

N_NEW = 40


@pytest.fixture(scope="module")
def models():
    """One untrained-head OrthrusLM (k=8) per family, shared by the module's greedy tests."""
    return {fam: tiny_orthrus(fam, k=8) for fam in ("llama", "qwen3")}


def oracle_drafter(reference: list[int], wrong: bool = False, vocab: int | None = None, log: list | None = None):
    """A drafter that proposes the AR reference trajectory's next k-1 tokens (or, with `wrong`, each of
    them shifted by one, so the very first draft is always rejected)."""

    def drafter(model, state, k, sampling, draws):
        assert sampling.greedy
        g = len(state.generated)
        drafts = list(reference[g:g + k - 1])
        assert len(drafts) == k - 1, "decoding asked for drafts past max_new_tokens"
        if wrong:
            drafts = [(t + 1) % vocab for t in drafts]
        if log is not None:
            log.append((g, k))
        return drafts, None

    return drafter


def expected_full_accepts(max_new_tokens: int, k: int) -> list[int]:
    """Accepted drafts per cycle when every draft is right: blocks of k, the last one cut to fit."""
    remaining, accepted = max_new_tokens - 1, []  # the prefill commits the first token
    while remaining > 0:
        k_eff = min(k, remaining)
        accepted.append(k_eff - 1)
        remaining -= k_eff
    return accepted


# ------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_orthrus_greedy_equals_ar_greedy_token_for_token(models, family, K):
    model = models[family]
    for prompt in PROMPTS:
        cfg = DecodeConfig(max_new_tokens=N_NEW, k=K, eos_ids=NO_EOS)
        ar = decode(model, prompt, "ar", cfg)
        orthrus = decode(model, prompt, "orthrus", cfg)
        assert len(ar.generated) == N_NEW
        assert orthrus.generated == ar.generated
        assert orthrus.finished == ar.finished == "length"
        # every cycle commits its accepted drafts plus one AR token
        assert sum(orthrus.stats.accepted) + orthrus.stats.steps == N_NEW - 1
        assert all(0 <= a <= K - 1 for a in orthrus.stats.accepted)


@pytest.mark.parametrize("K", [2, 4, 8])
def test_orthrus_greedy_equals_ar_greedy_with_the_models_eos(models, family, K):
    model = models[family]
    for prompt in PROMPTS:
        cfg = DecodeConfig(max_new_tokens=N_NEW, k=K)  # eos ids from the model (vocab - 1)
        ar = decode(model, prompt, "ar", cfg)
        orthrus = decode(model, prompt, "orthrus", cfg)
        assert orthrus.generated == ar.generated
        assert orthrus.finished == ar.finished


@pytest.mark.parametrize("K", [2, 4, 8])
def test_oracle_drafter_matches_ar_and_every_cycle_accepts_all_drafts(models, family, K):
    model = models[family]
    for prompt in PROMPTS[:2]:
        ref = ar_reference(model, prompt, N_NEW)
        cfg = DecodeConfig(max_new_tokens=N_NEW, k=K, eos_ids=NO_EOS)
        state = decode(model, prompt, "orthrus", cfg, drafter=oracle_drafter(ref))
        assert state.generated == ref
        assert state.stats.accepted == expected_full_accepts(N_NEW, K)
        assert state.stats.accepted[:-1] == [K - 1] * (len(state.stats.accepted) - 1)
        # one draft + one verify forward per cycle, plus the prefill (the oracle costs no forward)
        assert state.stats.forwards == 1 + state.stats.steps


@pytest.mark.parametrize("K", [2, 4, 8])
def test_always_wrong_drafter_matches_ar_and_accepts_nothing(models, family, K):
    model = models[family]
    vocab = model.config.vocab_size
    for prompt in PROMPTS[:2]:
        ref = ar_reference(model, prompt, N_NEW)
        cfg = DecodeConfig(max_new_tokens=N_NEW, k=K, eos_ids=NO_EOS)
        state = decode(model, prompt, "orthrus", cfg, drafter=oracle_drafter(ref, wrong=True, vocab=vocab))
        assert state.generated == ref
        assert state.stats.accepted == [0] * (N_NEW - 1)
        assert state.stats.steps == N_NEW - 1


@pytest.mark.parametrize("kernel", [True, False], ids=["exact kernels loaded", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_choice_is_torch_argmax_including_ties(dtype, kernel):
    """The decode loop's greedy choice takes the first maximal index, as torch.argmax (and HF greedy) do, on
    rows full of exact ties (few distinct values), all-equal rows, NaN rows and non-contiguous views: with exact
    mode's kernels loaded (their `choices`) and without."""
    from unittest import mock

    from lossless.decoding import kernels

    kernels.extension()
    gen = torch.Generator().manual_seed(0)
    with mock.patch.object(kernels, "loaded", lambda: kernel):
        for vocab, rows in [(2, 1), (49152, 8), (50000, 3), (1000, 17)]:
            x = torch.randint(0, 4, (rows, vocab), generator=gen).to(dtype)
            x[0] = 1  # every index ties
            if rows > 2:
                x[2, vocab // 2] = float("nan")
                x[1, : vocab // 3] = float("-inf")
            for logits in (x, x.t().contiguous().t(), x[0]):
                assert torch.equal(argmax(logits), logits.argmax(dim=-1))


def test_ar_greedy_equals_hugging_face_generate(models, family):
    model = models[family]
    backbone = model.backbone
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        mask = torch.ones_like(ids)
        # with the model's EOS: both stop at it (HF keeps it, so does lossless)
        hf = backbone.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=N_NEW)
        ours = decode(model, prompt, "ar", DecodeConfig(max_new_tokens=N_NEW))
        assert ours.generated == hf[0, len(prompt):].tolist()
        # without EOS: exactly N_NEW tokens on both sides
        hf = backbone.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=N_NEW, eos_token_id=None)
        assert hf.shape[1] == len(prompt) + N_NEW
        assert ar_reference(model, prompt, N_NEW) == hf[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------ stopping
def _prompt_with_fresh_token_at(model, indices) -> tuple[list[int], list[int], int]:
    """A prompt whose AR reference emits, at one of `indices`, a token it has not emitted before."""
    for prompt in PROMPTS:
        ref = ar_reference(model, prompt, N_NEW)
        for i in indices:
            if ref[i] not in ref[:i]:
                return prompt, ref, i
    pytest.fail(f"no prompt emits a first-time token at any of {indices}")


@pytest.mark.parametrize("where", ["accepted draft", "bonus token"])
def test_eos_inside_an_accepted_block_stops_right_after_it(models, family, where):
    model = models[family]
    K = 8
    # the first cycle commits indices 1..7 as drafts and index 8 as the AR (bonus) token
    prompt, ref, i = _prompt_with_fresh_token_at(model, (5, 4, 6, 3, 7) if where == "accepted draft" else (8,))
    eos = ref[i]
    cfg = DecodeConfig(max_new_tokens=N_NEW, k=K, eos_ids=(eos,))
    state = decode(model, prompt, "orthrus", cfg, drafter=oracle_drafter(ref))
    assert state.generated == ref[: i + 1]
    assert state.generated[-1] == eos
    assert state.finished == "eos"
    assert state.stats.steps == 1 and state.stats.accepted == [K - 1]
    assert state.cache.get_seq_length() == len(state.tokens) - 1
    ar = decode(model, prompt, "ar", cfg)
    assert ar.generated == state.generated and ar.finished == "eos"
    # the model's own drafter agrees too
    assert decode(model, prompt, "orthrus", cfg).generated == state.generated


@pytest.mark.parametrize("max_new_tokens,K", [(7, 4), (1, 4), (2, 8), (5, 4), (9, 8), (12, 8), (13, 3)])
def test_max_new_tokens_is_exact_with_an_oracle_drafter(models, family, max_new_tokens, K):
    model = models[family]
    prompt = PROMPTS[0]
    ref = ar_reference(model, prompt, N_NEW)
    asked = []
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, k=K, eos_ids=NO_EOS)
    state = decode(model, prompt, "orthrus", cfg, drafter=oracle_drafter(ref, log=asked))
    assert len(state.generated) == max_new_tokens
    assert state.generated == ref[:max_new_tokens]
    assert state.finished == "length"
    assert state.stats.accepted == expected_full_accepts(max_new_tokens, K)
    # no drafts are asked for past the end
    assert all(g + k <= max_new_tokens for g, k in asked)
    assert state.cache.get_seq_length() == len(state.tokens) - 1


@pytest.fixture(scope="module")
def bf16_model():
    """A bf16 model whose drafts are often wrong, so block shapes vary and rounding depends on them."""
    model = tiny_orthrus("llama", k=4).to(torch.bfloat16)
    perturb_head(model, 0.5)
    return model


CUT_SHORT = {"ar": ("ar", {}), "chain": ("orthrus", {}), "tree": ("orthrus", {"tree": 6}),
             "lookup": ("orthrus", {"lookup": 4}), "fused": ("orthrus", {"cycle": "fused"})}


@pytest.mark.parametrize("cycle", sorted(CUT_SHORT))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 24), prompt=st.sampled_from(PROMPTS))
def test_a_decode_cut_short_by_stop_after_is_the_start_of_the_full_decode_to_the_bit(bf16_model, cycle, n, prompt):
    mode, extra = CUT_SHORT[cycle]
    cfg = DecodeConfig(max_new_tokens=24, eos_ids=NO_EOS, record_margins=True, **extra)
    full = decode(bf16_model, prompt, mode, cfg)
    cut = decode(bf16_model, prompt, mode, dataclasses.replace(cfg, stop_after=n))
    m = len(cut.generated)
    assert n <= m <= 24 and cut.finished == ("stop" if m < 24 else "length")
    assert cut.generated == full.generated[:m] and cut.margins == full.margins[:m] and cut.tops == full.tops[:m]
    assert cut.stats.accepted == full.stats.accepted[:len(cut.stats.accepted)]


def test_stop_after_is_a_positive_count_and_eos_before_it_still_ends_the_decode(bf16_model):
    from lossless.errors import LosslessError

    prompt = PROMPTS[0]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(LosslessError, match="stop_after"):
            decode(bf16_model, prompt, "orthrus", DecodeConfig(max_new_tokens=8, stop_after=bad, eos_ids=NO_EOS))
    full = decode(bf16_model, prompt, "orthrus", DecodeConfig(max_new_tokens=24, eos_ids=NO_EOS))
    eos = full.generated[5]
    cut = decode(bf16_model, prompt, "orthrus", DecodeConfig(max_new_tokens=24, eos_ids=(eos,), stop_after=20))
    assert cut.finished == "eos" and cut.generated == full.generated[: full.generated.index(eos) + 1]


def test_commit_truncates_a_chunk_at_max_new_tokens_and_at_eos(models):
    model = models["llama"]
    prompt = PROMPTS[0]
    ref = ar_reference(model, prompt, 10)
    i = next(i for i in range(2, 8) if ref[i] not in ref[:i])
    for cfg, expect_len, reason in [
        (DecodeConfig(max_new_tokens=4, eos_ids=NO_EOS), 4, "length"),
        (DecodeConfig(max_new_tokens=10, eos_ids=(ref[i],)), i + 1, "eos"),
    ]:
        state = decoding.prefill(model, prompt, cfg, cfg.sampling.draws())
        model.verify(state.cache, [state.tokens[-1], *ref[1:8]])  # the cache now holds a whole block
        kept = decoding.commit(state, ref[1:9], cfg)
        assert state.generated == ref[:expect_len]
        assert kept == ref[1:expect_len]
        assert state.finished == reason
        assert state.cache.get_seq_length() == len(state.tokens) - 1


# ---------------------------------------------------------------------------------------- the cache
def _cache_tensors(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("K", [2, 4, 8])
def test_cache_holds_every_committed_token_but_the_last_and_draft_never_writes_it(family, K, temperature):
    model = tiny_orthrus(family, k=8)
    perturb_head(model, 0.5)  # drafts are sometimes rejected, so the cache must be cropped
    checks = []

    def checking_drafter(m, state, k, sampling, draws):
        assert state.cache.get_seq_length() == len(state.tokens) - 1
        before = _cache_tensors(state.cache)
        out = model_drafter(m, state, k, sampling, draws)
        after = _cache_tensors(state.cache)
        assert state.cache.get_seq_length() == len(state.tokens) - 1
        assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        checks.append(k)
        return out

    chunks = []
    for prompt in PROMPTS[:2]:
        cfg = DecodeConfig(max_new_tokens=N_NEW, k=K, eos_ids=NO_EOS,
                           sampling=SamplingConfig(temperature=temperature, seed=3))
        state = decode(model, prompt, "orthrus", cfg, drafter=checking_drafter, on_tokens=chunks.append)
        assert len(state.generated) == N_NEW
        assert state.cache.get_seq_length() == len(state.tokens) - 1
        assert [t for c in chunks for t in c] == state.generated
        chunks.clear()
        # the cropped cache equals the AR cache of the committed tokens (rejected drafts are gone)
        fresh, _ = model.prefill(state.tokens[:-1])
        for got, want in zip(_cache_tensors(state.cache), _cache_tensors(fresh)):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        ar = decode(model, prompt, "ar", cfg)
        assert ar.cache.get_seq_length() == len(ar.tokens) - 1
    assert checks and any(a < K - 1 for a in state.stats.accepted)


def test_draft_does_not_change_the_cache(family):
    model = tiny_orthrus(family, k=8)
    perturb_head(model, 1.0)
    cache, _ = model.prefill(PROMPTS[0])
    before = _cache_tensors(cache)
    for k in (2, 4, 8):
        logits = model.draft(cache, 5, k)
        assert logits.shape == (k - 1, model.config.vocab_size)
        assert cache.get_seq_length() == len(PROMPTS[0])
        assert all(torch.equal(a, b) for a, b in zip(before, _cache_tensors(cache)))


# ----------------------------------------------------------------------------------- rejection sampling
SAMPLING_PROMPT = [1, 2, 3]
N_SAMPLES = 3000


@pytest.fixture(scope="module")
def spread_model() -> OrthrusLM:
    """Vocabulary of 8, spread-out distributions, and a perturbed head so the draft q differs from p."""
    backbone = tiny_backbone("llama", vocab=8)
    with torch.no_grad():
        backbone.lm_head.weight.mul_(0.5)  # undo half of conftest's sharpening
    model = OrthrusLM(backbone, k=2, name="tiny-llama-v8")
    perturb_head(model, 2.0)
    return model


def _first_two_tokens(model, mode: str, seeds: range, stats: list | None = None, **cycle) -> Counter:
    counts: Counter = Counter()
    for seed in seeds:
        # orthrus needs 3 new tokens: k is capped by what is left, and token 2 must come from a k=2 cycle
        cfg = DecodeConfig(max_new_tokens=3 if mode == "orthrus" else 2, k=2, eos_ids=NO_EOS,
                           sampling=SamplingConfig(temperature=1.0, seed=seed), **cycle)
        state = decode(model, SAMPLING_PROMPT, mode, cfg)
        counts[tuple(state.generated[:2])] += 1
        if stats is not None:
            stats.append(state.stats.accepted[0])
    return counts


def _chi2_pvalue(a: Counter, b: Counter, min_total: int = 10) -> float:
    """Chi-square test of homogeneity for two samples of categories; cells rarer than min_total merged."""
    from scipy.stats import chi2_contingency

    cells = sorted(set(a) | set(b))
    common = [c for c in cells if a[c] + b[c] >= min_total]
    rare = [c for c in cells if a[c] + b[c] < min_total]
    rows = [[a[c] for c in common], [b[c] for c in common]]
    if rare:
        rows[0].append(sum(a[c] for c in rare))
        rows[1].append(sum(b[c] for c in rare))
    return float(chi2_contingency(rows, correction=False).pvalue)


def _exact_draft_acceptance(model) -> float:
    """P(the one draft is accepted) = E_tok1[sum_x min(p(x|tok1), q(x|tok1))], from the model's logits."""
    s = SamplingConfig(temperature=1.0)
    cache, logits = model.prefill(SAMPLING_PROMPT)
    p0 = s.probs(logits)
    total = 0.0
    for t in range(model.config.vocab_size):
        p1 = s.probs(model.step(copy.deepcopy(cache), t))
        q1 = s.probs(model.draft(copy.deepcopy(cache), t, 2))[0]
        total += float(p0[t] * torch.minimum(p1, q1).sum())
    return total


@pytest.fixture(scope="module")
def ar_samples(spread_model) -> Counter:
    return _first_two_tokens(spread_model, "ar", range(0, N_SAMPLES))


def test_rejection_sampling_matches_ar_sampling_in_distribution(spread_model, ar_samples):
    accepted: list[int] = []
    ar = ar_samples
    orthrus = _first_two_tokens(spread_model, "orthrus", range(N_SAMPLES, 2 * N_SAMPLES), accepted)
    assert _chi2_pvalue(ar, orthrus) > 1e-3
    # the second token really went through draft + rejection: some drafts accepted, some rejected, at
    # the rate sum_x min(p, q) that rejection sampling implies
    rate = sum(accepted) / len(accepted)
    expected = _exact_draft_acceptance(spread_model)
    assert 0.2 < expected < 0.95
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / N_SAMPLES) ** 0.5 + 1e-3


def test_chi2_check_has_power_against_uncorrected_draft_sampling(spread_model, ar_samples, monkeypatch):
    """Negative control: keep every draft (token 2 ~ q, no rejection step); the same test must reject."""

    def accept_everything(drafts, q, logits, sampling, draws, first):
        return len(drafts), sample(sampling.probs(logits[len(drafts)]), draws.at(first + len(drafts)))

    monkeypatch.setattr(decoding, "accept_sampling", accept_everything)
    ar = ar_samples
    from_q = _first_two_tokens(spread_model, "orthrus", range(2 * N_SAMPLES, 3 * N_SAMPLES))
    assert _chi2_pvalue(ar, from_q) < 1e-3


def test_a_sampled_tree_matches_ar_sampling_in_distribution(spread_model, ar_samples):
    """A tree of the draft's 3 most probable tokens, sampled: at the root, the token AR's draw chooses, kept on a
    child that holds it. Token 2 must follow AR's distribution (other seeds than AR's own), and a child is taken
    at the rate p(children) implies."""
    accepted: list[int] = []
    tree = _first_two_tokens(spread_model, "orthrus", range(3 * N_SAMPLES, 4 * N_SAMPLES), accepted, tree=3)
    assert _chi2_pvalue(ar_samples, tree) > 1e-3
    rate = sum(accepted) / len(accepted)
    assert 0.3 < rate < 0.97  # (a tree of 3 of 8 tokens: most draws, not all)


def test_a_sampled_tree_two_levels_deep_matches_ar_sampling_in_distribution():
    """A tree of 6 nodes over two draft positions (k = 3; at most 4 at the first): the walk goes on from a child taken at the root, with
    the AR view's distribution at that child's row and the draw of its position. The first three tokens must follow AR sampling's."""
    backbone = tiny_backbone("llama", vocab=8)
    with torch.no_grad():
        backbone.lm_head.weight.mul_(0.5)
    model = OrthrusLM(backbone, k=3, name="tiny-llama-v8-k3")
    perturb_head(model, 1.0)

    def first_three(mode, seeds, deeper):
        counts = Counter()
        for seed in seeds:
            cfg = DecodeConfig(max_new_tokens=4 if mode == "orthrus" else 3, k=3, eos_ids=NO_EOS,
                               sampling=SamplingConfig(temperature=1.0, seed=seed), tree=6 if mode == "orthrus" else 0)
            state = decode(model, SAMPLING_PROMPT, mode, cfg)
            counts[tuple(state.generated[:3])] += 1
            if mode == "orthrus":
                deeper.append(state.stats.accepted[0])
        return counts

    accepted: list[int] = []
    ar = first_three("ar", range(N_SAMPLES), [])
    tree = first_three("orthrus", range(N_SAMPLES, 2 * N_SAMPLES), accepted)
    assert _chi2_pvalue(ar, tree) > 1e-3
    assert accepted.count(2) > N_SAMPLES // 40  # (the walk went past the root's children, often)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sampled_trees_and_copies_commit_ar_samplings_tokens_for_the_same_seed(family, monkeypatch):
    """On exact kernels a sampled decode whose candidates are chosen without a draw (a tree, with or without
    looked-up copies beside it; two levels deep too) commits `--mode ar`'s tokens for the same seed, token for
    token, while taking candidates (every cycle kind; copies verified alone too); a sampled chain, whose drafts
    are drawn from q and accepted by rejection sampling, gives other tokens for some seeds (a draw from the same
    distribution, not the same draw)."""
    from test_exact import exact_tiny

    model = exact_tiny(family, torch.bfloat16)
    base = [5, 9, 2, 7]  # and what greedy decoding continues it with, then it again: a context worth copying from
    prompt = base + decode(model, base, "ar", DecodeConfig(max_new_tokens=8, eos_ids=NO_EOS)).generated + base
    copies_tried = []  # copies verified alone (a long context match), kept or not: AR's draw decides
    real = decoding.accept_sampling

    def counting(drafts, q, *rest):
        copies_tried.append(len(drafts) if q is None else 0)
        return real(drafts, q, *rest)
    monkeypatch.setattr(decoding, "accept_sampling", counting)
    cycles = (dict(tree=4), dict(tree=8, lookup=6), dict(tree=6, k=3))
    taken, chain_differs = dict.fromkeys(range(len(cycles)), 0), False
    for seed in range(8):
        sampling = SamplingConfig(temperature=[0.9, 0.3][seed % 2], top_k=[0, 20][seed % 2],
                                  top_p=[1.0, 0.95][seed % 2 == 0], seed=seed)
        cfg = DecodeConfig(max_new_tokens=20, eos_ids=NO_EOS, sampling=sampling)
        ar = decode(model, prompt, "ar", cfg)
        for i, cycle in enumerate(cycles):
            out = decode(model, prompt, "orthrus", dataclasses.replace(cfg, **cycle))
            assert out.generated == ar.generated, (seed, cycle)
            taken[i] += sum(out.stats.accepted)
        chain = decode(model, prompt, "orthrus", dataclasses.replace(cfg, k=4))
        chain_differs = chain_differs or chain.generated != ar.generated
    assert all(taken.values()) and sum(copies_tried) > 0 and chain_differs


def test_a_decodes_draws_are_keyed_by_position_and_uniform():
    """`Draws.at(i, what)` is a function of the seed, i and what alone (a fresh object gives it again, in any
    order); seeds, positions and purposes give other draws; over 20,000 positions they are uniform on [0, 1)."""
    from scipy.stats import kstest

    from lossless.decoding.sampling import DRAFT, TEST, TOKEN, Draws

    a, b = Draws(11), Draws(11)
    forward = [a.at(i) for i in range(50)]
    assert [b.at(i) for i in reversed(range(50))][::-1] == forward
    assert len(set(forward)) == 50 and all(0.0 <= u < 1.0 for u in forward)
    assert Draws(12).at(3) != a.at(3) and len({a.at(3, w) for w in (TOKEN, DRAFT, TEST)}) == 3
    assert kstest([a.at(i) for i in range(20_000)], "uniform").pvalue > 1e-3


def test_copies_are_kept_where_ars_draw_chooses_them_and_a_miss_commits_that_draw():
    """Drafts without a q (copied from the context): kept while each is the token AR's draw at its position chooses
    from its row's p; the first that is not ends the cycle with the token the draw chose; after the last, the
    bonus is AR's draw too. Over 20,000 seeds the first committed token follows p's first row."""
    from scipy.stats import chisquare

    from lossless.decoding.sampling import Draws

    logits = torch.log(torch.tensor([[0.5, 0.2, 1e-30, 0.3], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]]))
    sampling = SamplingConfig(temperature=1.0)
    first = Counter()
    for seed in range(20_000):
        draws = Draws(seed)
        ar = [sample(sampling.probs(logits[j]), draws.at(7 + j)) for j in range(3)]
        n, token = decoding.accept_sampling([0, 2], None, logits, sampling, draws, 7)
        want = next((j for j in range(2) if ar[j] != [0, 2][j]), 2)
        assert (n, token) == (want, ar[want])
        first[0 if n > 0 else token] += 1
    assert first[2] == 0
    p = sampling.probs(logits[0]).double()
    assert chisquare([first[i] for i in (0, 1, 3)], [20_000 * float(p[i] / p.sum()) for i in (0, 1, 3)]).pvalue > 1e-3


def test_a_draw_follows_the_distribution_and_never_takes_a_token_of_no_chance():
    """`sample` takes token i for a share probs[i] / sum(probs) of the uniform draws (a goodness-of-fit test over
    20,000 draws from unnormalised weights with zeros among them), never a zero-weight token, even where the draw
    lands on the whole sum (rounding); weights that are no distribution are refused."""
    from scipy.stats import chisquare

    from lossless.decoding.sampling import Draws

    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 5e-3, 2.0, 0.0, 0.5, 0.0])
    draws = Draws(0)
    chosen = Counter(sample(weights, draws.at(i)) for i in range(20_000))
    assert set(chosen) <= {i for i, w in enumerate(weights.tolist()) if w > 0}
    seen = [i for i, w in enumerate(weights.tolist()) if w > 0]
    expected = [20_000 * float(weights[i] / weights.sum()) for i in seen]
    assert chisquare([chosen[i] for i in seen], expected).pvalue > 1e-3
    coin = Counter(sample(torch.tensor([1.0, 1.0]), draws.at(i, 1)) for i in range(2_000))  # a fair coin is fair
    assert 850 < coin[0] < 1150
    assert sample(weights, 0.0) == 1 and sample(weights, 1.0) == 7  # the whole sum: the last token with a chance
    for bad in ([0.5, float("nan")], [0.0, 0.0], [1.0, -0.5], [1.0, float("inf")]):
        with pytest.raises(RuntimeError, match="cannot sample"):
            sample(torch.tensor(bad), 0.5)


# ------------------------------------------------------------------------------------ sampling options
@pytest.mark.parametrize("mode", ["ar", "orthrus"])
@pytest.mark.parametrize("K", [2, 4, 8])
def test_top_k_1_sampling_equals_greedy(models, family, mode, K):
    model = models[family]
    for prompt in PROMPTS[:2]:
        greedy = ar_reference(model, prompt, N_NEW)
        for seed in (0, 1):
            for options in (dict(top_k=1), dict(top_p=1e-6)):
                cfg = DecodeConfig(max_new_tokens=N_NEW, k=K, eos_ids=NO_EOS,
                                   sampling=SamplingConfig(temperature=1.0, seed=seed, **options))
                assert decode(model, prompt, mode, cfg).generated == greedy, options


def test_sampling_is_reproducible_for_a_seed_and_varies_across_seeds(spread_model):
    def run(seed, mode):
        cfg = DecodeConfig(max_new_tokens=20, k=2, eos_ids=NO_EOS, sampling=SamplingConfig(temperature=1.0, seed=seed))
        return decode(spread_model, SAMPLING_PROMPT, mode, cfg).generated

    for mode in ("ar", "orthrus"):
        assert run(5, mode) == run(5, mode)
        assert len({tuple(run(s, mode)) for s in range(5)}) > 1


def test_which_settings_commit_ar_samplings_tokens(monkeypatch):
    """`draws_ar_tokens` (whether a server may begin a request alone and hand it to a batch): greedy, AR and a
    two-pass tree (asked for, or a trained head's sampled default, the tree or AR) commit AR's draws; a sampled
    chain (an untrained head's default, a block size set, tree 0 with lookup) or the fused cycle does not."""
    from lossless.decoding import cycles

    model = tiny_orthrus("llama", k=8)

    def sampled(**kw):
        return {"temperature": 0.7, **kw}

    assert model.draws_ar_tokens({"temperature": 0.0}, 10) and model.draws_ar_tokens(sampled(mode="ar"), 10)
    assert model.draws_ar_tokens(sampled(tree=4), 10) and model.draws_ar_tokens(sampled(tree=4, lookup=8), 10)
    for chain in (sampled(), sampled(tree=0, lookup=8), sampled(cycle="fused"), sampled(cycle="fused", tree=4)):
        assert not model.draws_ar_tokens(chain, 10), chain
    monkeypatch.setattr(model, "head_digest", "a trained head")
    for mode, tree in (("orthrus", 8), ("ar", 0)):  # the sampled default this CPU's costs choose
        choice = cycles.Choice(mode, tree, 0, "chosen", {})
        monkeypatch.setattr(model, "choice_for", lambda greedy, context=None, choice=choice: choice)
        assert model.draws_ar_tokens(sampled(), 10)
    assert not model.draws_ar_tokens(sampled(k=4), 10)  # a block size set: no choice, the chain
