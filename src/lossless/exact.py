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

Passes that need no invariance run stock kernels inside `stock_kernels()`: a prefill, which AR and
Orthrus run identically; the draft view, which only proposes tokens (the verify pass decides what is
committed, and the cache the draft reads is the one exact mode keeps bitwise equal); teacher-forced
scoring. Outside such a block every forward is batch-invariant, however many rows it has.

Linear layers (projections, MLP, LM head) run in fixed groups of rows (`FixedRowsLinearMixin`): a
GEMM's per-row result can depend on how many rows it multiplies (always in fp32 on the CPUs measured,
rarely and data-dependently in bf16). The group size is 8 where the CPU multiplies the dtype natively
in wide SIMD (8 rows then cost about what 1 does) and 1 elsewhere (each row its own matrix-vector
product, the very call single-token decoding makes); see `default_row_group`.

Norms, MLP activations and the rotary embedding run one call per token row (`RowwiseMixin`,
`RotaryRowsMixin`). They are row-wise in math but not in machine code: an elementwise kernel runs
SIMD over the whole tensor and finishes the last `numel % width` elements with scalar code, whose
exp/cos round differently. A SiLU over one row of 72 floats ends in scalar code; the same row inside a
block of 8 does not, and fp32 logits then differ (intermediate sizes 72, 88, 168, 344, 688 on an
AVX-512 CPU; multiples of 32 happened to be safe).

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
from .names import EXACT, positive_int

MIRROR_ATTR = "_lossless_exact_fp32"  # on the key tensor an ExactCacheLayer returns: (keys, values) [cap, b, kv, d]


def exact_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, is_causal=None, **kwargs):
    """query [b, h, q, d], key/value [b, kv_h, n, d] -> (output [b, q, h, d], None)."""
    check_device(query.device)
    b, h, q, d = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    if (n == q and is_causal is not False) or is_causal is False or _STOCK.get():
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


def cpu_multiplies_natively(dtype: torch.dtype) -> bool:
    """Whether this CPU has wide-SIMD (or AMX) instructions for `dtype` products; where it has not, torch
    emulates them (bf16 then costs several times fp32)."""
    return any(f in _cpu_flags() for f in _NATIVE_FLAGS.get(dtype, ()))


def default_row_group(dtype: torch.dtype) -> int:
    """Rows per GEMM in exact mode: $LOSSLESS_EXACT_ROW_GROUP if set, else 8 where this CPU multiplies
    `dtype` natively in wide SIMD and 1 where it does not (there a bf16 GEMM of 8 rows costs about 8
    single-row products, and single-token decoding would pay 8x for every linear layer).

    The choice depends only on the machine, never on a timing, so every process on one machine runs
    the same kernels; exact mode compares Orthrus with AR under the same group size."""
    env = os.environ.get(ROW_GROUP_ENV)
    if env:
        return positive_int(env, f"{ROW_GROUP_ENV} must be a positive integer, got {env!r}")
    return ROW_GROUP if cpu_multiplies_natively(dtype) else 1


_STOCK: ContextVar[bool] = ContextVar("lossless_stock_kernels", default=False)
_FIRST_POSITION: ContextVar[int] = ContextVar("lossless_first_position", default=0)


@contextmanager
def stock_kernels():
    """Within this block exact mode's kernels take the stock path, for passes that need no invariance:
    a prefill (AR and Orthrus run it identically), the draft view (it only proposes tokens) and
    teacher-forced scoring. Everything outside such a block is batch-invariant."""
    token = _STOCK.set(True)
    try:
        yield
    finally:
        _STOCK.reset(token)


@contextmanager
def first_position(pos: int):
    """Within this block a forward's first row is the token at absolute position `pos` (the model sets
    it for every cached forward), so fixed-row linears can put each row in the same slot of its group
    whether it comes alone or in a block."""
    token = _FIRST_POSITION.set(int(pos))
    try:
        yield
    finally:
        _FIRST_POSITION.reset(token)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when contiguous at a 64-byte-aligned address, else a fresh contiguous copy (which the
    allocator aligns), so a row reaches a kernel with the same layout wherever it came from."""
    return t if t.is_contiguous() and t.data_ptr() % ALIGN == 0 else t.clone(memory_format=torch.contiguous_format)


class FixedRowsLinearMixin:
    """A Linear whose row results do not depend on how many rows are multiplied together.

    Rows go through GEMMs of exactly `row_group` rows, each group a fresh zero-padded buffer, and the
    token at absolute position p always sits in slot `p % row_group` of its group: a GEMM may compute
    its rows by different code paths depending on the slot (on an AVX-512 CPU an 8 x 10 by 10 x 3
    product rounds slot 1 differently from slot 0), so a single decoding row and the same row inside a
    verify block must share the slot as well as the shape. The other slots hold zeros or other rows;
    GEMM kernels have no data-dependent control flow, so they do not touch a row's result."""

    row_group = ROW_GROUP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if _STOCK.get():
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, shape[-1])
        n, group = rows.shape[0], self.row_group
        if group == 1:  # each row alone, as a [1, in] matrix at an aligned address: the very call a
            # single decoding step makes (a row of a block is copied only when its address is not aligned)
            outs = [F.linear(_aligned(r), self.weight, self.bias) for r in rows.split(1)]
            return (outs[0] if n == 1 else torch.cat(outs)).reshape(*shape[:-1], -1)
        slot = _FIRST_POSITION.get() % group  # slot of the first row in its group
        outs = []
        for start in range(-slot, n, group):  # one group per window of absolute positions [8j, 8j + 8)
            lo, hi = max(start, 0), min(start + group, n)
            buf = rows.new_zeros(group, shape[-1])
            buf[lo - start:hi - start] = rows[lo:hi]
            outs.append(F.linear(buf, self.weight, self.bias)[lo - start:hi - start])
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(*shape[:-1], -1)


class RowwiseMixin:
    """A module that maps each token row on its own (a norm, an activation), called once per row.

    Elementwise kernels vectorise over the whole tensor and finish the last `numel % width` elements
    with scalar code (a different exp, cos, ...), and reductions may pick their order from the shape,
    so a row's result can depend on how many rows share the call unless the row width is a multiple of
    the vector width. One call per row `[b, 1, ...]` is the very call a single decoding step makes.
    Token rows are along dim 1 (batch-first hidden states, `[b, q, d]` or `[b, q, heads, d]`)."""

    def forward(self, x: torch.Tensor, *args, **kwargs):
        parent = super().forward
        if _STOCK.get() or x.dim() < 2:
            return parent(x, *args, **kwargs)
        if x.shape[1] == 1:
            return parent(_aligned(x), *args, **kwargs)
        return torch.cat([parent(_aligned(x[:, r:r + 1]), *args, **kwargs) for r in range(x.shape[1])], dim=1)


class RotaryRowsMixin:
    """The rotary embedding (`forward(x, position_ids) -> (cos, sin)`, each `[b, q, d]`) computed one
    position at a time, for the same reason as `RowwiseMixin`: cos/sin are elementwise kernels."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        parent = super().forward
        if _STOCK.get() or position_ids.shape[-1] == 1:
            return parent(x, position_ids, *args, **kwargs)
        parts = [parent(x, position_ids[:, r:r + 1], *args, **kwargs) for r in range(position_ids.shape[-1])]
        return tuple(torch.cat(tensors, dim=1) for tensors in zip(*parts))


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: torch.nn.Module, mixin: type) -> None:
    base = type(module)
    if isinstance(module, mixin):
        return
    if (mixin, base) not in _SUBCLASSES:
        prefix = mixin.__name__.removesuffix("Mixin")
        _SUBCLASSES[(mixin, base)] = type(f"{prefix}{base.__name__}", (mixin, base), {})
    module.__class__ = _SUBCLASSES[(mixin, base)]


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def make_linears_fixed_rows(module: torch.nn.Module, row_group: int = ROW_GROUP) -> list[str]:
    """Swap every nn.Linear under `module` to the fixed-row-group variant. Returns descriptions like
    "linear 1536->576 x30 (rows in groups of 8)".

    All shapes are swapped, in every dtype: on this CPU fp32 GEMMs differ between 1 and k rows almost
    everywhere, and bf16 GEMMs differ rarely and data-dependently (`lossless probe` finds single
    elements of MLP projections that round differently on real activations, which random-input checks
    miss), so no shape can be certified batch-invariant by measurement."""
    swapped: dict[tuple[int, int], int] = {}
    for sub in module.modules():
        if not isinstance(sub, torch.nn.Linear):
            continue
        _swap_class(sub, FixedRowsLinearMixin)
        sub.row_group = row_group
        shape = (sub.in_features, sub.out_features)
        swapped[shape] = swapped.get(shape, 0) + 1
    return [f"linear {i}->{o} x{n} (rows in groups of {row_group})" for (i, o), n in sorted(swapped.items())]


def make_rowwise(backbone: torch.nn.Module) -> list[str]:
    """Swap the backbone's norms, MLP activations and rotary embedding to one call per token row.
    Returns descriptions like "RMSNorm x5 (one call per row)"."""
    counts: dict[str, int] = {}
    targets = [m for m in backbone.modules() if _is_norm(m)]
    targets += [layer.mlp.act_fn for layer in backbone.model.layers if hasattr(getattr(layer, "mlp", None), "act_fn")]
    for module in targets:
        if not isinstance(module, RowwiseMixin):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
            _swap_class(module, RowwiseMixin)
    rotary = getattr(backbone.model, "rotary_emb", None)
    if rotary is not None:
        counts[type(rotary).__name__] = 1
        _swap_class(rotary, RotaryRowsMixin)
    return [f"{name} x{n} (one call per row)" for name, n in sorted(counts.items())]


def check_device(device) -> None:
    """Exact mode's kernels are verified on the CPU only; refuse any other device (written once here)."""
    if torch.device(device).type != "cpu":
        raise LosslessError("attn=exact has only a CPU kernel so far; use --device cpu or --attn sdpa")


def make_batch_invariant(backbone: torch.nn.Module, row_group: int) -> list[str]:
    """Install exact mode on a backbone in place: the "exact" attention kernel, fixed-row-group linear
    layers and per-row norms, activations and rotary. Returns what was replaced."""
    register_exact()
    backbone.set_attn_implementation(EXACT)
    return ["attention", *make_linears_fixed_rows(backbone, row_group), *make_rowwise(backbone)]
