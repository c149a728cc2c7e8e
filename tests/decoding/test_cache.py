"""The cache that grows in place: the same keys and values as Hugging Face's DynamicCache under every operation
decoding does (appends of blocks, crops, a tree's accepted rows moved down), without copying the cache per step."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from conftest import tiny_backbone
from lossless.decoding import kernels
from lossless.decoding.cache import GrowingLayer, growing_cache, stack_keep_rows
from lossless.decoding.model import OrthrusLM


@pytest.mark.parametrize("kernel", [True, False], ids=["rows moved by the kernel", "rows moved by torch"])
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "crop", "keep"]), st.integers(1, 40)), min_size=1,
                    max_size=25), seed=st.integers(0, 2**16))
def test_a_growing_cache_holds_what_a_dynamic_cache_holds(kernel, ops, seed):
    with mock.patch.object(kernels, "loaded", lambda: kernel):
        grown_as_dynamic(ops, seed)


def grown_as_dynamic(ops, seed):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 4), d=st.integers(1, 70), n=st.integers(1, 60), data=st.data())
def test_rows_moved_by_the_kernel_are_the_rows_torch_moves(dtype, heads, d, n, data):
    """`kernels.move_rows` (a tree's accepted path moved into place, every buffer in one call) against index_select
    over any buffers, start and rising rows; the buffers' versions move (the key tiles see a write); rows that
    do not rise, or reach past a buffer, are refused."""
    start = data.draw(st.integers(0, n - 1), label="start")
    rows = sorted(data.draw(st.sets(st.integers(0, n - start - 1), min_size=1), label="rows"))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    buffers = [torch.randn(1, heads, n + data.draw(st.integers(0, 5), label="room"), d, generator=gen).to(dtype)
               for _ in range(3)]
    want = [b.clone() for b in buffers]
    for b in want:
        b[:, :, start: start + len(rows)] = b.index_select(2, torch.tensor(rows) + start)
    versions = [b._version for b in buffers]
    kernels.move_rows(buffers, start, rows)
    assert all(torch.equal(a, b) for a, b in zip(buffers, want))
    assert all(b._version > v for b, v in zip(buffers, versions))
    with pytest.raises(RuntimeError, match="rise"):
        kernels.move_rows(buffers, start, rows[::-1] if len(rows) > 1 else [-1])
    with pytest.raises(RuntimeError, match="past"):
        kernels.move_rows(buffers, buffers[0].shape[2], [0])
    with pytest.raises(RuntimeError, match="overlap"):  # one buffer twice: its rows would move twice
        kernels.move_rows([buffers[0], buffers[1], buffers[0]], start, rows)


def test_a_tree_commit_by_the_kernel_keeps_the_key_tiles_below_it_and_nothing_else():
    """Rows moved by the kernel leave each layer's key tiles valid below `start` only (the next forward makes the
    rest again), as a write from Python does; a cache holding other layers is left to torch (False)."""
    config = tiny_backbone("llama").config
    cache = growing_cache(config)
    for i in range(len(cache.layers)):
        cache.update(torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8), i)
    kernels.extension()
    for layer in cache.layers:
        tiles, _ = layer.key_tiles(8)
        layer._tiles_valid, layer._tiles_version = 30, layer._buffers[0]._version  # (as a forward leaves them)
    assert stack_keep_rows(cache.layers, 20, [0, 3, 5])
    for layer in cache.layers:
        assert layer._tiles_current() and layer._tiles_valid == 20
    assert not stack_keep_rows(DynamicCache(config=config).layers, 0, [0, 1])
    assert not stack_keep_rows(cache.layers, 20, [0, 10])  # a row past the cache's end: torch's path refuses it
