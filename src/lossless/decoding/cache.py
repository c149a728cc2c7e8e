"""A decode cache that grows in place: Hugging Face's `DynamicCache` with layers whose keys and values are views
into buffers with room to spare, so a decode step writes its new keys and values where they go instead of
concatenating (copying) the whole cache in every layer.

Everything else about the cache is Hugging Face's: `crop` slices the views, tree commits write through them, and
a layer whose keys were replaced by other code (not a view of its buffer) starts a new buffer from them. The
values a forward reads are the same numbers either way; only copies go.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# positions of room a new buffer gets beyond what it must hold: at least ROOM, else an eighth as many again (a
# long prompt's cache then holds 1/8 more, not 1/2, and growing by decode steps copies the cache every n/8 steps)
ROOM = 256
GROWTH = 8


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys`/`values` [b, kv, n, d] are the first n positions of buffers [b, kv, cap, d]."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    # exact mode's key tiles (`key_tiles`): the keys again in the layout attention reads, valid for the first
    # `_tiles_valid` positions as long as the key buffer's version is `_tiles_version` (any other write moves it)
    _tiles: torch.Tensor | None = None
    _tiles_valid: int = 0
    _tiles_version: int = -1

    def _views_buffer(self) -> bool:
        if self._buffers is None or self.keys is None or self.keys.numel() == 0:
            return False
        return all(t.dim() == 4 and t.data_ptr() == b.data_ptr() and t.stride() == b.stride() and t.dtype == b.dtype
                   and t.shape[:2] == b.shape[:2] and t.shape[3] == b.shape[3]
                   for t, b in zip((self.keys, self.values), self._buffers))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.get_seq_length(), key_states.shape[-2]
        fits = self._views_buffer() and n + q <= self._buffers[0].shape[2] and \
            self._buffers[0].shape[:2] == key_states.shape[:2] and self._buffers[0].dtype == key_states.dtype
        if not fits:
            self._grow(n, q, key_states, value_states)
        keys, values = self._buffers
        current = self._tiles_current()
        keys[:, :, n:n + q] = key_states
        self.keys_rewritten(n, current)
        values[:, :, n:n + q] = value_states
        self.keys, self.values = keys[:, :, :n + q], values[:, :, :n + q]
        return self.keys, self.values

    def _grow(self, n: int, q: int, key_like: torch.Tensor, value_like: torch.Tensor) -> None:
        """New buffers shaped like `key_like`/`value_like` with room for n + q positions and more, holding the
        cache's n positions."""
        cap = n + q + max(ROOM, (n + q) // GROWTH)
        fresh = tuple(torch.empty(*s.shape[:2], cap, s.shape[3], dtype=s.dtype, device=s.device)
                      for s in (key_like, value_like))
        if n:
            fresh[0][:, :, :n] = self.keys
            fresh[1][:, :, :n] = self.values
        self._buffers, self._tiles = fresh, None

    def room(self, q: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers [b, kv, cap, d], grown (as `update` grows them) to hold q positions past the cache's end,
        for a caller that writes those positions itself (`extend` then counts them in); a layer that holds
        nothing yet starts buffers shaped like `like` [b, kv, 0, d]. None when this layer's keys are not the
        first positions of its buffers (other code replaced them)."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
            self._grow(0, q, like, like)
            self.keys, self.values = self._buffers[0][:, :, :0], self._buffers[1][:, :, :0]
        keys, buffers = self.keys, self._buffers
        if buffers is None or keys is None or keys._base is not buffers[0] or self.values._base is not buffers[1] \
                or keys.storage_offset() or self.values.storage_offset() or keys.stride() != buffers[0].stride() \
                or self.values.stride() != buffers[1].stride():
            return None
        n = keys.shape[2]
        if n + q > buffers[0].shape[2]:
            self._grow(n, q, keys, self.values)
        return self._buffers

    def extend(self, q: int) -> None:
        """Count in the q positions past the cache's end that a caller wrote into the buffers (after `room`)."""
        n = self.keys.shape[2] + q
        self.keys, self.values = self._buffers[0].narrow(2, 0, n), self._buffers[1].narrow(2, 0, n)

    def _tiles_current(self) -> bool:
        return self._tiles is not None and self._buffers is not None and \
            self._buffers[0]._version == self._tiles_version

    def keys_rewritten(self, start: int, current: bool) -> None:
        """Positions from `start` on were written by Python (`current`: the tiles were valid before): the tiles
        stay valid below `start` (else they are made again in full by the next forward that reads them)."""
        if current:
            self._tiles_valid = min(self._tiles_valid, start)
            self._tiles_version = self._buffers[0]._version

    def key_tiles(self, steps: int) -> tuple[torch.Tensor, int]:
        """(tiles [kv, cap / 16, steps, 16] int32 for the buffers' every position, how many of the first positions
        they hold correctly) for a forward that writes positions from the cache's end on (`room` first)."""
        keys = self._buffers[0]
        b, kv, cap, _ = keys.shape
        shape = (kv, -(-cap // 16), steps, 16)
        if self._tiles is None or tuple(self._tiles.shape) != shape:
            self._tiles, self._tiles_valid = torch.empty(shape, dtype=torch.int32, device=keys.device), 0
        valid = min(self._tiles_valid, self.keys.shape[2]) if self._tiles_current() else 0
        return self._tiles, valid

    def tiles_written(self, valid: int) -> None:
        """A forward left the tiles correct for the first `valid` positions."""
        self._tiles_valid, self._tiles_version = valid, self._buffers[0]._version

    def update_aside(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The cache's keys and values followed by these [b, kv, q, d], without adding them to the cache: they are
        written into the buffers' room past its end (the next update writes over them), so a pass that reads
        the cache and rows of its own (the draft view's) copies nothing. The cache's length stays as it was."""
        n = self.get_seq_length()
        keys, values = self.update(key_states, value_states)
        self.keys, self.values = keys[:, :, :n], values[:, :, :n]
        return keys, values

    def reset(self) -> None:
        self._buffers, self._tiles = None, None
        super().reset()


def growing_cache(config) -> DynamicCache:
    """`DynamicCache(config=config)` with `GrowingLayer`s in place of its plain dynamic layers (a config whose
    layers are of other kinds, sliding windows say, keeps Hugging Face's)."""
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache
