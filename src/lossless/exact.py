"""Exact mode: attention whose per-query result does not depend on how many queries run together.

`exact_attention` is registered with the transformers attention interface as "exact". For a query at
absolute position p it always performs the same floating-point operations, whether it is decoded
alone (AR) or inside a block of k queries (Orthrus verify):

- keys are split into fixed-size chunks at absolute boundaries (0, C, 2C, ...), padded to C;
- q.k dot products and p.v sums are elementwise products reduced over a contiguous axis of fixed
  length (head_dim, then C), in fp32 - never a matmul, whose reduction order depends on its shape;
- the softmax uses the row's maximum over visible keys (exact) and sums chunk results with a scan
  (left to right), so chunks that a block adds beyond the row's position contribute exact zeros.

A forward with no cache (a prefill: as many keys as queries) uses stock SDPA: AR and Orthrus run the
identical prefill, so it needs no invariance, and SDPA is much faster there.

Linear layers (projections, MLP, LM head) run in fixed groups of rows (`FixedRowsLinearMixin`): a
GEMM's per-row result can depend on how many rows it multiplies (always in fp32 on the CPUs measured,
rarely and data-dependently in bf16). The group size is 8 where the CPU multiplies the dtype natively
in wide SIMD (8 rows then cost about what 1 does) and 1 elsewhere (each row its own matrix-vector
product, the very call single-token decoding makes); see `default_row_group`. Norms, rotary and activations are row-wise and were measured by
`lossless probe` to be batch-invariant already, so they are left alone. The kernel is CPU-only: on CUDA it
raises rather than silently falling back (a CUDA version would use a fixed split *size* as well).

This module does not know decoding; it only provides the kernel and its registration.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .errors import LosslessError

EXACT = "exact"
CHUNK = 64  # keys per chunk; fixed, so a row's reduction structure depends only on its own position


def exact_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, is_causal=None, **kwargs):
    """query [b, h, q, d], key/value [b, kv_h, n, d] -> (output [b, q, h, d], None)."""
    if query.device.type != "cpu":
        raise LosslessError("attn=exact has only a CPU kernel so far; use --device cpu or --attn sdpa")
    b, h, q, d = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    if n == q and is_causal is not False:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    visible = _visibility(attention_mask, is_causal, b, q, n, query.device)  # [b|1, 1, q, n] bool or None
    chunks = -(-n // CHUNK)
    pad = chunks * CHUNK - n
    groups = h // kv_heads
    qf = query.float().reshape(b, kv_heads, groups, q, 1, 1, d)
    kf = F.pad(key.float(), (0, 0, 0, pad)).reshape(b, kv_heads, 1, 1, chunks, CHUNK, d)
    # value with the chunk axis innermost, so p.v is also a contiguous fixed-length reduction
    vf = F.pad(value.float(), (0, 0, 0, pad)).reshape(b, kv_heads, chunks, CHUNK, d).transpose(-1, -2)
    vf = vf.reshape(b, kv_heads, 1, 1, chunks, d, CHUNK).contiguous()
    scores = (qf * kf).sum(-1) * scaling  # [b, kv, g, q, chunks, C]
    if visible is not None:
        keep = F.pad(visible, (0, pad), value=False).reshape(visible.shape[0], 1, 1, q, chunks, CHUNK)
        scores = scores.masked_fill(~keep, float("-inf"))
    elif pad:  # every key visible (a single decoding row, or the draft view): only the padding is hidden
        scores.view(*scores.shape[:-2], chunks * CHUNK)[..., n:] = float("-inf")
    # every row sees at least one key (its own position, or its block), so the row maximum is finite
    row_max = scores.amax(dim=(-1, -2), keepdim=True)  # exact, order-free
    probs = torch.exp(scores - row_max)  # [b, kv, g, q, chunks, C]
    chunk_sum = probs.sum(-1)  # [b, kv, g, q, chunks]
    chunk_out = (probs.unsqueeze(-2) * vf).sum(-1)  # [b, kv, g, q, chunks, d]
    # sequential sums over chunks (a scan adds left to right), so the all-masked chunks a block adds
    # beyond a row's position contribute exact zeros after the row's own total
    total = torch.cumsum(chunk_sum, dim=-1)[..., -1]
    acc = torch.cumsum(chunk_out, dim=-2)[..., -1, :]
    out = (acc / total.unsqueeze(-1)).to(query.dtype).reshape(b, h, q, d)
    return out.transpose(1, 2).contiguous(), None


def _visibility(mask, is_causal, b, q, n, device):
    """Which keys each query may see, as bool [b|1, 1, q, n]; None = all."""
    if mask is None:
        if is_causal is False or q == 1:  # bidirectional, or one query that sees every cached key
            return None
        offset = n - q  # batch 1, no padding: queries are the last q positions
        rows = torch.arange(q, device=device)[:, None] + offset
        return (torch.arange(n, device=device)[None, :] <= rows)[None, None]
    if mask.dtype == torch.bool:
        return mask[..., -n:]
    return mask[..., -n:] > torch.finfo(mask.dtype).min / 2  # additive float mask: 0 visible


def register_exact() -> None:
    """Make "exact" a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EXACT, exact_attention)
    if EXACT not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(EXACT, sdpa_mask)


ROW_GROUP = 8  # the group size where the CPU multiplies the dtype natively (M=8 then costs about what M=1 does)
ROW_GROUP_ENV = "LOSSLESS_EXACT_ROW_GROUP"
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
        rows = x.reshape(-1, shape[-1])
        n = rows.shape[0]
        if n > self.max_grouped_rows:
            return F.linear(x, self.weight, self.bias)
        group = self.row_group
        if group == 1:  # each row alone, in its own buffer, exactly as a single decoding step calls it
            out = torch.cat([F.linear(r.clone(), self.weight, self.bias) for r in rows.split(1)])
            return out.reshape(*shape[:-1], -1)
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
