"""Exact mode's bits belong to the model, the dtype and the prompt, not to the machine: every kernel variant
(AVX-512 BF16, AVX-512, AVX2, plain loops) and every thread count gives the same bits, one denormal and one NaN
rule hold everywhere, and the kernels are correct (float64 references, stock fp32 logits), not only invariant.
The borders (positions past the table, dynamic RoPE, sliding windows, modules without a kernel) decode or are
refused in one line."""

import copy
import dataclasses
import math
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import NO_EOS, StackCalls, perturb_head, tiny_backbone
from lossless.decoding import kernels
from lossless.decoding.loop import DecodeConfig, commit_cache, decode
from lossless.decoding.model import OrthrusLM
from lossless.errors import LosslessError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VARIANTS = kernels.runnable_isas()
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FLT_MIN = torch.finfo(torch.float32).tiny


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def adversarial(shape, dtype, g) -> torch.Tensor:
    """Values across the whole exponent range: subnormals, tiny and huge magnitudes (fp16: near its overflow)."""
    x = torch.randn(*shape, generator=g)
    if dtype == torch.float16:
        return (x.clamp(-8, 8) * 2.0 ** torch.randint(-26, 13, shape, generator=g).float()).clamp(-65504, 65504).to(dtype)
    return (x * 2.0 ** torch.randint(-140, 60, shape, generator=g).float()).to(dtype)


def every_kernel(dtype, make, g):
    """(name, call) for one input of every kernel, drawn by `make(shape)`."""
    x, w, bias, norm = make((9, 301)), make((70, 301)), make((70,)), make((301,))
    x17 = make((17, 301))  # tall blocks of 8 + 9 rows (dot products), 5 + 4 + 4 + 4 (widened)
    packed = kernels.pack_weight(w)
    q, k, v = make((9, 6, 40)), make((2, 70, 40)), make((2, 70, 40))
    visible = torch.rand(9, 70, generator=g) < 0.7
    return [("linear", lambda: kernels.linear(x, packed, 70, bias)),
            ("linear 17 rows", lambda: kernels.linear(x17, packed, 70, None)),
            ("attention", lambda: kernels.attention(q, k, v, visible, 0.2)),
            ("rms_norm", lambda: kernels.rms_norm(x, norm, 1e-5)),
            ("silu", lambda: kernels.silu(x * 8))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("data", ["randn", "adversarial"])
def test_every_variant_and_thread_count_gives_the_same_bits(dtype, data):
    g = torch.Generator().manual_seed(0)
    make = (lambda s: torch.randn(*s, generator=g).to(dtype)) if data == "randn" else (lambda s: adversarial(s, dtype, g))
    before = torch.get_num_threads()
    try:
        for name, call in every_kernel(dtype, make, g):
            want = bits(call())
            for isa in VARIANTS:
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    for widened in (False, True):  # bf16 products by dot-product instruction or widened fmas
                        with kernels.use_isa(isa), kernels.bf16_path(widened):
                            assert torch.equal(bits(call()), want), (name, isa, threads, widened)
    finally:
        torch.set_num_threads(before)


def nan_bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of `t` with every NaN as one NaN."""
    return bits(torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t))


def random_layers(dtype, make, layers: int, qk_norm: bool, bias: bool, tiles: bool = False):
    """Stack.add's arguments for `layers` decoder layers of odd widths (hidden 37, 4 heads and 2 kv heads of 10,
    MLP 45), every tensor drawn by `make(shape)`; `tiles`: bf16 weights packed in AMX's tile layout."""
    hidden, d, heads, kv, inter = 37, 10, 4, 2, 45
    empty = torch.empty(0, dtype=dtype)
    out = []
    for _ in range(layers):
        shapes_in, shapes_out = [(heads * d, hidden), (kv * d, hidden), (kv * d, hidden)], \
            [(hidden, heads * d), (inter, hidden), (inter, hidden), (hidden, inter)]
        packed = lambda shapes: [kernels.pack_weight(make(s), tiles=tiles) for s in shapes]  # noqa: E731
        biases = lambda shapes: [make((s[0],)) if bias else empty for s in shapes]  # noqa: E731
        norms = [make((d,)) if qk_norm else empty for _ in range(2)]
        out.append((make((hidden,)), 1e-5, packed(shapes_in), biases(shapes_in), [s[0] for s in shapes_in], *norms,
                    1e-6, d, d ** -0.5, packed(shapes_out), biases(shapes_out), [s[0] for s in shapes_out],
                    make((hidden,)), 1e-5))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=8, **SLOW)
@given(data=st.data())
def test_the_layer_stack_gives_the_bits_of_the_layer_calls(dtype, data):
    """One Stack call (all layers in one parallel region, the threads meeting at barriers) gives bit for bit the
    output and the cache rows of `layer_in`, the cache update and `layer_out` called layer by layer, for every
    variant and thread count: rows 1 to 13 over caches of 0 to 40 positions whose key tiles hold any prefix
    of them (the kernel makes the rest from the keys), any visibility, q/k norms and
    biases or none, values from subnormals up, bf16 weights in either layout. (A NaN is compared as a NaN, whatever its sign and payload: the
    elementwise steps round as ATen does, and ATen's own paths disagree on a NaN's bits.)"""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    top = 4 if dtype == torch.float16 else 8  # huge values overflow two layers into NaNs: subnormals up to 2^top
    spread = data.draw(st.booleans(), label="whole exponent range")
    make = ((lambda s: (torch.randn(*s, generator=g) * 2.0 ** torch.randint(-140, top, s, generator=g).float()).to(dtype))
            if spread else (lambda s: torch.randn(*s, generator=g).to(dtype)))
    m, n = data.draw(st.integers(1, 13), label="rows"), data.draw(st.integers(0, 40), label="cache")
    layers = random_layers(dtype, make, 2, data.draw(st.booleans(), label="qk norms"), data.draw(st.booleans(), label="bias"),
                           data.draw(st.booleans(), label="tile layout"))
    x, cos, sin = make((m, 37)), make((m, 10)), make((m, 10))
    visible = torch.rand(m, n + m, generator=g) < 0.8
    cap = n + m + data.draw(st.integers(0, 5), label="room")
    caches = [(make((1, 2, cap, 10)), make((1, 2, cap, 10))) for _ in layers]
    valid = data.draw(st.integers(0, n), label="positions the key tiles hold")
    assert_stack_matches_layers(dtype, g, x, cos, sin, visible, layers, caches, n, m, cap, valid)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=6, **SLOW)
@given(data=st.data())
def test_a_fused_forward_gives_each_views_rows_the_bits_of_its_layer_calls(dtype, data):
    """A fused forward in one Stack call (verify rows through the AR view's layers, then draft rows through the
    draft view's attention projections and q/k norms and the shared norms and MLP, the panels of both views in
    one step) gives each row the bits of its own view's layer calls, and every row's keys and values at its
    position, for every variant and thread count: over short caches and long ones (the split attention)."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    make = lambda s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    m = data.draw(st.integers(2, 16), label="rows")
    verify = data.draw(st.integers(1, m - 1), label="verify rows")
    n = data.draw(st.sampled_from([0, 7, 40, 1030]), label="cache")
    qk_norm, bias = data.draw(st.booleans(), label="qk norms"), data.draw(st.booleans(), label="bias")
    layers = random_layers(dtype, make, 2, qk_norm, bias, data.draw(st.booleans(), label="tile layout"))
    draft = draft_view_of(layers, make, qk_norm, bias)
    x, cos, sin = make((m, 37)), make((m, 10)), make((m, 10))
    visible = torch.zeros(m, n + m, dtype=torch.bool)
    visible[:verify, :n + verify] = True
    visible[:verify, n:n + verify] = torch.ones(verify, verify, dtype=torch.bool).tril()  # the verify chain
    if data.draw(st.booleans(), label="groups"):  # draft rows as groups see: the keys before an anchor, some rows
        for r in range(verify, m):
            visible[r, :n + data.draw(st.integers(0, verify), label="anchor")] = True
        visible[verify:, n + verify:] = torch.rand(m - verify, m - verify, generator=g) < 0.6
    else:  # any keys
        visible[verify:] = torch.rand(m - verify, n + m, generator=g) < 0.8
    cap = n + m + 2
    caches = [(make((1, 2, cap, 10)), make((1, 2, cap, 10))) for _ in layers]
    assert_stack_matches_layers(dtype, g, x, cos, sin, visible, layers, caches, n, m, cap, n, draft=draft,
                                verify=verify)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,stall", [(1, 2000), (9, 2000), (1, 20), (9, 20)])
def test_a_thread_held_up_has_its_panels_taken_and_the_bits_stay(dtype, m, stall):
    """The stack's last thread waits before every linear step: the others take panels from the back of its share
    (a long wait: they take some, counted; a short one: its owner and the others race for the same share), every
    panel runs exactly once, and every output and cache row keeps the layer calls' bits, for every variant and
    thread count."""
    g = torch.Generator().manual_seed(m)
    make = lambda s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    n = 20
    layers = random_layers(dtype, make, 2, True, True, tiles=m == 9)
    x, cos, sin = make((m, 37)), make((m, 10)), make((m, 10))
    visible = torch.ones(m, n + m, dtype=torch.bool).tril(n)
    caches = [(make((1, 2, n + m, 10)), make((1, 2, n + m, 10))) for _ in layers]
    assert_stack_matches_layers(dtype, g, x, cos, sin, visible, layers, caches, n, m, n + m, n, stall=stall)


def test_stack_add_refuses_packed_weights_that_do_not_match_the_layer():
    """A packed weight of another dtype or of more pair steps than its inputs need, or a bias of another length,
    is refused when the layer is added (nothing may throw later, inside the forward's parallel region)."""
    g = torch.Generator().manual_seed(0)
    make = lambda s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    args = random_layers(torch.bfloat16, make, 1, True, True)[0]
    wrong = [
        (2, 0, kernels.pack_weight(torch.randn(40, 37, generator=g))),  # q packed from fp32
        (2, 1, kernels.pack_weight(make((20, 70)))),  # k over 70 inputs, not 37
        (10, 3, kernels.pack_weight(make((37, 70)))),  # down over 70 inputs, not the MLP's 45
        (11, 0, make((36,))),  # o's bias one short
    ]
    for at, i, tensor in wrong:
        bad = list(args)
        bad[at] = [tensor if j == i else t for j, t in enumerate(args[at])]
        with pytest.raises(RuntimeError, match="Stack.add: a (packed weight|bias)"):
            kernels.stack().add(*bad)
    kernels.stack().add(*args)  # the layer as made


def draft_view_of(layers, make, qk_norm: bool, bias: bool):
    """Stack.add's arguments for a draft view of `layers`: q/k/v/o, their biases and the q/k norms its own, the
    norms and the MLP the very tensors of the AR layer's."""
    out = []
    for args in layers:
        own = random_layers(args[0].dtype, make, 1, qk_norm, bias)[0]
        packed_out, bias_out = [own[10][0], *args[10][1:]], [own[11][0], *args[11][1:]]
        out.append((args[0], args[1], own[2], own[3], args[4], own[5], own[6], own[7], args[8], args[9],
                    packed_out, bias_out, args[12], args[13], args[14]))
    return out


def assert_stack_matches_layers(dtype, g, x, cos, sin, visible, layers, caches, n, m, cap, valid, stall=0,
                                draft=None, verify=None):
    """A Stack forward over `layers` gives the bits of the layer calls, for every variant and thread count, each
    panel of its linear steps run once (with `stall`, its last thread held up that many microseconds before each
    linear step; from a millisecond, some of its panels taken by the others). With `draft` (a draft view's
    layers), a fused forward: the first `verify` rows through `layers`, the rest through `draft`'s, each view's
    layer calls on its own rows the reference. With two threads the stack applies a final norm too, and gives the
    bits of the norm kernel over the layers' output."""
    panels = sum(p.shape[0] for args in layers for p in (*args[2], *args[10]))
    if draft is not None:
        panels += sum(p.shape[0] for args in draft for p in (*args[2], args[10][0]))
    verify = m if draft is None else verify

    def by_layers():
        h, rows = x, []
        parts = [(slice(0, verify), 0)] + ([(slice(verify, m), 1)] if draft is not None else [])
        for l, cache in enumerate(caches):
            keys, values = (c.clone() for c in cache)
            views = [layers[l], draft[l] if draft is not None else None]
            ins = [kernels.layer_in(h[r], cos[r], sin[r], *views[i][:9]) for r, i in parts]
            for (r, _), (_, k, v) in zip(parts, ins):
                keys[:, :, n + r.start:n + r.stop], values[:, :, n + r.start:n + r.stop] = k, v
            h = torch.cat([kernels.layer_out(h[r], q, keys[0, :, :n + m], values[0, :, :n + m], visible[r],
                                             views[i][9], *views[i][10:]) for (r, i), (q, _, _) in zip(parts, ins)])
            rows += [keys[:, :, n:n + m], values[:, :, n:n + m]]
        return [h, *rows]

    final_norm = torch.randn(x.shape[1], generator=g).to(dtype)

    def stacked(normed: bool = False):
        stack = kernels.stack()
        for args in layers:
            stack.add(*args)
        buffers = [(k.clone(), v.clone()) for k, v in caches]
        # key tiles valid for the first `valid` positions, garbage after: the kernel makes the rest
        tiles = [torch.randint(-2**31, 2**31 - 1, (2, -(-cap // 16), 5 if dtype != torch.float32 else 10, 16),
                               generator=g, dtype=torch.int32) for _ in layers]
        for t, (k, _) in zip(tiles, caches):  # position p: tile p // 16, lane p % 16
            words = k[0, :, :valid].contiguous().view(torch.int32 if dtype == torch.float32 else torch.int16)
            if dtype != torch.float32:
                words = (words[..., 0::2].to(torch.int32) & 0xFFFF) | (words[..., 1::2].to(torch.int32) << 16)
            lanes = t.transpose(2, 3).contiguous().view(t.shape[0], -1, t.shape[2])  # [kv, position, step]
            lanes[:, :valid] = words
            t.copy_(lanes.view(t.shape[0], t.shape[1], 16, t.shape[2]).transpose(2, 3))
        args = (x, cos, sin, visible, [b[0] for b in buffers], [b[1] for b in buffers], tiles, [valid] * len(layers), n,
                *((final_norm, 1e-5) if normed else (None, 0.0)))
        if draft is None:
            h = stack.forward(*args)
        else:
            views = kernels.stack()
            for layer in draft:
                views.add(*layer)
            h = stack.forward_views(views, verify, *args)
        for (k, v), (k0, v0) in zip(buffers, caches):  # nothing but positions n..n+m-1 written
            assert torch.equal(bits(k[:, :, :n]), bits(k0[:, :, :n])) and torch.equal(bits(k[:, :, n + m:]), bits(k0[:, :, n + m:]))
            assert torch.equal(bits(v[:, :, :n]), bits(v0[:, :, :n]))
        return [h, *(t[:, :, n:n + m] for b in buffers for t in b)]

    want = [nan_bits(t) for t in by_layers()]
    with kernels.use_isa(VARIANTS[0]):
        want_normed = [nan_bits(kernels.rms_norm(by_layers()[0], final_norm, 1e-5)), *want[1:]]
    assert any(bool(torch.isfinite(t).any()) for t in by_layers())  # not all NaN: the values stay in range
    before = torch.get_num_threads()
    try:
        # bf16 products (the linear layers' and attention's scores) by dot-product instruction or widened fmas
        paths = (False, True) if dtype == torch.bfloat16 else (False,)
        for isa, widened in ((isa, w) for isa in VARIANTS for w in paths):
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                with kernels.use_isa(isa), kernels.bf16_path(widened):
                    kernels.ops().set_stack_stall(stall)
                    try:
                        for i, (a, b) in enumerate(zip(stacked(threads == 2), want_normed if threads == 2 else want)):
                            assert torch.equal(nan_bits(a), b), (isa, widened, threads, i)
                        granted, ran, taken = kernels.ops().stack_counts()
                        assert 1 <= granted <= threads and ran == panels, (isa, widened, threads, granted, ran, panels)
                        if stall >= 1000 and granted > 1:
                            assert taken > 0, (isa, widened, threads)
                    finally:
                        kernels.ops().set_stack_stall(0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=4, **SLOW)
@given(data=st.data())
def test_a_long_context_split_over_the_threads_gives_the_layer_calls_bits(dtype, data):
    """From 1,024 keys a row, a step or a chain of up to 17 rows spreads each kv head's attention over the threads
    (scores and exp by segments of keys, the weighted values by parts of the queries or chunks of the head dim),
    and so do the rows of a tree: the stack still gives the bits of the layer calls, for every variant and thread
    count, and so do longer chains, which take items."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    make = lambda s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    m, n = data.draw(st.integers(1, 18), label="rows"), data.draw(st.integers(1024, 1100), label="cache")
    layers = random_layers(dtype, make, 2, data.draw(st.booleans(), label="qk norms"), False)
    x, cos, sin = make((m, 37)), make((m, 10)), make((m, 10))
    visible = torch.ones(m, n + m, dtype=torch.bool)
    visible[:, n:] = torch.ones(m, m, dtype=torch.bool).tril()  # a chain: each row sees the cache and the rows before
    if data.draw(st.booleans(), label="a tree"):  # or itself and some of the rows before it
        visible[:, n:] &= (torch.rand(m, m, generator=g) < 0.5) | torch.eye(m, dtype=torch.bool)
    cap = n + m + 3
    caches = [(make((1, 2, cap, 10)), make((1, 2, cap, 10))) for _ in layers]
    assert_stack_matches_layers(dtype, g, x, cos, sin, visible, layers, caches, n, m, cap,
                                data.draw(st.sampled_from([0, n - 5, n]), label="positions the key tiles hold"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=6, **SLOW)
@given(data=st.data())
def test_long_context_attention_split_over_the_threads_is_correct_and_invariant(dtype, data):
    """The split attention (up to 17 rows that see the cache's first keys, 1,024 or more of them) matches a
    float64 reference and gives one set of bits for every variant and thread count, head dims not a multiple of
    16, more than four heads a kv head, rows of a tree (each sees some of the rows before it) and more rows than a
    split takes included."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    kv = data.draw(st.integers(1, 3), label="kv heads")
    heads = kv * data.draw(st.integers(1, 6), label="group")
    d = data.draw(st.sampled_from([10, 40, 64, 72, 128]), label="d")
    q, n = data.draw(st.integers(1, 18), label="q"), data.draw(st.integers(1024, 1300), label="keys")
    query, key, value = (torch.randn(*s, generator=g).to(dtype) for s in ((q, heads, d), (kv, n, d), (kv, n, d)))
    visible = torch.ones(q, n, dtype=torch.bool)
    visible[:, n - q + 1:] = torch.ones(q, q - 1, dtype=torch.bool).tril(-1)
    if data.draw(st.booleans(), label="a tree"):  # each row also sees some of the rows before it, not all
        drawn = torch.rand(q, q - 1, generator=g) < 0.5
        visible[:, n - q + 1:] &= drawn
    want = bits(kernels.attention(query, key, value, visible, 1 / math.sqrt(d)))
    k64, v64 = (t.double().repeat_interleave(heads // kv, dim=0) for t in (key, value))
    scores = torch.einsum("qhd,hnd->hqn", query.double(), k64) / math.sqrt(d)
    probs = torch.softmax(scores.masked_fill(~visible[None], -math.inf), dim=-1)
    ref = torch.einsum("hqn,hnd->qhd", probs, v64)
    got = want.view(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps  # fp32: sums of ~1,300 fp32 roundings
    assert torch.allclose(got, ref, rtol=tol, atol=tol)
    before = torch.get_num_threads()
    try:
        for isa in VARIANTS:
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                with kernels.use_isa(isa):
                    assert torch.equal(bits(kernels.attention(query, key, value, visible, 1 / math.sqrt(d))), want), \
                        (isa, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", VARIANTS)
def test_stream_reads_every_word_of_every_tensor(isa):
    """The floor benchmark's read: one set bit anywhere, in any tensor of odd size, shows in the result."""
    tensors = [torch.zeros(n, dtype=torch.int32) for n in (1, 17, 16384 * 3 + 5, 70001)]
    with kernels.use_isa(isa):
        assert kernels.stream(tensors) == 0
        for t in tensors:
            for at in {0, t.numel() // 2, t.numel() - 1}:
                t[at] = 1 << (at % 31)
                assert kernels.stream(tensors) == 1 << (at % 31), (t.numel(), at)
                t[at] = 0
        tensors[2][-1], tensors[0][0] = 1 << 30, 5
        assert kernels.stream(tensors) == (1 << 30) | 5


@pytest.mark.parametrize("isa", VARIANTS)
def test_the_compute_floor_rates_exist_where_the_dot_product_instruction_does(isa):
    """The compute floor's rates (forward_cost.py): a variant with the dot-product instruction times it and the fma
    over chains long enough to be a rate (0.1 to 50 G a second on any CPU that has them: a loop the compiler had
    removed would read as far more); the others say none."""
    with kernels.use_isa(isa):
        rates = kernels.product_rates()
    if isa in ("avx512bf16", "amx"):  # between 0.1 and 50 G a second, the instruction at 1/10 to 10x the fma's
        assert set(rates) == {"dot", "fma"} and all(1e8 < v < 5e10 for v in rates.values()), rates
        assert 0.1 < rates["dot"] / rates["fma"] < 10, rates
    else:
        assert rates is None


@pytest.mark.parametrize("isa", VARIANTS)
def test_subnormals_read_as_zero_and_results_flush_in_every_variant(isa):
    """The denormal rule (the one the AVX-512 BF16 dot product applies whatever MXCSR says) holds in every variant,
    whatever the calling thread's own denormal mode, in every worker thread."""
    sub = FLT_MIN / 4  # a float32 (and bfloat16) subnormal
    g = torch.Generator().manual_seed(1)
    with kernels.use_isa(isa):
        for flush in (False, True):
            torch.set_flush_denormal(flush)
            try:
                for dtype in (torch.float32, torch.bfloat16):
                    w = torch.randn(40, 6, generator=g).to(dtype)
                    packed = kernels.pack_weight(w)
                    # a subnormal input contributes nothing, even beside a normal accumulator of its size
                    x = torch.tensor([[sub, 0, 0, 0, 0, 0], [0] * 6], dtype=torch.float32).to(dtype)
                    assert torch.equal(kernels.linear(x, packed, 40), torch.zeros(2, 40, dtype=dtype))
                    # a product below FLT_MIN added to nothing is flushed (sign kept), never kept as a subnormal; in
                    # bf16 (AMX's order) the flushed -0 is then added to a sum that starts at +0, so +0
                    tiny = torch.full((1, 2), 2.0 ** -70).to(dtype)
                    out = kernels.linear(tiny, kernels.pack_weight(torch.full((3, 2), -2.0 ** -70).to(dtype)), 3)
                    zero = 0.0 if dtype == torch.bfloat16 else -0.0
                    assert torch.equal(bits(out), bits(torch.full((1, 3), zero, dtype=dtype)))
                    sums = kernels.linear_sums(tiny, kernels.pack_weight(torch.full((3, 2), -2.0 ** -70).to(dtype)), 3)
                    assert torch.equal(bits(sums), bits(torch.full((1, 3), zero)))
                    assert kernels.rms_norm(torch.full((2, 5), sub).to(dtype), torch.ones(5, dtype=dtype), 0.0).isnan().all()
            finally:
                torch.set_flush_denormal(False)


def test_nan_and_inf_have_one_defined_result_in_every_variant():
    nan_bits = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
    for dtype in DTYPES:
        x = torch.randn(4, 33).to(dtype)
        x[0, 3], x[1, 5], x[2, 7] = float("nan"), float("inf"), -float("inf")
        w = torch.randn(20, 33).to(dtype)
        outs = {}
        for isa in VARIANTS:
            with kernels.use_isa(isa):
                outs[isa] = [kernels.linear(x, kernels.pack_weight(w), 20), kernels.silu(x), kernels.rms_norm(x, w[0], 1e-5)]
        first = outs[VARIANTS[0]]
        for isa, got in outs.items():
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, first)), isa
        lin = first[0]
        assert lin[0].isnan().all() and (bits(lin[0]) == nan_bits[dtype]).all()  # the canonical quiet NaN
        # silu as stock defines it at the ends: silu(inf) = inf, silu(-inf) = -inf * 0 = NaN (here canonical)
        assert first[1][1, 5] == float("inf") and bits(first[1][0, 3]) == bits(first[1][2, 7]) == nan_bits[dtype]


def test_the_isa_switch_refuses_unknown_and_unrunnable_variants(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "avx1024")
    with pytest.raises(LosslessError, match="not a kernel variant: choose one of amx, avx512bf16, avx512, avx2, scalar"):
        kernels.isa()
    monkeypatch.setenv(kernels.ISA_ENV, "scalar")
    assert kernels.isa() == "scalar" and kernels.ops() is kernels.extension().scalar
    monkeypatch.delenv(kernels.ISA_ENV)
    assert kernels.isa() == VARIANTS[0]
    kernels._resolve.cache_clear()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"fma", "avx2", "f16c", "bmi2"}))
    try:
        with pytest.raises(LosslessError, match="this CPU cannot run that variant .it can run avx2, scalar"):
            with kernels.use_isa("avx512bf16"):
                pass
    finally:
        kernels._resolve.cache_clear()


def test_the_build_compiles_as_many_files_at_once_as_the_cores_and_the_memory_allow(monkeypatch):
    assert kernels.build_jobs(cores=8, available_gb=64.0) == 8
    assert kernels.build_jobs(cores=8, available_gb=6.0) == 2  # 2.5 GB a file
    assert kernels.build_jobs(cores=2, available_gb=1.0) == 1  # never none
    monkeypatch.setattr(kernels, "_available_gb", lambda: None)  # memory unknown: every file at once, up to the cores
    assert kernels.build_jobs(cores=16) == 1 + len(kernels.VARIANT_SOURCES)
    assert kernels.build_jobs(cores=3) == 3


def test_the_kernel_digest_covers_every_source_file_the_build_reads():
    package = {p.name for p in Path(kernels.__file__).parent.glob("exact_*") if p.suffix in (".cpp", ".h")}
    assert {p.name for p in kernels.SOURCES} == package
    assert {p.name for p in kernels.SOURCES if p.suffix == ".cpp"} == {"exact_kernels.cpp", *kernels.VARIANT_SOURCES}


def test_a_build_compiles_every_variant_file_with_the_jobs_it_chose_and_leaves_the_environment_as_it_was(
        monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("LOSSLESS_CACHE", str(tmp_path))
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(kernels, "_available_gb", lambda: 5.5)
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **kw: seen.append(
        (os.environ.get("MAX_JOBS"), sorted(os.path.basename(s) for s in sources))) or "built")
    assert kernels.build(["-O0"]) == "built" and "MAX_JOBS" not in os.environ
    assert seen[0] == (str(min(kernels._cores(), 2)), sorted(["exact_kernels.cpp", *kernels.VARIANT_SOURCES]))
    # the headers travel with them, into the build's own folder
    assert {"exact_common.h", "exact_api.h", "exact_isa.h"} <= {p.name for p in tmp_path.glob("kernels/*/src/*")}
    monkeypatch.setenv("MAX_JOBS", "3")  # the user's word decides
    kernels.build(["-O0"])
    assert seen[1][0] == "3" and os.environ["MAX_JOBS"] == "3"


def test_amx_is_refused_in_one_line_without_the_tiles_or_the_leave_to_use_them(monkeypatch):
    amx_flags = kernels._NEEDS["amx"]
    kernels._resolve.cache_clear()
    try:
        if "amx" not in VARIANTS:  # this CPU: no tiles (or no leave), so the variant is refused by name
            with pytest.raises(LosslessError, match="LOSSLESS_EXACT_ISA=amx: this CPU cannot run that variant"):
                with kernels.use_isa("amx"):
                    pass
        # a CPU with the tiles whose operating system refuses their state: refused, saying why
        monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(amx_flags))
        monkeypatch.setattr(kernels, "amx_refusal", lambda: "Linux refused the AMX tile state (arch_prctl: EPERM)")
        kernels._resolve.cache_clear()
        assert kernels.runnable_isas()[0] == "avx512bf16"  # the default goes on without tiles
        with pytest.raises(LosslessError, match=r"^LOSSLESS_EXACT_ISA=amx: .*Linux refused the AMX tile state.*it can "
                                                r"run avx512bf16, avx512, avx2, scalar\)$"):
            with kernels.use_isa("amx"):
                pass
    finally:
        kernels._resolve.cache_clear()


def test_the_cli_refuses_a_variant_in_one_line(tmp_path):
    import subprocess
    import sys

    from conftest import save_tiny_model_dir

    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    env = {**__import__("os").environ, kernels.ISA_ENV: "avx1024"}
    proc = subprocess.run([sys.executable, "-m", "lossless", "generate", "--model", str(model_dir), "--attn", "exact",
                           "--max-new-tokens", "2", "w1 w2"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "LOSSLESS_EXACT_ISA=avx1024" in proc.stderr


# ------------------------------------------------------------------------------------------ correctness
def test_the_rotary_table_is_correctly_rounded_and_covers_any_position():
    inv = kernels.default_inv_freq(100000.0, 64)
    exponents = (np.arange(0, 64, 2, dtype=np.float32) / np.float32(64)).astype(np.float64)  # as Hugging Face rounds them
    want = 100000.0 ** -exponents  # float64 reference
    assert np.all(np.abs(inv.astype(np.float64) - want) <= np.spacing(inv).astype(np.float64) / 2)
    cos, sin = kernels.rotary_table(inv, 5000, scaling=1.0)
    theta = (torch.arange(5000, dtype=torch.float32)[:, None] * torch.from_numpy(inv)[None]).double()
    theta = torch.cat([theta, theta], 1)
    assert cos.shape == (5000, 64) and cos.dtype == torch.float32
    assert torch.equal(cos, theta.cos().float()) and torch.equal(sin, theta.sin().float())  # correctly rounded
    big = torch.tensor([3e5, 7.5e5, 1e6], dtype=torch.float64)
    s, c = kernels.sincos64(big.numpy())
    assert np.allclose(s, np.sin(big.numpy()), atol=1e-12) and np.allclose(c, np.cos(big.numpy()), atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=12, **SLOW)
@given(data=st.data())
def test_attention_matches_a_float64_reference(dtype, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    kv = data.draw(st.integers(1, 3), label="kv heads")
    heads = kv * data.draw(st.integers(1, 4), label="group")
    d, n, q = (data.draw(st.integers(lo, hi), label=name) for name, lo, hi in (("d", 1, 130), ("keys", 1, 90), ("q", 1, 9)))
    query, key, value = (torch.randn(*s, generator=g).to(dtype) for s in ((q, heads, d), (kv, n, d), (kv, n, d)))
    visible = torch.rand(q, n, generator=g) < data.draw(st.floats(0.05, 1.0), label="density")
    visible[:, data.draw(st.integers(0, n - 1), label="always seen")] = True
    got = kernels.attention(query, key, value, visible, 1 / math.sqrt(d)).double()
    k64, v64 = (t.double().repeat_interleave(heads // kv, dim=0) for t in (key, value))  # [h, n, d]
    scores = torch.einsum("qhd,hnd->hqn", query.double(), k64) / math.sqrt(d)
    probs = torch.softmax(scores.masked_fill(~visible[None], -math.inf), dim=-1)
    want = torch.einsum("hqn,hnd->qhd", probs, v64)
    # fp32: a sum of up to 90 products and a softmax, each rounded in fp32 (~1e-6); bf16/fp16: one rounding of the
    # output to the dtype (the inputs are exact)
    tol = 2e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert torch.allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("isa", VARIANTS)
def test_exp_gives_a_lane_the_same_bits_whatever_its_neighbours_and_lane(isa):
    """exp (in SiLU and attention) skips its clamps for 16 lanes that all lie inside its range: a value gets the
    same bits in such a vector, beside a lane out of range (inf, -inf, NaN, beyond the clamps) and as a tail
    lane (exp one at a time), and SiLU matches float64 everywhere, the clamps' edges included."""
    g = torch.Generator().manual_seed(1)
    # 48 values whose exp arguments (-x) all lie inside [-87, 88], its edges included
    inside = torch.cat([(torch.randn(43, generator=g) * 30).clamp(-86, 86), torch.tensor([87.0, -88.0, -86.99, 0.0, -0.0])])
    with kernels.use_isa(isa):
        want = bits(kernels.silu(inside[None]))  # three vectors, every lane inside
        for odd in (float("inf"), -float("inf"), float("nan"), 120.0, -95.0, 88.5):
            for lane in (0, 7, 15):
                x = inside.clone()
                x[16 + lane] = odd
                got = bits(kernels.silu(x[None]))
                keep = torch.ones(48, dtype=torch.bool)
                keep[16 + lane] = False
                assert torch.equal(got[0, keep], want[0, keep]), (odd, lane)
        for at in range(0, 48, 5):  # a tail lane: a row of 17 values whose last one is `inside[at]`
            row = torch.cat([inside[:16], inside[at:at + 1]])
            assert torch.equal(bits(kernels.silu(row[None]))[0, 16], want[0, at]), at
        edges = torch.tensor([88.0, 88.0001, -87.0, -87.0001, 100.0, -100.0, 1e-30, -1e-30] * 2)
        x64 = edges.double()
        assert torch.allclose(kernels.silu(edges[None])[0].double(), x64 / (1 + torch.exp(-x64)), rtol=5e-7, atol=1e-37)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_and_silu_match_float64_to_their_rounding(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(7, 300, generator=g) * 3).to(dtype), torch.randn(300, generator=g).to(dtype)
    ulp = torch.finfo(dtype).eps
    x64, w64 = x.double(), w.double()
    silu = x64 / (1 + torch.exp(-x64))
    # fp32: exp to ~2 ulp, then two roundings; bf16/fp16: the result rounded once to the dtype
    assert torch.allclose(kernels.silu(x).double(), silu, rtol=4 * ulp if dtype == torch.float32 else ulp, atol=1e-30)
    inv = 1 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    if dtype == torch.float32:
        assert torch.allclose(kernels.rms_norm(x, w, 1e-6).double(), w64 * x64 * inv, rtol=8 * ulp, atol=0)
    else:  # the Llama/Qwen order: x * inv rounded to the dtype, then times the weight, rounded again
        inner = (x64 * inv).to(dtype).double()
        assert torch.allclose(kernels.rms_norm(x, w, 1e-6).double(), w64 * inner, rtol=ulp, atol=0)


def drawn_backbone(data, family: str):
    """A 2-layer random Llama or Qwen3 of drawn shapes: GQA ratio, head_dim (rarely a multiple of 16), vocab
    (rarely a multiple of 16), tied or untied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kv = data.draw(st.integers(1, 3), label="kv heads")
    heads = kv * data.draw(st.integers(1, 3), label="group")
    head_dim = data.draw(st.sampled_from([4, 6, 8, 10, 14, 16, 18, 24, 34]), label="head_dim")
    cfg = dict(vocab_size=data.draw(st.integers(40, 300), label="vocab"), hidden_size=heads * head_dim,
               intermediate_size=data.draw(st.integers(8, 200), label="intermediate"), num_hidden_layers=2,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=128,
               tie_word_embeddings=data.draw(st.booleans(), label="tied"),
               rope_theta=data.draw(st.sampled_from([10000.0, 100000.0, 1e6]), label="rope theta"))
    torch.manual_seed(data.draw(st.integers(0, 1000), label="seed"))
    model = LlamaForCausalLM(LlamaConfig(**cfg)) if family == "llama" else Qwen3ForCausalLM(Qwen3Config(**cfg))
    return model.eval()


@settings(max_examples=10, **SLOW)
@given(data=st.data())
def test_exact_fp32_logits_match_stock_fp32_logits(family, data):
    """A rotary off by one, a wrong GQA head or a mask bug would hit AR and verification alike and pass every
    equality test; against stock fp32 they would miss by O(1). The tolerance: both sides are fp32 with different
    summation orders, a few ulps per op through two layers, so 1e-4 of the logits' scale is far above rounding
    and far below any such bug."""
    backbone = drawn_backbone(data, family)
    stock = OrthrusLM(backbone, k=8)
    ids = data.draw(st.lists(st.integers(0, backbone.config.vocab_size - 1), min_size=2, max_size=60), label="ids")
    split = data.draw(st.integers(1, len(ids) - 1), label="prefill")
    cache, first = stock.prefill(ids[:split])
    want = torch.cat([first[None], stock.verify(cache, ids[split:])])
    import copy

    exact = OrthrusLM(copy.deepcopy(backbone), k=8)
    exact.set_attn("exact")
    cache, first = exact.prefill(ids[:split])
    got = torch.cat([first[None], exact.verify(cache, ids[split:])])
    scale = float(want.abs().max())
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale), float((got - want).abs().max() / scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=6, **SLOW)
@given(data=st.data())
def test_fused_decoder_layers_give_the_bits_of_the_module_path(family, dtype, data):
    """Exact mode runs a forward's decoder layers as one kernel call (each Llama/Qwen3 layer as two kernels,
    rotary, residual adds and gate * up inside them), or layer by layer as two calls each (a cache that does
    not grow in place); module by module, Hugging Face's layer code calling each kernel, gives the same logits
    and the same cache bit for bit in all three: a prefill, a verify block and a tree. A fused forward (a verify
    block and draft groups through a draft view of its own weights) runs as one call too, with the module
    path's verify logits, draft logits and cache."""
    from transformers import DynamicCache

    from lossless.decoding.exact import layer_modules

    model = OrthrusLM(drawn_backbone(data, family).to(dtype), k=4)
    perturb_head(model, 0.3)  # a draft view of weights its own
    model.set_attn("exact")
    assert f"decoder layer x{model.config.num_hidden_layers} (one call per forward)" in model.exact_ops
    vocab = model.config.vocab_size
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=3, max_size=40), label="ids")
    split = data.draw(st.integers(1, len(ids) - 1), label="prefill")
    tree = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8), label="tree ids")
    parents = [-1] + [data.draw(st.integers(0, i - 1), label="parent") for i in range(1, len(tree))]
    block = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5), label="fused block")
    anchors = sorted(data.draw(st.sets(st.integers(0, len(block) - 1), min_size=1), label="anchors"))

    def run():
        cache, first = model.prefill(ids[:split])
        out = [first, model.verify(cache, ids[split:]), model.verify_tree(cache, tree, parents)]
        commit_cache(cache, len(ids) + 1)  # the tree's rows go: the cache holds the ids
        out += [model.draft(cache, tree[0], 4), *model.verify_and_draft(cache, block, anchors, 3)]
        return out + [t for layer in cache.layers for t in (layer.keys, layer.values)]

    with StackCalls(model) as stacked:
        whole = run()
    with mock.patch.object(kernels, "layer_in", wraps=kernels.layer_in) as layer_in:
        with mock.patch.object(model, "new_cache", lambda: DynamicCache(config=model.config)):
            fused = run()
        with layer_modules():
            modules = run()
    assert stacked == [split, len(ids) - split, len(tree), 4, (len(block), 4 * len(anchors))]  # one call each
    assert layer_in.call_count == 3 * model.config.num_hidden_layers  # layer by layer: every AR forward's layers
    for i, (a, b, c) in enumerate(zip(whole, fused, modules)):
        assert torch.equal(bits(a), bits(c)) and torch.equal(bits(b), bits(c)), i


def test_the_layer_stack_follows_head_weights_changed_in_place_or_replaced(family):
    """A stack is kept between forwards and made again when any weight it was made from changes: a draft pass
    after the head's weights change in place (a training step, a loaded head), after one is replaced by a new
    tensor (by assignment or in the module's dict), after new data is assigned to one, or after a whole
    projection is replaced by another module, gives the module path's draft logits for the new weights."""
    from lossless.decoding.exact import layer_modules

    model = OrthrusLM(tiny_backbone(family), k=4)
    model.set_attn("exact")
    cache, _ = model.prefill(PROMPTS_FOR_STACK)
    before = model.draft(cache, 7, 4)
    perturb_head(model, 0.5)  # in place
    changed = model.draft(cache, 7, 4)
    with layer_modules():
        assert torch.equal(changed, model.draft(cache, 7, 4)) and not torch.equal(changed, before)
    attn = model.backbone.model.layers[1].self_attn
    replace = ["v_proj_diff"] + (["q_norm_diff"] if family == "qwen3" else [])
    with torch.no_grad():
        for name in replace:  # a new tensor in the module's place
            module = getattr(attn, name)
            module.weight = torch.nn.Parameter(module.weight * 3)
    replaced = model.draft(cache, 7, 4)
    with layer_modules():
        assert torch.equal(replaced, model.draft(cache, 7, 4)) and not torch.equal(replaced, changed)
    attn.k_proj_diff.weight.data = attn.k_proj_diff.weight.data * 2  # new data, the same parameter and version
    assigned = model.draft(cache, 7, 4)
    with layer_modules():
        assert torch.equal(assigned, model.draft(cache, 7, 4)) and not torch.equal(assigned, replaced)
    with torch.no_grad():  # a new tensor written into the module's dict, as torch.func.functional_call does
        attn.q_proj_diff._parameters["weight"] = torch.nn.Parameter(attn.q_proj_diff.weight * 0.5)
    written = model.draft(cache, 7, 4)
    with layer_modules():
        assert torch.equal(written, model.draft(cache, 7, 4)) and not torch.equal(written, assigned)
    assigned = written
    other = copy.deepcopy(attn.o_proj_diff)  # another module of the same kind in the projection's place
    with torch.no_grad():
        other.weight.mul_(-1)
    attn.o_proj_diff = other
    swapped = model.draft(cache, 7, 4)
    with layer_modules():
        assert torch.equal(swapped, model.draft(cache, 7, 4)) and not torch.equal(swapped, assigned)


PROMPTS_FOR_STACK = [3, 9, 14, 15, 22, 40, 41, 2]


@pytest.mark.parametrize("cycle", [dict(), dict(tree=4, lookup=8)], ids=["chain", "tree+lookup"])
def test_a_hook_on_the_layers_sees_every_forward_of_a_decode(family, cycle):
    """Decoding calls the layer stack without the module calls around it (the layers, the embedding, the rotary
    embedding), and the stack applies the final norm itself, where nothing watches; a forward hook on the
    backbone's layers, its final norm, its embedding or its rotary embedding (or on every module) still sees each
    call the module path makes, and the tokens and logits stay the same to the bit."""
    from lossless.decoding.exact import NormMixin, RotaryTableMixin, layer_modules

    model = OrthrusLM(tiny_backbone(family), k=4)
    perturb_head(model, 0.3)
    model.set_attn("exact")
    cfg = DecodeConfig(max_new_tokens=12, eos_ids=NO_EOS, **cycle)
    backbone = model.backbone.model
    spies = [mock.patch.object(cls, "forward", autospec=True, side_effect=cls.forward)
             for cls in (NormMixin, RotaryTableMixin)]
    with spies[0] as norms, spies[1] as rotary:
        plain = decode(model, PROMPTS_FOR_STACK, "orthrus", cfg)
        assert not [c for c in norms.call_args_list if c.args[0] is backbone.norm]  # (the stack applied it)
        assert rotary.call_count == 0  # (the stack's rows read the table itself)

    def verify_logits():
        cache, _ = model.prefill(PROMPTS_FOR_STACK)
        return model.verify(cache, [5, 6, 7])

    unwatched = verify_logits()
    for watched, register in ((backbone, backbone.register_forward_hook), (backbone.norm, backbone.norm.register_forward_hook),
                              (backbone.embed_tokens, backbone.embed_tokens.register_forward_hook),
                              (backbone.rotary_emb, backbone.rotary_emb.register_forward_hook),
                              (backbone, torch.nn.modules.module.register_module_forward_hook)):
        seen = []
        handle = register(lambda module, args, out, watched=watched: seen.append(module) if module is watched else None)
        try:
            hooked = decode(model, PROMPTS_FOR_STACK, "orthrus", cfg)
            calls = len(seen)
            with layer_modules():  # module by module: every call the module path makes
                assert decode(model, PROMPTS_FOR_STACK, "orthrus", cfg).generated == plain.generated
            assert hooked.generated == plain.generated and calls == len(seen) - calls > 0, watched
            assert torch.equal(verify_logits(), unwatched)
        finally:
            handle.remove()
        if watched is backbone:
            assert calls == hooked.stats.forwards  # (the prefill counted)


def test_rows_the_stack_does_not_take_go_the_module_path(family):
    """`lossless_rows` declines (None: the module path runs) a batch of sequences, no rows, a depth per row that
    does not match the rows, a draft pass over an empty cache, and any forward while gradients are on."""
    model = OrthrusLM(tiny_backbone(family), k=4)
    model.set_attn("exact")
    backbone = model.backbone.model
    cache, _ = model.prefill(PROMPTS_FOR_STACK)
    n = cache.get_seq_length()
    assert backbone.lossless_rows(cache, n, ids=[3]) is None  # (gradients on, as outside the model's passes)
    with torch.no_grad():
        embeds = backbone.embed_tokens(torch.tensor([3, 4]))
        assert backbone.lossless_rows(cache, n, ids=torch.tensor([[3, 4], [5, 6]])) is None
        assert backbone.lossless_rows(cache, n, ids=[]) is None
        assert backbone.lossless_rows(cache, n, ids=[3, 4], depth=[0]) is None
        assert backbone.lossless_rows(model.new_cache(), 0, embeds=embeds, draft=True) is None
        assert cache.get_seq_length() == n  # (nothing ran)
        hidden = backbone.lossless_rows(cache, n, ids=torch.tensor([[3, 4]]))
    assert hidden.shape == (2, model.config.hidden_size) and cache.get_seq_length() == n + 2


def test_a_decode_call_checks_each_stacks_weights_at_its_first_forward_only(family):
    """Within a decode call the weights are fixed: the AR stack and the draft view's stack each check their weights
    once (at their first forward), however many forwards the call runs; outside one, every forward checks."""
    from lossless.decoding import exact

    model = OrthrusLM(tiny_backbone(family), k=4)
    perturb_head(model, 0.3)
    model.set_attn("exact")
    cfg = DecodeConfig(max_new_tokens=24, eos_ids=NO_EOS)
    decode(model, PROMPTS_FOR_STACK, "orthrus", cfg)  # the stacks made
    checks = mock.patch.object(exact._HeldStack, "current", autospec=True, side_effect=exact._HeldStack.current)
    with checks as current:
        state = decode(model, PROMPTS_FOR_STACK, "orthrus", cfg)
        assert state.stats.forwards > 4 and current.call_count == 2
        cache, _ = model.prefill(PROMPTS_FOR_STACK)
        for _ in range(3):
            model.draft(cache, 7, 4)
        assert current.call_count == 2 + 4


# -------------------------------------------------------------------------------------------- borders
def test_the_fused_cycle_decodes_up_to_the_end_of_the_context(family):
    """Draft groups reach k - 3 positions past the last token a request may commit; the table grows to them."""
    model = OrthrusLM(tiny_backbone(family), k=8)
    perturb_head(model, 0.3)
    model.set_attn("exact")
    assert model.max_positions == 256
    prompt = torch.randint(0, 63, (240,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = DecodeConfig(max_new_tokens=16, eos_ids=NO_EOS, k=8)
    ar = decode(model, prompt, "ar", cfg).generated
    for extra in (dict(cycle="fused"), dict(cycle="fused", lookup=16), dict(tree=8, lookup=16)):
        assert decode(model, prompt, "orthrus", dataclasses.replace(cfg, **extra)).generated == ar, extra
    rotary = model.backbone.model.rotary_emb
    assert max(t[0].shape[0] for t in rotary._lossless_tables.values()) >= 256 + 8 - 3


def test_models_exact_mode_cannot_serve_are_refused_by_name(family):
    from transformers.activations import GELUActivation

    def fresh(**config):
        backbone = tiny_backbone(family)
        for key, value in config.items():
            setattr(backbone.config, key, value)
        return OrthrusLM(backbone, k=8)

    model = fresh()
    model.backbone.model.layers[1].mlp.act_fn = GELUActivation()
    with pytest.raises(LosslessError, match=r"activation model.layers.1.mlp.act_fn \(GELUActivation\)"):
        model.set_attn("exact")
    model = fresh()
    model.backbone.model.layers[0].extra = torch.nn.Conv1d(2, 2, 1)
    with pytest.raises(LosslessError, match=r"no kernel for model.layers.0.extra \(Conv1d\); use --attn sdpa"):
        model.set_attn("exact")
    model = fresh()
    model.backbone.model.norm = torch.nn.LayerNorm(32)
    with pytest.raises(LosslessError, match=r"norm model.norm \(LayerNorm: not a Llama/Qwen RMSNorm\)"):
        model.set_attn("exact")
    model = fresh(layer_types=["full_attention", "sliding_attention"], sliding_window=16)
    with pytest.raises(LosslessError, match="sliding-window attention"):
        model.set_attn("exact")
    model = fresh()
    model.backbone.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(LosslessError, match="'dynamic' RoPE"):
        model.set_attn("exact")
