"""The choices a decode reads from logits, by exact mode's `choices` kernel: the greedy token (torch.max's index,
ties and NaN included), a tree's candidates in rank order and their softmax probabilities (against a float64
softmax), the same on every variant the CPU runs, and the same tree decodes as torch's choices give."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lossless.decoding import kernels
from lossless.decoding.sampling import argmax, top_candidates

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VARIANTS = kernels.runnable_isas()


def ranked(row: list[float], n: int) -> list[int]:
    """The reference order: a NaN above every number, larger values first, the earlier index first among equals."""
    return sorted(range(len(row)), key=lambda j: (not math.isnan(row[j]), -row[j] if not math.isnan(row[j]) else 0, j))[:n]


def softmax64(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(x - top) for x in row]
    total = math.fsum(e)
    return [x / total for x in e]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 9), v=st.integers(1, 300), n=st.integers(1, 8), spread=st.sampled_from([0.5, 3.0, 30.0]),
       ties=st.booleans(), specials=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 299),
                                                      st.sampled_from(["nan", "inf", "-inf"])), max_size=4),
       seed=st.integers(0, 2**16))
@example(m=3, v=49152, n=4, spread=3.0, ties=False, specials=[], seed=0)  # a real vocabulary
def test_choices_rank_as_torch_and_give_softmax_probabilities(dtype, m, v, n, spread, ties, specials, seed):
    n = min(n, v)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, v, generator=gen) * spread
    if ties:  # few distinct values: ties everywhere, the top included
        x = x.round()
    x = x.to(dtype)
    for r, j, what in specials:
        if r < m and j < v:
            x[r, j] = float(what)
    outs = {}
    for isa in VARIANTS:
        with kernels.use_isa(isa):
            outs[isa] = kernels.choices(x, n, probs=True)
            assert torch.equal(kernels.choices(x, n)[0], outs[isa][0])  # (the same ids without probabilities)
    ids, probs = outs[VARIANTS[0]]
    for i, p in outs.values():  # every variant: the same ids, and probabilities to the bit (NaN where the row has)
        assert torch.equal(i, ids) and torch.equal(p.isnan(), probs.isnan()) and torch.equal(p.nan_to_num(), probs.nan_to_num())
    assert torch.equal(ids[:, 0], x.max(dim=-1).indices)
    for r in range(m):
        row = x[r].float().tolist()
        assert ids[r].tolist() == ranked(row, n)
        if not any(math.isnan(t) or t == math.inf for t in row) and max(row) > -math.inf:  # (-inf: probability 0)
            want = softmax64(row)
            for j, p in zip(ids[r].tolist(), probs[r].tolist()):
                assert math.isclose(p, want[j], rel_tol=1e-5, abs_tol=1e-30), (p, want[j])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_choices_rank_subnormal_logits_as_torch_does(dtype):
    """Selection compares values as they are: subnormal logits rank by size (under the kernels' denormal rule they
    would all read as zero, and the first would win), and a row of -inf alone has NaN probabilities, as torch's."""
    x = torch.tensor([[1e-40, 3e-40, 2e-40, 0.0, -1e-40], [-1e-40, -3e-40, -2e-40, -5e-40, -4e-40]]).to(dtype)
    assert x[0, 1] > x[0, 2] > x[0, 0] > 0  # (subnormal in this dtype, and distinct)
    for isa in VARIANTS:
        with kernels.use_isa(isa):
            ids, probs = kernels.choices(x, 3, probs=True)
            assert ids.tolist() == [[1, 2, 0], [0, 2, 1]] and torch.equal(ids[:, 0], x.max(dim=-1).indices)
            _, none = kernels.choices(torch.full((1, 7), float("-inf"), dtype=dtype), 2, probs=True)
            assert none.isnan().all() and torch.softmax(torch.full((7,), float("-inf")), -1).isnan().all()


def test_choices_refuse_what_they_cannot_rank():
    x = torch.randn(2, 10)
    for n in (0, 9, 11):
        with pytest.raises(RuntimeError, match="choices"):
            kernels.choices(x, n) if n != 11 else kernels.choices(x[:, :5], 6)
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        kernels.choices(x.double(), 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_trees_candidates_are_the_same_with_the_kernel_and_with_torch(dtype):
    """`top_candidates` (a tree's candidates) and `argmax` give the ids torch gives where no values tie, and
    probabilities within float rounding of torch.softmax's, with exact mode's kernels loaded and without."""
    kernels.extension()
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(7, 5000, generator=gen) * 4).to(dtype)
    logits[:, :100] = logits[:, :100] + torch.arange(100) * 0.3  # distinct leaders, no ties among the top
    got = {}
    for loaded in (True, False):
        with mock.patch.object(kernels, "loaded", lambda: loaded):
            got[loaded] = top_candidates(logits, 4), argmax(logits).tolist()
    (p_kernel, ids_kernel), best_kernel = got[True]
    (p_torch, ids_torch), best_torch = got[False]
    assert ids_kernel == ids_torch and best_kernel == best_torch == [r[0] for r in ids_torch]
    for a, b in zip(p_kernel, p_torch):
        assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, b))
