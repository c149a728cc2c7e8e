"""What a prefill costs: stock kernels against exact mode's fixed-order kernels, over prompt lengths.

Exact mode runs the prefill on its own kernels (causal attention over the prompt, linear layers blocked over
rows), so that every trajectory starts from a cache with the same bits on any machine. This times
`model.prefill` on random token ids of each `--lengths` entry, both kernels warmed up, alternating in one process
for `--repeats` rounds (medians), and prints a table and, last, one JSON line.

    python benchmarks/prefill.py --dtype bf16 --lengths 200,2000 --repeats 3 --threads 2

With `--llama-bench`, llama.cpp's own llama-bench (the build `make llama-server` makes) times its prefill of each
length on the same GGUF, requantized to `--dtype`, once a round beside them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

import lossless
from lossless.errors import LosslessError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--lengths", default="200,2000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bench", action="store_true",
                        help="also time llama.cpp's prefill with its own llama-bench (`make llama-server` builds it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        if not lengths or min(lengths) < 1:
            raise ValueError
    except ValueError:
        print(f"prefill: error: --lengths '{args.lengths}': expected positive lengths, e.g. 200,2000", file=sys.stderr)
        sys.exit(2)
    bench_run = None
    if args.llama_bench:
        from lossless.study import llamacpp

        try:
            llamacpp.require_bench()
            gguf = llamacpp.server_gguf(args.model, args.dtype)
        except LosslessError as exc:
            print(f"prefill: error: {exc}", file=sys.stderr)
            sys.exit(2)
        bench_run = lambda n: llamacpp.bench(gguf, args.threads, n_prompt=n)[0]["ms"] / 1000  # noqa: E731
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
            if bench_run is not None:
                try:
                    times.setdefault(("llama.cpp", n), []).append(bench_run(n))
                except LosslessError as exc:
                    print(f"prefill: error: {exc}", file=sys.stderr)
                    sys.exit(2)
    rows = []
    print(f"prefill, {args.model} {args.dtype}, {args.threads} threads, {platform.processor() or platform.machine()}, "
          f"medians of {args.repeats}")
    peer = f" {'llama.cpp s':>12} {'exact/llama':>12}" if bench_run is not None else ""
    print(f"{'tokens':>7} {'stock s':>9} {'stock tok/s':>12} {'exact s':>9} {'exact tok/s':>12} {'exact/stock':>12}"
          + peer)
    for n in lengths:
        stock, exact = (statistics.median(times[(attn, n)]) for attn in ("sdpa", "exact"))
        rows.append({"tokens": n, "stock_s": round(stock, 3), "exact_s": round(exact, 3),
                     "stock_tokens_per_s": round(n / stock, 1), "exact_tokens_per_s": round(n / exact, 1)})
        line = f"{n:>7} {stock:>9.2f} {n / stock:>12.0f} {exact:>9.2f} {n / exact:>12.0f} {exact / stock:>12.2f}"
        if bench_run is not None:
            llama = statistics.median(times[("llama.cpp", n)])
            rows[-1].update({"llama_cpp_s": round(llama, 3), "llama_cpp_tokens_per_s": round(n / llama, 1)})
            line += f" {llama:>12.2f} {exact / llama:>12.2f}"
        print(line)
    print(json.dumps({"benchmark": "prefill", "model": args.model, "dtype": args.dtype, "threads": args.threads,
                      "rows": rows}))


if __name__ == "__main__":
    main()
