"""Decoding speed, side by side in one process: HF `generate` greedy, our `ar`, HF prompt-lookup decoding, and
`orthrus` with the model's head (the shipped one by default) in the two-pass cycle, the fused one
(`orthrus_fused`; `--fused 4:2,3:3` adds block-size:group settings side by side), verifying a candidate tree
(`orthrus_tree`; `--tree 8,16` sets its node budgets), and with a prompt-lookup branch beside the drafts
(`orthrus_lookup`, `orthrus_tree_lookup` with the first tree budget, `orthrus_fused_lookup` with the first fused
setting; `--lookup N` tokens); `default`, what `lossless generate` runs with no cycle options (the cycle this CPU's
measured forward costs choose, or AR: `decoding/cycles.py`; the table says which and why); and, where llama-cpp-python is installed (`pip install .[peers]`), `llama_cpp`:
llama.cpp's greedy decoding of the embedded GGUF requantized by llama.cpp to `--dtype` (`peers.py`).

The protocol (so that a ratio means something on a noisy machine):
- every method is warmed up first (first calls allocate, pick kernels, pack weights);
- on each prompt, each repeat runs every method once, in an order shuffled per prompt and repeat (`--seed`);
- a method's speed on a prompt is its median tokens/s over the repeats; its speedup is the mean over prompts of
  the per-prompt paired ratio to HF `generate`, with a bootstrap 95% interval over prompts;
- HF methods always run the stock kernels (`generate` cannot drive exact mode's); every other method runs on
  each kernel of `--attn` (`orthrus@exact` is `orthrus` on the exact kernels), and a method on the second kernel
  reports its time per token against the same method on the first (`slowdown_vs_<kernel>`, paired, with its
  interval), and on how many prompts its tokens equal `ar` on the same kernel;
- the same paired ratio to `ar` on the same kernels (`vs_ar`) and to `llama_cpp` (`vs_llama_cpp`) where they ran;
  the JSON keeps each method's per-prompt tokens/s, so any other ratio can be computed after;
- `--temperature T` samples instead (our methods only: AR, the chain, tree, lookup and fused cycles, and
  `default`, which is then what a sampled `lossless generate` runs); every run of a prompt draws with one seed, so
  on exact kernels a sampled tree's tokens equal sampled `ar`'s ('= ar'), and a chain's (rejection sampling) may not.
Tokens per step = tokens committed per decode cycle after the prefill (1.0 for plain AR); tokens per forward
counts every model forward, prefill included. The last stdout line is one JSON object.

    python benchmarks/speed.py --model smollm2-135m --dtype bf16 --attn sdpa,exact --limit 6 --repeats 3
    python benchmarks/speed.py --suite suites/default.jsonl --per-domain 2 --methods hf_generate,orthrus_tree_lookup
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter

import torch

import lossless
import peers
from lossless import paths
from lossless.training.distill import read_prompts
from lossless.decoding.head import UNTRAINED
from lossless.errors import LosslessError
from lossless.jsonio import read_jsonl
from lossless.decoding.sampling import SamplingConfig
from lossless.names import DEFAULT_LOOKUP, DEFAULT_TREE, EXACT, positive_int
from lossless.stats import bootstrap_mean
from lossless.text import encode_prompt

METHODS = ("hf_generate", "ar", "prompt_lookup", "orthrus", "orthrus_lookup", "orthrus_tree", "orthrus_tree_lookup",
           "orthrus_fused", "orthrus_fused_lookup", "default", "llama_cpp")
HF_METHODS = ("hf_generate", "prompt_lookup")
PEER_METHODS = ("llama_cpp",)  # other engines, run once each (their own kernels), when they are installed
FUSED_DEFAULT = "3"  # block size k[:draft groups per forward]; "3" = the library's default (k=3, every group)
WARMUP_TOKENS = 16


class ForwardCounter:
    """Counts forwards of a backbone's decoder (draft and verify passes both count)."""

    def __init__(self, module):
        self.n = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def run_hf(model, ids, max_new_tokens, counter, prompt_lookup=False):
    eos = model.eos_token_ids()
    x = torch.tensor([ids], device=model.device)
    kwargs = {"prompt_lookup_num_tokens": 10} if prompt_lookup else {}
    before = counter.n
    t = time.perf_counter()
    out = model.backbone.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0], **kwargs)
    seconds = time.perf_counter() - t
    forwards = counter.n - before
    return {"tokens": out[0, len(ids):].tolist(), "seconds": seconds, "forwards": forwards,
            "steps": max(forwards - 1, 1), "accepted": []}


SAMPLING = SamplingConfig()  # greedy, or `--temperature`'s


def run_ours(model, ids, max_new_tokens, mode, k, cycle="two-pass", groups=None, tree=0, lookup=0, ar_below=0.0):
    cfg = lossless.DecodeConfig(max_new_tokens=max_new_tokens, k=k, cycle=cycle, groups=groups, tree=tree, lookup=lookup,
                                sampling=SAMPLING, ar_below=ar_below)
    state = lossless.decode(model, ids, mode, cfg)
    s = state.stats
    return {"tokens": state.generated, "seconds": s.seconds, "forwards": s.forwards, "steps": max(s.steps, 1),
            "accepted": list(s.accepted)}


def parse_fused(text: str) -> tuple[int, int | None]:
    """`4:2` -> (k=4, groups=2); `4` -> (4, None: a group for every acceptance count)."""
    k, _, groups = text.partition(":")
    try:
        return int(k), (int(groups) if groups else None)
    except ValueError:
        raise LosslessError(f"--fused '{text}': expected k:groups, e.g. 4:2") from None


def variants_for(methods, kernels, trees, fused):
    """{name: (kernel, kind, setting)}: HF methods once (stock kernels), peers once (their own), every other method
    on every kernel."""
    out = {}
    for j, kernel in enumerate(kernels):
        at = "" if j == 0 else f"@{kernel}"
        for m in methods:
            if m in HF_METHODS or m in PEER_METHODS:
                if j == 0:
                    out[m] = ("stock" if m in HF_METHODS else "peer", m, None)
            elif m == "orthrus_fused":
                for i, (k, groups) in enumerate(fused):
                    tag = "" if i == 0 else f"[{k}{f':{groups}' if groups else ''}]"
                    out[f"orthrus_fused{tag}{at}"] = (kernel, m, (k, groups))
            elif m == "orthrus_tree":
                for i, nodes in enumerate(trees):
                    out[f"orthrus_tree{'' if i == 0 else f'[{nodes}]'}{at}"] = (kernel, m, nodes)
            else:
                out[f"{m}{at}"] = (kernel, m, None)
    return out


def run_variant(model, kind, setting, ids, max_new_tokens, args, trees, fused, counter):
    if kind == "llama_cpp":
        return model.run(ids, max_new_tokens, args.eos)
    if kind in HF_METHODS:
        return run_hf(model, ids, max_new_tokens, counter, prompt_lookup=kind == "prompt_lookup")
    if kind == "orthrus_tree":
        return run_ours(model, ids, max_new_tokens, "orthrus", args.k, tree=setting)
    if kind == "orthrus_lookup":
        return run_ours(model, ids, max_new_tokens, "orthrus", args.k, lookup=args.lookup)
    if kind == "orthrus_tree_lookup":
        return run_ours(model, ids, max_new_tokens, "orthrus", args.k, tree=trees[0], lookup=args.lookup)
    if kind == "orthrus_fused_lookup":
        return run_ours(model, ids, max_new_tokens, "orthrus", fused[0][0], "fused", fused[0][1], lookup=args.lookup)
    if kind == "orthrus_fused":
        return run_ours(model, ids, max_new_tokens, "orthrus", setting[0], "fused", setting[1])
    if kind == "default":  # what `lossless generate` runs with no cycle options: chosen from this CPU's costs
        if model.head_digest == UNTRAINED:  # as `generate`: the chain and lookup
            return run_ours(model, ids, max_new_tokens, "orthrus", None, tree=0,
                            lookup=DEFAULT_LOOKUP if SAMPLING.greedy else 0)
        choice = model.choice_for(SAMPLING.greedy, context=len(ids))  # as `generate` chooses for its prompt's length
        return run_ours(model, ids, max_new_tokens, choice.mode, None, tree=choice.tree, lookup=choice.lookup,
                        ar_below=choice.ar_below)
    return run_ours(model, ids, max_new_tokens, kind, args.k)


def paired(num: list[float], den: list[float]) -> dict:
    """Mean over prompts of num[p] / den[p], with its bootstrap 95% interval."""
    out = bootstrap_mean([a / b for a, b in zip(num, den)])
    return {"mean": round(out["mean"], 3), "ci95": [round(x, 3) for x in out["ci95"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default=None)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--attn", default="sdpa",
                    help="kernels, comma-separated (e.g. sdpa,exact): every non-HF method runs on each; the first "
                         "kernel's methods carry plain names, the others `method@kernel`")
    ap.add_argument("--suite", default=str(paths.HELDOUT_PROMPTS), help="JSONL of {\"prompt\": ...} lines")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--per-domain", type=int, default=0,
                    help="take the first N prompts of each domain of --suite (e.g. suites/default.jsonl) instead of --limit")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-prompt, per-repeat method order")
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--methods", default=",".join(m for m in METHODS if m not in PEER_METHODS or peers.available()),
                    help=f"comma-separated, from {', '.join(METHODS)} (default: all; llama_cpp where it is installed)")
    ap.add_argument("--fused", default=FUSED_DEFAULT,
                    help="orthrus_fused settings as k:groups, comma-separated; the first is `orthrus_fused`, the "
                         "others run side by side as `orthrus_fused[k:groups]`")
    ap.add_argument("--tree", default=str(DEFAULT_TREE),
                    help="orthrus_tree node budgets, comma-separated; the first is `orthrus_tree` (and the tree of "
                         "orthrus_tree_lookup), the others run side by side as `orthrus_tree[N]`")
    ap.add_argument("--lookup", type=int, default=DEFAULT_LOOKUP,
                    help="tokens of the lookup branch (orthrus_lookup, orthrus_tree_lookup, orthrus_fused_lookup)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (0: greedy); our methods only, each prompt's runs with one seed")
    args = ap.parse_args(argv)
    global SAMPLING
    try:
        SAMPLING = SamplingConfig(temperature=args.temperature)
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.repeats < 1:
            raise LosslessError(f"--repeats must be >= 1, got {args.repeats}")
        methods = [m for m in args.methods.split(",") if m]
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise LosslessError(f"unknown method {bad[0]}: choose from {', '.join(METHODS)}")
        greedy_only = {"hf_generate", "prompt_lookup", "llama_cpp"} & set(methods)
        if args.temperature and greedy_only:
            raise LosslessError(f"--temperature: {', '.join(sorted(greedy_only))} decode greedily; run our methods "
                                f"(ar, orthrus and its tree, lookup and fused forms, default)")
        if "llama_cpp" in methods and not peers.available():
            raise LosslessError("llama_cpp: llama-cpp-python is not installed; pip install .[peers] (see docs/speed.md)")
        fused = [parse_fused(f) for f in args.fused.split(",") if f]
        if {"orthrus_fused", "orthrus_fused_lookup"} & set(methods) and not fused:
            raise LosslessError("--fused needs at least one k:groups setting")
        trees = [positive_int(t, f"--tree '{t}': expected node budgets >= 1, e.g. 8,16") for t in args.tree.split(",") if t]
        if {"orthrus_tree", "orthrus_tree_lookup"} & set(methods) and not trees:
            raise LosslessError("--tree needs at least one node budget")
        kernels = list(dict.fromkeys(a for a in args.attn.split(",") if a))
        models = {a: lossless.load_model(args.model, args.dtype, attn=a, head=args.head) for a in kernels}
        stock = next((a for a in kernels if a != EXACT), None)
        models["stock"] = models[stock] if stock else lossless.load_model(args.model, args.dtype, attn="sdpa",
                                                                          head=args.head)
        prompts = read_prompts(args.suite)
        if args.per_domain:
            domains = [row.get("domain") for row in read_jsonl(args.suite, what="prompt file")]
            if None in domains:
                raise LosslessError(f"--per-domain: {args.suite} has lines without a \"domain\" field")
            taken: Counter = Counter()
            prompts = [p for p, d in zip(prompts, domains) if taken.update([d]) or taken[d] <= args.per_domain]
        else:
            prompts = prompts[: args.limit]
        if not prompts:
            raise LosslessError(f"{args.suite}: no prompts")
        if "llama_cpp" in methods:
            models["peer"] = peers.LlamaCpp(args.model, args.dtype, torch.get_num_threads())
    except LosslessError as exc:
        print(f"speed: error: {exc}", file=sys.stderr)
        return 2
    args.eos = models["stock"].eos_token_ids()
    # forwards counted by a hook for HF's methods only: a hook on an exact model's layers would make its decodes
    # take the module call (ours count their own forwards)
    counters = {id(models["stock"]): ForwardCounter(models["stock"].backbone.model)}
    encoded = [encode_prompt(models["stock"].tokenizer, p["prompt"]) for p in prompts]
    variants = variants_for(methods, kernels, trees, fused)

    def run(name, ids, max_new_tokens):
        kernel, kind, setting = variants[name]
        model = models[kernel]
        return run_variant(model, kind, setting, ids, max_new_tokens, args, trees, fused, counters.get(id(model)))

    for name in variants:  # warm-up, every method
        run(name, encoded[0], min(WARMUP_TOKENS, args.max_new_tokens))
    rng = random.Random(args.seed)
    tps: dict[str, list[float]] = {m: [] for m in variants}
    first: dict[str, list[dict]] = {m: [] for m in variants}
    hist: dict[str, Counter] = {m: Counter() for m in variants}
    for ids in encoded:
        reps: dict[str, list[dict]] = {m: [] for m in variants}
        for _ in range(args.repeats):
            order = list(variants)
            rng.shuffle(order)  # so drift and noise hit every method alike
            for name in order:
                reps[name].append(run(name, ids, args.max_new_tokens))
        for name, rs in reps.items():
            tps[name].append(statistics.median(len(r["tokens"]) / r["seconds"] for r in rs))
            first[name].append(rs[0])
            hist[name].update(rs[0]["accepted"])
    summary = {}
    for name, (kernel, kind, _) in variants.items():
        rs = first[name]
        ar_name = "ar" if kernel in ("stock", "peer", kernels[0]) else f"ar@{kernel}"
        summary[name] = {
            "tokens_per_second": round(statistics.median(tps[name]), 2),
            "tokens_per_step": round(statistics.mean((len(r["tokens"]) - 1) / r["steps"] for r in rs), 3),
            "tokens_per_forward": round(statistics.mean(len(r["tokens"]) / r["forwards"] for r in rs), 3),
            "speedup_vs_hf_generate": None,
            "mean_new_tokens": round(statistics.mean(len(r["tokens"]) for r in rs), 1),
            "kernel": {"stock": stock or "sdpa", "peer": "llama.cpp"}.get(kernel, kernel),
        }
        if "hf_generate" in variants:
            ratio = paired(tps[name], tps["hf_generate"])
            summary[name]["speedup_vs_hf_generate"], summary[name]["speedup_ci95"] = ratio["mean"], ratio["ci95"]
        for other, key in (("llama_cpp", "vs_llama_cpp"), (ar_name, "vs_ar")):
            if other in variants and other != name and not (key == "vs_ar" and (kernel == "peer" or kind in HF_METHODS)):
                ratio = paired(tps[name], tps[other])
                summary[name][key], summary[name][f"{key}_ci95"] = ratio["mean"], ratio["ci95"]
        summary[name]["per_prompt_tokens_per_second"] = [round(x, 2) for x in tps[name]]
        if ar_name in first and kind not in HF_METHODS:  # (sampled: a tree's are AR's draws, a chain's other draws)
            summary[name]["prompts_equal_to_ar"] = sum(r["tokens"] == a["tokens"] for r, a in zip(rs, first[ar_name]))
        if hist[name]:
            summary[name]["acceptance_histogram"] = {str(a): hist[name][a] for a in sorted(hist[name])}
        base = name.rsplit("@", 1)[0]
        if "@" in name and base in variants:  # the same method on the first kernel: paired time per token
            slow = paired(tps[base], tps[name])
            summary[name][f"slowdown_vs_{kernels[0]}"], summary[name]["slowdown_ci95"] = slow["mean"], slow["ci95"]
    print(f"model={args.model} dtype={args.dtype} attn={args.attn} prompts={len(prompts)} max_new_tokens={args.max_new_tokens} "
          f"repeats={args.repeats} seed={args.seed} threads={torch.get_num_threads()} head_k={models['stock'].k}"
          + (f" temperature={args.temperature}" if args.temperature else ""))
    for a, m in models.items():
        if a == EXACT and m.exact_ops:
            print(f"{a} kernels: {'; '.join(m.exact_ops)}")
    for name, (kernel, kind, _) in variants.items():
        if kind == "default" and models[kernel].head_digest != UNTRAINED:  # chosen for each prompt's length
            chosen = {}
            for ids in encoded:
                choice = models[kernel].choice_for(SAMPLING.greedy, context=len(ids))
                chosen.setdefault(choice.why, choice)
            summary[name]["choice"] = next(iter(chosen.values())).to_dict()
            summary[name]["choices"] = [c.to_dict() for c in chosen.values()]
            for why in chosen:
                print(f"{name}: {why}")
    if "peer" in models:
        from importlib.metadata import version

        print(f"llama_cpp: llama-cpp-python {version('llama-cpp-python')}, {models['peer'].path.name} (requantized by "
              f"llama.cpp from the embedded GGUF), greedy, {torch.get_num_threads()} threads; its '= ar' column "
              f"compares with our ar on {kernels[0]}")
    width = max(15, *(len(m) + 2 for m in summary))
    print(f"{'method':<{width}}{'tokens/s':>10}{'tok/step':>10}{'tok/fwd':>9}{'vs HF generate [95% CI]':>26}{'= ar':>7}")
    for m, s in summary.items():
        sp = (f"{s['speedup_vs_hf_generate']:.2f}x [{s['speedup_ci95'][0]:.2f}, {s['speedup_ci95'][1]:.2f}]"
              if s["speedup_vs_hf_generate"] else "-")
        same = f"{s['prompts_equal_to_ar']}/{len(prompts)}" if "prompts_equal_to_ar" in s else "-"
        print(f"{m:<{width}}{s['tokens_per_second']:>10.1f}{s['tokens_per_step']:>10.2f}{s['tokens_per_forward']:>9.2f}"
              f"{sp:>26}{same:>7}")
    for key, what in (("vs_ar", "ar's on the same kernels"), ("vs_llama_cpp", "llama.cpp's")):
        for m, s in summary.items():
            if key in s:
                lo, hi = s[f"{key}_ci95"]
                print(f"{m}: {s[key]:.2f}x [{lo:.2f}, {hi:.2f}] {what} tokens/s (paired over prompts)")
    for m, s in summary.items():
        for key, value in s.items():
            if key.startswith("slowdown_vs_"):
                lo, hi = s["slowdown_ci95"]
                print(f"{m}: {value:.3f}x [{lo:.3f}, {hi:.3f}] the time per token of {m.split('@')[0]} "
                      f"with {key[len('slowdown_vs_'):]} (paired over prompts)")
    for m, s in summary.items():
        if "acceptance_histogram" in s:
            print(f"{m} acceptance histogram (drafts accepted per cycle):", s["acceptance_histogram"])
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
