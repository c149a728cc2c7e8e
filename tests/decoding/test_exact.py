"""Exact mode: with the "exact" kernels every row of a forward computes bitwise what one-token-at-a-time
decoding computes, whatever shares the forward with it (a verify block, a candidate tree, the draft groups of
a fused forward), so every Orthrus cycle equals AR token for token in fp32, bf16 and fp16."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import NO_EOS, VOCAB, perturb_head, tiny_backbone
from lossless.decoding import kernels
from lossless.decoding.loop import DecodeConfig, decode
from lossless.decoding.dualview import additive_mask, tree_visibility
from lossless.errors import LosslessError
from lossless.decoding.exact import PackedLinearMixin, SiluMixin, exact_attention
from lossless.decoding.model import OrthrusLM

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
_MODELS: dict = {}


def exact_tiny(family: str, dtype: torch.dtype) -> OrthrusLM:
    key = (family, dtype)
    if key not in _MODELS:
        model = OrthrusLM(tiny_backbone(family).to(dtype), k=16)
        perturb_head(model, 0.5)
        model.set_attn("exact")
        _MODELS[key] = model
    return _MODELS[key]


def block_and_single(model, ids, prefix_len, k):
    cache, _ = model.prefill(ids[:prefix_len])
    block = model.verify(cache, ids[prefix_len:prefix_len + k])
    cache_single, _ = model.prefill(ids[:prefix_len])
    single = torch.stack([model.step(cache_single, t) for t in ids[prefix_len:prefix_len + k]])
    return block, single, cache, cache_single


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=8, **SLOW)
@given(data=st.data())
def test_block_logits_equal_one_at_a_time_bitwise(family, dtype, data):
    model = exact_tiny(family, dtype)
    prefix_len = data.draw(st.integers(1, 133), label="prefix")
    k = data.draw(st.integers(1, 32), label="block")
    ids = data.draw(st.lists(st.integers(0, 62), min_size=prefix_len + k, max_size=prefix_len + k), label="ids")
    block, single, cache, cache_single = block_and_single(model, ids, prefix_len, k)
    assert torch.equal(block, single)
    # the cache the draft pass reads is the same whichever way it was filled
    for a, b in zip(cache.layers, cache_single.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    last = ids[prefix_len + k - 1]
    cache.crop(-1), cache_single.crop(-1)
    assert torch.equal(model.draft(cache, last, 8), model.draft(cache_single, last, 8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_logits_equal_one_at_a_time_on_a_grid(family, dtype):
    # a fixed sweep next to the random one; (133, 13) once caught a bf16 GEMM rounding one element
    # differently for 13 rows than for 1
    model = exact_tiny(family, dtype)
    ids = torch.randint(0, 63, (170,), generator=torch.Generator().manual_seed(0)).tolist()
    for prefix_len in (1, 15, 16, 17, 63, 64, 65, 133):
        for k in (2, 8, 13, 16, 17, 32):
            block, single, _, _ = block_and_single(model, ids, prefix_len, k)
            assert torch.equal(block, single), (prefix_len, k)


def random_tree(data, max_nodes: int) -> list[int]:
    """parents of a random token tree (row 0 the root, parents[i] < i)."""
    n = data.draw(st.integers(1, max_nodes), label="nodes")
    return [-1] + [data.draw(st.integers(0, i - 1), label=f"parent {i}") for i in range(1, n)]


def ar_logits_along(model, prefix: list[int], path: list[int]) -> torch.Tensor:
    """AR next-token logits after each token of `path` fed one at a time after `prefix` [len(path), V]."""
    cache, _ = model.prefill(prefix)
    return torch.stack([model.step(cache, t) for t in path])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=6, **SLOW)
@given(data=st.data())
def test_tree_rows_equal_ar_steps_along_their_paths_bitwise(family, dtype, data):
    """Every node of a verified tree gets the logits AR computes at its position after committing its path:
    it sees the cache and its ancestors in position order, which are exactly the keys the AR step sees."""
    model = exact_tiny(family, dtype)
    prefix_len = data.draw(st.integers(1, 70), label="prefix")
    parents = random_tree(data, 24)
    ids = data.draw(st.lists(st.integers(0, 62), min_size=prefix_len + len(parents),
                             max_size=prefix_len + len(parents)), label="ids")
    prefix, tokens = ids[:prefix_len], ids[prefix_len:]  # tokens[0] is the root (the last committed token)
    cache, _ = model.prefill(prefix)
    logits = model.verify_tree(cache, tokens, parents)
    for node in {len(parents) - 1, *data.draw(st.sets(st.integers(0, len(parents) - 1), max_size=4), label="nodes")}:
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        ar = ar_logits_along(model, prefix, [tokens[i] for i in reversed(path)])
        assert torch.equal(logits[node], ar[-1]), node


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_verify_rows_equal_single_steps_beside_any_groups(family, dtype):
    model = exact_tiny(family, dtype)
    ids = torch.randint(0, 63, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    for prefix_len, block, anchors in ((5, 4, [0, 1, 2, 3]), (16, 9, [0, 4]), (40, 1, [0])):
        cache, _ = model.prefill(ids[:prefix_len])
        logits, _ = model.verify_and_draft(cache, ids[prefix_len:prefix_len + block], anchors, 7)
        single = ar_logits_along(model, ids[:prefix_len], ids[prefix_len:prefix_len + block])
        assert torch.equal(logits, single), (prefix_len, block)


def shaped_backbone(family: str, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                    seed: int = 0):
    """A 2-layer random backbone of the given widths (sharpened LM head, as in conftest)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**cfg)) if family == "llama" else Qwen3ForCausalLM(Qwen3Config(**cfg))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def exact_shaped(family, dtype, vocab: int = 64, **widths) -> OrthrusLM:
    backbone = shaped_backbone(family, **widths)
    if vocab != 64:
        backbone.resize_token_embeddings(vocab)
    model = OrthrusLM(backbone.to(dtype), k=16)
    perturb_head(model, 0.5)
    model.set_attn("exact")
    return model


@pytest.mark.parametrize("intermediate", [72, 88, 168, 344, 688])
def test_block_logits_equal_one_at_a_time_for_widths_off_the_vector_width(family, intermediate):
    # an elementwise kernel finishes a row whose width is not a multiple of its vector width in scalar
    # code; these intermediate sizes made fp32 blocks differ from single steps on an AVX-512 CPU
    model = exact_shaped(family, torch.float32, hidden=36, intermediate=intermediate, heads=3, kv_heads=1, head_dim=12)
    ids = torch.randint(0, 63, (160,), generator=torch.Generator().manual_seed(0)).tolist()
    for prefix_len in (1, 31, 64, 100, 133):
        block, single, _, _ = block_and_single(model, ids, prefix_len, 8)
        assert torch.equal(block, single), prefix_len


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=6, **SLOW)
@given(data=st.data())
def test_every_cycle_equals_exact_ar_for_any_widths(family, dtype, data):
    """Drawn models (widths, heads, kv heads, head_dim, vocab), positions across the kernels' 16-lane
    boundaries, blocks of 1..32 rows and random trees: block logits equal single steps bitwise, and every
    cycle decodes exact AR's tokens."""
    heads = data.draw(st.integers(1, 4), label="heads")
    kv_heads = data.draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]), label="kv_heads")
    # Llama wants hidden divisible by heads; the widths are still rarely multiples of 16
    widths = dict(hidden=heads * data.draw(st.integers(3, 33), label="hidden / heads"),
                  intermediate=data.draw(st.integers(8, 400), label="intermediate"),
                  heads=heads, kv_heads=kv_heads, head_dim=data.draw(st.sampled_from(range(2, 26, 2)), label="head_dim"))
    model = exact_shaped(family, dtype, vocab=data.draw(st.integers(64, 300), label="vocab"), **widths)
    prefix_len = data.draw(st.integers(1, 70), label="prefix")
    k = data.draw(st.integers(1, 32), label="block")
    ids = data.draw(st.lists(st.integers(0, 62), min_size=prefix_len + k, max_size=prefix_len + k), label="ids")
    block, single, _, _ = block_and_single(model, ids, prefix_len, k)
    assert torch.equal(block, single)
    cfg = DecodeConfig(max_new_tokens=24, eos_ids=NO_EOS, k=8)
    ar = decode(model, ids[:prefix_len], "ar", cfg).generated
    for extra in (dict(), dict(tree=data.draw(st.integers(1, 16), label="tree")), dict(tree=8, lookup=16),
                  dict(cycle="fused", k=data.draw(st.integers(2, 8), label="fused k"))):
        assert decode(model, ids[:prefix_len], "orthrus", dataclasses.replace(cfg, **extra)).generated == ar, extra


def test_stock_kernels_are_not_batch_invariant_in_fp32():
    # the property above is not vacuous: with stock kernels a block differs from single steps
    model = OrthrusLM(tiny_backbone("llama"), k=8)
    ids = list(range(1, 40))
    block, single, _, _ = block_and_single(model, ids, 30, 8)
    assert not torch.equal(block, single)
    assert torch.allclose(block, single, atol=1e-4)


CYCLES = {"chain": dict(), "tree": dict(tree=8), "tree+lookup": dict(tree=8, lookup=16), "lookup": dict(lookup=16),
          "fused": dict(cycle="fused", k=3), "fused+lookup": dict(cycle="fused", k=4, lookup=16)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cycle", CYCLES)
def test_exact_orthrus_equals_exact_ar_in_every_cycle(family, dtype, cycle):
    model = exact_tiny(family, dtype)
    accepted = []
    for prompt in ([1, 5, 9, 3], list(range(2, 60, 3)), [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]):
        cfg = DecodeConfig(max_new_tokens=40, eos_ids=NO_EOS, k=8)
        ar = decode(model, prompt, "ar", cfg)
        orth = decode(model, prompt, "orthrus", dataclasses.replace(cfg, **CYCLES[cycle]))
        assert orth.generated == ar.generated
        accepted += orth.stats.accepted
    assert 0 in accepted and any(a > 0 for a in accepted)  # the perturbed head is rejected and accepted


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_exact_attention_computes_attention_over_the_visible_keys(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 16) for heads, n in ((6, 5), (2, 40), (2, 40)))
    causal = torch.arange(40)[None] <= torch.arange(35, 40)[:, None]
    tree, _ = tree_visibility([-1, 0, 0, 1, 2], 35)
    for visible, masks in ((causal, (None, causal[None, None])), (tree, (additive_mask(tree, dtype),))):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.25, enable_gqa=True)
        for mask in masks:
            got, _ = exact_attention(None, q.to(dtype), k.to(dtype), v.to(dtype), mask, scaling=0.25, is_causal=None)
            assert got.dtype == dtype and got.shape == (1, 5, 6, 16)
            assert torch.allclose(got.float(), want.transpose(1, 2), atol=2e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@settings(max_examples=12, **SLOW)
@given(n=st.integers(2, 120), chunk=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_a_prefill_in_chunks_gives_the_bits_of_one_pass(family, n, chunk, seed):
    """Exact mode runs a long prompt's prefill in chunks of EXACT_PREFILL_CHUNK rows: the last logits and every
    cached key and value are bitwise those of the prompt in one pass."""
    from unittest import mock

    from lossless.decoding import model as modeling

    model = exact_tiny(family, torch.bfloat16)
    prompt = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    with mock.patch.object(modeling, "EXACT_PREFILL_CHUNK", 0):  # one pass
        whole, last = model.prefill(prompt)
    with mock.patch.object(modeling, "EXACT_PREFILL_CHUNK", chunk):
        chunked, last_chunked = model.prefill(prompt)
    assert torch.equal(last, last_chunked)
    assert chunked.get_seq_length() == whole.get_seq_length() == n
    for a, b in zip(whole.layers, chunked.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=25, **SLOW)
@given(data=st.data())
def test_rows_of_sequences_sharing_a_cache_get_the_bits_of_their_own_keys_alone(dtype, data):
    """Rows that each see one sequence's keys of a shared cache (in blocks, interleaved, or both, as a batch lays
    them out; 1 to 3 rows a sequence, a row also seeing its sequence's rows before it): each row's output is
    bitwise its attention over its own keys gathered apart, whichever tiles the kernel skips or rows it groups,
    at 1 and 2 threads; and near a float64 reference."""
    sizes = data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=5), label="keys per sequence")
    layout = data.draw(st.sampled_from(["blocks", "interleaved", "blocks then interleaved"]), label="layout")
    owner = [i for i, m in enumerate(sizes) for _ in range(m)]  # blocks
    if layout != "blocks":
        cut = 0 if layout == "interleaved" else len(owner) // 2
        tail = owner[cut:]
        owner = owner[:cut] + [tail[j] for j in sorted(range(len(tail)), key=lambda j: (j % 7, tail[j]))]
    per = data.draw(st.lists(st.integers(1, 3), min_size=len(sizes), max_size=len(sizes)), label="rows each")
    rows = [i for i, r in enumerate(per) for _ in range(r)]
    n, q, h, kvh, d = len(owner), len(rows), 4, 2, 16
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    query, key, value = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((q, h, d), (kvh, n + q, d),
                                                                                     (kvh, n + q, d)))
    visible = torch.zeros(q, n + q, dtype=torch.bool)
    for r, seq in enumerate(rows):
        visible[r, [j for j in range(n) if owner[j] == seq]] = True
        visible[r, [n + i for i in range(r + 1) if rows[i] == seq]] = True  # its own rows up to itself
    want64 = []
    for r in range(q):
        seen = visible[r].nonzero().flatten()
        k64, v64 = key[:, seen].double(), value[:, seen].double()
        w = torch.softmax(torch.einsum("hd,hnd->hn", query[r].double(), k64.repeat_interleave(h // kvh, 0)) * 0.25, -1)
        want64.append(torch.einsum("hn,hnd->hd", w, v64.repeat_interleave(h // kvh, 0)))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = kernels.attention(query, key, value, visible, 0.25)
            for r in range(q):
                seen = visible[r].nonzero().flatten()
                alone = kernels.attention(query[r:r + 1], key[:, seen].contiguous(), value[:, seen].contiguous(),
                                          torch.ones(1, len(seen), dtype=torch.bool), 0.25)
                assert torch.equal(got[r], alone[0]), (threads, r)
                assert torch.allclose(got[r].double(), want64[r].to(got.dtype).double(),
                                      atol=3e-2 if dtype != torch.float32 else 1e-5)
    finally:
        torch.set_num_threads(before)


def test_exact_attention_refuses_batches():
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 10, 8)
    with pytest.raises(LosslessError, match="batch 1"):
        exact_attention(None, q, k, k, None, scaling=1.0, is_causal=True)


def test_exact_attention_refuses_non_cpu_tensors():
    q = torch.empty(1, 2, 3, 8, device="meta")
    with pytest.raises(LosslessError, match="CPU"):
        exact_attention(None, q, q, q, None, scaling=1.0)


def test_exact_mode_reports_what_it_replaced():
    model = OrthrusLM(tiny_backbone("llama").to(torch.float32), k=8)
    replaced = model.set_attn("exact")
    assert replaced[0] == "attention" and model.exact_ops == replaced and model.attn == "exact"
    linears = [r for r in replaced if r.startswith("linear ")]
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.backbone.modules())
    assert sum(int(r.split(" x", 1)[1].split()[0]) for r in linears) == n_linear
    assert all(r.endswith("(fixed-order kernel)") for r in linears)
    # 2 norms per layer + the final norm, 1 activation per layer, the rotary embedding
    assert set(replaced) - set(linears) == {"attention", "LlamaRMSNorm x5 (fixed-order kernel)",
                                            "SiLUActivation x2 (fixed-order kernel)",
                                            "LlamaRotaryEmbedding x1 (table of every position)",
                                            "decoder layer x2 (one call per forward)",
                                            f"kernels {kernels.isa()}"}
    # a draft adapter added later (a loaded head brings one) goes on the kernels too, its activation included
    model.set_draft_adapter(4)
    adapter = model.backbone.model.layers[0].mlp.mlp_diff
    assert all(isinstance(m, PackedLinearMixin) for m in (adapter.down, adapter.up))
    assert isinstance(adapter.act, SiluMixin) and "SiLU x2 (fixed-order kernel)" in model.exact_ops


def test_exact_mode_keeps_frozen_weights_as_panels_only(family):
    """One copy of the weights: every frozen linear weight lives as its panels only (the module's `weight` a meta
    tensor), the tied LM head's too, the embedding then gathering its rows from those panels; stock passes
    (scoring) and the head's int8 reference see the weights unpacked bit for bit; trainable weights (the draft
    head's) keep their tensors."""
    from lossless.decoding import exact
    from lossless.decoding.dualview import diff_reference_parameters

    backbone = tiny_backbone(family).to(torch.float32)
    backbone.config.tie_word_embeddings = True
    backbone.lm_head.weight = backbone.model.embed_tokens.weight  # tied, as SmolLM2's
    model = OrthrusLM(backbone, k=8)
    weights = {name: m.weight.detach().clone() for name, m in backbone.named_modules()
               if isinstance(m, torch.nn.Linear)}
    ids = list(range(3, 40))
    scored = model.score(ids[:5], ids[5:])
    device, dtype = model.device, model.dtype
    model.set_attn("exact")
    linears = {name: m for name, m in backbone.named_modules() if isinstance(m, PackedLinearMixin)}
    released = {name for name, m in linears.items() if m.released()}
    assert released == {n for n in linears if "_diff" not in n}
    embed = backbone.model.embed_tokens
    assert embed.weight.is_meta and embed.weight is backbone.lm_head.weight
    every = torch.arange(backbone.config.vocab_size)
    assert torch.equal(embed(every[None])[0], weights["lm_head"])  # each row gathered from the panels
    assert (model.device, model.dtype) == (device, dtype)
    held = model._held_parameter()  # what answers them: a frozen parameter with values (a norm's), kept
    assert not held.is_meta and not held.requires_grad and model._held_parameter() is held
    assert all(linears[n].weight.device.type == "meta" for n in released)
    assert not any(linears[n].weight.is_meta for n in set(linears) - released)
    for name in released:
        assert torch.equal(linears[name].stock_weight(), weights[name])
    again = model.score(ids[:5], ids[5:])
    assert torch.equal(again[0], scored[0]) and torch.equal(again[1], scored[1])
    refs = diff_reference_parameters(backbone)
    for key, ref in refs.items():
        if key.endswith("proj_diff.weight"):
            layer, proj = key.split(".")[1], key.split(".")[2].removesuffix("_diff")
            assert torch.equal(ref, weights[f"model.layers.{layer}.self_attn.{proj}"])
    q = linears["model.layers.0.self_attn.q_proj"]
    with exact.stock_kernels():  # unpacked once per block
        assert q.stock_weight() is q.stock_weight()
    assert q.stock_weight() is not q.stock_weight()
    with pytest.raises(LosslessError, match="trainable"):
        linears["model.layers.0.self_attn.q_proj_diff"].release_weight()


# ------------------------------------------------------------------------------------------ the kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_unpacking_a_packed_weight_gives_it_back_bit_for_bit(dtype, n, k, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    assert torch.equal(kernels.unpack_weight(kernels.pack_weight(w), n, k), w)
    tiled = kernels.pack_weight(w, tiles=True)  # AMX's tile layout (bf16; the others keep theirs)
    assert torch.equal(kernels.unpack_weight(tiled, n, k), w)
    assert tiled.dim() == (4 if dtype == torch.bfloat16 else 3) and tiled.numel() == kernels.pack_weight(w).numel()


def test_the_tile_layout_holds_amx_b_tiles():
    """Chunk c of panel p in the tile layout is TDPBF16PS's B tile: row i, lane l holds inputs 32c + 2i (low half)
    and 32c + 2i + 1 (high half) of output 16p + l."""
    w = (torch.arange(40 * 70) % 251).reshape(40, 70).to(torch.bfloat16)  # small integers: exact in bf16
    tiled = kernels.pack_weight(w, tiles=True)
    assert tiled.shape == (3, 3, 16, 32)
    for p, c, i, lane in ((0, 0, 0, 0), (1, 2, 7, 5), (2, 1, 15, 7), (0, 1, 3, 15)):
        out, j = 16 * p + lane, 32 * c + 2 * i
        want = [w[out, j + h].item() if out < 40 and j + h < 70 else 0.0 for h in (0, 1)]
        assert tiled[p, c, i, 2 * lane:2 * lane + 2].tolist() == want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 120), k=st.integers(1, 70), seed=st.integers(0, 2**16))
@example(n=96, k=64, seed=0)  # nothing to pad: the chunked path (real models' shapes)
@example(n=80, k=32, seed=1)
def test_packing_chunk_by_chunk_gives_the_panels_and_says_which_rows_it_read(dtype, n, k, seed):
    """Panels written PACK_PANELS at a time (here 2: several chunks) are the whole weight's; `consumed` reports
    every row once, in order, and only once packing is done with it: rows spoilt as soon as they are reported (as
    dropping their pages would) leave the panels the same."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    spoilt = w.clone()
    before = kernels.PACK_PANELS
    spans = []

    def consumed(r0, r1):
        spans.append((r0, r1))
        spoilt[r0:r1] = float("nan")
    try:
        kernels.PACK_PANELS = 2
        packed = kernels.pack_weight(spoilt, consumed)
    finally:
        kernels.PACK_PANELS = before
    assert torch.equal(packed, kernels.pack_weight(w)) and torch.equal(kernels.unpack_weight(packed, n, k), w)
    assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 70), shape=st.sampled_from([(5,), (1, 7), (2, 3), (0,)]),
       seed=st.integers(0, 2**16))
@example(n=32, k=64, shape=(1, 7), seed=0)  # nothing to pad: the layout of real models' LM heads
def test_rows_gathered_from_the_panels_are_the_embedding_lookup(dtype, n, k, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(dtype)
    ids = torch.randint(0, n, shape, generator=gen)
    packed = kernels.pack_weight(w)
    assert torch.equal(kernels.embedding_rows(packed, ids, n, k), torch.nn.functional.embedding(ids, w))
    assert torch.equal(kernels.embedding_rows(kernels.pack_weight(w, tiles=True), ids, n, k),
                       torch.nn.functional.embedding(ids, w))
    for bad in (-1, n):  # outside the vocabulary: refused, as the lookup refuses it (not a padding row)
        with pytest.raises(IndexError):
            kernels.embedding_rows(packed, torch.tensor([0, bad]), n, k)
    with pytest.raises(RuntimeError, match="integers"):  # as the lookup refuses them
        kernels.embedding_rows(packed, ids.float(), n, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=25, **SLOW)
@given(data=st.data())
def test_kernel_rows_do_not_depend_on_the_other_rows(dtype, data):
    """Any subset of rows, in any order, gives bitwise the rows of the full call: linear (any k, n, bias),
    attention (any visibility), RMSNorm and SiLU."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    m, k, n = (data.draw(st.integers(lo, hi), label=name) for name, lo, hi in (("m", 1, 40), ("k", 1, 70), ("n", 1, 70)))
    rows = data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=m), label="rows")
    x, w, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
    bias = b.to(dtype) if data.draw(st.booleans(), label="bias") else None
    packed = kernels.pack_weight(w)
    full = kernels.linear(x, packed, n, bias)
    assert torch.equal(kernels.linear(x[rows], packed, n, bias), full[rows])
    assert torch.allclose(full.float(), torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()),
                          atol=0.05 * k ** 0.5, rtol=0.02)
    heads, kv, d, keys = (data.draw(st.integers(lo, hi), label=name) for name, lo, hi in
                          (("heads", 1, 4), ("kv", 1, 4), ("d", 1, 40), ("keys", 1, 50)))
    heads *= kv
    q, kk, vv = (torch.randn(*shape, generator=g).to(dtype) for shape in ((m, heads, d), (kv, keys, d), (kv, keys, d)))
    visible = torch.rand(m, keys, generator=g) < data.draw(st.floats(0.05, 1.0), label="density")
    out = kernels.attention(q, kk, vv, visible, 0.3)
    assert torch.equal(kernels.attention(q[rows], kk, vv, visible[rows], 0.3), out[rows])
    norm_w = torch.randn(k, generator=g).to(dtype)
    assert torch.equal(kernels.rms_norm(x[rows], norm_w, 1e-5), kernels.rms_norm(x, norm_w, 1e-5)[rows])
    assert torch.equal(kernels.silu(x[rows]), kernels.silu(x)[rows])


def test_kernel_results_do_not_depend_on_the_thread_count():
    torch.manual_seed(0)
    x, w = torch.randn(9, 300).to(torch.bfloat16), torch.randn(1000, 300).to(torch.bfloat16)
    packed, before = kernels.pack_weight(w), torch.get_num_threads()
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        outs.append(kernels.linear(x, packed, 1000))
    torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_packed_weights_follow_a_changed_weight():
    from lossless.decoding.exact import PackedLinearMixin, stock_kernels
    from lossless.decoding.mixins import swap_class

    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80)
    x = torch.randn(1, 5, 48)
    swap_class(lin, PackedLinearMixin)
    first = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # a loaded head or a training step changes the weight in place
    assert torch.allclose(lin(x), 2 * first - lin.bias, atol=1e-4)
    with stock_kernels():
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    # a forward autograd must see (a training step of the head) takes the stock path, gradients included
    lin(x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, x[0].sum(0).expand(80, 48))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_exact_mode_covers_verify_blocks_of_a_loaded_head_with_large_k(tmp_path, dtype):
    # the head arrives after exact mode is chosen and brings k = 40: every verify block, however many
    # rows, must still run the invariant kernels (a row bound frozen at 32 once sent these to stock GEMMs)
    from conftest import save_tiny_model_dir, tiny_orthrus
    from lossless.decoding.models import load_model

    model_dir = save_tiny_model_dir(tmp_path / "tiny", "llama")
    head = tiny_orthrus("llama", k=40).save_head(tmp_path / "head-k40")
    model = load_model(str(model_dir), dtype, attn="exact", head=str(head))
    assert model.k == 40 and model.attn == "exact"
    ids = torch.randint(0, 63, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    for prefix_len in (5, 37):
        block, single, _, _ = block_and_single(model, ids, prefix_len, 40)
        assert torch.equal(block, single), prefix_len
    cfg = DecodeConfig(max_new_tokens=60, eos_ids=NO_EOS)
    assert decode(model, ids[:5], "orthrus", cfg).generated == decode(model, ids[:5], "ar", cfg).generated
