"""What a decode holds in memory: the peak resident set of `lossless generate` on stock kernels and in exact mode.

Each configuration runs in a fresh process (one at a time, so peaks do not overlap): first the command a user
types, `lossless generate PROMPT --attn A --dtype D --max-new-tokens N` (its peak from the kernel's rusage of the
finished child), then the same load and decode step by step in a second process that reads its own resident set
(`VmRSS`) and peak (`VmHWM`) after each stage: torch and lossless imported, the model loaded, the first forward
(where exact mode packs its weights), the decode done. Prints a table and, last, one JSON line.

`--prompt-tokens N` decodes after a long prompt instead (about N tokens: numbered copies of the short one), where
attention's working memory and the cache show.

    python benchmarks/memory.py --dtype bf16 --attn sdpa,exact --threads 2
    python benchmarks/memory.py --dtype bf16 --attn sdpa,exact --threads 2 --prompt-tokens 6000 --max-new-tokens 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

PROMPT = "Write a short note to a colleague about moving a meeting to Thursday."

STAGES = r"""
import json, sys
def mem():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
    return {k: int(v.split()[0]) / 1024 for k, v in fields.items()}  # MiB
out = {}
import torch, lossless
torch.set_num_threads(int(sys.argv[4]))
out["imported"] = mem()
model = lossless.load_model(sys.argv[1], sys.argv[2], attn=sys.argv[3])
out["loaded"] = mem()
model.generate(sys.argv[5], max_new_tokens=1)
out["first forward"] = mem()
model.generate(sys.argv[5], max_new_tokens=int(sys.argv[6]))
out["decoded"] = mem()
print(json.dumps(out))
"""


def peak_of_command(args: list[str], env: dict) -> float:
    """Peak resident set (MiB) of a child process running `args` to completion."""
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(args)} failed: {err.strip().splitlines()[-1] if err.strip() else status}")
    return usage.ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--attn", default="sdpa,exact")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of about this many tokens (default: "
                        "a short one)")
    args = parser.parse_args()
    prompt = PROMPT
    if args.prompt_tokens:  # each numbered copy is about 18 tokens
        prompt = " ".join(f"Note {i}: {PROMPT}" for i in range(max(1, args.prompt_tokens // 18)))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    results = []
    for attn in args.attn.split(","):
        cli = [sys.executable, "-m", "lossless", "generate", prompt, "--model", args.model, "--dtype", args.dtype,
               "--attn", attn, "--max-new-tokens", str(args.max_new_tokens)]
        peak = peak_of_command(cli, env)
        staged = subprocess.run([sys.executable, "-c", STAGES, args.model, args.dtype, attn, str(args.threads),
                                 prompt, str(args.max_new_tokens)], env=env, capture_output=True, text=True)
        if staged.returncode != 0:
            raise SystemExit(f"staged run ({attn}) failed: {staged.stderr.strip().splitlines()[-1]}")
        stages = json.loads(staged.stdout.strip().splitlines()[-1])
        results.append({"attn": attn, "cli_peak_mib": round(peak, 1),
                        "stages": {k: {"rss_mib": round(v["VmRSS"], 1), "peak_mib": round(v["VmHWM"], 1)}
                                   for k, v in stages.items()}})
    after = f" after about {args.prompt_tokens} prompt tokens" if args.prompt_tokens else ""
    print(f"peak resident memory, {args.model} {args.dtype}, {args.max_new_tokens} new tokens{after}, {args.threads} threads, "
          f"{platform.processor() or platform.machine()}")
    names = list(results[0]["stages"])
    print(f"{'attn':>6} {'generate peak':>14} " + " ".join(f"{n + ' rss/peak':>26}" for n in names))
    for r in results:
        cells = " ".join(f"{r['stages'][n]['rss_mib']:>12.0f} / {r['stages'][n]['peak_mib']:>11.0f}" for n in names)
        print(f"{r['attn']:>6} {r['cli_peak_mib']:>11.0f} MiB {cells}")
    if len(results) > 1:
        base = results[0]["cli_peak_mib"]
        for r in results[1:]:
            print(f"{r['attn']} against {results[0]['attn']}: {100 * (r['cli_peak_mib'] / base - 1):+.0f}% peak")
    print(json.dumps({"benchmark": "memory", "model": args.model, "dtype": args.dtype, "threads": args.threads,
                      "prompt_tokens": args.prompt_tokens,
                      "max_new_tokens": args.max_new_tokens, "results": results}))


if __name__ == "__main__":
    main()
