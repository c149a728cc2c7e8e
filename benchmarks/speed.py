"""Decoding speed, side by side in one process: HF `generate` greedy, our `ar`, HF prompt-lookup
decoding, and `orthrus` with the model's head (the shipped one by default), in the two-pass cycle and
the fused one (`orthrus_fused`; `--fused 4:2,3:3` adds more block-size:group settings side by side), and
the two-pass cycle verifying a candidate tree (`orthrus_tree`; `--tree 8,16,24` sets its node budgets), and
both with a prompt-lookup branch verified beside the drafts (`orthrus_lookup`, `orthrus_tree_lookup` with the
first tree budget, `orthrus_fused_lookup` with the first fused setting; `--lookup N` tokens).

Methods run alternately on each prompt, for several repeats; the table reports medians over prompts
of per-prompt medians over repeats. Tokens per step = tokens committed per decode cycle after the
prefill (1.0 for plain AR); tokens per forward counts every model forward, prefill included.
The last stdout line is one JSON object.

    python benchmarks/speed.py --model smollm2-135m --dtype bf16 --limit 8 --max-new-tokens 128
    python benchmarks/speed.py --suite suites/default.jsonl --per-domain 2 --methods hf_generate,orthrus_tree_lookup
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

import torch

import lossless
from lossless import paths
from lossless.distill import read_prompts
from lossless.errors import LosslessError
from lossless.jsonio import read_jsonl
from lossless.names import positive_int
from lossless.text import encode_prompt

METHODS = ("hf_generate", "ar", "prompt_lookup", "orthrus", "orthrus_lookup", "orthrus_tree", "orthrus_tree_lookup",
           "orthrus_fused", "orthrus_fused_lookup")
FUSED_DEFAULT = "3"  # block size k[:draft groups per forward]; "3" = the library's default (k=3, every group)


class ForwardCounter:
    """Counts forwards of the backbone's decoder (draft and verify passes both count)."""

    def __init__(self, module):
        self.n = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def run_hf(model, ids, max_new_tokens, eos, counter, prompt_lookup=False):
    x = torch.tensor([ids], device=model.device)
    kwargs = {"prompt_lookup_num_tokens": 10} if prompt_lookup else {}
    before = counter.n
    t = time.perf_counter()
    out = model.backbone.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0], **kwargs)
    seconds = time.perf_counter() - t
    new = out[0, len(ids):].tolist()
    forwards = counter.n - before
    return {"tokens": new, "seconds": seconds, "forwards": forwards, "steps": max(forwards - 1, 1), "accepted": []}


def run_ours(model, ids, max_new_tokens, mode, k, cycle="two-pass", groups=None, tree=0, lookup=0):
    cfg = lossless.DecodeConfig(max_new_tokens=max_new_tokens, k=k, cycle=cycle, groups=groups, tree=tree, lookup=lookup)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default=None)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--attn", default="sdpa",
                    help="kernel for all methods; a second kernel after a comma (e.g. sdpa,exact) also runs ar and "
                         "orthrus (and orthrus_lookup, if asked for) under it, alternating with the rest, and reports "
                         "its overhead")
    ap.add_argument("--suite", default=str(paths.HELDOUT_PROMPTS), help="JSONL of {\"prompt\": ...} lines")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--per-domain", type=int, default=0,
                    help="take the first N prompts of each domain of --suite (e.g. suites/default.jsonl) instead of --limit")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    ap.add_argument("--fused", default=FUSED_DEFAULT,
                    help="orthrus_fused settings as k:groups, comma-separated; the first is `orthrus_fused`, the "
                         "others run side by side as `orthrus_fused[k:groups]`")
    ap.add_argument("--tree", default="16",
                    help="orthrus_tree node budgets, comma-separated; the first is `orthrus_tree`, the others run side "
                         "by side as `orthrus_tree[N]`")
    ap.add_argument("--lookup", type=int, default=7, help="tokens of the lookup branch (orthrus_lookup, orthrus_tree_lookup)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args(argv)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        methods = [m for m in args.methods.split(",") if m]
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise LosslessError(f"unknown method {bad[0]}: choose from {', '.join(METHODS)}")
        fused = [parse_fused(f) for f in args.fused.split(",") if f]
        if {"orthrus_fused", "orthrus_fused_lookup"} & set(methods) and not fused:
            raise LosslessError("--fused needs at least one k:groups setting")
        trees = [positive_int(t, f"--tree '{t}': expected node budgets >= 1, e.g. 8,16") for t in args.tree.split(",") if t]
        if {"orthrus_tree", "orthrus_tree_lookup"} & set(methods) and not trees:
            raise LosslessError("--tree needs at least one node budget")
        kernels = [a for a in args.attn.split(",") if a]
        model = lossless.load_model(args.model, args.dtype, attn=kernels[0], head=args.head)
        extra = {a: lossless.load_model(args.model, args.dtype, attn=a, head=args.head) for a in kernels[1:]}
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
    except LosslessError as exc:
        print(f"speed: error: {exc}", file=sys.stderr)
        return 2
    eos = model.eos_token_ids()
    counter = ForwardCounter(model.backbone.model)
    encoded = [encode_prompt(model.tokenizer, p["prompt"]) for p in prompts]
    variants = {m: (model, m, None) for m in methods}
    if "orthrus_fused" in methods:
        for j, setting in enumerate(fused):
            k, groups = setting
            name = "orthrus_fused" if j == 0 else f"orthrus_fused[{k}{f':{groups}' if groups else ''}]"
            variants[name] = (model, "orthrus_fused", setting)
    if "orthrus_tree" in methods:
        for j, nodes in enumerate(trees):
            variants["orthrus_tree" if j == 0 else f"orthrus_tree[{nodes}]"] = (model, "orthrus_tree", nodes)
    on_extra = ["ar", "orthrus"] + (["orthrus_lookup"] if "orthrus_lookup" in methods else [])
    for a, extra_model in extra.items():
        for m in on_extra:
            variants[f"{m}@{a}"] = (extra_model, m, None)
    methods = list(variants)
    per_prompt: dict[str, list[dict]] = {m: [] for m in methods}
    hist: dict[str, Counter] = {m: Counter() for m in methods}
    for warm in (model, *extra.values()):  # warm-up: first calls allocate and pick kernels
        for kind in ("ar", "orthrus"):
            run_ours(warm, encoded[0], 8, kind, args.k)
        for k, groups in fused:
            run_ours(warm, encoded[0], 8, "orthrus", k, "fused", groups)
    for ids in encoded:
        reps: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(args.repeats):
            for m in methods:  # alternate methods so machine noise hits all alike
                runner, kind, setting = variants[m]
                if kind == "hf_generate":
                    r = run_hf(runner, ids, args.max_new_tokens, eos, counter)
                elif kind == "prompt_lookup":
                    r = run_hf(runner, ids, args.max_new_tokens, eos, counter, prompt_lookup=True)
                elif kind == "orthrus_tree":
                    r = run_ours(runner, ids, args.max_new_tokens, "orthrus", args.k, tree=setting)
                elif kind == "orthrus_lookup":
                    r = run_ours(runner, ids, args.max_new_tokens, "orthrus", args.k, lookup=args.lookup)
                elif kind == "orthrus_tree_lookup":
                    r = run_ours(runner, ids, args.max_new_tokens, "orthrus", args.k, tree=trees[0], lookup=args.lookup)
                elif kind == "orthrus_fused_lookup":
                    r = run_ours(runner, ids, args.max_new_tokens, "orthrus", fused[0][0], "fused", fused[0][1],
                                 lookup=args.lookup)
                elif kind == "orthrus_fused":
                    r = run_ours(runner, ids, args.max_new_tokens, "orthrus", setting[0], "fused", setting[1])
                else:
                    r = run_ours(runner, ids, args.max_new_tokens, kind, args.k)
                reps[m].append(r)
        for m in methods:
            n = len(reps[m][0]["tokens"])
            per_prompt[m].append({
                "tokens_per_second": statistics.median(n / r["seconds"] for r in reps[m]),
                "tokens_per_step": (n - 1) / reps[m][0]["steps"],
                "tokens_per_forward": n / reps[m][0]["forwards"],
                "new_tokens": n,
            })
            hist[m].update(reps[m][0]["accepted"])
    summary = {}
    base = statistics.median(p["tokens_per_second"] for p in per_prompt.get("hf_generate", [])) if "hf_generate" in methods else None
    for m in methods:
        rows = per_prompt[m]
        tps = statistics.median(r["tokens_per_second"] for r in rows)
        summary[m] = {
            "tokens_per_second": round(tps, 2),
            "tokens_per_step": round(statistics.mean(r["tokens_per_step"] for r in rows), 3),
            "tokens_per_forward": round(statistics.mean(r["tokens_per_forward"] for r in rows), 3),
            "speedup_vs_hf_generate": round(tps / base, 3) if base else None,
            "mean_new_tokens": round(statistics.mean(r["new_tokens"] for r in rows), 1),
        }
        if hist[m]:
            summary[m]["acceptance_histogram"] = {str(a): hist[m][a] for a in sorted(hist[m])}
    for a in extra:
        for m in (m for m in on_extra if m in summary):
            summary[f"{m}@{a}"]["slowdown_vs_" + kernels[0]] = round(
                summary[m]["tokens_per_second"] / summary[f"{m}@{a}"]["tokens_per_second"], 3)
    print(f"model={args.model} dtype={args.dtype} attn={args.attn} prompts={len(prompts)} "
          f"max_new_tokens={args.max_new_tokens} repeats={args.repeats} threads={torch.get_num_threads()} head_k={model.k}")
    for a, m in extra.items():
        if m.exact_ops:
            print(f"{a} kernels: {'; '.join(m.exact_ops)}")
    width = max(15, *(len(m) + 2 for m in summary))
    print(f"{'method':<{width}}{'tokens/s':>10}{'tok/step':>10}{'tok/fwd':>10}{'speedup':>10}{'new tok':>9}")
    for m, s in summary.items():
        sp = f"{s['speedup_vs_hf_generate']:.2f}x" if s["speedup_vs_hf_generate"] else "-"
        print(f"{m:<{width}}{s['tokens_per_second']:>10.1f}{s['tokens_per_step']:>10.2f}{s['tokens_per_forward']:>10.2f}"
              f"{sp:>10}{s['mean_new_tokens']:>9.0f}")
    for m, s in summary.items():
        for key, value in s.items():
            if key.startswith("slowdown_vs_"):
                print(f"{m}: {value:.3f}x the time per token of {m.split('@')[0]} with {key[len('slowdown_vs_'):]}")
    for m, s in summary.items():
        if "acceptance_histogram" in s:
            print(f"{m} acceptance histogram (drafts accepted per cycle):", s["acceptance_histogram"])
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
