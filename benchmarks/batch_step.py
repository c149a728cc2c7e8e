"""What one batched step costs, by the number of sequences decoding together and their context length.

For each `--batch` size B and `--contexts` length C, a `BatchDecoder` on exact kernels holds B greedy AR
sequences (random token ids of C tokens, no prompt lookup, so that every step runs exactly B rows) past their
prompts; then steps are timed, the (B, C) settings visited in a shuffled order each round, `--rounds` rounds
(medians). Per setting: the step's time, as a multiple of one sequence's step at the same context, and the tokens
per second over all sequences. The sequences share one cache; exact attention scores only the 16-key tiles
holding keys a row sees, and each sequence's prompt lies together in it, so a row reads its own C keys (and the
few tiles its steps share with the others'), and the step's cost grows with B x C through the keys each row
reads, not through the whole shared cache: what this shows. Prints a table and, last, one JSON line.

    python benchmarks/batch_step.py --batch 1,2,4,8 --contexts 100,500,1000 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

import lossless
from lossless.decoding.batch import BatchDecoder

NO_EOS = (-1,)  # no token matches: every sequence decodes for the whole measurement


def ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{option}: expected comma-separated integers, got '{text}'") from None
    if any(v < 1 for v in values):
        raise SystemExit(f"{option}: every value must be >= 1, got '{text}'")
    return values


def time_steps(model, batch: int, context: int, steps: int, seed: int) -> float:
    """The median time of `steps` steps of `batch` sequences of `context` prompt tokens, past their prompts."""
    from lossless.decoding.loop import DecodeConfig

    rng = random.Random(seed)
    vocab = model.backbone.config.vocab_size
    dec = BatchDecoder(model, prefill_chunk=1 << 30)
    for _ in range(batch):
        dec.add([rng.randrange(vocab) for _ in range(context)], DecodeConfig(max_new_tokens=steps + 8, eos_ids=NO_EOS))
    for _ in range(2):  # the prompts, then one step
        dec.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        dec.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch", default="1,2,4,8", help="sequences decoding together, comma-separated")
    ap.add_argument("--contexts", default="100,500,1000", help="their prompts' length in tokens, comma-separated")
    ap.add_argument("--steps", type=int, default=12, help="steps timed per setting and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    sizes, contexts = ints(args.batch, "--batch"), ints(args.contexts, "--contexts")
    torch.set_num_threads(args.threads)
    model = lossless.load_model(args.model, args.dtype, attn="exact")
    if max(contexts) + args.steps + 8 > model.max_positions:
        raise SystemExit(f"--contexts {max(contexts)} does not fit the model's context ({model.max_positions})")
    settings = [(b, c) for c in contexts for b in sorted(set([1, *sizes]))]
    for b, c in settings:  # warm-up, untimed
        time_steps(model, b, c, 2, args.seed)
    rng = random.Random(args.seed)
    times: dict[tuple[int, int], list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        order = list(settings)
        rng.shuffle(order)
        for b, c in order:
            times[(b, c)].append(time_steps(model, b, c, args.steps, args.seed + r))
        print(f"round {r + 1}/{args.rounds}: done", flush=True)
    rows = []
    for b, c in settings:
        step = statistics.median(times[(b, c)])
        alone = statistics.median(times[(1, c)])
        rows.append({"batch": b, "context": c, "step_ms": round(step * 1000, 2),
                     "vs_one_sequence": round(step / alone, 3), "tokens_per_second": round(b / step, 1),
                     "shared_cache": b * (c + 2)})
    print(f"\nbatched AR steps ({args.dtype}, exact, no lookup), medians of {args.rounds} rounds x {args.steps} steps; "
          f"{args.threads} threads, {platform.processor() or platform.machine()}")
    print("| context | sequences | shared cache (keys) | step (ms) | vs one sequence | tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['context']} | {row['batch']} | {row['shared_cache']} | {row['step_ms']:.1f} "
              f"| {row['vs_one_sequence']:.2f}x | {row['tokens_per_second']:.1f} |")
    print(json.dumps({"benchmark": "batch_step", "model": args.model, "dtype": args.dtype, "rounds": args.rounds,
                      "steps": args.steps, "threads": args.threads, "torch": torch.__version__, "settings": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
