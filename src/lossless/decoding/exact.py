"""Exact mode: a forward whose per-row results do not depend on how many rows run together.

A token at absolute position p gets bitwise the same logits whether it is decoded alone (AR), inside a
verify block of k rows, as a node of a candidate tree, or beside the draft groups of a fused forward. Each
op that mixes numbers across a row runs a kernel of `kernels.py`, whose every output is one fixed sequence
of IEEE operations over exactly the inputs it reads (no dependence on the call's row count, a row's place,
the other rows, the thread count or the CPU's vector width):

- linear layers (projections, MLP, LM head): `PackedLinearMixin`, one fma chain per output over the
  inputs in order, from weights packed once into panels of 16 outputs (re-packed if the weight changes);
- attention (`exact_attention`, registered as the attention kernel "exact"): each query row attends to the
  keys its mask lets it see, in cache order, with a fixed dot product, max, exp and sum; a tree row sees
  the cache and its ancestors, which are the keys an AR step at its position sees, in the same order;
- RMSNorm and SiLU: `NormMixin` and `SiluMixin`, statistics and exp in a fixed order;
- rotary embedding: `RotaryTableMixin` looks cos/sin up in a table made once per dtype, so a position's
  values never depend on which other positions share the call.

Everything else in a decoder layer is elementwise (residual adds, gate * up, the rotary products):
correctly rounded per element whatever the kernel's vector width, so batch-invariant as it stands. A module
of a kind the kernels do not cover (a norm or activation of another family, a rope that changes with the
sequence length) falls back to one stock call per token row (`RowwiseMixin`, `RotaryRowsMixin`): exact,
because a single row is the very call a decoding step makes, but slower.

Passes that need no invariance run stock kernels inside `stock_kernels()`: a prefill, which AR and Orthrus
run identically, and teacher-forced scoring (long sequences, where the stock GEMMs are faster). A forward
that needs gradients (a training step of the draft head) takes the stock path too: the kernels have no
backward. The draft view's decoding passes run the exact kernels; they only propose tokens, so any kernel
would do, and on the CPUs measured these are the faster ones for a few rows.

This module does not know decoding; it only swaps module classes and registers the attention kernel.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from . import kernels
from ..errors import LosslessError
from ..names import EXACT


def exact_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, is_causal=None, **kwargs):
    """query [b, h, q, d], key/value [b, kv_h, n, d] -> (output [b, q, h, d], None)."""
    check_device(query.device)
    b, h, q, d = query.shape
    n = key.shape[2]
    if (n == q and is_causal is not False) or is_causal is False or _stock(query, key, value):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if b != 1:
        raise LosslessError("attn=exact decodes one sequence at a time (batch 1); use --attn sdpa for batches")
    visible = _visibility(attention_mask, q, n, query.device)
    out = kernels.attention(query[0].transpose(0, 1), key[0], value[0], visible, scaling)  # [q, h, d]
    return out.unsqueeze(0), None


def _visibility(mask, q: int, n: int, device) -> torch.Tensor:
    """bool [q, n]: which keys each query row sees. No mask: causal, the q rows being the last q positions."""
    if mask is None:
        return torch.arange(n, device=device)[None, :] <= torch.arange(n - q, n, device=device)[:, None]
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1:
        raise LosslessError("attn=exact takes one mask for all heads of one sequence; use --attn sdpa")
    mask = mask[0, 0, -q:, -n:]
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def register_exact() -> None:
    """Make "exact" a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EXACT, exact_attention)
    if EXACT not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(EXACT, sdpa_mask)


# CPU flags under which a dtype's GEMMs run natively in wide SIMD (elsewhere torch emulates bf16/fp16)
_NATIVE_FLAGS = {torch.float32: ("avx512f",), torch.bfloat16: ("avx512_bf16", "amx_bf16"),
                 torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_multiplies_natively(dtype: torch.dtype) -> bool:
    """Whether this CPU has wide-SIMD (or AMX) instructions for `dtype` products; where it has not, torch
    emulates them (bf16 then costs several times fp32)."""
    return any(f in kernels.cpu_flags() for f in _NATIVE_FLAGS.get(dtype, ()))


_STOCK: ContextVar[bool] = ContextVar("lossless_stock_kernels", default=False)


def _stock(x: torch.Tensor, *params) -> bool:
    """Whether this call takes the stock path: inside `stock_kernels()`, or when autograd must see it."""
    return _STOCK.get() or (torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad
                                                                                for p in params)))


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


class PackedLinearMixin:
    """A Linear computed by `kernels.linear`: each output one fma chain over the inputs in order, so a row's
    result depends on nothing but the row. The packed weight is made on first use and again whenever the
    weight tensor changes (a loaded head, a training step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _stock(x, self.weight, self.bias):
            return F.linear(x, self.weight, self.bias)
        w = self.weight
        stamp = (w.data_ptr(), w._version, w.dtype)
        if getattr(self, "_lossless_stamp", None) != stamp:
            self._lossless_packed, self._lossless_stamp = kernels.pack_weight(w), stamp
        return kernels.linear(x, self._lossless_packed, self.out_features, self.bias)


class NormMixin:
    """An RMSNorm of the Llama/Qwen kind (`weight * (x / sqrt(mean(x^2) + eps))` cast to x's dtype) computed by
    `kernels.rms_norm`: the mean of squares in a fixed order, one row at a time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _stock(x, self.weight):
            return super().forward(x)
        return kernels.rms_norm(x, self.weight, self.variance_epsilon)


class SiluMixin:
    """SiLU through `kernels.silu`: a fixed exp, the same bits for an element wherever it sits in the tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _stock(x):
            return super().forward(x)
        return kernels.silu(x)


class RotaryTableMixin:
    """The rotary embedding (`forward(x, position_ids) -> (cos, sin)`, each `[b, q, d]`) looked up in a table of
    every position, computed by one stock call per dtype and device: a position's cos/sin then never depend on
    which positions share the call (cos/sin kernels round a tensor's last elements differently)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        if _STOCK.get():
            return super().forward(x, position_ids, *args, **kwargs)
        tables = self.__dict__.setdefault("_lossless_tables", {})
        key = (x.dtype, x.device)
        if key not in tables:
            every = torch.arange(self._lossless_positions, device=x.device)[None]
            tables[key] = super().forward(x, every, *args, **kwargs)
        cos, sin = tables[key]
        return cos[0, position_ids], sin[0, position_ids]


class RowwiseMixin:
    """The fallback for a norm or activation the kernels do not cover: one stock call per token row.

    Elementwise kernels vectorise over the whole tensor and finish the last `numel % width` elements with
    scalar code (a different exp, ...), so a row's result can depend on how many rows share the call; one
    call per row `[b, 1, ...]` is the very call a single decoding step makes. Token rows are along dim 1."""

    def forward(self, x: torch.Tensor, *args, **kwargs):
        parent = super().forward
        if _STOCK.get() or x.dim() < 2 or x.shape[1] == 1:
            return parent(x, *args, **kwargs)
        return torch.cat([parent(x[:, r:r + 1].contiguous(), *args, **kwargs) for r in range(x.shape[1])], dim=1)


class RotaryRowsMixin:
    """The fallback for a rotary embedding that depends on more than the position (dynamic scaling): one
    stock call per position."""

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


def _kernel_norm_matches(module: torch.nn.Module) -> bool:
    """Whether `module` computes what `kernels.rms_norm` computes (checked on random rows, to a tolerance):
    the Llama/Qwen RMSNorm does; a LayerNorm or a (1 + weight) norm does not."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return False
    x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.no_grad():
        want, got = module(x).float(), kernels.rms_norm(x, weight.detach(), eps).float()
    return want.shape == got.shape and torch.allclose(want, got, rtol=2e-2, atol=2e-2 * float(weight.detach().abs().max()))


def _is_silu(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.SiLU) or type(module).__name__ == "SiLUActivation"


def make_batch_invariant(backbone: torch.nn.Module) -> list[str]:
    """Install exact mode on a backbone in place: the "exact" attention kernel and the kernels of
    `kernels.py` for every linear layer, RMSNorm and SiLU, the rotary table (and the per-row
    fallback for anything else). Returns what was replaced, e.g. "linear 576->192 x60 (fixed-order kernel)"."""
    kernels.ops()  # build (or load) the kernels now: a missing compiler is an error before any work
    register_exact()
    backbone.set_attn_implementation(EXACT)
    linears: dict[tuple[int, int], int] = {}
    for sub in backbone.modules():
        if isinstance(sub, torch.nn.Linear):
            _swap_class(sub, PackedLinearMixin)
            linears[(sub.in_features, sub.out_features)] = linears.get((sub.in_features, sub.out_features), 0) + 1
    counts: dict[str, int] = {}

    def swap(module, mixin, how):
        if not isinstance(module, (NormMixin, SiluMixin, RotaryTableMixin, RowwiseMixin, RotaryRowsMixin)):
            label = f"{type(module).__name__} x{{}} ({how})"
            counts[label] = counts.get(label, 0) + 1
            _swap_class(module, mixin)

    for module in [m for m in backbone.modules() if _is_norm(m)]:
        fits = _kernel_norm_matches(module)
        swap(module, NormMixin if fits else RowwiseMixin, "fixed-order kernel" if fits else "one call per row")
    for layer in backbone.model.layers:
        act = getattr(getattr(layer, "mlp", None), "act_fn", None)
        if act is not None:
            swap(act, SiluMixin if _is_silu(act) else RowwiseMixin,
                 "fixed-order kernel" if _is_silu(act) else "one call per row")
    rotary = getattr(backbone.model, "rotary_emb", None)
    if rotary is not None:
        static = getattr(rotary, "rope_type", "default") == "default"
        rotary._lossless_positions = int(getattr(backbone.config, "max_position_embeddings", 4096))
        swap(rotary, RotaryTableMixin if static else RotaryRowsMixin,
             "table of every position" if static else "one call per row")
    return ["attention", *(f"linear {i}->{o} x{n} (fixed-order kernel)" for (i, o), n in sorted(linears.items())),
            *(label.format(n) for label, n in sorted(counts.items()))]


def check_device(device) -> None:
    """Exact mode's kernels are verified on the CPU only; refuse any other device (written once here)."""
    if torch.device(device).type != "cpu":
        raise LosslessError("attn=exact has only a CPU kernel so far; use --device cpu or --attn sdpa")
