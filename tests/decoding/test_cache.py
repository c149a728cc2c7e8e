"""The cache that grows in place: the same keys and values as Hugging Face's DynamicCache under every operation
decoding does (appends of blocks, crops, a tree's accepted rows moved down), without copying the cache per step."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from conftest import tiny_backbone
from lossless.decoding.cache import GrowingLayer, growing_cache
from lossless.decoding.model import OrthrusLM


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "crop", "keep"]), st.integers(1, 40)), min_size=1,
                    max_size=25), seed=st.integers(0, 2**16))
def test_a_growing_cache_holds_what_a_dynamic_cache_holds(ops, seed):
    config = tiny_backbone("llama").config
    g = torch.Generator().manual_seed(seed)
    mine, theirs = growing_cache(config), DynamicCache(config=config)
    assert all(isinstance(layer, GrowingLayer) for layer in mine.layers)
    for op, size in ops:
        n = theirs.get_seq_length()
        if op == "append" or n == 0:
            for i in range(len(mine.layers)):
                k, v = (torch.randn(1, 2, size, 8, generator=g) for _ in range(2))
                got, want = mine.update(k, v, i), theirs.update(k.clone(), v.clone(), i)
                assert all(torch.equal(a, b) for a, b in zip(got, want))
        elif op == "crop":
            cut = min(size, n)
            mine.crop(-cut)
            theirs.crop(-cut)
        else:  # a tree commit: rows moved down through the views, as OrthrusLM.keep_cache_rows does
            start = max(0, n - size)
            rows = sorted(torch.randperm(n - start, generator=g)[: max(1, (n - start) // 2)].tolist())
            OrthrusLM.keep_cache_rows(mine, start, rows)
            OrthrusLM.keep_cache_rows(theirs, start, rows)
        assert mine.get_seq_length() == theirs.get_seq_length()
        for a, b in zip(mine.layers, theirs.layers):
            if b.get_seq_length():
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_decode_step_writes_in_place():
    config = tiny_backbone("llama").config
    cache = growing_cache(config)
    cache.update(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), 0)
    buffer = cache.layers[0].keys.data_ptr()
    for _ in range(100):  # within the room a buffer starts with
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    assert cache.layers[0].keys.data_ptr() == buffer and cache.get_seq_length(0) == 110
    cache.layers[0].keys = cache.layers[0].keys.clone()  # replaced by other code: a new buffer from it
    before = cache.layers[0].keys.clone()
    keys, _ = cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    assert torch.equal(keys[:, :, :110], before) and keys.shape[2] == 111


def test_a_copied_cache_holds_the_same_keys_and_grows_in_its_own_buffers():
    config = tiny_backbone("llama").config
    cache = growing_cache(config)
    cache.update(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), 0)
    cache.crop(-3)
    held = cache.layers[0].keys.clone()  # (its views made, and copied with it)
    twin = copy.deepcopy(cache)
    assert torch.equal(twin.layers[0].keys, held) and twin.get_seq_length(0) == 7
    twin.offload(0)  # (on the CPU already: its own views given back, as they were)
    buffer = twin.layers[0].keys.data_ptr()
    assert buffer != cache.layers[0].keys.data_ptr()
    step = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    keys, _ = twin.update(*step, 0)
    assert keys.data_ptr() == buffer and torch.equal(keys, cache.update(*step, 0)[0])
