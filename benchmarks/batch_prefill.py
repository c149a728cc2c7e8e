"""A long prompt joining a busy batch: what chunking its prefill (`lossless serve --prefill-chunk`) buys the
requests already decoding, and what it costs the one joining.

`--decoders` greedy requests (held-out chat prompts, prompt lookup as the server runs them) decode together in a
`BatchDecoder` on exact kernels; once every one of them is past its prompt, a long prompt (`--long` tokens of the
default suite's text, a different stretch for each of `--prompts` prompts) joins. From its arrival until its first
token, every step is timed: that is the gap between two tokens of each request already decoding. Per
`--chunks` setting (`none`: the whole prompt in one step, as before chunking existed), each warmed up once, then
`--repeats` rounds over the prompts, the settings in a shuffled order per prompt and round:
- the longest and the mean gap of the decoding requests while the long prompt joins (their stall),
- the long prompt's time to its first token (TTFT),
and, paired by prompt and round, each setting's ratio to `none` with a bootstrap 95% interval. Every setting's
tokens (the decoders' and the long prompt's first) must equal `none`'s: chunks change no bit. Prints a table and,
last, one JSON line.

    python benchmarks/batch_prefill.py --decoders 7 --long 1500 --chunks none,512,256,128,64,32 --repeats 3 --threads 2
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
from lossless import paths
from lossless.decoding.batch import BatchDecoder
from lossless.jsonio import read_jsonl
from lossless.names import DEFAULT_LOOKUP
from lossless.stats import bootstrap_mean
from lossless.text import encode_prompt

NO_EOS = (-1,)  # no token matches: the decoding requests run for the whole measurement
WHOLE = 1 << 30  # `none`: a chunk no prompt reaches


def long_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens: stretches of the default suite's prompts run together, each from its own
    starting prompt."""
    texts = [r["prompt"] for r in read_jsonl(paths.DEFAULT_SUITE)]
    out = []
    for i in range(n):
        ids, j = [], i * 97
        while len(ids) < length:
            ids += tokenizer.encode(texts[j % len(texts)] + "\n\n", add_special_tokens=False)
            j += 1
        out.append(ids[:length])
    return out


def trial(model, chunk: int, decoders: list[list[int]], long: list[int], lookup: int) -> dict:
    """One long prompt joining `decoders` mid-decode: the gaps of the steps until its first token, its TTFT."""
    from lossless.decoding.loop import DecodeConfig

    dec = BatchDecoder(model, prefill_chunk=chunk)
    running = [dec.add(ids, DecodeConfig(max_new_tokens=model.max_positions // 2, eos_ids=NO_EOS, lookup=lookup))
               for ids in decoders]
    while any(len(s.state.generated) < 3 for s in running):  # everyone past its prompt and decoding
        dec.step()
    before = [len(s.state.generated) for s in running]
    joined = time.perf_counter()
    seq = dec.add(long, DecodeConfig(max_new_tokens=4, eos_ids=NO_EOS))
    gaps = []
    while not seq.state.generated:
        t = time.perf_counter()
        dec.step()
        gaps.append(time.perf_counter() - t)
    ttft = time.perf_counter() - joined
    made = sum(len(s.state.generated) - b for s, b in zip(running, before))
    return {"ttft": ttft, "max_gap": max(gaps), "mean_gap": statistics.mean(gaps), "steps": len(gaps),
            "decoder_tokens_per_second": made / ttft,
            "tokens": [s.state.generated for s in running] + [seq.state.generated[:1]]}


def agree(a: list[list[int]], b: list[list[int]]) -> bool:
    """Two trials' tokens agree: each request's shorter list (chunks let the decoders make more tokens while the
    long prompt joins) begins the longer one, and the long prompt's first token is the same."""
    return len(a) == len(b) and all(x[:len(y)] == y[:len(x)] for x, y in zip(a, b)) and a[-1] == b[-1]


def parse_chunks(text: str) -> dict[str, int]:
    out = {}
    for c in text.split(","):
        c = c.strip()
        if c == "none":
            out[c] = WHOLE
        elif c.isdigit() and int(c) > 0:
            out[c] = int(c)
        else:
            raise SystemExit(f"--chunks: '{c}' is neither 'none' nor a positive integer")
    if "none" not in out:
        out = {"none": WHOLE, **out}  # the reference every ratio is to
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--decoders", type=int, default=7, help="requests decoding when the long prompt joins")
    ap.add_argument("--long", type=int, default=1500, help="tokens of the joining prompt")
    ap.add_argument("--prompts", type=int, default=3, help="different long prompts")
    ap.add_argument("--chunks", default="none,512,256,128,64,32", help="prefill chunks, comma-separated ('none': whole)")
    ap.add_argument("--lookup", type=int, default=DEFAULT_LOOKUP, help="the decoding requests' prompt lookup")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-prompt, per-round order of the settings")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    chunks = parse_chunks(args.chunks)
    model = lossless.load_model(args.model, args.dtype, attn="exact")
    if args.long + 8 > model.max_positions:
        raise SystemExit(f"--long {args.long} does not fit the model's context ({model.max_positions})")
    heldout = [r["prompt"] for r in read_jsonl(paths.HELDOUT_PROMPTS)]
    decoders = [encode_prompt(model.tokenizer, heldout[i % len(heldout)]) for i in range(args.decoders)]
    longs = long_prompts(model.tokenizer, args.prompts, args.long)

    for name, chunk in chunks.items():  # warm-up, untimed
        trial(model, chunk, decoders, longs[0][:256], args.lookup)
    rng = random.Random(args.seed)
    runs: dict[str, list[dict]] = {name: [] for name in chunks}  # in (round, prompt) order, paired across settings
    for r in range(args.repeats):
        for p, long in enumerate(longs):
            order = list(chunks)
            rng.shuffle(order)
            for name in order:
                runs[name].append(trial(model, chunks[name], decoders, long, args.lookup))
            print(f"round {r + 1}/{args.repeats}, prompt {p + 1}/{len(longs)}: done", flush=True)
    same = {name: all(agree(a["tokens"], b["tokens"]) for a, b in zip(runs[name], runs["none"])) for name in chunks}

    def ratio(name, key):
        out = bootstrap_mean([a[key] / b[key] for a, b in zip(runs[name], runs["none"])])
        return {"mean": round(out["mean"], 3), "ci95": [round(x, 3) for x in out["ci95"]]}

    rows = {}
    for name in chunks:
        med = {k: statistics.median(t[k] for t in runs[name])
               for k in ("ttft", "max_gap", "mean_gap", "steps", "decoder_tokens_per_second")}
        rows[name] = {**{k: round(v, 4) for k, v in med.items()}, "same_tokens": same[name],
                      "ttft_vs_none": ratio(name, "ttft"), "max_gap_vs_none": ratio(name, "max_gap")}

    print(f"\n{args.decoders} requests decoding ({args.dtype}, exact, lookup {args.lookup}) when a {args.long}-token "
          f"prompt joins; {args.prompts} prompts x {args.repeats} rounds, medians; {args.threads} threads, "
          f"{platform.processor() or platform.machine()}")
    print(f"| chunk | longest gap (s) | vs none [95% CI] | mean gap (s) | decoders' tokens/s | joining TTFT (s) "
          f"| vs none [95% CI] | steps | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, row in rows.items():
        mg, tt = row["max_gap_vs_none"], row["ttft_vs_none"]
        print(f"| {name} | {row['max_gap']:.3f} | {mg['mean']:.2f}x [{mg['ci95'][0]:.2f}, {mg['ci95'][1]:.2f}] "
              f"| {row['mean_gap']:.3f} | {row['decoder_tokens_per_second']:.1f} | {row['ttft']:.2f} "
              f"| {tt['mean']:.2f}x [{tt['ci95'][0]:.2f}, {tt['ci95'][1]:.2f}] | {row['steps']:.0f} "
              f"| {'yes' if row['same_tokens'] else 'NO'} |")
    print(json.dumps({"benchmark": "batch_prefill", "model": args.model, "dtype": args.dtype,
                      "decoders": args.decoders, "long": args.long, "prompts": args.prompts,
                      "repeats": args.repeats, "lookup": args.lookup, "threads": args.threads,
                      "torch": torch.__version__, "settings": rows}))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
