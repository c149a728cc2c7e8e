"""Draft-head training throughput: one optimiser step's time, per setting, alternating in one process.

A step is `--seqs` sequences of `--length` tokens (a prompt of `--prompt` tokens plus the response) with
`--anchors` blocks each; token ids come from the model's own greedy responses to held-out prompts (the
content does not change the cost). Settings are `autocast:anchors[:k]`, e.g. `off:32,bf16:32,bf16:64:4` (k: the
block size trained, default the model's); `--chunk-blocks 0,8` runs every setting with each chunking
of the draft pass's attention (0: one masked attention over all rows; N: chunks of N blocks).
Reported per setting: seconds per step (median over rounds), sequence tokens per second, and supervised
positions per second (block positions with a target: what the loss learns from). The last stdout line
is one JSON object.

    python benchmarks/train_throughput.py --settings off:32,bf16:32,bf16:64,bf16:96,bf16:32:4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import lossless
from lossless import paths
from lossless.training.distill import read_prompts
from lossless.errors import LosslessError
from lossless.text import encode_prompt
from lossless.training.train import CHUNK_BLOCKS, DistillLoss, FrozenCast, choose_anchors, resolve_autocast, step_rng


def parse_settings(text: str) -> list[tuple[str, int, int | None]]:
    out = []
    for item in text.split(","):
        cast, anchors, *k = item.strip().split(":")
        try:
            if len(k) > 1:
                raise ValueError
            out.append((cast, int(anchors), int(k[0]) if k else None))
        except ValueError:
            raise LosslessError(f"--settings '{item}': expected autocast:anchors[:k], e.g. bf16:64 or bf16:64:4") from None
    return out


def sequences(model, n: int, length: int, prompt: int) -> list[list[int]]:
    """`n` real token sequences: a held-out prompt's ids cut or padded to `prompt`, then the model's greedy
    continuation, to `length` tokens."""
    out = []
    for p in read_prompts(paths.HELDOUT_PROMPTS)[:n]:
        ids = encode_prompt(model.tokenizer, p["prompt"])[:prompt]
        state = lossless.decode(model, ids, "ar", lossless.DecodeConfig(max_new_tokens=length - len(ids), eos_ids=(-1,)))
        out.append((ids + state.generated)[:length])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--settings", default="off:32,bf16:32,bf16:64,bf16:96")
    ap.add_argument("--seqs", type=int, default=4, help="sequences per step")
    ap.add_argument("--length", type=int, default=220, help="tokens per sequence")
    ap.add_argument("--prompt", type=int, default=60, help="prompt tokens per sequence (at most)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk-blocks", default=str(CHUNK_BLOCKS), help="comma-separated blocks per attention chunk")
    args = ap.parse_args(argv)
    settings = parse_settings(args.settings)
    model = lossless.load_model(args.model, "fp32", head="none")
    chunkings = [int(c) for c in args.chunk_blocks.split(",")]
    settings = [(c, a, k or model.k, n) for c, a, k in settings for n in chunkings]
    for p in model.backbone_parameters().values():
        p.requires_grad_(False)
    seqs = sequences(model, args.seqs, args.length, args.prompt)
    losses = {(k, n): DistillLoss(model, k, chunk_blocks=n) for _, _, k, n in settings}
    casts = {c: FrozenCast(model, resolve_autocast(c, model.device)) for c, _, _, _ in settings}

    def one_step(cast: str, anchors: int, k: int, chunks: int, r: int) -> tuple[float, int, int]:
        t0 = time.perf_counter()
        tokens = positions = 0
        with casts[cast].step():
            for j, ids in enumerate(seqs):
                n_prompt = min(args.prompt, len(ids) - 2)
                a = choose_anchors(step_rng(r, 0, j), n_prompt, len(ids), anchors)
                loss, n_pos, _ = losses[(k, chunks)](ids, n_prompt, a)
                loss.backward()
                tokens += len(ids)
                positions += n_pos
        for p in model.head_parameters().values():
            p.grad = None
        return time.perf_counter() - t0, tokens, positions

    times: dict[tuple[str, int, int, int], list[float]] = {s: [] for s in settings}
    counts: dict[tuple[str, int, int, int], tuple[int, int]] = {}
    for s in settings:  # warm-up
        one_step(*s, 0)
    for r in range(1, args.rounds + 1):
        for s in settings:  # alternate: the machine's noise hits every setting alike
            dt, tokens, positions = one_step(*s, r)
            times[s].append(dt)
            counts[s] = (tokens, positions)
    rows = []
    for (cast, anchors, k, chunks), ts in times.items():
        sec = statistics.median(ts)
        tokens, positions = counts[(cast, anchors, k, chunks)]
        rows.append({"autocast": cast, "anchors": anchors, "k": k, "chunk_blocks": chunks, "seconds_per_step": round(sec, 3),
                     "tokens_per_second": round(tokens / sec, 1), "positions_per_second": round(positions / sec, 1)})
    base = rows[0]["positions_per_second"]
    print(f"{'autocast':>8} {'anchors':>7} {'k':>3} {'chunks':>6} {'s/step':>8} {'tokens/s':>9} {'positions/s':>12} {'vs first':>9}")
    for row in rows:
        print(f"{row['autocast']:>8} {row['anchors']:>7} {row['k']:>3} {row['chunk_blocks']:>6} {row['seconds_per_step']:>8.2f} {row['tokens_per_second']:>9.1f} "
              f"{row['positions_per_second']:>12.1f} {row['positions_per_second'] / base:>8.2f}x")
    from lossless.study.audit import machine_id

    print(json.dumps({"machine": machine_id(), "seqs": args.seqs, "length": args.length,
                      "settings": rows}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LosslessError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
