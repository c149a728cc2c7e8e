"""The numerics probe: where does a block forward stop being bitwise equal to one-token-at-a-time?

The same k tokens after a shared prefix are run (a) as one block, as Orthrus's verify pass does, and
(b) one token per forward, as AR decoding does. Forward hooks record every sub-module's output in
execution order - per layer: input norm, q/k/v projections, q/k norms, rotary (the attention inputs),
attention core, o projection, post-attention norm, MLP projections - then the final norm and LM head.
For each op the report gives how many elements differ and the largest difference, and names the first
op that differs. Linear layers are also measured *in isolation* (the block's own inputs through the
layer as k rows vs one row at a time), which separates an op's own batch dependence from differences
it merely propagates.

This module does not change the model; it only observes it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..errors import LosslessError
from ..decoding.model import OrthrusLM
from ..decoding.exact import layer_modules


@dataclass
class OpDiff:
    name: str
    numel: int
    n_diff: int
    max_abs_diff: float
    isolated_n_diff: int | None = None  # linear layers: differences of the op on identical inputs

    def to_dict(self) -> dict:
        return self.__dict__.copy()


@dataclass
class ProbeResult:
    dtype: str
    attn: str
    k: int
    prefix_tokens: int
    ops: list[OpDiff] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # what exact mode replaced on this model

    @property
    def first_diff(self) -> OpDiff | None:
        return next((op for op in self.ops if op.n_diff), None)

    @property
    def first_isolated_diff(self) -> OpDiff | None:
        return next((op for op in self.ops if op.isolated_n_diff), None)

    def to_dict(self) -> dict:
        first = self.first_diff
        iso = self.first_isolated_diff
        return {"dtype": self.dtype, "attn": self.attn, "k": self.k, "prefix_tokens": self.prefix_tokens,
                "replaced_ops": self.replaced,
                "first_differing_op": first.name if first else None,
                "first_op_differing_in_isolation": iso.name if iso else None,
                "ops": [op.to_dict() for op in self.ops]}


def _op_modules(model: OrthrusLM) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) for every observed op, in execution order."""
    out = []
    inner = model.backbone.model
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        out.append((f"layer{i}.input_norm", layer.input_layernorm))
        for name in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
            if getattr(attn, name, None) is not None:
                out.append((f"layer{i}.{name}", getattr(attn, name)))
        out.append((f"layer{i}.rotary_q", ("rotary_q", i)))
        out.append((f"layer{i}.rotary_k", ("rotary_k", i)))
        out.append((f"layer{i}.attention_core", ("core", i)))
        out.append((f"layer{i}.o_proj", attn.o_proj))
        out.append((f"layer{i}.post_attention_norm", layer.post_attention_layernorm))
        for name in ("gate_proj", "up_proj", "down_proj"):
            if getattr(layer.mlp, name, None) is not None:
                out.append((f"layer{i}.mlp.{name}", getattr(layer.mlp, name)))
    out.append(("final_norm", inner.norm))
    out.append(("lm_head", model.backbone.lm_head))
    return out


class _Recorder:
    """Collects op outputs (and linear inputs) of one phase; rows are along the sequence axis."""

    def __init__(self):
        self.out: dict[str, list[torch.Tensor]] = {}
        self.inp: dict[str, list[torch.Tensor]] = {}

    def add(self, name, tensor, seq_dim=1):
        self.out.setdefault(name, []).append(tensor.detach().movedim(seq_dim, 1).float().clone())

    def rows(self, name) -> torch.Tensor:
        return torch.cat(self.out[name], dim=1)


@contextlib.contextmanager
def _observe(model: OrthrusLM, recorder_ref: list):
    """Hooks on every op; the attention core and rotary via a wrapped attention function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    handles = []
    layer_of = {}
    for name, mod in _op_modules(model):
        if isinstance(mod, tuple):
            continue

        def hook(module, args, output, name=name):
            rec = recorder_ref[0]
            out = output[0] if isinstance(output, tuple) else output
            rec.add(name, out)
            if isinstance(module, torch.nn.Linear):
                rec.inp.setdefault(name, []).append(args[0].detach().clone())

        handles.append(mod.register_forward_hook(hook))
    for i, layer in enumerate(model.backbone.model.layers):
        layer_of[id(layer.self_attn)] = i
    impl = model.config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS[impl]

    def wrapped(module, query, key, value, attention_mask, **kwargs):
        rec, i = recorder_ref[0], layer_of.get(id(module))
        out = original(module, query, key, value, attention_mask, **kwargs)
        if i is not None:
            q = query.shape[2]
            rec.add(f"layer{i}.rotary_q", query, seq_dim=2)
            rec.add(f"layer{i}.rotary_k", key[:, :, -q:], seq_dim=2)
            rec.add(f"layer{i}.attention_core", out[0])
        return out

    ALL_ATTENTION_FUNCTIONS[impl] = wrapped
    try:
        with layer_modules():  # exact mode's fused decoder layers run op by op, so every hook sees its op
            yield
    finally:
        ALL_ATTENTION_FUNCTIONS[impl] = original
        for h in handles:
            h.remove()


@torch.no_grad()
def probe(model: OrthrusLM, ids: list[int], k: int = 8) -> ProbeResult:
    """Compare the last k of `ids` as one block vs one at a time, after the shared prefix ids[:-k]."""
    if k < 2:
        raise LosslessError("--k must be >= 2 to compare a block with single tokens")
    if len(ids) < k + 1:
        raise LosslessError(f"the text has {len(ids)} tokens; the probe needs at least k + 1 = {k + 1}")
    if len(ids) > model.max_positions:  # past the context the positions are extrapolated: not the model's numerics
        raise LosslessError(f"the text has {len(ids)} tokens, more than the model's context of {model.max_positions}: "
                            "shorten it")
    prefix, block = ids[:-k], ids[-k:]
    ref: list = [None]
    block_rec, single_rec = _Recorder(), _Recorder()
    with _observe(model, ref):
        ref[0] = _Recorder()  # prefill: observed but discarded
        cache, _ = model.prefill(prefix)
        ref[0] = block_rec
        model.verify(cache, block)
        ref[0] = _Recorder()
        cache, _ = model.prefill(prefix)
        ref[0] = single_rec
        for tok in block:
            model.step(cache, tok)
    result = ProbeResult(dtype=model.dtype_name, attn=model.attn, k=k, prefix_tokens=len(prefix),
                         replaced=list(getattr(model, "exact_ops", [])))
    modules = dict(_op_modules(model))
    for name, mod in _op_modules(model):
        a, b = block_rec.rows(name), single_rec.rows(name)
        diff = (a - b).abs()
        op = OpDiff(name, a.numel(), int((a != b).sum()), float(diff.max()) if diff.numel() else 0.0)
        if isinstance(modules[name], torch.nn.Linear) and name in block_rec.inp:
            x = block_rec.inp[name][0]  # [1, k, in]
            together = modules[name](x)
            alone = [modules[name](x[:, j:j + 1]) for j in range(x.shape[1])]
            op.isolated_n_diff = int((together != torch.cat(alone, dim=1)).sum())
        result.ops.append(op)
    return result


def format_table(result: ProbeResult, only_differing: bool = False) -> str:
    lines = [f"probe: dtype={result.dtype} attn={result.attn} k={result.k} prefix={result.prefix_tokens} tokens"
             + (f" | exact mode replaced: {', '.join(result.replaced)}" if result.replaced else ""),
             f"{'op':<30}{'differing':>16}{'max |diff|':>14}{'isolated':>10}"]
    for op in result.ops:
        if only_differing and not op.n_diff and not op.isolated_n_diff:
            continue
        iso = "-" if op.isolated_n_diff is None else str(op.isolated_n_diff)
        lines.append(f"{op.name:<30}{f'{op.n_diff}/{op.numel}':>16}{op.max_abs_diff:>14.3g}{iso:>10}")
    first, iso = result.first_diff, result.first_isolated_diff
    if first is None:
        lines.append("no op differs: the block pass is bitwise equal to one-token-at-a-time decoding")
    else:
        lines.append(f"first op that differs: {first.name} ({first.n_diff} of {first.numel} elements, "
                     f"max |diff| {first.max_abs_diff:.3g})")
        lines.append("first op that differs on identical inputs (isolated linears): "
                     + (iso.name if iso else "none - linear layers are batch-invariant here"))
    return "\n".join(lines)
