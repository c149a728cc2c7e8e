"""A decode cache that grows in place: Hugging Face's `DynamicCache` with layers whose keys and values are views
into buffers with room to spare, so a decode step writes its new keys and values where they go instead of
concatenating (copying) the whole cache in every layer.

Everything else about the cache is Hugging Face's: `crop` slices the views, tree commits write through them, and
a layer whose keys were replaced by other code (not a view of its buffer) starts a new buffer from them. The
values a forward reads are the same numbers either way; only copies go.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# positions of room a new buffer gets beyond what it must hold: at least ROOM, else an eighth as many again (a
# long prompt's cache then holds 1/8 more, not 1/2, and growing by decode steps copies the cache every n/8 steps)
ROOM = 256
GROWTH = 8


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys`/`values` [b, kv, n, d] are the first n positions of buffers [b, kv, cap, d].

    While the layer holds buffers it keeps only their lengths; `keys`/`values` are views made when read, so counting
    positions in or cropping them costs no tensor operation. A view of a buffer from its first position assigned to
    them sets the length; any other tensor (or None) lets the buffers go and is kept as it is."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    _lengths: tuple[int, int] = (0, 0)  # the positions of the key and value buffers the layer holds
    _made: tuple | None = None  # (lengths, keys, values): the views last made
    _loose: tuple = (None, None)  # keys and values while the layer holds no buffers
    # exact mode's key tiles (`key_tiles`): the keys again in the layout attention reads, valid for the first
    # `_tiles_valid` positions as long as the key buffer's version is `_tiles_version` (any other write moves it)
    _tiles: torch.Tensor | None = None
    _tiles_steps: int = 0
    _tiles_valid: int = 0
    _tiles_version: int = -1

    def __getstate__(self) -> dict:  # (a copy makes its views again from its own buffers)
        state = self.__dict__.copy()
        state.pop("_made", None)
        return state

    def _read(self, i: int) -> torch.Tensor | None:
        if self._buffers is None:
            return self._loose[i]
        made = self._made
        if made is None or made[0] != self._lengths:
            (nk, nv), (keys, values) = self._lengths, self._buffers
            made = self._made = (self._lengths, keys.narrow(2, 0, nk), values.narrow(2, 0, nv))
        return made[1 + i]

    def _assign(self, i: int, tensor: torch.Tensor | None) -> None:
        buffers = self._buffers
        if buffers is not None and tensor is not None and _starts(tensor, buffers[i]):
            lengths = list(self._lengths)
            lengths[i] = tensor.shape[2]
            self._lengths = tuple(lengths)
            return
        loose = [self._read(0), self._read(1)]
        loose[i] = tensor
        self._loose, self._buffers, self._made, self._tiles = tuple(loose), None, None, None

    keys = property(lambda self: self._read(0), lambda self, tensor: self._assign(0, tensor))
    values = property(lambda self: self._read(1), lambda self, tensor: self._assign(1, tensor))

    def get_seq_length(self) -> int:
        if self._buffers is not None:
            return self._lengths[0]
        return super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        if self._buffers is None or tokens_to_remove >= 0:
            return super().crop(tokens_to_remove)
        self._lengths = tuple(max(0, n + tokens_to_remove) for n in self._lengths)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.get_seq_length(), key_states.shape[-2]
        buffers = self._buffers
        fits = buffers is not None and self._lengths[1] == n and n + q <= buffers[0].shape[2] and all(
            b.shape[:2] == s.shape[:2] and b.shape[3] == s.shape[3] and b.dtype == s.dtype
            for b, s in zip(buffers, (key_states, value_states)))
        if not fits:
            self._grow(n, q, key_states, value_states)
        keys, values = self._buffers
        current = self._tiles_current()
        keys[:, :, n:n + q] = key_states
        self.keys_rewritten(n, current)
        values[:, :, n:n + q] = value_states
        self._lengths = (n + q, n + q)
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
        self._buffers, self._lengths, self._made, self._tiles = fresh, (n, n), None, None
        self._loose = (None, None)

    def room(self, q: int, like: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers [b, kv, cap, d], grown (as `update` grows them) to hold q positions past the cache's end,
        for a caller that writes those positions itself (`wrote` then counts them in); a layer that holds
        nothing yet starts buffers shaped like `like` [b, kv, 0, d]. None when the layer holds no buffers (other
        code replaced its keys or values) or keys and values of different lengths."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
            self._grow(0, q, like, like)
        buffers = self._buffers
        if buffers is None or self._lengths[0] != self._lengths[1]:
            return None
        n = self._lengths[0]
        if n + q > buffers[0].shape[2]:
            self._grow(n, q, *buffers)
        return self._buffers

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
        if self._tiles is None or self._tiles_steps != steps:
            kv, cap = self._buffers[0].shape[1:3]
            self._tiles = torch.empty(kv, -(-cap // 16), steps, 16, dtype=torch.int32, device=self._buffers[0].device)
            self._tiles_steps, self._tiles_valid = steps, 0
        valid = min(self._tiles_valid, self._lengths[0]) if self._tiles_current() else 0
        return self._tiles, valid

    def wrote(self, q: int, valid: int) -> None:
        """A forward wrote q positions past the cache's end into the buffers (after `room`) and left the tiles
        correct for the first `valid` positions: count the positions in."""
        n = self._lengths[0] + q
        self._lengths = (n, n)
        self._tiles_valid, self._tiles_version = valid, self._buffers[0]._version

    def update_aside(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The cache's keys and values followed by these [b, kv, q, d], without adding them to the cache: they are
        written into the buffers' room past its end (the next update writes over them), so a pass that reads
        the cache and rows of its own (the draft view's) copies nothing. The cache's length stays as it was."""
        n = self.get_seq_length()
        keys, values = self.update(key_states, value_states)
        self._lengths = (n, n)
        return keys, values

    def reset(self) -> None:
        self._buffers, self._tiles = None, None
        super().reset()


def _starts(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `tensor` is the first positions of `buffer` [b, kv, cap, d]."""
    return (tensor._base is buffer and tensor.storage_offset() == 0 and tensor.stride() == buffer.stride()
            and tensor.dim() == 4 and tensor.shape[:2] == buffer.shape[:2] and tensor.shape[3] == buffer.shape[3]
            and tensor.dtype == buffer.dtype)


def stack_room(layers: list, q: int, like: Callable[[], torch.Tensor], steps: int) -> tuple | None:
    """For a forward that writes q positions past the end of every layer itself (the layer stack): (the cache's
    length, (key buffers, value buffers), (key tiles, how many positions each holds)), every layer's `room` and
    `key_tiles` in one pass (`like()` makes `room`'s tensor, for a layer that holds nothing yet). None when a
    layer is no `GrowingLayer`, holds no buffers or another length."""
    keys, values, tiles, valid, n = [], [], [], [], None
    for layer in layers:
        if not isinstance(layer, GrowingLayer):
            return None
        room = layer.room(q, None if layer.is_initialized else like())
        if room is None or (n is not None and layer._lengths[0] != n):
            return None
        n = layer._lengths[0]
        keys.append(room[0])
        values.append(room[1])
        t, ok = layer.key_tiles(steps)
        tiles.append(t)
        valid.append(ok)
    return n, (keys, values), (tiles, valid)


def stack_wrote(layers: list, q: int, valid: int) -> None:
    """Every layer's `wrote(q, valid)` after a forward of the layer stack."""
    for layer in layers:
        layer.wrote(q, valid)


def growing_cache(config) -> DynamicCache:
    """`DynamicCache(config=config)` with `GrowingLayer`s in place of its plain dynamic layers (a config whose
    layers are of other kinds, sliding windows say, keeps Hugging Face's)."""
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def stack_keep_rows(layers, start: int, rows: list[int]) -> bool:
    """A tree's accepted path moved into place (the entries at start + rows[j] to start + j) in every layer's
    buffers by one kernel call, where every layer is a `GrowingLayer` holding CPU buffers and exact mode's kernels
    are loaded; False (nothing moved) elsewhere."""
    from . import kernels

    if not layers or not kernels.loaded():
        return False
    buffers, last = [], start + max(rows, default=-1)
    for layer in layers:
        held = layer._buffers if isinstance(layer, GrowingLayer) else None
        if held is None or held[0].device.type != "cpu" or last >= min(layer._lengths):
            return False  # (torch's path, which refuses rows past the cache's end as index_select does)
        buffers.extend(held)
    current = [layer._tiles_current() for layer in layers]
    kernels.move_rows(buffers, start, rows)
    for layer, was in zip(layers, current):
        layer.keys_rewritten(start, was)
    return True
