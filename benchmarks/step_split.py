"""Where a decode's time goes in exact mode: the layer stack's kernel calls, the LM head's, and everything between
them (Python, small tensor ops, the cycle's bookkeeping), per forward and per committed token.

Each method decodes each held-out prompt once per repeat, the methods in an order shuffled per prompt and repeat,
after a warm-up; the stack's calls and the LM head's are timed from Python around the calls themselves, so the
rest is the decode's time after the prefill less those. Memory speed moves the kernels' share from run to run on
a shared machine, and with it the rest (its cache misses after the weights streamed through), so compare builds
within one run or over several.

    python benchmarks/step_split.py --limit 6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

import lossless
from lossless import paths
from lossless.decoding import exact
from lossless.errors import LosslessError
from lossless.names import DEFAULT_LOOKUP, DEFAULT_TREE
from lossless.text import encode_prompt
from lossless.training.distill import read_prompts

METHODS = {"ar": ("ar", {}), "chain": ("orthrus", {}),
           "tree_lookup": ("orthrus", {"tree": DEFAULT_TREE, "lookup": DEFAULT_LOOKUP})}


class Clock:
    """Seconds spent in the layer stack's kernel calls and the LM head's, while `on`."""

    def __init__(self, model):
        self.stack = self.head = 0.0
        self.on = False
        clock, held = self, exact.FusedStackMixin._lossless_stack

        class Timed:  # a stack whose calls are timed
            def __init__(self, stack):
                self.inner = stack

            def forward(self, *args):
                return clock.time("stack", self.inner.forward, args)

            def forward_views(self, *args):
                return clock.time("stack", self.inner.forward_views, args)

        exact.FusedStackMixin._lossless_stack = lambda s, *a, **k: None if (st := held(s, *a, **k)) is None else Timed(st)
        head = model.backbone.lm_head
        forward = head.forward
        head.forward = lambda x: clock.time("head", forward, (x,))

    def time(self, part: str, call, args):
        start = time.perf_counter()
        out = call(*args)
        if self.on:
            setattr(self, part, getattr(self, part) + time.perf_counter() - start)
        return out


def run(model, clock: Clock, ids: list[int], mode: str, max_new_tokens: int, options: dict) -> dict:
    marks: list[float] = []

    def on_tokens(_):  # the first call comes after the prefill
        marks.append(time.perf_counter())
        clock.on = True

    clock.stack = clock.head = 0.0
    cfg = lossless.DecodeConfig(max_new_tokens=max_new_tokens, **options)
    state = lossless.decode(model, ids, mode, cfg, on_tokens=on_tokens)
    clock.on = False
    total = marks[-1] - marks[0]
    forwards = state.stats.forwards - 1  # (the prefill's aside)
    return {"seconds": total, "stack": clock.stack, "head": clock.head, "forwards": forwards,
            "tokens": len(state.generated) - 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--suite", default=str(paths.HELDOUT_PROMPTS))
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        methods = [m for m in args.methods.split(",") if m]
        if bad := [m for m in methods if m not in METHODS]:
            raise LosslessError(f"unknown method {bad[0]}: choose from {', '.join(METHODS)}")
        model = lossless.load_model(args.model, args.dtype, attn="exact")
        prompts = [encode_prompt(model.tokenizer, p["prompt"]) for p in read_prompts(args.suite)[: args.limit]]
        if not prompts:
            raise LosslessError(f"{args.suite}: no prompts")
    except LosslessError as exc:
        print(f"step_split: error: {exc}", file=sys.stderr)
        return 2
    clock = Clock(model)
    rng = random.Random(args.seed)
    for m in methods:  # warm-up
        run(model, clock, prompts[0], METHODS[m][0], 16, METHODS[m][1])
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for ids in prompts:
        for _ in range(args.repeats):
            for m in rng.sample(methods, len(methods)):
                runs[m].append(run(model, clock, ids, METHODS[m][0], args.max_new_tokens, METHODS[m][1]))
    out = {}
    print(f"exact {args.dtype}, {torch.get_num_threads()} threads, {len(prompts)} prompts x {args.repeats} repeats, "
          f"{args.max_new_tokens} tokens")
    print(f"{'method':12s} {'ms/forward':>10s} {'stack':>7s} {'head':>7s} {'rest':>7s} {'rest %':>7s} "
          f"{'ms/token':>9s} {'rest/token':>10s}")
    for m, rs in runs.items():
        f = sum(r["forwards"] for r in rs)
        tokens = sum(r["tokens"] for r in rs)
        total, stack, head = (sum(r[key] for r in rs) for key in ("seconds", "stack", "head"))
        rest = total - stack - head
        per = [(r["seconds"] - r["stack"] - r["head"]) / r["forwards"] * 1e3 for r in rs if r["forwards"]]
        out[m] = {"forward_ms": round(total / f * 1e3, 3), "stack_ms": round(stack / f * 1e3, 3),
                  "head_ms": round(head / f * 1e3, 3), "rest_ms": round(rest / f * 1e3, 3),
                  "rest_share": round(rest / total, 4), "token_ms": round(total / tokens * 1e3, 3),
                  "rest_token_ms": round(rest / tokens * 1e3, 3),
                  "rest_ms_median_run": round(statistics.median(per), 3), "forwards": f, "tokens": tokens}
        o = out[m]
        print(f"{m:12s} {o['forward_ms']:10.2f} {o['stack_ms']:7.2f} {o['head_ms']:7.2f} {o['rest_ms']:7.2f} "
              f"{100 * o['rest_share']:6.1f}% {o['token_ms']:9.2f} {o['rest_token_ms']:10.3f}")
    print(json.dumps({"benchmark": "step_split", "model": args.model, "dtype": args.dtype,
                      "threads": torch.get_num_threads(), "prompts": len(prompts), "repeats": args.repeats,
                      "max_new_tokens": args.max_new_tokens, "methods": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
