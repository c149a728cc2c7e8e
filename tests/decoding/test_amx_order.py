"""bf16 products in AMX's own order, in every kernel variant: per chunk of 32 inputs an fma chain over the even
inputs and one over the odd inputs, each from +0, then sum + (even + odd). Checked against the outputs AMX's
TDPBF16PS itself gave (recorded on an Intel Xeon with AMX: `data/amx_tdpbf16ps.bin`, adversarial data, NaN and inf
included), so a CPU without AMX checks the order the hardware computes; and against a float64 model of the order
(each fma rounded once, by round-to-odd in float64), over shapes, rows and blocks. Where the CPU has AMX, the
`amx` variant runs in the same tests, its tiles taking calls from one row on."""

from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lossless.decoding import kernels

VECTORS = Path(__file__).with_name("data") / "amx_tdpbf16ps.bin"
VARIANTS = kernels.runnable_isas()
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def recorded_blocks():
    """Each block of the file: (K, data kind, A [16, K] bf16 bits, B [K, 16] bf16 bits, C0 [16, 16], C [16, 16]),
    C = C0 + A.B as TDPBF16PS computed it (little-endian: int32 K, int32 kind, A, B, C0, C)."""
    raw, at, blocks = VECTORS.read_bytes(), 0, []
    while at < len(raw):
        k, kind = (int(v) for v in np.frombuffer(raw, np.int32, 2, at))
        at += 8
        a = np.frombuffer(raw, np.uint16, 16 * k, at).reshape(16, k)
        b = np.frombuffer(raw, np.uint16, 16 * k, at + 32 * k).reshape(k, 16)
        c0, c = (np.frombuffer(raw, np.float32, 256, at + 64 * k + 1024 * i).reshape(16, 16) for i in range(2))
        blocks.append((k, kind, a, b, c0, c))
        at += 64 * k + 2048
    return blocks


def bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)


def variant_settings():
    """(label, a function making its context managers) for every way this CPU can compute bf16 products: each variant, the dot-product
    instruction or widened fmas where the variant has both, the dot products' calls of many rows in tall blocks or
    in blocks of 4 rows, AMX tiles from one row or never where it has them."""
    for isa in VARIANTS:
        for widened in (False, True):
            yield f"{isa} widened={widened}", lambda isa=isa, wide=widened: [kernels.use_isa(isa), kernels.bf16_path(wide)]
        if isa in ("avx512bf16", "amx"):
            yield f"{isa} blocks of 4 rows", lambda isa=isa: [kernels.use_isa(isa), kernels.bf16_path(False),
                                                              kernels.tall_blocks(False)]
        if isa == "amx":
            for rows in (1, None):
                yield f"amx tiles from {rows} rows", lambda rows=rows: [kernels.use_isa("amx"), kernels.amx_rows(rows)]


def run_under(managers, call):
    with ExitStack() as stack:
        for manager in managers():
            stack.enter_context(manager)
        return call()


def same_bits_nan_aside(got: np.ndarray, want: np.ndarray) -> int:
    """How many outputs differ in their bits, an output NaN on both sides counting as equal (payloads may differ)."""
    both_nan = np.isnan(got) & np.isnan(want)
    return int(((got.view(np.int32) != want.view(np.int32)) & ~both_nan).sum())


def test_the_recorded_file_holds_every_data_kind_and_width():
    blocks = recorded_blocks()
    assert len(blocks) == 64 and {b[0] for b in blocks} == {32, 64, 576, 1536} and len({b[1] for b in blocks}) == 8
    assert any(np.isnan(b[5]).any() for b in blocks) and any(np.isinf(b[5]).any() for b in blocks)


@pytest.mark.parametrize("threads", [1, 2])
def test_every_variant_reproduces_amx_recorded_outputs(threads):
    blocks = recorded_blocks()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for label, managers in variant_settings():
            for tiles in (False, True):  # weights in pair steps, and in AMX's tile layout
                differ = 0
                for k, kind, a, b, c0, c in blocks:
                    packed = kernels.pack_weight(bf16(b.T.copy()), tiles=tiles)
                    got = run_under(managers, lambda: kernels.linear_sums(bf16(a), packed, 16, torch.from_numpy(c0.copy())))
                    differ += same_bits_nan_aside(got.numpy(), c)
                assert differ == 0, f"{label}, tile layout {tiles}: {differ} of {64 * 256} outputs differ from AMX's"
    finally:
        torch.set_num_threads(before)


def test_the_order_is_not_one_chain():
    """The recorded outputs tell AMX's order from the kernels' former one (one fma chain per output over the pairs):
    a test that would pass for either order would check nothing."""
    k, _, a, b, c0, c = next(blk for blk in recorded_blocks() if blk[0] == 576 and not np.isnan(blk[5]).any())
    xs, ws = (bf16(t).float().numpy().astype(np.float64) for t in (a, b))
    chain = np.zeros((16, 16), np.float32)
    for i in range(k):  # fp32 fmas in input order (rounded once each: round-to-odd in float64, then to fp32)
        chain = fma32(xs[:, i][:, None] * ws[i][None, :], chain)
    assert same_bits_nan_aside(chain, (c - c0).astype(np.float32)) > 50  # most outputs of 256 differ


# ------------------------------------------------------------------------------------------ a float64 model
def round_once(exact_hi: np.ndarray, exact_lo: np.ndarray) -> np.ndarray:
    """fp32 of the exact sum hi + lo (hi = fl64(hi + lo)), rounded once: hi made odd where lo is not zero (round to
    odd keeps 29 spare bits, so the rounding to fp32 below is the correct one), then rounded to nearest even."""
    bits = exact_hi.view(np.int64)
    inexact_even = (exact_lo != 0) & (bits & 1 == 0)
    toward = np.where(exact_lo > 0, np.inf, -np.inf)
    odd = np.where(inexact_even, np.nextafter(exact_hi, toward), exact_hi)
    return flush(odd.astype(np.float32))


def flush(x: np.ndarray) -> np.ndarray:
    """Subnormal fp32 results flushed to zero, sign kept (the kernels' denormal rule)."""
    tiny = (x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)
    return np.where(tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


def fma32(product: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """fp32 fma of an exact product (float64) and an fp32 accumulator, one rounding: TwoSum in float64."""
    c = acc.astype(np.float64)
    s = product + c
    v = s - product
    err = (product - (s - v)) + (c - v)
    return round_once(s, err)


def amx_order(x: torch.Tensor, w: torch.Tensor, init: np.ndarray) -> np.ndarray:
    """x [m, k] @ w[n, k]^T in AMX's order, in float64 arithmetic that rounds once where fp32 rounds (finite data
    whose products do not underflow: the recorded file covers those)."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    xs = np.zeros((m, kp)); xs[:, :k] = x.float().numpy()
    ws = np.zeros((w.shape[0], kp)); ws[:, :k] = w.float().numpy()
    total = flush(init.astype(np.float32))
    for c in range(0, kp, 32):
        chains = [np.zeros(total.shape, np.float32), np.zeros(total.shape, np.float32)]
        for i in range(c, c + 32):
            chains[i % 2] = fma32(xs[:, i][:, None] * ws[:, i][None, :], chains[i % 2])
        pair = flush(chains[0] + chains[1])
        total = flush(total + pair)
    return total


@settings(max_examples=60, **SLOW)
@given(data=st.data())
def test_every_variant_computes_amx_order_over_shapes_and_blocks(data):
    """Any rows (blocks of 4; tall blocks read chunk by chunk: up to 14 rows with e and o side by side, 15 to 28
    rows as one block even steps first, more rows in several blocks of up to 14; widened blocks; 16-row tiles and
    their remainders), any k (padded to 32) and any outputs, the weights in pair steps or in AMX's tile layout:
    linear's fp32 sums are AMX's order exactly, and linear rounds them once to bf16."""
    m, k, n = (data.draw(st.integers(lo, hi), label=name) for name, lo, hi in (("m", 1, 60), ("k", 1, 130), ("n", 1, 40)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    spread = data.draw(st.sampled_from([0, 12]), label="exponent spread")  # 2^-12..2^12: no underflow, no overflow
    make = lambda *shape: (torch.randn(*shape, generator=g)
                           * 2.0 ** torch.randint(-spread, spread + 1, shape, generator=g).float()).to(torch.bfloat16)
    x, w = make(m, k), make(n, k)
    init = (torch.randn(m, n, generator=g) * 4).numpy() if data.draw(st.booleans(), label="init") else np.zeros((m, n))
    want = amx_order(x, w, init)
    packed = kernels.pack_weight(w, tiles=data.draw(st.booleans(), label="tile layout"))
    for label, managers in variant_settings():
        sums = run_under(managers, lambda: kernels.linear_sums(x, packed, n, torch.from_numpy(init).float()))
        assert same_bits_nan_aside(sums.numpy(), want) == 0, label
        rounded = run_under(managers, lambda: kernels.linear(x, packed, n))
        zero_init = run_under(managers, lambda: kernels.linear_sums(x, packed, n))
        assert torch.equal(rounded, zero_init.to(torch.bfloat16)), label


@pytest.mark.skipif("amx" not in VARIANTS, reason=f"the amx variant cannot run here: {kernels.amx_refusal()}")
@pytest.mark.parametrize("rows,n", [(1, 1536), (9, 1536), (16, 1536), (17, 1552), (32, 1552), (33, 1536)])
def test_amx_tiles_give_the_dot_product_variant_bits(rows, n):
    """On a CPU with AMX: tiles from one row on (every call on tiles; tiles as tall as the rows up to 16, two row
    tiles a B tile past 16, the second as tall as the rows left up to 32, whole 16-row tiles and a remainder past
    32; an odd panel left over) against the AVX-512 BF16 variant, over the embedded model's shapes, with a bias,
    at 1 and 2 threads."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    w, bias = torch.randn(n, 576, generator=g).to(torch.bfloat16), torch.randn(n, generator=g).to(torch.bfloat16)
    packed = kernels.pack_weight(w)
    with kernels.use_isa("avx512bf16"):
        want = kernels.linear(x, packed, n, bias)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for tiles in (False, True):  # B tiles rebuilt from pair steps, and read in place from the tile layout
                with kernels.use_isa("amx"), kernels.amx_rows(1):
                    got = kernels.linear(x, kernels.pack_weight(w, tiles=tiles), n, bias)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (threads, tiles)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif("avx512bf16" not in VARIANTS, reason="the amx variant's code needs AVX-512 BF16 around its tiles")
def test_the_amx_path_with_its_tile_instructions_written_out_reproduces_amx():
    """On any CPU that can run the amx variant's other instructions: its whole path (x in 16-row tiles in the
    inputs' own order, each chunk's B tiles rebuilt from the parity pairs or read from the tile layout, starting
    sums, remainders, stores) with only TDPBF16PS written out reproduces AMX's recorded outputs and the other
    variants' bits. The tile instructions, the tiles' shapes and the loop over two row tiles run on a CPU with AMX
    only (`test_amx_tiles_give_the_dot_product_variant_bits`, the self-check)."""
    amx = kernels.extension().amx
    before = amx.amx_min_rows()
    amx.set_tile_emulation(True)
    amx.set_amx_rows(1)
    try:
        assert amx.amx_min_rows() == 1
        for k, kind, a, b, c0, c in recorded_blocks():
            for tiles in (False, True):
                got = amx.linear_sums(bf16(a), kernels.pack_weight(bf16(b.T.copy()), tiles=tiles), 16,
                                      torch.from_numpy(c0.copy()))
                assert same_bits_nan_aside(got.numpy(), c) == 0, (k, kind, tiles)
        g = torch.Generator().manual_seed(3)
        for rows, k, n in ((1, 576, 70), (17, 100, 33), (40, 64, 16)):  # 4 panels and 1, 16-row tiles and remainders
            x, w = torch.randn(rows, k, generator=g).to(torch.bfloat16), torch.randn(n, k, generator=g).to(torch.bfloat16)
            bias = torch.randn(n, generator=g).to(torch.bfloat16)
            with kernels.use_isa("avx512bf16"):
                want = kernels.linear(x, kernels.pack_weight(w), n, bias)
            for tiles in (False, True):
                got = amx.linear(x, kernels.pack_weight(w, tiles=tiles), n, bias)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rows, tiles)
    finally:
        amx.set_tile_emulation(False)
        amx.set_amx_rows(before if before > 0 else 0)
