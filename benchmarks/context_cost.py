"""What a decode step costs as the context grows: stock and exact kernels (and llama.cpp) side by side.

For each kernel of `--attn` and each context length of `--contexts`, it prefills a prompt of that many tokens
once, then times a decode step (one row) and a 9-row verify (the chain's verify at k=8) over that cache, every
(kernel, context, forward) once per round in a shuffled order, for `--rounds` rounds, beside the memory floor (one
read of the linear weights a step reads). With `--llama-cpp` (where llama-cpp-python is installed, see
docs/speed.md) it also times llama.cpp's decode step at each context on the same GGUF, requantized to `--dtype`;
with `--llama-bench`, llama.cpp's own llama-bench times it (the build `make llama-server` makes), once a round.
Each forward's cost against the same forward at the first context is a per-round paired ratio (mean, bootstrap 95%
interval). It prints a table and, last, one JSON line.

    python benchmarks/context_cost.py --dtype bf16 --attn sdpa,exact --contexts 200,2000,6000 --rounds 7 --threads 2
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
from lossless.decoding.loop import commit_cache
from lossless.errors import LosslessError
from lossless.stats import bootstrap_mean

from forward_cost import floor_call, weight_tensors

ROWS = {"step": 1, "verify 9 rows": 9}
BENCH_TOKENS = 8  # tokens llama-bench generates at each context a round (its time a token is their mean)
PAUSE = 0.05  # seconds after each llama.cpp call


def prompt_ids(n: int) -> list[int]:
    """The first n tokens of one fixed prompt (every context is a prefix of the longest)."""
    return [(7 * i) % 1000 + 100 for i in range(n)]


def ours(model, n: int) -> dict:
    """{forward: call} over a cache of n prompt tokens (each call leaves the cache as it found it)."""
    cache, _ = model.prefill(prompt_ids(n))
    length = cache.get_seq_length()
    return {name: (lambda r=r: (model.verify(cache, [42] * r), commit_cache(cache, length + 1)))
            for name, r in ROWS.items()}


class LlamaCppSteps:
    """llama.cpp's decode step after n prompt tokens: `hold(n)` makes its cache hold exactly the prompt's first n
    tokens (reusing the common prefix, untimed), `step()` decodes one token there and rewinds."""

    def __init__(self, peer):
        self.llm, self.n = peer.llm, 0

    def hold(self, n: int) -> None:
        ids = prompt_ids(n)
        held = list(self.llm.input_ids[:self.llm.n_tokens])
        common = next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), n))
        self.llm.n_tokens = common  # eval drops the cache's positions from n_tokens on, then appends
        if common < n:
            self.llm.eval(ids[common:])
        self.n = n

    def step(self) -> None:
        self.llm.n_tokens = self.n
        self.llm.eval([42])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--attn", default="sdpa,exact", help="kernels side by side, comma-separated")
    ap.add_argument("--contexts", default="200,2000,6000", help="context lengths, comma-separated (the first is the base)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="seed of each round's order")
    ap.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp's decode step (needs llama-cpp-python)")
    ap.add_argument("--llama-bench", action="store_true",
                    help="also time llama.cpp's decode step with its own llama-bench (`make llama-server` builds it), "
                         f"{BENCH_TOKENS} tokens at each context, once a round")
    args = ap.parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c]
        if not contexts or min(contexts) < 1 or len(set(contexts)) < len(contexts):
            raise LosslessError(f"--contexts '{args.contexts}': expected distinct positive lengths, e.g. 200,2000,6000")
        if args.rounds < 2:
            raise LosslessError("--rounds: at least 2, for an interval")
        torch.set_num_threads(args.threads)
        attns = list(dict.fromkeys(a for a in args.attn.split(",") if a))
        models = {a: lossless.load_model(args.model, args.dtype, attn=a, head="none") for a in attns}
        limit = next(iter(models.values())).backbone.config.max_position_embeddings
        if max(contexts) + max(ROWS.values()) > limit:
            raise LosslessError(f"--contexts: {max(contexts)} tokens and a {max(ROWS.values())}-row verify pass "
                                f"{args.model}'s context of {limit}; choose contexts up to {limit - max(ROWS.values())}")
        peer = None
        if args.llama_cpp:
            import peers

            if not peers.available():
                raise LosslessError("--llama-cpp: llama_cpp does not import; pip install .[peers] (see docs/speed.md)")
            peer = peers.LlamaCpp(args.model, args.dtype, args.threads, n_ctx=max(contexts) + 64)
        bench_run = None
        if args.llama_bench:
            from lossless.study import llamacpp

            llamacpp.require_bench()
            gguf = llamacpp.server_gguf(args.model, args.dtype)
            bench_run = lambda: llamacpp.bench(gguf, args.threads, depths=contexts, n_gen=BENCH_TOKENS)  # noqa: E731
    except (LosslessError, ValueError) as exc:
        print(f"context_cost: error: {exc}", file=sys.stderr)
        return 2
    calls = {}
    for a, model in models.items():
        for n in contexts:
            for name, fn in ours(model, n).items():
                calls[(a, n, name)] = fn
    steps = LlamaCppSteps(peer) if peer is not None else None
    for n in contexts if steps is not None else []:
        calls[("llama.cpp", n, "step")] = lambda n=n: (steps.hold(n), steps.step())
    weights = weight_tensors(models[attns[-1]], calls[(attns[-1], contexts[0], "step")])
    floor = floor_call(weights, args.threads)
    for fn in list(calls.values()) + [floor]:  # warm-up
        fn()
    order = list(calls)
    rng = random.Random(args.seed)
    times = {key: [] for key in calls}
    if bench_run is not None:  # one llama-bench run a round times every context (its own warm-up first)
        order.append(("llama-bench run", -1, ""))
        times.update({("llama-bench", n, "step"): [] for n in contexts})
    floors = []
    for _ in range(args.rounds):
        rng.shuffle(order)
        start = time.perf_counter()
        floor()
        floors.append(time.perf_counter() - start)
        for key in order:
            if key[0] == "llama-bench run":
                try:
                    for test in bench_run():
                        times[("llama-bench", test["depth"], "step")].append(test["ms"] / 1000)
                except LosslessError as exc:
                    print(f"context_cost: error: {exc}", file=sys.stderr)
                    return 2
                continue
            fn = calls[key]
            if key[0] == "llama.cpp":
                steps.hold(key[1])  # this context's prompt in its cache, untimed
                fn = steps.step
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
            if key[0] == "llama.cpp":
                time.sleep(PAUSE)  # llama.cpp's threads poll for work a while after a call: not in the next timing
    floor_ms = 1000 * statistics.median(floors)
    mbytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    rows = []
    for key, ts in times.items():
        kernel, n, name = key
        base = times[(kernel, contexts[0], "step")]
        ratio = bootstrap_mean([t / b for t, b in zip(ts, base)])
        rows.append({"kernel": kernel, "context": n, "forward": name, "ms": round(1000 * statistics.median(ts), 2),
                     "vs_floor": round(1000 * statistics.median(ts) / floor_ms, 3),
                     "vs_base_step": round(ratio["mean"], 3), "ci95": [round(x, 3) for x in ratio["ci95"]]})
    rows.sort(key=lambda r: (r["kernel"], r["forward"], r["context"]))
    print(f"model={args.model} dtype={args.dtype} threads={args.threads} rounds={args.rounds} contexts={contexts}")
    print(f"floor: one read of the {len(weights)} linear weights ({mbytes:.0f} MB) {floor_ms:.1f} ms "
          f"({mbytes / floor_ms:.1f} GB/s)")
    print(f"{'kernel':<12}{'forward':<15}{'context':>8}{'ms':>9}{'x floor':>9}   x step at {contexts[0]} [95% CI]")
    for r in rows:
        print(f"{r['kernel']:<12}{r['forward']:<15}{r['context']:>8}{r['ms']:>9.1f}{r['vs_floor']:>9.2f}   "
              f"{r['vs_base_step']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]")
    print(json.dumps({"benchmark": "context_cost", "model": args.model, "dtype": args.dtype, "threads": args.threads,
                      "rounds": args.rounds, "contexts": contexts,
                      "floor": {"mb": round(mbytes, 1), "ms": round(floor_ms, 2)}, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
