"""Real model sizes, by simulation: exact AR, stock AR and llama.cpp's greedy decoding on random-weight models of
public checkpoints' shapes (Qwen3-0.6B, Llama-3.2-1B, Qwen3-1.7B; `forward_cost.SHAPES`), the same bf16 weights in
both engines.

Each size is made once and cached (`$LOSSLESS_CACHE/random-models/NAME-bf16/`): the seeded random backbone of
`forward_cost.random_backbone`, saved as a model directory (safetensors) that `lossless.load_model` reads, and as a
GGUF file of the same weights bit for bit (`study.llamacpp.write_gguf`) that llama.cpp's server reads. A forward's
time depends on the shapes only, so these cost what the real models cost.

Two phases per size, nothing else running meanwhile:
1. **Peak memory**, each method once (`--repeats` times) in shuffled order, each in a fresh process (so peaks do not
   mix): `exact` and `stock` load the model (`lossless.load_model(DIR, "bf16", attn=...)`), warm up and decode; their
   process's peak resident memory. `llama.cpp`: llama-server (`make llama-server`) with the same threads, the same
   decodes; the server's peak. Each run's tokens/s is printed too (a fresh process's, before the machine settles).
2. **Speed, paired**: one process holds every method at once (our models loaded, a llama-server beside them), warms
   each up, then in `--rounds` rounds decodes with each method in shuffled order, seconds apart: `--tokens` greedy
   tokens after a 32-token prompt. Ours: tokens / (a decode of N + 1 tokens minus one of 1 token, the prefill);
   llama.cpp: its own decode time (its "predicted" timing, from the first token to the last, so N - 1 forwards).
   Each round's ratios pair methods measured within seconds of each other, so the machine's memory bandwidth,
   which moves by half between minutes on a shared VM, cancels.
Prints a table per size (tokens/s: medians; ratios: the geometric mean of the rounds' paired ratios with its 95%
t-interval) and, last, one JSON line.

    python benchmarks/model_sizes.py --sizes qwen3-0.6b,llama-3.2-1b,qwen3-1.7b --tokens 32 --rounds 10 --threads 2

The forward cost against rows at these sizes and the speed-up the shipped head's tokens per cycle would give there
come from `forward_cost.py --model random:NAME --tokens-per-cycle T`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lossless.errors import LosslessError  # noqa: E402
from lossless.paths import cache_dir  # noqa: E402
from lossless.study import llamacpp  # noqa: E402

METHODS = ("exact", "stock", "llama.cpp")
KERNEL = {"exact": "exact", "stock": "sdpa"}  # our methods' attention kernels
PROMPT = [100 + 7 * i for i in range(32)]

OURS = r"""
import json, sys, time, torch
import lossless
from lossless.decoding.loop import DecodeConfig, decode
path, attn, threads, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompt = json.loads(sys.argv[5])
torch.set_num_threads(threads)
model = lossless.load_model(path, "bf16", attn=attn)
def run(k):
    t = time.perf_counter()
    state = decode(model, prompt, "ar", DecodeConfig(max_new_tokens=k, eos_ids=(-1,)))  # no end: each run decodes k
    assert len(state.generated) == k, (len(state.generated), k)
    return time.perf_counter() - t
run(n + 1)  # warm-up: exact mode packs its weights on its first forward, and every page is touched
prefill = min(run(1) for _ in range(3))
whole = min(run(n + 1) for _ in range(2))
peak = next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"tokens_per_s": n / (whole - prefill), "peak_mib": peak}))
"""


PAIRED = r"""
import json, random, sys, time, torch
import lossless
from lossless.decoding.loop import DecodeConfig, decode
from lossless.study import llamacpp
path, methods, threads, n, rounds, seed = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5]), int(sys.argv[6])
prompt = json.loads(sys.argv[7])
torch.set_num_threads(threads)
models = {m: lossless.load_model(path, "bf16", attn={"exact": "exact", "stock": "sdpa"}[m]) for m in methods
          if m != "llama.cpp"}
server = llamacpp.Server(llamacpp.require_server(), path + "/model.gguf", threads) if "llama.cpp" in methods else None
def ours(model, k):
    t = time.perf_counter()
    state = decode(model, prompt, "ar", DecodeConfig(max_new_tokens=k, eos_ids=(-1,)))
    assert len(state.generated) == k, (len(state.generated), k)
    return time.perf_counter() - t
def tokens_per_s(m):
    if m == "llama.cpp":
        d = server.decode(prompt, n, ignore_eos=True)
        return (len(d.ids) - 1) / d.decode_seconds
    return n / (ours(models[m], n + 1) - ours(models[m], 1))
try:
    if server is not None:
        server.start()
    for m in methods:  # warm-up: exact mode packs its weights on its first forward, and every page is touched
        tokens_per_s(m)
    rng, out = random.Random(seed), {m: [] for m in methods}
    for r in range(rounds):
        order = list(methods)
        rng.shuffle(order)
        for m in order:
            time.sleep(0.2)  # the other engine's threads asleep
            out[m].append(tokens_per_s(m))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{m} {out[m][-1]:.2f}" for m in methods), file=sys.stderr,
              flush=True)
finally:
    if server is not None:
        server.close()
print(json.dumps(out))
"""


def paired(path: Path, methods: list[str], threads: int, tokens: int, rounds: int, seed: int) -> dict:
    """Phase 2: {method: tokens/s per round}, every method in one process, shuffled within each round."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", PAIRED, str(path), ",".join(methods), str(threads), str(tokens),
                           str(rounds), str(seed), json.dumps(PROMPT)], stdout=subprocess.PIPE, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the paired runs on {path.name} failed (exit {done.returncode}): see above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def made(name: str) -> Path:
    """The model directory of `name` (safetensors + model.gguf), made once."""
    import forward_cost

    out = cache_dir() / "random-models" / f"{name}-bf16"
    if (out / "model.gguf").is_file() and (out / "config.json").is_file():
        return out
    print(f"making {name}: random weights, a model directory and a GGUF file of the same weights", file=sys.stderr)
    backbone = forward_cost.random_backbone(name, "bf16")
    out.mkdir(parents=True, exist_ok=True)
    backbone.save_pretrained(out)
    llamacpp.write_gguf(backbone, out / "model.gguf")
    return out


def ours(path: Path, attn: str, threads: int, tokens: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", OURS, str(path), attn, str(threads), str(tokens), json.dumps(PROMPT)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{attn} on {path.name} failed: {' '.join(done.stderr.strip().splitlines()[-1:])}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama(path: Path, threads: int, tokens: int) -> dict:
    server = llamacpp.Server(llamacpp.require_server(), path / "model.gguf", threads)
    try:
        server.start()
        server.decode(PROMPT, tokens, ignore_eos=True)  # warm-up, as for ours
        d = min((server.decode(PROMPT, tokens, ignore_eos=True) for _ in range(2)), key=lambda d: d.decode_seconds)
        # llama.cpp's decode time runs from its first token to its last: one forward fewer than tokens
        return {"tokens_per_s": (len(d.ids) - 1) / d.decode_seconds, "peak_mib": server.peak_mib()}
    finally:
        server.close()


def geomean(ratios: list[float]) -> float:
    return math.exp(statistics.mean(math.log(r) for r in ratios))


def interval(ratios: list[float]) -> list[float]:
    """95% t-interval of the geometric mean of paired ratios."""
    from scipy import stats

    logs = [math.log(r) for r in ratios]
    if len(logs) < 2:
        return [ratios[0], ratios[0]]
    m, s = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    t = stats.t.ppf(0.975, len(logs) - 1)
    return [math.exp(m - t * s), math.exp(m + t * s)]


def main(argv=None) -> int:
    import forward_cost

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="qwen3-0.6b,llama-3.2-1b,qwen3-1.7b",
                    help=f"comma-separated, from {', '.join(forward_cost.SHAPES)}")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded after the prompt")
    ap.add_argument("--repeats", type=int, default=1, help="fresh-process runs of each method (peak memory)")
    ap.add_argument("--rounds", type=int, default=10, help="paired rounds of every method (speed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="of the methods' shuffled order")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    try:
        for s in sizes:
            if s not in forward_cost.SHAPES:
                raise LosslessError(f"unknown size {s}: choose from {', '.join(forward_cost.SHAPES)}")
        for m in methods:
            if m not in METHODS:
                raise LosslessError(f"unknown method {m}: choose from {', '.join(METHODS)}")
        if "llama.cpp" in methods:
            llamacpp.require_server()
        paths = {s: made(s) for s in sizes}
    except LosslessError as exc:
        print(f"model_sizes: error: {exc}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    runs = {(s, m): [] for s in sizes for m in methods}  # the fresh processes' (peaks)
    for r in range(args.repeats):
        for s in sizes:
            order = list(methods)
            rng.shuffle(order)
            for m in order:
                t = time.perf_counter()
                out = llama(paths[s], args.threads, args.tokens) if m == "llama.cpp" else \
                    ours(paths[s], KERNEL[m], args.threads, args.tokens)
                runs[(s, m)].append(out)
                print(f"round {r + 1}/{args.repeats} {s} {m}: {out['tokens_per_s']:.2f} tokens/s, peak "
                      f"{out['peak_mib']:.0f} MiB ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    speed = {}
    for s in sizes:
        t = time.perf_counter()
        print(f"{s}: {args.rounds} paired rounds of {', '.join(methods)}", file=sys.stderr)
        speed[s] = paired(paths[s], methods, args.threads, args.tokens, args.rounds, rng.randrange(2**31))
        print(f"{s}: paired rounds done ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    base = "llama.cpp" if "llama.cpp" in methods else methods[-1]
    result = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "tokens": args.tokens,
              "repeats": args.repeats, "rounds": args.rounds, "sizes": {}}
    print(f"threads={args.threads} tokens={args.tokens} rounds={args.rounds} (tokens/s: medians of the paired rounds; "
          f"ratios: geometric mean of the rounds' paired ratios, 95% CI; peaks: fresh processes)")
    print(f"{'size':<14}{'method':<11}{'tokens/s':>10}{'vs ' + base:>28}{'peak MiB':>10}{'vs stock':>10}")
    for s in sizes:
        rows = {}
        for m in methods:
            tps = speed[s][m]
            peaks = [x["peak_mib"] for x in runs[(s, m)] if x["peak_mib"]]
            ratios = [a / b for a, b in zip(tps, speed[s][base])]
            row = {"tokens_per_s": round(statistics.median(tps), 2), f"vs_{base}": round(geomean(ratios), 3),
                   "ci95": [round(x, 3) for x in interval(ratios)], "peak_mib": round(max(peaks)) if peaks else None,
                   "rounds": [round(x, 3) for x in tps],
                   "fresh_tokens_per_s": [round(x["tokens_per_s"], 2) for x in runs[(s, m)]]}
            rows[m] = row
        for m, row in rows.items():
            stock = rows.get("stock", {}).get("peak_mib")
            row["peak_vs_stock"] = round(row["peak_mib"] / stock, 3) if stock and row["peak_mib"] else None
            ci = f"{row[f'vs_{base}']:.2f}x [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}]"
            vs_stock = f"{row['peak_vs_stock']:.2f}" if row["peak_vs_stock"] else "-"
            print(f"{s:<14}{m:<11}{row['tokens_per_s']:>10.2f}{ci:>28}{row['peak_mib'] or '-':>10}{vs_stock:>10}")
        result["sizes"][s] = rows
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
