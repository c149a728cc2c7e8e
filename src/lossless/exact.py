"""Exact mode: attention whose per-query result does not depend on how many queries run together.

`exact_attention` is registered with the transformers attention interface as "exact". A query at
absolute position p is computed by the same calls, on arrays of the same shapes, strides and
contents, whether it is decoded alone (AR) or inside a block of k queries (Orthrus verify):

- each query row is its own computation: q.K^T over exactly the keys at positions 0..p (the cache
  prefix it may see, nothing more, so no masking), softmax, then P.V over the same prefix, in fp32;
- its keys and values are read from a position-major fp32 copy of the cache, `[positions, b, kv, d]`,
  whose prefix 0..p has the same layout however long the cache is; `ExactCacheLayer` (the cache
  `OrthrusLM.new_cache` makes in exact mode) keeps that copy, writing each position once;
- the query row is copied into a fresh contiguous buffer.

So the AR step at position p and the block row at position p make identical calls on identical inputs;
CPU kernels are deterministic for identical inputs in one process, so the results are bitwise equal,
with no assumption about how any kernel orders its reductions. (A CUDA version would need the same
property from its kernels, e.g. a fixed split size; there the kernel raises rather than falling back.)

Two kinds of call use stock SDPA, as they need no invariance and SDPA is faster: a forward with no
cache (a prefill: as many keys as queries), which AR and Orthrus run identically, and the draft view's
bidirectional pass (`is_causal=False`), which only proposes tokens; the verify pass decides what is
committed, and the cache the draft reads is the one exact mode keeps bitwise equal. The draft pass
also runs its linear layers stock (`stock_linears`).

Linear layers (projections, MLP, LM head) run in fixed groups of rows (`FixedRowsLinearMixin`): a
GEMM's per-row result can depend on how many rows it multiplies (always in fp32 on the CPUs measured,
rarely and data-dependently in bf16). The group size is 8 where the CPU multiplies the dtype natively
in wide SIMD (8 rows then cost about what 1 does) and 1 elsewhere (each row its own matrix-vector
product, the very call single-token decoding makes); see `default_row_group`. Norms, rotary and
activations are row-wise and were measured by `lossless probe` to be batch-invariant already, so they
are left alone.

This module does not know decoding; it only provides the kernels, the cache layer and the registration.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .errors import LosslessError

EXACT = "exact"
MIRROR_ATTR = "_lossless_exact_fp32"  # on the key tensor an ExactCacheLayer returns: (keys, values) [cap, b, kv, d]


def exact_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, is_causal=None, **kwargs):
    """query [b, h, q, d], key/value [b, kv_h, n, d] -> (output [b, q, h, d], None)."""
    if query.device.type != "cpu":
        raise LosslessError("attn=exact has only a CPU kernel so far; use --device cpu or --attn sdpa")
    b, h, q, d = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    if (n == q and is_causal is not False) or is_causal is False:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    _check_causal_prefixes(attention_mask, b, q, n)
    mirror = getattr(key, MIRROR_ATTR, None)
    if mirror is not None:
        keys, values = mirror
    else:  # a plain cache: the same layout, made for this call (same numbers, so the same results)
        keys, values = position_major_fp32(key), position_major_fp32(value)
    groups = h // kv_heads
    rows = []
    for r in range(q):
        p = n - q + r  # the row's absolute position: it sees keys 0..p
        # a fresh, contiguous (so aligned) fp32 buffer, whether the row came alone or as part of a block
        qr = query[:, :, r].reshape(b, kv_heads, groups, d).to(torch.float32, memory_format=torch.contiguous_format,
                                                                 copy=True)
        scores = torch.matmul(qr, keys[: p + 1].permute(1, 2, 3, 0))  # [b, kv, g, p+1]
        scores.mul_(scaling)
        probs = torch.softmax(scores, dim=-1)
        rows.append(torch.matmul(probs, values[: p + 1].permute(1, 2, 0, 3)))  # [b, kv, g, d]
    out = (rows[0].unsqueeze(1) if q == 1 else torch.stack(rows, dim=1)).reshape(b, q, h, d)
    return out.to(query.dtype), None


def position_major_fp32(states: torch.Tensor) -> torch.Tensor:
    """[b, kv, n, d] -> fp32 [n, b, kv, d], contiguous: any prefix of positions has the same layout."""
    return states.float().permute(2, 0, 1, 3).contiguous()


def _check_causal_prefixes(mask, b, q, n):
    """Exact attention serves batch-1 causal decoding: the q queries are the last q positions and each
    sees every key up to its own. Anything else (padding, custom masks) is refused, not approximated."""
    if b != 1:
        raise LosslessError("attn=exact decodes one sequence at a time (batch 1); use --attn sdpa for batches")
    if mask is None:
        return
    visible = mask[..., -n:] if mask.dtype == torch.bool else mask[..., -n:] > torch.finfo(mask.dtype).min / 2
    causal = torch.arange(n, device=mask.device)[None, :] <= torch.arange(n - q, n, device=mask.device)[:, None]
    if not bool((visible == causal).all()):
        raise LosslessError("attn=exact supports causal attention over the cache only (no padding or custom masks)")


class ExactCacheLayer(DynamicLayer):
    """A DynamicLayer that also holds its keys and values as fp32 `[positions, b, kv, d]` buffers (see
    `position_major_fp32`), written once per new position and grown by doubling, rather than converting
    the whole cache on every forward. The buffers ride on the key tensor `update` returns; positions past
    the cache (after a crop) are never read, as each query reads only the prefix up to itself."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        b, kv, _, d = key_states.shape
        self._kbuf = key_states.new_zeros(0, b, kv, d, dtype=torch.float32)
        self._vbuf = key_states.new_zeros(0, b, kv, d, dtype=torch.float32)

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.get_seq_length()
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        end = keys.shape[-2]
        if end > self._kbuf.shape[0]:
            self._kbuf, self._vbuf = (self._grown(buf, max(end, 2 * buf.shape[0])) for buf in (self._kbuf, self._vbuf))
        self._kbuf[start:end].copy_(key_states.permute(2, 0, 1, 3))  # bf16/fp16 -> fp32 is exact
        self._vbuf[start:end].copy_(value_states.permute(2, 0, 1, 3))
        setattr(keys, MIRROR_ATTR, (self._kbuf, self._vbuf))
        return keys, values

    @staticmethod
    def _grown(buf: torch.Tensor, size: int) -> torch.Tensor:
        return torch.cat([buf, buf.new_zeros(size - buf.shape[0], *buf.shape[1:])])

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise LosslessError("exact-mode caches hold one sequence; beam search is not supported with attn=exact")

    batch_select_indices = batch_repeat_interleave


def exact_cache(config) -> DynamicCache:
    """A DynamicCache whose full-attention layers keep the fp32 copy `exact_attention` reads."""
    cache = DynamicCache(config=config)
    cache.layers = [ExactCacheLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def register_exact() -> None:
    """Make "exact" a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EXACT, exact_attention)
    if EXACT not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(EXACT, sdpa_mask)


ROW_GROUP = 8  # the group size where the CPU multiplies the dtype natively (M=8 then costs about what M=1 does)
ROW_GROUP_ENV = "LOSSLESS_EXACT_ROW_GROUP"
ALIGN = 64  # bytes; the CPU allocator's alignment, so a fresh single-row buffer always has it
# CPU flags under which a dtype's GEMMs run natively in wide SIMD, so a group of 8 rows is cheap
_NATIVE_FLAGS = {torch.float32: ("avx512f",), torch.bfloat16: ("avx512_bf16", "amx_bf16"),
                 torch.float16: ("avx512_fp16", "amx_fp16")}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def default_row_group(dtype: torch.dtype) -> int:
    """Rows per GEMM in exact mode: $LOSSLESS_EXACT_ROW_GROUP if set, else 8 where this CPU multiplies
    `dtype` natively in wide SIMD and 1 where it does not (there a bf16 GEMM of 8 rows costs about 8
    single-row products, and single-token decoding would pay 8x for every linear layer).

    The choice depends only on the machine, never on a timing, so every process on one machine runs
    the same kernels; exact mode compares Orthrus with AR under the same group size."""
    env = os.environ.get(ROW_GROUP_ENV)
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value < 1:
            raise LosslessError(f"{ROW_GROUP_ENV} must be a positive integer, got {env!r}")
        return value
    return ROW_GROUP if any(f in _cpu_flags() for f in _NATIVE_FLAGS.get(dtype, ())) else 1


_STOCK_LINEARS: ContextVar[bool] = ContextVar("lossless_stock_linears", default=False)


@contextmanager
def stock_linears():
    """Within this block, fixed-row linears take the stock path (for passes that need no invariance:
    the draft view only proposes tokens, so its GEMMs may batch rows however is fastest)."""
    token = _STOCK_LINEARS.set(True)
    try:
        yield
    finally:
        _STOCK_LINEARS.reset(token)


class FixedRowsLinearMixin:
    """A Linear whose row results do not depend on how many rows are multiplied together: rows are
    processed in groups of exactly `row_group` (zero-padded), so a single decoding row and the same row
    inside a verify block go through the same GEMM shape.

    Calls with more than `max_grouped_rows` rows (prefills, which AR and Orthrus share bit for bit)
    take the stock path; `enable_exact` sets that bound above the model's block size."""

    max_grouped_rows = 32
    row_group = ROW_GROUP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if _STOCK_LINEARS.get():
            return F.linear(x, self.weight, self.bias)
        if self.row_group == 1 and x.numel() == shape[-1] and x.is_contiguous() and x.data_ptr() % ALIGN == 0:
            # a single decoding row: the very call each row of a block makes below, minus the bookkeeping
            return F.linear(x.view(1, shape[-1]), self.weight, self.bias).view(*shape[:-1], -1)
        rows = x.reshape(-1, shape[-1])
        n = rows.shape[0]
        if n > self.max_grouped_rows:
            return F.linear(x, self.weight, self.bias)
        group = self.row_group
        if group == 1:  # each row alone, as a [1, in] matrix at a 64-byte-aligned address, exactly as a single
            # decoding step calls it (a row of a block is copied only when its address is not aligned)
            outs = [F.linear(r if r.data_ptr() % ALIGN == 0 else r.clone(), self.weight, self.bias)
                    for r in rows.split(1)]
            return (outs[0] if n == 1 else torch.cat(outs)).reshape(*shape[:-1], -1)
        pad = (-n) % group
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        out = torch.cat([F.linear(g, self.weight, self.bias) for g in rows.split(group)])
        return out[:n].reshape(*shape[:-1], -1)


_FIXED: dict[type, type] = {}


def make_linears_fixed_rows(module: torch.nn.Module, max_grouped_rows: int = 32,
                            row_group: int = ROW_GROUP) -> list[str]:
    """Swap every nn.Linear under `module` to the fixed-row-group variant. Returns descriptions like
    "linear 1536->576 x30 (rows in groups of 8)".

    All shapes are swapped, in every dtype: on this CPU fp32 GEMMs differ between 1 and k rows almost
    everywhere, and bf16 GEMMs differ rarely and data-dependently (`lossless probe` finds single
    elements of MLP projections that round differently on real activations, which random-input checks
    miss), so no shape can be certified batch-invariant by measurement."""
    swapped: dict[tuple[int, int], int] = {}
    for sub in module.modules():
        if not isinstance(sub, torch.nn.Linear) or isinstance(sub, FixedRowsLinearMixin):
            continue
        base = type(sub)
        if base not in _FIXED:
            _FIXED[base] = type(f"FixedRows{base.__name__}", (FixedRowsLinearMixin, base), {})
        sub.__class__ = _FIXED[base]
        sub.max_grouped_rows = max_grouped_rows
        sub.row_group = row_group
        shape = (sub.in_features, sub.out_features)
        swapped[shape] = swapped.get(shape, 0) + 1
    return [f"linear {i}->{o} x{n} (rows in groups of {row_group})" for (i, o), n in sorted(swapped.items())]


def enable_exact(model, row_group: int | None = None) -> list[str]:
    """Put an OrthrusLM into exact mode in place: the "exact" attention kernel and fixed-row-group linear
    layers (`row_group` rows per GEMM; default: `default_row_group`). Returns what was replaced."""
    if model.device.type != "cpu":
        raise LosslessError("attn=exact has only a CPU kernel so far; use --device cpu or --attn sdpa")
    register_exact()
    model.backbone.set_attn_implementation(EXACT)
    model.attn = EXACT
    group = row_group or default_row_group(model.dtype)
    model.exact_ops = ["attention", *make_linears_fixed_rows(model.backbone, max(32, model.k), group)]
    return model.exact_ops
