"""The dual-view attention: a second, trainable set of attention projections on a frozen backbone.

Every decoder layer's attention module gets `q_proj_diff`, `k_proj_diff`, `v_proj_diff`, `o_proj_diff`
(and `q_norm_diff`, `k_norm_diff` where the backbone has per-head q/k norms). The module's class is
swapped for a subclass of the backbone's own attention class that adds one branch: when called with
`orthrus_draft=DraftSpec(...)` it runs the *draft view* — block queries/keys/values from the diff
projections, attending to the cached AR keys/values (read, never written) and bidirectionally to the
block itself. Without that keyword the backbone's forward runs unchanged, so the AR view is exactly
the Hugging Face model.

A head may also carry a draft adapter (`set_draft_adapter`): a small low-rank MLP per layer, `mlp_diff`,
whose output is added to the backbone MLP's on draft rows only (one layer's attention tells its MLP which
rows of the forward are draft rows), so the draft view gains capacity while the AR view stays the backbone.

This module owns the attention branch and the installation of diff parameters. It does not know about
decoding loops, head files or training objectives.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import LosslessError
from ..names import EXACT
from .exact import exact_attention
from .mixins import swap_class

DIFF_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
DIFF_NORM = ("q_norm", "k_norm")
# `model_type`s whose decoder the dual view is built and tested on (SmolLM2 is a Llama; the Orthrus
# authors' checkpoints are Qwen3 with draft weights)
SUPPORTED_FAMILIES = ("llama", "qwen3")
# attention implementations whose draft view calls torch's SDPA itself, with grouped-query attention in the
# kernel (on CPU, where a mask does not push SDPA off its fast kernels)
GQA_IN_KERNEL = ("sdpa",)


def check_family(model_type: str | None, where: str = "") -> None:
    """Refuse a backbone family the dual view is not built for, naming the supported ones."""
    if model_type not in SUPPORTED_FAMILIES:
        raise LosslessError(f"{where + ': ' if where else ''}model type '{model_type}' is not supported; "
                            f"supported families: {', '.join(SUPPORTED_FAMILIES)} (and Orthrus checkpoints)")


@dataclass
class DraftSpec:
    """How the draft view of one forward pass sees the cache.

    `context_mask` is None at inference: every cached position and every block position is visible.
    In training it is an additive float mask `[1, 1, q, n_ctx + q]` (0 = visible, -inf = hidden) that
    lets each block see AR keys strictly before its anchor and its own block bidirectionally (or the same
    layout in `chunks` of blocks, which training uses by default).
    `context` optionally replaces the cache as the source of AR keys/values: a list over layers of
    `(keys, values)`, each `[b, kv_heads, n_ctx, head_dim]`.
    """

    context_mask: torch.Tensor | None = None
    context: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # Fused forwards (one forward verifies a block and drafts the next): the first `verify_rows` rows are
    # the AR view (causal under `verify_mask` [1, 1, v, n_cache + v], written to the cache), the rest
    # are draft rows that see the cache *after* the verify rows were written, under `context_mask`.
    verify_rows: int = 0
    verify_mask: torch.Tensor | None = None
    # Training's layout in chunks of blocks (`chunked_block_masks`), in place of one `context_mask` over all
    # rows: chunk (start, end, n_ctx, mask) is rows start..end-1, which see the first n_ctx context keys and
    # their own rows under mask [1, 1, end - start, n_ctx + end - start]. The same attention, without
    # scoring every row against other blocks' keys and context keys that no row of the chunk sees.
    chunks: list[tuple[int, int, int, torch.Tensor]] | None = None


def block_visibility(anchors: list[int], k: int, n_ctx: int) -> torch.Tensor:
    """The draft view's mask, in training and in fused decoding alike: visibility [n*k, n_ctx + n*k]
    (True = may attend) for blocks of k rows at absolute positions `anchors` over n_ctx AR keys. Block b
    sees AR keys j < anchors[b] and all k positions of its own block."""
    n = len(anchors)
    visible = torch.zeros(n * k, n_ctx + n * k, dtype=torch.bool)
    for b, a in enumerate(anchors):
        rows = slice(b * k, (b + 1) * k)
        visible[rows, :a] = True
        visible[rows, n_ctx + b * k: n_ctx + (b + 1) * k] = True
    return visible


def chunked_block_masks(anchors: list[int], k: int, blocks: int, dtype: torch.dtype,
                        device: torch.device | str = "cpu") -> list[tuple[int, int, int, torch.Tensor]]:
    """`block_visibility`'s layout as `DraftSpec.chunks` of up to `blocks` blocks each (sorted anchors keep
    each chunk's context short): per chunk (first row, end row, context keys it needs, additive mask)."""
    if blocks < 1:
        raise LosslessError(f"blocks per attention chunk must be >= 1, got {blocks}")
    chunks = []
    for first in range(0, len(anchors), blocks):
        group = anchors[first: first + blocks]
        n_ctx = max(group)  # a block sees AR keys strictly before its anchor
        mask = additive_mask(block_visibility(group, k, n_ctx), dtype).to(device)
        chunks.append((first * k, (first + len(group)) * k, n_ctx, mask))
    return chunks


def tree_visibility(parents: list[int], n_ctx: int) -> tuple[torch.Tensor, list[int]]:
    """The AR view's mask over a token tree after n_ctx cached keys, for verifying candidate trees and the
    fused cycle's verify rows (a chain: parents [-1, 0, 1, ...], i.e. causal): visibility [n, n_ctx + n]
    (row i sees every cached key, its ancestors and itself) and each row's depth (row 0, the root, is 0;
    row i > 0 sits one position after its parent parents[i] < i)."""
    n = len(parents)
    depth, seen = [0] * n, [1 << i for i in range(n)]  # seen[i]: bit j set where row i sees row j
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        seen[i] |= seen[parents[i]]
    visible = torch.ones(n, n_ctx + n, dtype=torch.bool)
    visible[:, n_ctx:] = torch.tensor([[(bits >> j) & 1 for j in range(n)] for bits in seen], dtype=torch.bool)
    return visible, depth


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [q, kv] -> additive float mask [1, 1, q, kv] (0 where visible, dtype-min elsewhere)."""
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


class _ViewRows:
    """Where one layer's current forward starts its draft rows (None: no draft rows, the AR view alone). The
    layer's attention sets it on every call and its MLP, which runs next, reads it."""

    __slots__ = ("start",)

    def __init__(self):
        self.start: int | None = None


class DraftAdapter(nn.Module):
    """The draft view's MLP adapter of one layer: x -> up(silu(down(x))), rank `rank`. `up` starts at zero,
    so a new adapter leaves a head's drafts as they were."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        self.act = nn.SiLU()  # a module, so exact mode can put it on its kernel
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.act(self.down(x)))


class DualViewMLPMixin:
    """Adds the draft adapter's output to a backbone MLP's on the draft rows of a forward; AR rows (and AR
    forwards) get the parent's output untouched."""

    def forward(self, x):
        out = super().forward(x)
        start, adapter = self._orthrus_rows.start, getattr(self, "mlp_diff", None)
        if start is None or adapter is None or start >= x.shape[1]:
            return out
        if start == 0:
            return out + adapter(x)
        return torch.cat([out[:, :start], out[:, start:] + adapter(x[:, start:])], dim=1)


class DualViewAttentionMixin:
    """Adds the draft view to a backbone attention class; the AR view is the parent's forward."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        draft = kwargs.pop("orthrus_draft", None)
        rows = getattr(self, "_orthrus_rows", None)
        if rows is not None:
            rows.start = None if draft is None else draft.verify_rows
        if draft is None:
            return super().forward(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                cache=cache,
                **kwargs,
            )
        if draft.verify_rows:
            return self._fused_forward(hidden_states, position_embeddings, cache, draft, kwargs)
        return self._draft_forward(hidden_states, position_embeddings, cache, draft)

    def _fused_forward(self, hidden_states, position_embeddings, cache, draft: DraftSpec, kwargs):
        """Verify rows through the AR view (appending to the cache), then draft rows through the draft view
        over the grown cache: one forward, two views, outputs in input row order."""
        v = draft.verify_rows
        cos, sin = position_embeddings
        # rows as [1, q, d] tensors of their own strides: a slice keeps the parent's batch stride, which makes
        # every projection a batched matmul that copies its weight
        verify, rest = hidden_states[0, :v].unsqueeze(0), hidden_states[0, v:].unsqueeze(0)
        verified, _ = super().forward(verify, position_embeddings=(cos[:, :v], sin[:, :v]),
                                      attention_mask=draft.verify_mask, cache=cache, **kwargs)
        if rest.shape[1] == 0:  # no draft rows (block size 1)
            return verified, None
        drafted, _ = self._draft_forward(rest, (cos[:, v:], sin[:, v:]), cache, draft)
        return torch.cat([verified, drafted], dim=1), None

    def _project_diff(self, hidden_states: torch.Tensor, name: str) -> torch.Tensor:
        """[b, q, d] -> [b, heads, q, head_dim] through the diff projection (and diff norm if any)."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        states = getattr(self, f"{name}_proj_diff")(hidden_states).view(shape)
        norm = getattr(self, f"{name}_norm_diff", None)
        if norm is not None:
            states = norm(states)
        return states.transpose(1, 2)

    def _draft_forward(self, hidden_states, position_embeddings, cache, draft: DraftSpec):
        query = self._project_diff(hidden_states, "q")
        key = self._project_diff(hidden_states, "k")
        value = self._project_diff(hidden_states, "v")
        cos, sin = position_embeddings
        query, key = self._orthrus_rotary(query, key, cos, sin)

        # Context: the AR view's keys/values of committed tokens. Read only; the draft never writes.
        if draft.context is not None:
            ctx_k, ctx_v = draft.context[self.layer_idx]
        elif cache is not None and cache.get_seq_length(self.layer_idx) > 0:
            layer = cache.layers[self.layer_idx]
            ctx_k, ctx_v = layer.keys, layer.values
        else:
            ctx_k = ctx_v = None
        if draft.chunks is not None:
            ctx_k = ctx_k.to(key.dtype) if ctx_k is not None else key[:, :, :0]
            ctx_v = ctx_v.to(value.dtype) if ctx_v is not None else value[:, :, :0]
            out = torch.cat([self._attend(query[:, :, start:end],
                                          torch.cat([ctx_k[:, :, :n_ctx], key[:, :, start:end]], dim=2),
                                          torch.cat([ctx_v[:, :, :n_ctx], value[:, :, start:end]], dim=2), mask)
                             for start, end, n_ctx, mask in draft.chunks], dim=1)
        else:
            if ctx_k is not None:
                key = torch.cat([ctx_k.to(key.dtype), key], dim=2)
                value = torch.cat([ctx_v.to(value.dtype), value], dim=2)
            out = self._attend(query, key, value, draft.context_mask)
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj_diff(out), None

    def _attend(self, query, key, value, mask):
        """Draft-view attention: query [b, h, q, d] over key/value [b, kv, n, d] under an additive mask (or
        none: all visible) -> [b, q, h, d]."""
        if mask is not None:
            mask = mask.to(query.dtype)
        impl = self.config._attn_implementation
        if impl == EXACT:
            # the fixed-order kernel, as the AR view's passes (the stock path only where `exact_attention`
            # takes it: autograd, `stock_kernels()`); no mask: every key visible
            return exact_attention(self, query, key, value, mask, scaling=self.scaling, is_causal=False)[0]
        if impl in GQA_IN_KERNEL and query.device.type == "cpu":
            # grouped-query attention inside the kernel: with a mask, the stock SDPA path first copies the
            # keys/values to every query head (training steps 4.5% faster without that copy, same results)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=True).transpose(1, 2)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(impl, _eager_attention)
        return attention(self, query, key, value, mask, dropout=0.0, scaling=self.scaling, is_causal=False)[0]


def _eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain softmax attention with GQA; used only if the backbone names no registered kernel."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _dual_view_namespace(base: type) -> dict:
    """What `DualView<Base>` adds to a backbone attention class: its module's own rotary function."""
    rotary = getattr(inspect.getmodule(base), "apply_rotary_pos_emb", None)
    if rotary is None:
        raise LosslessError(f"{base.__name__}: its module defines no apply_rotary_pos_emb; backbone unsupported")
    return {"_orthrus_rotary": staticmethod(rotary)}


def attention_modules(backbone: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    layers = getattr(getattr(backbone, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        check_family(getattr(getattr(backbone, "config", None), "model_type", None), type(backbone).__name__)
        raise LosslessError(f"{type(backbone).__name__}: no decoder layers with self_attn; backbone unsupported")
    return [layer.self_attn for layer in layers]


def install_dual_view(backbone: nn.Module) -> None:
    """Add diff parameters (copies of the AR ones) to every attention module, in place.

    The backbone's own parameters are untouched and frozen; the diff parameters require grad.
    """
    check_family(getattr(backbone.config, "model_type", None), type(backbone).__name__)
    for p in backbone.parameters():
        p.requires_grad_(False)
    for attn in attention_modules(backbone):
        if isinstance(attn, DualViewAttentionMixin):
            continue
        swap_class(attn, DualViewAttentionMixin, f"DualView{type(attn).__name__}", _dual_view_namespace(type(attn)))
        attn._orthrus_rows = _ViewRows()
        for name in DIFF_PROJ + DIFF_NORM:
            source = getattr(attn, name, None)
            if source is None:
                continue
            diff = copy.deepcopy(source)
            for p in diff.parameters():
                p.requires_grad_(True)
            setattr(attn, f"{name}_diff", diff)


def set_draft_adapter(backbone: nn.Module, rank: int) -> None:
    """Give every layer a fresh draft adapter of `rank` (its output starts at zero), or none (rank 0)."""
    if rank < 0:
        raise LosslessError(f"a draft adapter's rank must be >= 0, got {rank}")
    hidden = backbone.config.hidden_size
    for layer, attn in zip(backbone.model.layers, attention_modules(backbone)):
        mlp = layer.mlp
        if rank == 0:
            if getattr(mlp, "mlp_diff", None) is not None:
                del mlp.mlp_diff
            continue
        weight = next(mlp.parameters())
        swap_class(mlp, DualViewMLPMixin, f"DualView{type(mlp).__name__}")
        mlp._orthrus_rows = attn._orthrus_rows
        mlp.mlp_diff = DraftAdapter(hidden, rank).to(device=weight.device, dtype=weight.dtype)


@contextlib.contextmanager
def draft_adapters_restored_on_error(backbone: nn.Module):
    """If the block raises, every layer gets back the draft adapter (or none) it had when the block began."""
    before = [getattr(layer.mlp, "mlp_diff", None) for layer in backbone.model.layers]
    try:
        yield
    except BaseException:
        for layer, adapter in zip(backbone.model.layers, before):
            if adapter is not None:
                layer.mlp.mlp_diff = adapter
            elif getattr(layer.mlp, "mlp_diff", None) is not None:
                del layer.mlp.mlp_diff
        raise


def draft_adapter_rank(backbone: nn.Module) -> int:
    """The rank of the backbone's draft adapters (0: none)."""
    adapter = getattr(backbone.model.layers[0].mlp, "mlp_diff", None)
    return 0 if adapter is None else adapter.down.out_features


def diff_parameters(backbone: nn.Module) -> dict[str, nn.Parameter]:
    """Draft-head parameters by head-file name: `layers.{i}.{q,k,v,o}_proj_diff.weight`, ..., and with a
    draft adapter `layers.{i}.mlp_diff.{down,up}.weight`."""
    params: dict[str, nn.Parameter] = {}
    for i, attn in enumerate(attention_modules(backbone)):
        for name in DIFF_PROJ + DIFF_NORM:
            module = getattr(attn, f"{name}_diff", None)
            if module is None:
                continue
            for pname, p in module.named_parameters():
                params[f"layers.{i}.{name}_diff.{pname}"] = p
        adapter = getattr(backbone.model.layers[i].mlp, "mlp_diff", None)
        for pname, p in (adapter.named_parameters() if adapter is not None else ()):
            params[f"layers.{i}.mlp_diff.{pname}"] = p
    return params


def backbone_parameters(backbone: nn.Module) -> dict[str, nn.Parameter]:
    """The frozen AR parameters (everything that is not a diff parameter)."""
    return {n: p for n, p in backbone.named_parameters() if "_diff." not in n}


def diff_reference_parameters(backbone: nn.Module) -> dict[str, torch.Tensor]:
    """For each diff parameter name, the AR parameter it was copied from (same key as diff_parameters); zeros
    for a draft adapter's weights, which copy nothing."""
    refs: dict[str, nn.Parameter] = {}
    for i, attn in enumerate(attention_modules(backbone)):
        for name in DIFF_PROJ + DIFF_NORM:
            module = getattr(attn, name, None)
            if module is None or getattr(attn, f"{name}_diff", None) is None:
                continue
            for pname, p in module.named_parameters():
                # exact mode's linear layers give their weight as a tensor even where it lives as panels only
                refs[f"layers.{i}.{name}_diff.{pname}"] = (module.stock_weight() if pname == "weight"
                                                           and hasattr(module, "stock_weight") else p)
        adapter = getattr(backbone.model.layers[i].mlp, "mlp_diff", None)
        for pname, p in (adapter.named_parameters() if adapter is not None else ()):
            refs[f"layers.{i}.mlp_diff.{pname}"] = torch.zeros_like(p)  # stored as int8 over zero
    return refs
