"""The cost model behind the cycles: what one forward costs as its rows grow, and where its time goes.

At a fixed cache length it times, alternating in one process (medians over rounds), on each kernel of
`--attn` (e.g. `sdpa,exact`: stock kernels and exact mode's side by side):
- AR forwards of 1, 2, 4, 8, 9, 16, 17 and 32 rows (a decode step and verify blocks; 9 rows is the chain's
  verify at k=8, 17 a lookup of 16 tokens),
- a tree verify (the 8-node tree of the chain's shape plus a 4-token branch: 13 rows),
- the two-pass draft pass (k rows of the draft view; in exact mode also module by module, unfused),
- fused forwards `verify_and_draft` for each `--fused k:groups` setting (k verify rows plus `groups`
  draft groups of k rows),
and the memory floor: one read of every byte of the linear weights a decode step reads (exact mode's packed panels where a
kernel has them), at 1 and 2 threads and at the run's thread count, timed in the same rounds, so every forward
is also a multiple of the floor at the run's threads; in bf16 on the dot-product instruction also the compute
floor: what a forward's products alone cost at the instruction's own rate on this core (measured, 24 chains). It profiles a decode step and a 9-row verify by op family
(linear layers, LM head, attention, norms and activations, exact mode's fused decoder layers, the rest; exact
mode's kernels are counted under the family they replace; its step and verify also module by module, the
decoder layers unfused, for the split inside them) and the fused forward of the first setting (its draft groups' LM head call included).
Each forward's row says which kernels ran it (`variant`: stock; or exact mode's variant and, in bf16, whether
its matrix products ran on AMX tiles, as dot products or as widened fmas).

Bigger models, by simulation: `--model random:qwen3-0.6b` (or `random:llama-3.2-1b`, `random:qwen3-1.7b`) times a
backbone of that model's shapes (hidden size, layers, heads, kv heads, head dim, MLP width, vocabulary, tied embeddings) with random
weights (seeded), which costs what the real model costs: a forward's time depends on the shapes only. With
`--tokens-per-cycle T` (tokens a cycle commits, measured on the real model by `speed.py`) it also prints the
speed-up over AR that the cycle would give at these costs: T x step / (draft pass + verify), for the chain
(9-row verify) and for the tree with lookup (13 rows). The last stdout line is one JSON object.

    python benchmarks/forward_cost.py --dtype bf16 --cache 200 --attn sdpa,exact --fused 3:3,4:2
    python benchmarks/forward_cost.py --model random:qwen3-0.6b --attn sdpa,exact --fused "" --tokens-per-cycle 3.5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager

import torch

import lossless
from lossless.decoding import kernels
from lossless.decoding.exact import FusedStackMixin, layer_modules
from lossless.decoding.loop import commit_cache
from lossless.errors import LosslessError


def parse_fused(text: str) -> tuple[int, int]:
    k, _, groups = text.partition(":")
    try:
        return int(k), int(groups or k)
    except ValueError:
        raise LosslessError(f"--fused '{text}': expected k:groups, e.g. 4:2") from None


FAMILIES = ("linear (GEMM)", "LM head (GEMM)", "attention", "norm + activation", "fused layers", "other")


@contextmanager
def labelled_exact_kernels():
    """Exact mode's compiled kernels under profiler labels (they are not aten ops), for `profile_ops`."""
    from torch.profiler import record_function

    saved = {name: getattr(kernels, name) for name in ("linear", "attention", "rms_norm", "silu", "layer_in", "layer_out")}

    def wrap(name, fn):
        def call(*args, **kwargs):
            label = "lm_head" if name == "linear" and args[2] > 10000 else name
            with record_function(f"exact::{label}"):
                return fn(*args, **kwargs)
        return call

    class LabelledStack:  # a forward's layers in one kernel call (exact.FusedStackMixin)
        def __init__(self, stack):
            self.stack = stack

        def forward(self, *args):
            with record_function("exact::stack"):
                return self.stack.forward(*args)

        def forward_views(self, draft, *args):  # a fused forward: the draft view's stack beside this one
            with record_function("exact::stack"):
                return self.stack.forward_views(draft.stack, *args)

    make_stack = FusedStackMixin._lossless_stack
    for name, fn in saved.items():
        setattr(kernels, name, wrap(name, fn))
    FusedStackMixin._lossless_stack = lambda self, draft, **kw: LabelledStack(make_stack(self, draft, **kw))
    try:
        yield
    finally:
        FusedStackMixin._lossless_stack = make_stack
        for name, fn in saved.items():
            setattr(kernels, name, fn)


def family(key: str, shapes) -> str | None:
    """The op family of a profiler event (None: counted inside another event)."""
    if key.startswith("exact::"):
        return {"exact::linear": FAMILIES[0], "exact::lm_head": FAMILIES[1], "exact::attention": FAMILIES[2],
                "exact::layer_in": FAMILIES[4], "exact::layer_out": FAMILIES[4],
                "exact::stack": FAMILIES[4]}.get(key, FAMILIES[3])
    if key in ("aten::mm", "aten::addmm", "aten::bmm"):
        return FAMILIES[1] if any(len(s) == 2 and s[-1] > 10000 for s in (shapes or []) if s) else FAMILIES[0]
    if "attention" in key:
        return FAMILIES[2]
    if key in ("aten::silu", "aten::rsqrt", "aten::pow", "aten::mean"):
        return FAMILIES[3]
    return FAMILIES[5]


def profile_ops(fn, rounds: int = 3) -> dict[str, float]:
    """Milliseconds per call of fn by op family, from the PyTorch profiler's self CPU time."""
    from torch.profiler import profile

    fn()
    with labelled_exact_kernels(), profile(record_shapes=True) as prof:
        for _ in range(rounds):
            fn()
    out = dict.fromkeys(FAMILIES, 0.0)
    for e in prof.key_averages(group_by_input_shape=True):
        out[family(e.key, e.input_shapes)] += e.self_cpu_time_total / 1000 / rounds
    return {k: round(v, 2) for k, v in out.items()}


def weight_tensors(model, step) -> list[torch.Tensor]:
    """Every linear weight that `step()` (a decode step) reads, once each (LM head included): exact mode's packed
    panels where a layer has them, else the stock weight. The draft view's own weights are not a step's."""
    used: dict[int, torch.nn.Linear] = {}
    hooks = [m.register_forward_hook(lambda m, *_: used.update({id(m): m}))  # (returns None: the output stays)
             for m in model.backbone.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with layer_modules():  # module by module, so every linear layer's hook sees its call
            step()
    finally:
        for h in hooks:
            h.remove()
    seen, out = set(), []
    for module in used.values():
        w = getattr(module, "_lossless_packed", None)
        w = module.weight if w is None else w
        if w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            out.append(w.detach())
    return out


def floor_call(tensors: list[torch.Tensor], threads: int):
    """A call that streams `tensors` once at `threads` threads (the run's own count restored after)."""
    stream = kernels.stream

    def call():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            stream(tensors)
        finally:
            torch.set_num_threads(before)
    return call


def forwards(model, cache, n: int, fused: list[tuple[int, int]]) -> dict[str, tuple]:
    """{name: (call, rows)} of the forwards this benchmark times, each leaving the cache at n + 1 positions."""
    token = 42
    reset = lambda: commit_cache(cache, n + 1)  # noqa: E731
    calls = {f"ar {r} row{'s' if r > 1 else ''}": (lambda r=r: (model.verify(cache, [token] * r), reset()), r)
             for r in (1, 2, 4, 8, 9, 16, 17, 32)}
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11]  # the 8-node chain and a 4-token branch beside it
    calls["tree 13 rows"] = (lambda: (model.verify_tree(cache, [token] * 13, parents), reset()), 13)
    calls[f"draft pass k={model.k}"] = (lambda: model.draft(cache, token, model.k), model.k)

    def draft_by_module():
        with layer_modules():  # exact mode's draft pass through Hugging Face's layer code (stock: the same call)
            model.draft(cache, token, model.k)
    calls[f"draft pass k={model.k}, modules"] = (draft_by_module, model.k)
    for k, g in fused:
        calls[f"fused k={k} groups={g}"] = (
            lambda k=k, g=g: (model.verify_and_draft(cache, [token] * k, list(range(g)), k - 1), reset()), k + g * k)
    return calls


# the shapes of public checkpoints (their config.json), for `--model random:NAME`: architecture and shapes
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                                 rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                                   rope_theta=500_000.0, rms_norm_eps=1e-5)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                                 rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
}


def random_backbone(name: str, dtype: str):
    """A random-weight Hugging Face backbone of a public checkpoint's shapes (seeded: the same weights every time;
    Llama 3.2's rope scaling left out: it changes no cost)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from lossless.dtypes import dtype_name, torch_dtype

    if name not in SHAPES:
        raise LosslessError(f"no shapes for random:{name}; choose from {', '.join('random:' + s for s in SHAPES)}")
    arch, shapes = SHAPES[name]
    config_class, causal = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    torch.manual_seed(0)
    config = config_class(**shapes, max_position_embeddings=40960)
    config._attn_implementation = "sdpa"
    return causal(config).to(torch_dtype(dtype_name(dtype))).eval()


def random_model(name: str, dtype: str, attn: str, k: int = 8):
    """An Orthrus model on `random_backbone(name)`, with an untrained head of block size k."""
    from lossless.decoding.model import OrthrusLM

    model = OrthrusLM(random_backbone(name, dtype), k=k, name=f"random:{name}")
    model.set_attn(attn)
    return model


def variant_of(model, rows: int) -> str:
    """Which kernels ran a forward of `rows` rows: stock, or exact mode's variant and, in bf16, how its matrix
    products ran (AMX tiles from the variant's row count on, else dot products or widened fmas)."""
    if model.attn != "exact":
        return "stock"
    isa = kernels.isa()
    if model.dtype != torch.bfloat16:
        return isa
    tiles = kernels.amx_min_rows()
    if tiles is not None and rows >= tiles:
        return f"{isa} tiles"
    return f"{isa} {'fmas' if kernels.bf16_widened() else 'dots'}"


def compute_floor(model, mbytes: float, threads: int) -> dict | None:
    """What a bf16 forward's products cost at the dot-product instruction's own rate on this core (one instruction
    per 64-byte line of weights and row, spread over the threads), where exact mode's products run on it (not
    widened, not on tiles): milliseconds a row. None elsewhere."""
    rates = kernels.product_rates() if model.attn == "exact" and model.dtype == torch.bfloat16 else None
    if rates is None or kernels.bf16_widened() or kernels.amx_min_rows() is not None:
        return None
    return {"dot_per_s": round(rates["dot"]), "fma_per_s": round(rates["fma"]),
            "ms_per_row": round(1000 * mbytes * 1e6 / 64 / (rates["dot"] * threads), 3)}


def projected(summary: dict, tokens_per_cycle: float, k: int) -> dict:
    """Speed-up over AR of a cycle committing `tokens_per_cycle` at these forwards' costs (per kernel)."""
    out = {}
    for a, rows in summary.items():
        step, draft = rows["ar 1 row"]["ms"], rows[f"draft pass k={k}"]["ms"]
        out[a] = {"chain": round(tokens_per_cycle * step / (draft + rows["ar 9 rows"]["ms"]), 2),
                  "tree_lookup": round(tokens_per_cycle * step / (draft + rows["tree 13 rows"]["ms"]), 2)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--cache", type=int, default=200, help="cache length the forwards run at")
    ap.add_argument("--fused", default="4:2,4:4,8:8", help="fused settings as k:groups, comma-separated")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--attn", default="sdpa", help="kernels to measure side by side, comma-separated (e.g. sdpa,exact)")
    ap.add_argument("--tokens-per-cycle", type=float, default=0.0,
                    help="tokens a cycle commits (from speed.py): print the speed-up over AR these costs would give")
    args = ap.parse_args(argv)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        fused = [parse_fused(f) for f in args.fused.split(",") if f]
        attns = list(dict.fromkeys(a for a in args.attn.split(",") if a))
        if args.model.startswith("random:"):
            models = {a: random_model(args.model.removeprefix("random:"), args.dtype, a) for a in attns}
        else:
            models = {a: lossless.load_model(args.model, args.dtype, attn=a) for a in attns}
    except LosslessError as exc:
        print(f"forward_cost: error: {exc}", file=sys.stderr)
        return 2
    prompt = [(7 * i) % 1000 + 100 for i in range(args.cache)]
    setups = {}
    for a, model in models.items():
        cache, _ = model.prefill(prompt)
        setups[a] = (model, cache, cache.get_seq_length())
    calls = {a: forwards(model, cache, n, fused) for a, (model, cache, n) in setups.items()}
    for a in calls:  # warm-up (exact mode packs its weights on its first forward)
        for fn, _ in calls[a].values():
            fn()
    weights = weight_tensors(models[attns[-1]], calls[attns[-1]]["ar 1 row"][0])
    threads = torch.get_num_threads()
    floor_threads = sorted({t for t in (1, 2, threads) if t <= max(threads, 2)})
    floors = {t: floor_call(weights, t) for t in floor_threads}
    times: dict[tuple[str, str], list[float]] = {(a, name): [] for a in calls for name in calls[a]}
    times.update({("floor", t): [] for t in floors})
    for fn in floors.values():
        fn()
    for _ in range(args.rounds):
        for t, fn in floors.items():
            start = time.perf_counter()
            fn()
            times[("floor", t)].append(time.perf_counter() - start)
        for a in calls:
            for name, (fn, _) in calls[a].items():
                t = time.perf_counter()
                fn()
                times[(a, name)].append(time.perf_counter() - t)
    floor = {t: statistics.median(times[("floor", t)]) for t in floors}
    mbytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    step = {a: statistics.median(times[(a, "ar 1 row")]) for a in calls}
    summary = {a: {name: {"rows": rows, "variant": variant_of(models[a], rows),
                          "ms": round(1000 * statistics.median(times[(a, name)]), 2),
                          "vs_step": round(statistics.median(times[(a, name)]) / step[a], 3),
                          "vs_floor": round(statistics.median(times[(a, name)]) / floor[threads], 3),
                          f"vs_{attns[0]}": round(statistics.median(times[(a, name)]) /
                                                    statistics.median(times[(attns[0], name)]), 3)}
                   for name, (_, rows) in calls[a].items()} for a in calls}
    first = next(iter(calls[attns[0]]))
    k0, g0 = fused[0] if fused else (None, None)
    def modules(fn):
        def call():
            with layer_modules():
                fn()
        return call

    breakdown = {a: {"step": profile_ops(calls[a][first][0]), "verify 9 rows": profile_ops(calls[a]["ar 9 rows"][0]),
                     **({"step, by module": profile_ops(modules(calls[a][first][0])),
                         "verify 9, by module": profile_ops(modules(calls[a]["ar 9 rows"][0]))}
                        if models[a].attn == "exact" else {}),
                     **({f"fused k={k0} groups={g0}": profile_ops(calls[a][f"fused k={k0} groups={g0}"][0])} if fused
                        else {})} for a in calls}
    print(f"model={args.model} dtype={args.dtype} cache={args.cache} rounds={args.rounds} threads={torch.get_num_threads()}")
    for a, model in models.items():
        if model.exact_ops:
            tiles = kernels.amx_min_rows()
            print(f"{a} kernels: {'; '.join(model.exact_ops)}; bf16 products in AMX's order, "
                  f"{'as widened fp32 fmas' if kernels.bf16_widened() else 'by the dot-product instruction'}"
                  + (f", on AMX tiles from {tiles} rows" if tiles else ""))
    print(f"floor: one read of the {len(weights)} linear weights ({mbytes:.0f} MB) "
          + ", ".join(f"{1000 * floor[t]:.1f} ms at {t} thread{'s' if t > 1 else ''} ({mbytes / 1000 / floor[t]:.1f} GB/s)"
                      for t in floors))
    compute = compute_floor(models[attns[-1]], mbytes, threads)
    if compute:
        per_row = compute["ms_per_row"]
        print(f"products: the dot-product instruction {compute['dot_per_s'] / 1e9:.2f} G a second a core, the fp32 fma "
              f"{compute['fma_per_s'] / 1e9:.2f} G (24 chains, one thread); at that rate a forward's products alone "
              f"take {per_row:.2f} ms a row at {threads} thread{'s' if threads > 1 else ''} (9 rows {9 * per_row:.1f} ms, "
              f"32 rows {32 * per_row:.1f} ms)")
    print(f"{'forward':<24}{'rows':>5}" + "".join(f"{a + ' ms':>12}{'x step':>8}{'x floor':>8}{'variant':>18}"
                                                  for a in attns)
          + "".join(f"{a + '/' + attns[0]:>14}" for a in attns[1:]))
    for name, (_, rows) in calls[attns[0]].items():
        print(f"{name:<24}{rows:>5}" + "".join(f"{summary[a][name]['ms']:>12.1f}{summary[a][name]['vs_step']:>8.2f}"
                                               f"{summary[a][name]['vs_floor']:>8.2f}{summary[a][name]['variant']:>18}"
                                               for a in attns)
              + "".join(f"{summary[a][name]['vs_' + attns[0]]:>14.2f}" for a in attns[1:]))
    print("one forward by op family (ms, profiler self time):")
    print(f"  {'kernel':<8}{'forward':<22}" + "".join(f"{f:>20}" for f in FAMILIES))
    for a, parts in breakdown.items():
        for name, ops in parts.items():
            print(f"  {a:<8}{name:<22}" + "".join(f"{ops[f]:>20.1f}" for f in FAMILIES))
    speedups = projected(summary, args.tokens_per_cycle, models[attns[0]].k) if args.tokens_per_cycle else {}
    for a, s in speedups.items():
        print(f"{a}: at {args.tokens_per_cycle} tokens a cycle, the chain would run {s['chain']:.2f}x AR, the tree with "
              f"lookup {s['tree_lookup']:.2f}x")
    print(json.dumps({"model": args.model, "dtype": args.dtype, "cache": args.cache, "projected": speedups,
                      "forwards": summary, "breakdown": breakdown, "threads": threads,
                      "floor": {"mb": round(mbytes, 1), **{f"ms_{t}_thread{'s' if t > 1 else ''}": round(1000 * floor[t], 2)
                                                         for t in floors}}, "compute": compute}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
