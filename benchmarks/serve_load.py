"""`lossless serve` under load: throughput and latency with 1, 2, 4 and 8 concurrent clients, for one server
configuration or several side by side (`--configs`, e.g. one at a time against `--batch 8`).

Starts one `lossless serve` per configuration (the model, dtype, attn and decoding options given here; by default
the embedded model in the fastest lossless configuration), warms each up, then `--repeats` times, for each level
of concurrency C and each configuration in a shuffled order (the other servers idle), runs C client threads of the
official `openai` client, each streaming `--requests` chat completions of `--max-tokens` tokens over held-out
prompts (taken in turn, so every level and configuration answers the same prompts). Per configuration and level:
total completion tokens / wall seconds, and per request the time to first token and the whole latency (median,
p90), each the median over the repeats; per level, every configuration's throughput as a ratio to the first one's,
paired by repeat, with a bootstrap 95% interval. Prints a table and, last, one JSON line.

A configuration that begins with `llama-server` runs llama.cpp's own server instead (the binary `--llama-server`
names, built as docs/serving.md says), the rest of it being llama-server's options (`llama-server -np 8`: 8 slots,
continuous batching), on the embedded model's GGUF file requantized by that build's `llama-quantize` to `--dtype`
(bf16 where it is auto), with `--threads` threads for decoding and prompts, a context of 1,024 tokens per slot,
and its chat template (`--jinja`). Every request is greedy (temperature 0) and carries an empty system message,
which both servers' SmolLM2 template renders as `lossless` does by default, so both are sent the same prompt
tokens (the table's last column compares the servers' prompt token counts); llama-server is asked not to reuse
a slot's earlier prompt (`cache_prompt: false`): repeats send the same prompts, real clients do not.

`--context-tokens N` puts a long context before each prompt: about N tokens of notes (the held-out prompts' words,
shuffled by the prompt's index), so that requests carry long prompts, as with documents or long chats.

    python benchmarks/serve_load.py --clients 1,2,4,8 --requests 3 --max-tokens 64 --threads 2
    python benchmarks/serve_load.py --configs '--batch 1;--batch 8' --repeats 3 --threads 2
    python benchmarks/serve_load.py --configs '--batch 8;llama-server -np 8' --dtype bf16 --attn exact --repeats 3 \
        --llama-server ~/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from lossless.net import free_port

ROOT = Path(__file__).resolve().parents[1]


LLAMA_SERVER = "llama-server"
SLOT_CONTEXT = 1024  # llama-server's context per slot: a held-out prompt and its answer fit


def start_llama_server(args, port: int, log, options: str) -> subprocess.Popen:
    """llama.cpp's own server on the embedded GGUF requantized to the run's dtype by the same build."""
    from lossless.errors import LosslessError
    from lossless.study import llamacpp

    dtype = "bf16" if args.dtype == "auto" else args.dtype
    try:  # the binary --llama-server names, else $LLAMA_SERVER, `make llama-server`'s build or PATH's
        binary = llamacpp.require_server(args.llama_server)
        gguf = llamacpp.server_gguf(args.model, dtype, binary)
    except LosslessError as exc:
        raise SystemExit(f"serve_load: {exc}") from None
    opts = options.split()
    flag = next((f for f in ("-np", "--parallel") if f in opts), None)
    slots = int(opts[opts.index(flag) + 1]) if flag else 1
    per_slot = SLOT_CONTEXT + args.context_tokens
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
           "-tb", str(args.threads), "-c", str(per_slot * slots), "--jinja", "--no-webui", *opts]
    return wait_healthy(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), port, log, "llama-server")


def start_server(args, port: int, log, serve_args: str) -> subprocess.Popen:
    if serve_args.startswith(LLAMA_SERVER):
        return start_llama_server(args, port, log, serve_args[len(LLAMA_SERVER):])
    cmd = [sys.executable, "-m", "lossless", "serve", "--model", args.model, "--dtype", args.dtype, "--attn", args.attn,
           "--port", str(port), "--max-queue", "64", *serve_args.split()]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    return wait_healthy(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), port, log,
                        "lossless serve")


def wait_healthy(proc: subprocess.Popen, port: int, log, name: str) -> subprocess.Popen:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}: see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{name} did not answer /health within 600 s")


def one_request(client, model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    start = time.perf_counter()
    first, tokens, prompt_tokens, ran = None, 0, None, {}
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "system", "content": ""},
                                                                       {"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=extra):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if chunk.usage:
            tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        ran = (chunk.model_extra or {}).get("lossless") or ran
    return {"ttft": first if first is not None else time.perf_counter() - start,
            "latency": time.perf_counter() - start, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "tokens_per_cycle": ran.get("tokens_per_cycle")}


def run_level(client, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
              extra: dict | None = None) -> dict:
    results, lock = [], threading.Lock()
    work = iter(range(clients * requests))

    failures = []

    def worker():
        for i in work:
            try:
                r = {"prompt": i % len(prompts),
                     **one_request(client, model, prompts[i % len(prompts)], max_tokens, extra)}
            except Exception as exc:  # noqa: BLE001 - a failed request invalidates the level: said below
                failures.append(exc)
                continue
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if failures:
        raise SystemExit(f"{len(failures)} of {clients * requests} requests failed with {clients} clients, e.g. "
                         f"{type(failures[0]).__name__}: {str(failures[0])[:300]}")

    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]

    lat, ttft = [r["latency"] for r in results], [r["ttft"] for r in results]
    cycles = [r["tokens_per_cycle"] for r in results if r["tokens_per_cycle"]]
    return {"clients": clients, "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "seconds": round(wall, 3), "tokens_per_second": round(sum(r["tokens"] for r in results) / wall, 2),
            "latency_median": round(statistics.median(lat), 3), "latency_p90": round(pct(lat, 0.9), 3),
            "ttft_median": round(statistics.median(ttft), 3), "ttft_p90": round(pct(ttft, 0.9), 3),
            "tokens_per_cycle": round(statistics.mean(cycles), 3) if cycles else None,
            "prompt_tokens": {r["prompt"]: r["prompt_tokens"] for r in results}}


def with_context(prompts: list[str], model: str, tokens: int) -> list[str]:
    """Each prompt after about `tokens` tokens of notes: the prompts' words shuffled by the prompt's index."""
    import random

    from lossless.decoding.models import load_tokenizer

    tokenizer, words = load_tokenizer(model), " ".join(prompts).split()
    out = []
    for i, prompt in enumerate(prompts):
        rng, notes = random.Random(i), []
        while len(tokenizer(" ".join(notes))["input_ids"]) < tokens:
            notes += rng.sample(words, len(words))
        ids = tokenizer(" ".join(notes))["input_ids"][:tokens]
        out.append(f"Notes: {tokenizer.decode(ids)}\n\n{prompt}")
    return out


def median_row(runs: list[dict]) -> dict:
    """One configuration at one level over the repeats: each number the median of the runs'."""
    out = {"clients": runs[0]["clients"], "requests": runs[0]["requests"], "repeats": len(runs)}
    for key in ("tokens_per_second", "latency_median", "latency_p90", "ttft_median", "ttft_p90", "tokens_per_cycle"):
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    out["runs"] = runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attn", default="auto")
    parser.add_argument("--serve-args", default="", help="more options of lossless serve, e.g. '--mode ar'")
    parser.add_argument("--configs", default=None,
                        help="several servers' options, separated by ';' (e.g. '--batch 1;--batch 8'): ratios are to "
                             "the first (default: --serve-args alone)")
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--requests", type=int, default=3, help="requests per client at each level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context-tokens", type=int, default=0,
                        help="about this many tokens of notes before each prompt (default: none)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every level and configuration")
    parser.add_argument("--seed", type=int, default=0, help="of the shuffled configuration order")
    parser.add_argument("--threads", type=int, default=2, help="each server's torch threads (llama-server's threads)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="the llama-server binary of a configuration 'llama-server ...' (default: $LLAMA_SERVER, "
                             "else `make llama-server`'s build, else llama-server on PATH); its build's llama-quantize "
                             "requantizes the GGUF")
    args = parser.parse_args()
    import random

    import openai

    from lossless.stats import bootstrap_mean

    configs = [c.strip() for c in args.configs.split(";")] if args.configs else [args.serve_args]
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "data" / "heldout_prompts.jsonl").read_text().splitlines()
               if line.strip()]
    levels = [int(c) for c in args.clients.split(",")]
    prompts = prompts[: max(levels) * args.requests]
    if args.context_tokens:
        prompts = with_context(prompts, args.model, args.context_tokens)
    extras = [{"cache_prompt": False} if c.startswith(LLAMA_SERVER) else None for c in configs]
    servers, clients, names, cards = [], [], [], []
    try:
        for serve_args in configs:
            port = free_port()
            with tempfile.NamedTemporaryFile("w", prefix="serve-load-", suffix=".log", delete=False) as log:
                servers.append(start_server(args, port, log, serve_args))
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=600)
            card = client.models.list().data[0]
            cards.append(card)
            clients.append(client)
            names.append(card.id)
            for prompt in prompts[:2]:  # warm-up: kernels, caches, the first requests' one-off costs
                one_request(client, card.id, prompt, args.max_tokens, extras[len(cards) - 1])
        runs = {(i, c): [] for i in range(len(configs)) for c in levels}
        order = random.Random(args.seed)
        for _ in range(args.repeats):
            for c in levels:
                for i in order.sample(range(len(configs)), len(configs)):
                    runs[(i, c)].append(run_level(clients[i], names[i], prompts, c, args.requests, args.max_tokens,
                                                  extras[i]))
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(30)
    config = (cards[0].model_extra or {}).get("lossless", {})
    from lossless.decoding import kernels

    cpu = f"{kernels.cpu_model()}, {kernels.isa()} kernels"
    notes = f" after {args.context_tokens} tokens of notes" if args.context_tokens else ""
    print(f"{names[0]} ({config.get('dtype')} {config.get('attn')}); {args.requests} requests per "
          f"client, {args.max_tokens} tokens each{notes}, {args.threads} threads, {args.repeats} repeat(s) (medians), {cpu}")
    print(f"{'configuration':<20} {'clients':>7} {'tokens/s':>9} {'vs first [95% CI]':>22} {'latency med':>11} "
          f"{'p90':>7} {'ttft med':>8} {'p90':>7} {'tok/cycle':>9} {'prompts':>8}")
    table = []
    for i, serve_args in enumerate(configs):
        for c in levels:
            row = {"serve_args": serve_args, **median_row(runs[(i, c)])}
            ratio = bootstrap_mean([a["tokens_per_second"] / b["tokens_per_second"]
                                    for a, b in zip(runs[(i, c)], runs[(0, c)])]) if i else None
            row["tokens_per_second_vs_first"] = ratio
            # the prompt token counts each server reported, against the first configuration's (the same prompts)
            mine = {k: v for r in runs[(i, c)] for k, v in r["prompt_tokens"].items()}
            first = {k: v for r in runs[(0, c)] for k, v in r["prompt_tokens"].items()}
            row["same_prompt_tokens"] = all(first.get(k) == v for k, v in mine.items())
            table.append(row)
            vs = ("1.00x" if not ratio else f"{ratio['mean']:.2f}x" if args.repeats < 2 else
                  f"{ratio['mean']:.2f}x [{ratio['ci95'][0]:.2f}, {ratio['ci95'][1]:.2f}]")
            print(f"{serve_args or 'defaults':<20} {c:>7} {row['tokens_per_second']:>9.1f} {vs:>22} "
                  f"{row['latency_median']:>11.2f} {row['latency_p90']:>7.2f} {row['ttft_median']:>8.2f} "
                  f"{row['ttft_p90']:>7.2f} {row['tokens_per_cycle'] if row['tokens_per_cycle'] is not None else '-':>9} "
                  f"{'same' if row['same_prompt_tokens'] else 'DIFFER':>8}")
    print(json.dumps({"benchmark": "serve_load", "model": names[0], "config": config, "configs": configs,
                      "threads": args.threads, "max_tokens": args.max_tokens, "context_tokens": args.context_tokens,
                      "repeats": args.repeats, "cpu": cpu,
                      "levels": table}))


if __name__ == "__main__":
    main()
