"""Exact mode: a forward whose per-row results depend on nothing but the row, on any machine.

A token at absolute position p gets bitwise the same logits whether it is decoded alone (AR), inside a
verify block of k rows, as a node of a candidate tree, or beside the draft groups of a fused forward; and the
same on any CPU the kernels run on (AMD or Intel, AVX-512 BF16, AVX-512, AVX2 or plain loops), at any thread
count. Every op of an exact-mode decode that mixes numbers across a row runs a kernel of `kernels.py`, whose
every output is one fixed sequence of IEEE operations over exactly the inputs it reads, under one denormal rule:

- linear layers (projections, MLP, LM head): `PackedLinearMixin`, one fma chain per output over the
  inputs in order, from weights packed once into panels of 16 outputs (re-packed if the weight changes);
- attention (`exact_attention`, registered as the attention kernel "exact"): each query row attends to the
  keys its mask lets it see, in cache order, with a fixed dot product, max, exp and sum; a tree row sees
  the cache and its ancestors, which are the keys an AR step at its position sees, in the same order. The
  prefill (causal over the prompt) and the draft view's passes (bidirectional blocks) run it too;
- RMSNorm and SiLU: `NormMixin` and `SiluMixin`, statistics and exp in a fixed order;
- rotary embedding: `RotaryTableMixin` looks cos/sin up in a table computed by `kernels.rotary_table` from
  float64 additions and multiplications only (the same bits everywhere), grown on demand to any position.

Everything else in a decoder layer is elementwise (residual adds, gate * up, the rotary products, the
embedding lookup): correctly rounded per element whatever the kernel's vector width, so the same bits as it
stands. A module of any other kind (a norm of another family, another activation, dynamic or long-context
RoPE, sliding-window attention, a module the swap does not know) is refused by name: running it on stock
kernels would quietly give up the guarantee.

Passes that need no invariance run stock kernels inside `stock_kernels()`: teacher-forced scoring (long
sequences, where the stock GEMMs are faster; scores are reported, not decoded from). A forward that needs
gradients (a training step of the draft head) takes the stock path too: the kernels have no backward.

This module does not know decoding; it only swaps module classes and registers the attention kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import operator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from . import kernels
from .cache import GrowingLayer, stack_room, stack_wrote
from .mixins import swap_class
from ..errors import LosslessError
from ..names import EXACT


def exact_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, is_causal=None, **kwargs):
    """query [b, h, q, d], key/value [b, kv_h, n, d] -> (output [b, q, h, d], None). Without a mask the rows are
    causal (the last q positions; a prefill, a verify block) unless is_causal is False (all keys visible: the
    draft view's block)."""
    check_device(query.device)
    b, h, q, d = query.shape
    n = key.shape[2]
    if _stock(query, key, value):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if b != 1:
        raise LosslessError("attn=exact decodes one sequence at a time (batch 1); use --attn sdpa for batches")
    visible = _visibility(attention_mask, q, n, query.device, causal=is_causal is not False)
    out = kernels.attention(query[0].transpose(0, 1), key[0], value[0], visible, scaling)  # [q, h, d]
    return out.unsqueeze(0), None


def _visibility(mask, q: int, n: int, device, causal: bool = True) -> torch.Tensor:
    """bool [q, n]: which keys each query row sees. No mask: causal (the q rows being the last q positions), or
    every key when not `causal`."""
    if mask is None:
        if not causal or q == 1:  # (one row, the last position, sees every key)
            return torch.ones(q, n, dtype=torch.bool, device=device)
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
# weights unpacked from their panels for the stock passes of one `stock_kernels()` block, freed when it ends
_UNPACKED: ContextVar[dict | None] = ContextVar("lossless_unpacked_weights", default=None)


def _stock(x: torch.Tensor, *params) -> bool:
    """Whether this call takes the stock path: inside `stock_kernels()`, or when autograd must see it."""
    return _STOCK.get() or (torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad
                                                                                for p in params)))


@contextmanager
def stock_kernels():
    """Within this block exact mode's kernels take the stock path, for passes that need no invariance
    (teacher-forced scoring). Everything outside such a block runs the fixed-order kernels."""
    token, unpacked = _STOCK.set(True), _UNPACKED.set({})
    try:
        yield
    finally:
        _UNPACKED.reset(unpacked)
        _STOCK.reset(token)


class PackedLinearMixin:
    """A Linear computed by `kernels.linear`: each output one fma chain over the inputs in order, so a row's
    result depends on nothing but the row. The packed weight is made on first use and again whenever the
    weight tensor changes (a loaded head, a training step). A frozen weight no other module shares is kept as
    the panels only (`release_weight`): its `weight` is then a meta tensor of its shape, and a stock pass
    unpacks the panels (bit for bit the weight) for as long as it runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _stock(x, self.weight, self.bias):
            return F.linear(x, self.stock_weight(), self.bias)
        return kernels.linear(x, self.packed(), self.out_features, self.bias)

    def released(self) -> bool:
        """Whether the weight lives only in the panels."""
        return self.weight is self.__dict__.get("_lossless_placeholder")

    def release_weight(self) -> None:
        """Keep the weight as the panels only (one copy of it in memory); the module's `weight` becomes a meta
        tensor of the same shape and dtype, so code that reads its values fails loudly instead of computing
        with zeros. For frozen weights: a weight that trains must stay a tensor autograd can update."""
        if self.released():
            return
        w = self.weight
        if w.requires_grad:
            raise LosslessError("a trainable weight keeps its tensor; only frozen weights live as panels only")
        self.packed()
        placeholder = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        self.weight = placeholder
        self.__dict__["_lossless_placeholder"] = placeholder  # not a registered parameter of its own

    def stock_weight(self) -> torch.Tensor:
        """The weight as a tensor: the module's own, or, if it lives in the panels only, unpacked from them (once
        per `stock_kernels()` block, freed when the block ends)."""
        if not self.released():
            return self.weight
        unpacked = _UNPACKED.get()
        if unpacked is not None and id(self) in unpacked:
            return unpacked[id(self)]
        weight = kernels.unpack_weight(self._lossless_packed, self.out_features, self.in_features)
        if unpacked is not None:
            unpacked[id(self)] = weight
        return weight

    def packed(self) -> torch.Tensor:
        """The weight in `kernels.linear`'s layout, packed again if the weight tensor changed."""
        if self.released():
            return self._lossless_packed
        if not self.packed_now():
            self.pack()
        return self._lossless_packed

    def _stamp(self) -> tuple:
        w = self.weight
        return w.data_ptr(), w._version, w.dtype

    def packed_now(self) -> bool:
        """Whether the panels hold the weight as it is now."""
        return getattr(self, "_lossless_stamp", None) == self._stamp()

    def pack(self, consumed=None) -> None:
        """Pack the weight into panels (`kernels.pack_weight`, `consumed` passed on)."""
        tiles = self.weight.dtype == torch.bfloat16 and kernels.tile_layout()
        self._lossless_packed, self._lossless_stamp = kernels.pack_weight(self.weight, consumed, tiles), self._stamp()


class PanelRowsMixin:
    """An embedding tied to a linear layer's weight (a tied LM head) that lives as that layer's panels only: a
    token's row is gathered from the panels (`kernels.embedding_rows`, a copy, so the same bits as the lookup in
    the weight). The module's `weight` is the linear's meta placeholder, so one copy of the matrix stays."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        linear = self.__dict__["_lossless_rows_of"]
        return kernels.embedding_rows(linear.packed(), ids, self.num_embeddings, self.embedding_dim)


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
    positions made by `kernels.rotary_table` (float64 operations only, rounded once: the same bits on every
    machine, and a position's values never depend on which positions share the call). The table doubles
    whenever a call reaches past it, so every position a cycle touches is covered."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        if _STOCK.get():
            return super().forward(x, position_ids, *args, **kwargs)
        one = int(position_ids) if position_ids.numel() == 1 else None  # a decode step's one position
        need = one + 1 if one is not None else int(position_ids.max()) + 1 if position_ids.numel() else 1
        cos, sin = self.lossless_table(need, x)
        if one is not None and one >= 0:  # its rows as views, [1, 1, d] (indexing would copy them)
            return cos[one:one + 1].expand(position_ids.shape + cos.shape[1:]), \
                sin[one:one + 1].expand(position_ids.shape + sin.shape[1:])
        return cos[position_ids], sin[position_ids]

    def lossless_table(self, need: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables (cos, sin) [positions, d] in `like`'s dtype and device, holding at least `need` positions."""
        tables = self.__dict__.setdefault("_lossless_tables", {})
        key = (like.dtype, like.device)
        if key not in tables or tables[key][0].shape[0] < need:
            size = max(self._lossless_positions, 1 << max(need - 1, 1).bit_length())
            cos, sin = kernels.rotary_table(self._lossless_inv_freq, size, self._lossless_scaling)
            tables[key] = (cos.to(device=like.device, dtype=like.dtype), sin.to(device=like.device, dtype=like.dtype))
        return tables[key]

    def lossless_rows(self, start: int, q: int, depth: list[int] | None, like: torch.Tensor):
        """(cos, sin) [q, d] of positions start..start+q-1 (views of the tables), or of start + depth[i] (a tree's
        rows): `forward`'s rows for those positions, without the position tensor."""
        cos, sin = self.lossless_table(start + (q if depth is None else max(depth, default=-1) + 1), like)
        if depth is None:
            return cos.narrow(0, start, q), sin.narrow(0, start, q)
        index = torch.tensor(depth, dtype=torch.long, device=cos.device) + start
        return cos.index_select(0, index), sin.index_select(0, index)


_NONE = torch.empty(0)  # "no bias" / "no norm" for the layer kernels


class _Visible:
    """The visibility [q, n] of one forward's rows, made once for all its layers: every layer gets the same mask
    object (kept here, so its id cannot be reused while the entry stands) and the same shapes."""

    key: tuple | None = None
    mask: torch.Tensor | None = None
    visible: torch.Tensor | None = None

    @classmethod
    def of(cls, mask, q: int, n: int, device) -> torch.Tensor:
        key = (id(mask), q, n, device)
        if cls.key != key or cls.mask is not mask:
            cls.visible, cls.key, cls.mask = _visibility(mask, q, n, device), key, mask
        return cls.visible


_MODULES: ContextVar[bool] = ContextVar("lossless_layer_modules", default=False)
_FIXED: ContextVar[dict | None] = ContextVar("lossless_weights_fixed", default=None)


@contextmanager
def weights_fixed():
    """Within this block no weight changes (a decode call): each kernel stack checks that it still holds the
    weights it was made from at its first forward in the block only, not at every forward."""
    token = _FIXED.set({})
    try:
        yield
    finally:
        _FIXED.reset(token)


@contextmanager
def layer_modules():
    """Within this block exact-mode decoder layers run module by module (Hugging Face's layer code calling each
    kernel) instead of as two fused calls: the same bits (tested), for tests and per-op profiles."""
    token = _MODULES.set(True)
    try:
        yield
    finally:
        _MODULES.reset(token)


class FusedLayerMixin:
    """A Llama/Qwen3 decoder layer whose AR forwards in exact mode run as two kernel calls around the cache update
    (`layer_in`: norm, q/k/v, q/k norms, rotary; `layer_out`: attention, o, residual, norm, MLP, residual), the
    same ops in the same order as the modules would run them, so the same bits with far less per-op overhead.
    Anything else (the draft view, a batch, no cache, autograd, stock kernels) runs the Hugging Face layer.
    The kernels' arguments are kept between forwards and made again when any weight of the layer changes."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        draft = kwargs.get("orthrus_draft")
        if ((draft is not None and not self._lossless_drafts_fused(draft, cache)) or cache is None
                or position_embeddings is None or hidden_states.shape[0] != 1 or "past_key_values" in kwargs
                or _MODULES.get() or _stock(hidden_states, self.input_layernorm.weight)):
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        _, rows, layer_idx, scaling, args_in, args_out = self._lossless_current_plan(draft is not None)
        if rows is not None:
            rows.start = None if draft is None else 0  # AR rows, or draft rows from the first on
        x = hidden_states[0].contiguous()
        cos, sin = position_embeddings
        q, key, value = kernels.layer_in(x, cos[0].contiguous(), sin[0].contiguous(), *args_in)
        if draft is None:
            keys, values = cache.update(key, value, layer_idx)
            visible = _Visible.of(attention_mask, x.shape[0], keys.shape[2], x.device)
        else:  # the draft view: the cache and its own rows, all of them visible, the cache left as it was
            keys, values = cache.layers[layer_idx].update_aside(key, value)
            visible = torch.ones(x.shape[0], keys.shape[2], dtype=torch.bool, device=x.device)
        return kernels.layer_out(x, q, keys[0], values[0], visible, scaling, *args_out).unsqueeze(0)

    def _lossless_current_plan(self, draft: bool) -> tuple:
        """The AR (or draft-view) plan, made again when any weight it was made from has changed."""
        key_of = "_lossless_draft_plan" if draft else "_lossless_plan"
        plan = self.__dict__.get(key_of)
        if plan is None or not plan[0].current():
            plan = self.__dict__[key_of] = self._lossless_make_plan(draft=draft)
        return plan

    def _lossless_drafts_fused(self, draft, cache) -> bool:
        """Whether a draft-view forward runs as the two layer calls too: a decoding draft pass (no verify rows,
        no training layout: every row sees the whole cache and the block) over a cache that grows in place,
        with the draft view's projections and no draft adapter (its output joins the MLP's inside the kernel's
        reach only as its own module)."""
        return draft.verify_rows == 0 and draft.context_mask is None and self._lossless_view_fusable(draft, cache)

    def _lossless_view_fusable(self, draft, cache) -> bool:
        """Whether this layer's draft view can run on the kernels' layer code: decoding (no training layout or
        context of its own) over a cache that grows in place, with packed projections and no draft adapter. A
        fused forward (verify rows and draft groups) then runs on the layer stack."""
        idx = self._modules["self_attn"].layer_idx
        return (draft.context is None and draft.chunks is None and cache is not None
                and isinstance(cache.layers[idx], GrowingLayer) and cache.get_seq_length(idx) > 0
                and self._lossless_draft_fits())

    def _lossless_draft_fits(self) -> bool:
        """Whether the draft view's parts run on the layer kernels: packed projections, no draft adapter."""
        own = self._modules["self_attn"]._modules  # (submodules by dict: every layer of a draft forward asks)
        return self._modules["mlp"]._modules.get("mlp_diff") is None and \
            all(isinstance(own.get(f"{p}_proj_diff"), PackedLinearMixin) for p in "qkvo")

    def _lossless_make_plan(self, draft: bool = False) -> tuple:
        """(the weights it was made from with their versions, the draft adapter's row marker, layer index,
        attention scaling, layer_in's arguments after cos/sin, layer_out's after the visibility). `draft`: the
        draft view's plan (its q/k/v/o projections and q/k norms; the layer's norms and MLP)."""
        attn, mlp = self.self_attn, self.mlp
        view = "_diff" if draft else ""
        ins = tuple(getattr(attn, f"{p}_proj{view}") for p in "qkv")
        outs = (getattr(attn, f"o_proj{view}"), mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        q_norm, k_norm = getattr(attn, f"q_norm{view}", None), getattr(attn, f"k_norm{view}", None)
        first, second = self.input_layernorm, self.post_attention_layernorm
        modules = [*ins, *outs, first, second, *(n for n in (q_norm, k_norm) if n is not None)]
        held = [(self, "self_attn"), (self, "mlp"), (self, "input_layernorm"), (self, "post_attention_layernorm"),
                *((attn, f"{p}_proj{view}") for p in "qkvo"), (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj"),
                *((attn, f"{p}_norm{view}") for p, n in (("q", q_norm), ("k", k_norm)) if n is not None),
                *([(mlp, "mlp_diff")] if draft else [])]  # (the draft view's adapter: none, as `_lossless_draft_fits`)
        weights = [(m._parameters, name, t) for m in modules for name in ("weight", "bias")
                   if (t := m._parameters.get(name)) is not None]
        stamps = _Stamps([(parent._modules, name, parent._modules.get(name)) for parent, name in held] + weights)
        bias = lambda p: _NONE if p.bias is None else p.bias  # noqa: E731
        args_in = (first.weight, first.variance_epsilon, [p.packed() for p in ins], [bias(p) for p in ins],
                   [p.out_features for p in ins], _NONE if q_norm is None else q_norm.weight,
                   _NONE if k_norm is None else k_norm.weight, 0.0 if q_norm is None else q_norm.variance_epsilon,
                   attn.head_dim)
        args_out = ([p.packed() for p in outs], [bias(p) for p in outs], [p.out_features for p in outs],
                    second.weight, second.variance_epsilon)
        return (stamps, getattr(attn, "_orthrus_rows", None), attn.layer_idx, float(attn.scaling), args_in, args_out)


class FusedStackMixin:
    """A Llama/Qwen3 decoder stack (the backbone's `model`) whose layers are all `FusedLayerMixin`s: an AR forward
    over a growing cache, or a decoding draft pass, runs every layer in one kernel call (`kernels.Stack`: each
    layer's `layer_in`, its keys and values written where the cache update writes them, `layer_out`). The same
    calls in the same order as layer by layer, so the same bits and the same cache; what goes is the Python
    between the layers (about as long as the layers themselves on a small model). The kernel call runs
    without the interpreter lock. Anything the layers would not fuse, and a forward that needs gradients, runs
    the Hugging Face forward."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        hidden = self._lossless_stack_forward(input_ids, attention_mask, position_ids, cache, inputs_embeds, kwargs)
        if hidden is not None:
            from transformers.modeling_outputs import BaseModelOutputWithPast

            return BaseModelOutputWithPast(last_hidden_state=hidden[None], cache=cache)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)

    def lossless_hidden(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                        use_cache=None, **kwargs) -> torch.Tensor:
        """The forward's last hidden states [q, d] (one sequence): `self(...).last_hidden_state[0]`, without the
        module call and its output object where the stack runs it and nothing asks to see the forward (a forward
        hook on this module or on every module, or a `forward` of its own on this instance)."""
        if not (_watched(self) or _GLOBAL_HOOKS()):
            hidden = self._lossless_stack_forward(input_ids, attention_mask, position_ids, cache, inputs_embeds, kwargs)
            if hidden is not None:
                return hidden
        return self(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                    inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs).last_hidden_state[0]

    def _lossless_stack_forward(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, kwargs):
        """The forward's last hidden states [q, d] from one stack call, or None where it does not apply."""
        draft = kwargs.get("orthrus_draft")
        views = draft is not None and draft.verify_rows > 0  # a fused forward: verify rows, then draft groups
        if (cache is None or position_ids is None or kwargs.keys() - {"orthrus_draft"} or torch.is_grad_enabled()
                or _MODULES.get() or _STOCK.get() or (input_ids is None) == (inputs_embeds is None)
                or (draft is not None and not views and attention_mask is not None)
                or (attention_mask is not None and attention_mask.dim() != 4)
                or (views and draft.context_mask is not None and draft.context_mask.dim() != 4)):
            return None
        layers = self.layers
        if len(cache.layers) != len(layers) or (draft is not None and (  # a decoding draft (as `_lossless_view_fusable`)
                draft.context is not None or draft.chunks is not None or (not views and draft.context_mask is not None))):
            return None
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if embeds.shape[0] != 1 or position_ids.shape != (1, embeds.shape[1]) or (
                draft is not None and cache.get_seq_length() == 0):  # (a draft reads a cache)
            return None
        if views:  # the AR view's stack for the verify rows, the draft view's for the groups after them
            stacks = self._lossless_stack(False), self._lossless_stack(True, rows_from=draft.verify_rows)
        else:  # (a fused forward without draft rows is a verify pass)
            stacks = (self._lossless_stack(draft is not None),)
        if stacks[-1] is None:  # the draft view has parts the layer kernels do not run
            return None
        q = embeds.shape[1]
        v = draft.verify_rows if views else 0 if draft is not None else q  # the rows the cache keeps
        if v > q:
            return None
        device = embeds.device

        def visibility(n: int) -> torch.Tensor:
            if views:  # verify rows as a verify pass sees, then the groups under their mask (all: no mask)
                visible = torch.zeros(q, n + q, dtype=torch.bool, device=device)
                visible[:v, : n + v] = _visibility(draft.verify_mask, v, n + v, device)  # as the module path
                visible[v:] = _visibility(draft.context_mask, q - v, n + q, device, causal=False)
                return visible
            if draft is not None:  # the draft view: the cache and its own rows, all visible, the cache as it was
                return torch.ones(q, n + q, dtype=torch.bool, device=device)
            return _visibility(attention_mask, q, n + q, device)

        rotary = lambda: self.rotary_emb(embeds, position_ids=position_ids)  # noqa: E731
        return self._lossless_call(stacks, embeds[0], rotary, visibility, cache, v)

    def lossless_rows(self, cache, start: int, ids=None, embeds: torch.Tensor | None = None,
                      depth: list[int] | None = None, visible: torch.Tensor | None = None,
                      draft: bool = False) -> torch.Tensor | None:
        """A decode forward's last hidden states [q, d] from one stack call, without the module calls around it:
        token `ids` (a list, or a tensor of q ids) through the embedding, or `embeds` [q, d]; at positions
        start..start+q-1, or start + depth[i] (a tree's rows); the AR view, each row seeing the cache and the
        rows `visible` [q, cache + q] bool says (None: causal), its rows kept by the cache; or (`draft`) the draft
        view, every row seeing the cache and all rows, the cache left as it was. The same bits and the same cache
        as the module path with the matching position ids and mask (`self(...)`, what `lossless_hidden` runs).

        None where that path must run instead: something watches this module, its embedding, its rotary
        embedding or every module (a hook, or an instance `forward`), gradients are on, the module path is
        forced, or the stack does not apply to this forward."""
        embed, rotary = self.embed_tokens, self.rotary_emb
        if (cache is None or torch.is_grad_enabled() or _MODULES.get() or _STOCK.get() or (ids is None) == (embeds is None)
                or not isinstance(rotary, RotaryTableMixin) or _watched(self) or _watched(rotary)
                or (ids is not None and _watched(embed)) or _GLOBAL_HOOKS() or len(cache.layers) != len(self.layers)
                or (draft and (visible is not None or cache.get_seq_length() == 0))):  # (a draft reads a cache)
            return None
        stacks = (self._lossless_stack(draft),)
        if stacks[0] is None:
            return None
        if ids is not None:
            if isinstance(ids, torch.Tensor) and (ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1)):
                return None  # (a batch of sequences: the module path)
            ids = ids.reshape(-1) if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
            embeds = embed.forward(ids)
        q = embeds.shape[0]
        if embeds.dim() != 2 or q == 0 or (depth is not None and len(depth) != q):
            return None
        device = embeds.device

        def visibility(n: int) -> torch.Tensor:
            if draft:
                return torch.ones(q, n + q, dtype=torch.bool, device=device)
            if visible is None:
                return _visibility(None, q, n + q, device)
            return visible if visible.shape == (q, n + q) else _visibility(visible[None, None], q, n + q, device)

        return self._lossless_call(stacks, embeds, lambda: rotary.lossless_rows(start, q, depth, embeds), visibility,
                                   cache, 0 if draft else q)

    def _lossless_call(self, stacks: tuple, embeds: torch.Tensor, rotary, visibility, cache, v: int):
        """The stack call of a forward of rows `embeds` [q, d] (the first `v` kept by the cache; a fused forward's
        two stacks, its draft rows from v on): room for them in the cache, `rotary()`'s (cos, sin), the rows'
        `visibility(n)` after the cache's n positions; the cache's new length and key tiles after it. The last
        hidden states [q, d], or None where the cache holds no room the stack can write."""
        q, attn = embeds.shape[0], self.layers[0].self_attn
        like = lambda: embeds.new_empty(1, self.config.num_key_value_heads, 0, attn.head_dim)  # noqa: E731
        steps = (attn.head_dim + 1) // 2 if embeds.element_size() == 2 else attn.head_dim
        room = stack_room(cache.layers, q, like, steps)
        if room is None:
            return None
        n, buffers, tiles = room
        cos, sin = rotary()
        norm = _final_norm(self.norm, embeds)  # (the stack applies the final norm itself where nothing watches it)
        args = (embeds.contiguous(), cos.reshape(q, cos.shape[-1]).contiguous(), sin.reshape(q, sin.shape[-1]).contiguous(),
                visibility(n),
                buffers[0], buffers[1], tiles[0], tiles[1], n, *norm)
        if len(stacks) > 1 and v < q:
            hidden = stacks[0].forward_views(stacks[1], v, *args)
        else:
            hidden = stacks[0].forward(*args)
        stack_wrote(cache.layers, v, n + v)  # the tiles hold the cache's positions now (and draft rows past its end)
        return hidden if norm[0] is not None else self.norm(hidden)

    def _lossless_stack(self, draft: bool, rows_from: int = 0):
        """The kernel stack of every layer's AR (or draft-view) plan, made again when any weight a plan was made
        from has changed (every forward asks, but within `weights_fixed` only the first; the check runs over all
        layers' weights at once, in C), or None where the draft view has parts the kernels do not run. The
        layers' draft-row markers say where the forward's draft rows start, as the layer-by-layer path marks
        them: none (AR), or `rows_from`."""
        key = (draft, kernels.isa())
        held = self.__dict__.setdefault("_lossless_stacks", {}).get(key)
        checked = _FIXED.get()  # (the stacks checked since `weights_fixed` began)
        if held is None or not ((checked is not None and checked.get(key) is held) or held.current(self.layers)):
            if draft and not all(layer._lossless_draft_fits() for layer in self.layers):
                return None  # (a current stack's stamps hold the parts this asks about)
            plans = [layer._lossless_current_plan(draft) for layer in self.layers]
            held = self._lossless_stacks[key] = _HeldStack(list(self.layers), plans)
        if checked is not None:
            checked[key] = held
        held.mark_rows(rows_from if draft else None)
        return held.stack


def _final_norm(norm: torch.nn.Module, like: torch.Tensor) -> tuple[torch.Tensor | None, float]:
    """(weight, epsilon) of the backbone's final norm where the layer stack applies it itself (the bits of
    `kernels.rms_norm`, which the module computes): exact mode's RMSNorm, its call watched by nothing (no hook on
    it or on every module, no `forward` of its own on the instance), a weight of the rows' dtype and device; else
    (None, 0.0) and the module runs."""
    weight = getattr(norm, "weight", None)
    if (isinstance(norm, NormMixin) and not _watched(norm)
            and isinstance(weight, torch.Tensor) and weight.dtype == like.dtype and weight.device == like.device
            and weight.dim() == 1 and weight.is_contiguous() and not weight.is_meta and not _GLOBAL_HOOKS()):
        return weight, float(norm.variance_epsilon)
    return None, 0.0


def _watched(module: torch.nn.Module) -> bool:
    """Whether a call of `module` would run more than its class's `forward`: a hook, or a `forward` of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _GLOBAL_HOOKS() -> bool:
    """Whether forward hooks for every module are registered (`nn.modules.module.register_module_forward_hook`)."""
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


_VERSION = operator.attrgetter("_version")
_POINTER = torch.Tensor.data_ptr


class _Stamps:
    """What kernel arguments were made from: the objects in their places (a module or weight found under `name` in
    its parent's `_modules` or `_parameters`: another one put there, by assignment or by writing the dict as
    `torch.func.functional_call` does, is noticed), and the tensors that hold values (a released weight's meta
    placeholder holds none) with their version and data pointer (an in-place change moves the version, an
    assignment to `.data` the pointer). `current()` says whether all still hold."""

    def __init__(self, places: list[tuple[dict, str, object]]):
        self.places = places
        self.dicts, self.names, self.objects = [d for d, _, _ in places], [n for _, n, _ in places], \
            [o for _, _, o in places]
        self.tensors = [o for o in self.objects if isinstance(o, torch.Tensor) and not o.is_meta]
        self.versions, self.pointers = list(map(_VERSION, self.tensors)), list(map(_POINTER, self.tensors))

    def current(self) -> bool:
        return (all(map(operator.is_, map(dict.get, self.dicts, self.names), self.objects))
                and list(map(_VERSION, self.tensors)) == self.versions
                and list(map(_POINTER, self.tensors)) == self.pointers)


class _HeldStack:
    """A kernel stack made from every layer's plan, with what it was made from (the layers, and the plans' `_Stamps`)
    and the layers' draft-row markers."""

    def __init__(self, layers: list, plans: list[tuple]):
        self.stack = kernels.stack()
        for _, _, _, scaling, args_in, args_out in plans:
            self.stack.add(*args_in, scaling, *args_out)
        self.stamps = _Stamps([place for plan in plans for place in plan[0].places])  # (each plan current now)
        self.layers, self.rows = layers, [rows for _, rows, *_ in plans if rows is not None]

    def current(self, layers) -> bool:
        """Whether the stack's layers are still these, each with the modules and weights it was made from, and
        those unchanged."""
        return len(layers) == len(self.layers) and all(map(operator.is_, layers, self.layers)) and \
            self.stamps.current()

    def mark_rows(self, start: int | None) -> None:
        for rows in self.rows:
            rows.start = start


def _fusable(layer: torch.nn.Module) -> bool:
    """Whether `layer` is a decoder layer `FusedLayerMixin` computes exactly: a Llama or Qwen3 layer whose parts
    are all exact mode's (packed projections, the RMSNorm kernel, SiLU), full attention, no sliding window."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = {type(layer).__name__.removeprefix("FusedLayer")}
    if not names & {"LlamaDecoderLayer", "Qwen3DecoderLayer"} or attn is None or mlp is None:
        return False
    parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
            [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    qk = [getattr(attn, n) for n in ("q_norm", "k_norm") if getattr(attn, n, None) is not None]
    if qk and (len(qk) != 2 or qk[0].variance_epsilon != qk[1].variance_epsilon):
        return False  # the layer kernel takes one epsilon for both
    norms += qk
    return (all(isinstance(p, PackedLinearMixin) for p in parts) and all(isinstance(n, NormMixin) for n in norms)
            and isinstance(getattr(mlp, "act_fn", None), SiluMixin) and getattr(attn, "sliding_window", None) is None
            and isinstance(getattr(attn, "head_dim", None), int) and isinstance(getattr(attn, "layer_idx", None), int))


def _rotary_frequencies(rotary: torch.nn.Module, config) -> tuple[object, float]:
    """(inv_freq as fp32 numpy, attention scaling) of a static rotary embedding; refuses one that changes
    with the sequence length. The default RoPE's frequencies are recomputed correctly rounded (the same bits
    everywhere) and checked against the module's own; a scaled RoPE (linear, llama3, yarn) keeps the module's."""
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if "dynamic" in rope_type or rope_type == "longrope":
        raise LosslessError(f"exact mode does not support '{rope_type}' RoPE (its frequencies change with the "
                            f"sequence length); use --attn sdpa")
    own = rotary.inv_freq.detach().cpu()  # fp32, or rounded to the model's dtype when the model was cast
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if rope_type != "default":
        return own.float().numpy(), scaling
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    if base is not None:
        # the frequencies correctly rounded to fp32, then to the buffer's dtype as a cast would round them
        mine = torch.from_numpy(kernels.default_inv_freq(float(base), 2 * own.shape[0])).to(own.dtype)
        if torch.allclose(mine.float(), own.float(), rtol=3 * torch.finfo(own.dtype).eps, atol=0.0):
            return mine.float().numpy(), scaling
    raise LosslessError(f"exact mode could not rebuild this model's RoPE frequencies ({type(rotary).__name__}); "
                        f"use --attn sdpa")


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def _kernel_norm_matches(module: torch.nn.Module) -> bool:
    """Whether `module` computes what `kernels.rms_norm` computes, `weight * (x / sqrt(mean(x^2) + eps))`: an fp32
    copy of it against that formula in float64, on rows with a mean and a spread, to 1e-5 (fp32 rounding of a
    few operations; a LayerNorm or a (1 + weight) norm misses by far more)."""
    import copy

    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, weight.shape[0], generator=g) * 3 + 1
    w = weight.detach().double()
    want = w * (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps))
    with torch.no_grad():
        got = copy.deepcopy(module).float()(x).double()
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(w.abs().max()))


def _is_silu(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.SiLU, SiluMixin)) or type(module).__name__ == "SiLUActivation"


_COVERED = (PackedLinearMixin, NormMixin, SiluMixin, RotaryTableMixin, torch.nn.Embedding, torch.nn.Dropout,
            torch.nn.Identity, torch.nn.ModuleList)


def _refuse_sliding_window(backbone: torch.nn.Module) -> None:
    config = backbone.config
    types = set(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if types - {"full_attention"} or window or any(getattr(layer.self_attn, "sliding_window", None)
                                                     for layer in backbone.model.layers):
        raise LosslessError("exact mode does not support sliding-window attention (this model's config uses it); "
                            "use --attn sdpa")


def make_batch_invariant(backbone: torch.nn.Module) -> list[str]:
    """Install exact mode on a backbone in place: the "exact" attention kernel and the kernels of `kernels.py`
    for every linear layer, RMSNorm and SiLU, and the rotary table. A module of any other kind is refused by
    name (nothing runs stock in silence). Idempotent: run it again after adding modules (a draft adapter).
    Returns what was replaced, e.g. "linear 576->192 x60 (fixed-order kernel)", and the kernel variant."""
    kernels.ops()  # build (or load) the kernels now: a missing compiler is an error before any work
    _refuse_sliding_window(backbone)
    rotary = getattr(backbone.model, "rotary_emb", None)
    if rotary is not None and not isinstance(rotary, RotaryTableMixin):
        rotary._lossless_inv_freq, rotary._lossless_scaling = _rotary_frequencies(rotary, backbone.config)
        rotary._lossless_positions = int(getattr(backbone.config, "max_position_embeddings", 4096))
    for name, module in backbone.named_modules():
        if _is_norm(module) and not isinstance(module, NormMixin) and not _kernel_norm_matches(module):
            raise LosslessError(f"exact mode has no kernel for the norm {name} ({type(module).__name__}: not a "
                                f"Llama/Qwen RMSNorm); use --attn sdpa")
        if name.endswith("act_fn") and not _is_silu(module):
            raise LosslessError(f"exact mode has no kernel for the activation {name} ({type(module).__name__}); "
                                f"use --attn sdpa")
    register_exact()
    backbone.set_attn_implementation(EXACT)
    linears: dict[tuple[int, int], int] = {}
    counts: dict[str, int] = {}
    structure = {id(backbone), id(backbone.model)}
    for layer in backbone.model.layers:
        structure |= {id(layer), id(layer.self_attn), id(layer.mlp)}
    for name, module in backbone.named_modules():
        if isinstance(module, torch.nn.Linear):
            swap_class(module, PackedLinearMixin)
            linears[(module.in_features, module.out_features)] = linears.get((module.in_features, module.out_features), 0) + 1
            continue
        mixin, how = ((NormMixin, "fixed-order kernel") if _is_norm(module) else
                      (SiluMixin, "fixed-order kernel") if _is_silu(module) else
                      (RotaryTableMixin, "table of every position") if module is rotary else (None, ""))
        if mixin is not None:
            label = f"{type(module).__name__.removeprefix(mixin.__name__.removesuffix('Mixin'))} x{{}} ({how})"
            counts[label] = counts.get(label, 0) + 1
            swap_class(module, mixin)
        elif id(module) not in structure and not isinstance(module, _COVERED) and type(module).__name__ != "DraftAdapter":
            raise LosslessError(f"exact mode has no kernel for {name} ({type(module).__name__}); use --attn sdpa")
    release_frozen_weights(backbone)
    fused = 0
    for layer in backbone.model.layers:
        if _fusable(layer):
            swap_class(layer, FusedLayerMixin)
            fused += 1
    stacked = bool(fused) and fused == len(backbone.model.layers) and hasattr(backbone.model, "embed_tokens") \
        and hasattr(backbone.model, "norm")
    if stacked:
        swap_class(backbone.model, FusedStackMixin)
    how = "one call per forward" if stacked else "two calls per AR forward"
    return ["attention", *(f"linear {i}->{o} x{n} (fixed-order kernel)" for (i, o), n in sorted(linears.items())),
            *([f"decoder layer x{fused} ({how})"] if fused else []),
            *(label.format(n) for label, n in sorted(counts.items())), f"kernels {kernels.isa()}"]


def release_frozen_weights(backbone: torch.nn.Module) -> int:
    """Keep every frozen linear weight as its panels only: exact mode then holds one copy of those weights, not
    two. A weight no other module shares goes at once; one shared with an embedding alone (a tied LM head) goes
    too, the embedding then gathering its rows from the same panels (`PanelRowsMixin`). Returns how many
    weights it released."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in backbone.modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(module)
    released, mapped = 0, _file_mappings()
    for module in backbone.modules():
        if isinstance(module, PackedLinearMixin) and not module.released():
            w = module.weight
            others = [m for m in holders.get(id(w), []) if m is not module]
            tied = [m for m in others if _gathers_rows(m, module)]
            if w.requires_grad or w.device.type != "cpu" or len(tied) != len(others) or len(others) > 1:
                continue
            start, end = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
            if any(a <= start and end <= b for a, b in mapped) and not module.packed_now():
                # read from a mapped checkpoint: its pages go as packing passes them, so the weight and its panels
                # are never both whole in memory (an LM head of 150,000 tokens would hold 300 MB twice)
                row = w.shape[1] * w.element_size()
                module.pack(lambda r0, r1: _drop_file_pages(start + r0 * row, start + r1 * row, mapped))
            module.release_weight()
            for embedding in tied:
                swap_class(embedding, PanelRowsMixin)
                embedding.__dict__["_lossless_rows_of"] = module  # not a submodule: no second owner of it
                embedding.weight = module.weight  # the meta placeholder
            _drop_file_pages(start, end, mapped)
            _return_freed_memory()  # each time: glibc would keep the packing's freed chunks, and the peak grows
            released += 1
    return released


def _gathers_rows(module: torch.nn.Module, linear: torch.nn.Module) -> bool:
    """Whether `module` is a plain embedding of `linear`'s weight, whose lookup a gather from the panels gives
    exactly (no max_norm renormalising rows in place)."""
    return (type(module) is torch.nn.Embedding and module.max_norm is None  # a subclass may have its own forward
            and module.weight.shape == (linear.out_features, linear.in_features))


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files (a checkpoint loaded without a copy is one), from
    /proc/self/maps; none where there is no such file."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/") and "x" not in fields[1]:
                    start, end = (int(a, 16) for a in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        pass
    return ranges


def _drop_file_pages(start: int, end: int, mapped: list[tuple[int, int]]) -> None:
    """A released weight read straight from a memory-mapped checkpoint: the process's pages of it go
    (MADV_DONTNEED; the whole pages inside it only, so no neighbour is touched). Nothing reads them again, and
    the file still holds the same bytes. Freeing the tensor alone would not do it: the other tensors of the
    checkpoint keep the mapping, and with it every page that packing read."""
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    libc = _libc()
    if libc is None or last <= first or not any(a <= start and end <= b for a, b in mapped):
        return
    try:
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)
    except AttributeError:
        pass


def _return_freed_memory() -> None:
    """Hand the heap pages the released weights occupied back to the system (glibc keeps freed chunks of the
    middle of its heap otherwise, so the resident set would not shrink). Nothing where the C library has no
    `malloc_trim`."""
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:
        pass


@functools.cache
def _libc():
    """The C library, loaded once (finding it runs a subprocess), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def check_device(device) -> None:
    """Exact mode's kernels are verified on the CPU only; refuse any other device (written once here)."""
    if torch.device(device).type != "cpu":
        raise LosslessError("attn=exact has only a CPU kernel so far; use --device cpu or --attn sdpa")
