"""What a prefill costs: stock kernels against exact mode's fixed-order kernels, over prompt lengths.

Exact mode runs the prefill on its own kernels (causal attention over the prompt, linear layers blocked over
rows), so that every trajectory starts from a cache with the same bits on any machine. This times
`model.prefill` on random token ids of each `--lengths` entry, both kernels warmed up, alternating in one process
for `--repeats` rounds (medians), and prints a table and, last, one JSON line.

    python benchmarks/prefill.py --dtype bf16 --lengths 200,2000 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import lossless


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--lengths", default="200,2000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    models = {attn: lossless.load_model(args.model, args.dtype, attn=attn, head="none") for attn in ("sdpa", "exact")}
    vocab = models["sdpa"].config.vocab_size
    ids = torch.randint(100, vocab - 1, (max(lengths),), generator=torch.Generator().manual_seed(0)).tolist()
    for model in models.values():  # warm-up: kernels built and loaded, caches touched
        model.prefill(ids[:64])
    times = {(attn, n): [] for attn in models for n in lengths}
    for r in range(args.repeats):
        for n in lengths:
            for attn in (("sdpa", "exact") if r % 2 == 0 else ("exact", "sdpa")):
                start = time.perf_counter()
                models[attn].prefill(ids[:n])
                times[(attn, n)].append(time.perf_counter() - start)
    rows = []
    print(f"prefill, {args.model} {args.dtype}, {args.threads} threads, {platform.processor() or platform.machine()}, "
          f"medians of {args.repeats}")
    print(f"{'tokens':>7} {'stock s':>9} {'stock tok/s':>12} {'exact s':>9} {'exact tok/s':>12} {'exact/stock':>12}")
    for n in lengths:
        stock, exact = (statistics.median(times[(attn, n)]) for attn in ("sdpa", "exact"))
        rows.append({"tokens": n, "stock_s": round(stock, 3), "exact_s": round(exact, 3),
                     "stock_tokens_per_s": round(n / stock, 1), "exact_tokens_per_s": round(n / exact, 1)})
        print(f"{n:>7} {stock:>9.2f} {n / stock:>12.0f} {exact:>9.2f} {n / exact:>12.0f} {exact / stock:>12.2f}")
    print(json.dumps({"benchmark": "prefill", "model": args.model, "dtype": args.dtype, "threads": args.threads,
                      "rows": rows}))


if __name__ == "__main__":
    main()
