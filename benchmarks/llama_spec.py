"""llama.cpp's speculative modes against its own plain greedy decoding: speed, and whether the tokens are the same.

Every mode of the audit's llama.cpp candidates (`study.llamacpp.MODES`) and plain decoding, each in its own
llama-server on the embedded GGUF requantized to `--dtype`, with the same threads; the held-out chat prompts (our
chat template's token ids), greedy, `--max-new-tokens`, no top tokens asked for (the audit asks for them, which
costs plain decoding a sort of the vocabulary per token and a verified draft's tokens nothing). Every server is
warmed up; then `--repeats` rounds, the methods in an order shuffled per prompt and round. A method's speed on a
prompt is its median tokens/s (llama.cpp's own prefill plus decode time); its speed-up is the mean over prompts of
the paired ratio to plain decoding, with a bootstrap 95% interval; `= plain` counts prompts whose tokens equal plain
decoding's. Prints a table and, last, one JSON line. Nothing else may run meanwhile.

    python benchmarks/llama_spec.py --dtype bf16 --threads 2 --repeats 3 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

from lossless.errors import LosslessError
from lossless.paths import HELDOUT_PROMPTS
from lossless.stats import bootstrap_mean
from lossless.study import llamacpp
from lossless.text import encode_prompt

PLAIN = llamacpp.GREEDY


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16", choices=sorted(llamacpp.FILE_TYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="the first N held-out prompts (0: all)")
    ap.add_argument("--modes", default=",".join(llamacpp.MODES), help="comma-separated, from the audit's modes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from lossless.decoding.models import load_model

    try:
        modes = [m for m in args.modes.split(",") if m]
        for m in modes:
            if m not in llamacpp.MODES:
                raise LosslessError(f"unknown mode {m}: choose from {', '.join(llamacpp.MODES)}")
        tokenizer = load_model(args.model, "fp32", "cpu", "sdpa", head="none").tokenizer
        servers = {m: llamacpp.server(args.model, args.dtype, m, args.threads) for m in [PLAIN, *modes]}
    except LosslessError as exc:
        print(f"llama_spec: error: {exc}", file=sys.stderr)
        return 2
    texts = [json.loads(line)["prompt"] for line in Path(HELDOUT_PROMPTS).read_text().splitlines() if line.strip()]
    prompts = [encode_prompt(tokenizer, t) for t in texts[:args.limit or None]]
    methods = list(servers)
    for m in methods:  # warm-up
        servers[m].decode(prompts[0], 16, probs=False)
    rng = random.Random(args.seed)
    runs = {(m, i): [] for m in methods for i in range(len(prompts))}
    tokens = {}
    for _ in range(args.repeats):
        for i, ids in enumerate(prompts):
            order = list(methods)
            rng.shuffle(order)
            for m in order:
                d = servers[m].decode(ids, args.max_new_tokens, probs=False)
                runs[(m, i)].append(len(d.ids) / d.seconds)
                tokens[(m, i)] = d.ids
    speed = {(m, i): statistics.median(v) for (m, i), v in runs.items()}
    result = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
              "llama_server": llamacpp.server_version(), "methods": {}}
    print(f"llama.cpp {args.dtype}, {len(prompts)} held-out prompts, {args.max_new_tokens} tokens, {args.threads} "
          f"threads, {args.repeats} repeats (paired per prompt, bootstrap 95% CI); {result['llama_server']}")
    print(f"{'method':<16}{'tokens/s':>10}{'vs plain [95% CI]':>26}{'= plain':>10}")
    for m in methods:
        ratios = [speed[(m, i)] / speed[(PLAIN, i)] for i in range(len(prompts))]
        b = bootstrap_mean(ratios)
        same = sum(tokens[(m, i)] == tokens[(PLAIN, i)] for i in range(len(prompts)))
        row = {"tokens_per_s": round(statistics.mean(speed[(m, i)] for i in range(len(prompts))), 2),
               "vs_plain": round(b["mean"], 3), "ci95": [round(x, 3) for x in b["ci95"]], "same_tokens": same}
        result["methods"][m] = row
        ci = f"{row['vs_plain']:.2f}x [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}]"
        print(f"{m:<16}{row['tokens_per_s']:>10.1f}{ci:>26}{f'{same}/{len(prompts)}':>10}")
    llamacpp.close_all()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
