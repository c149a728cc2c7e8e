"""Two builds of exact mode's kernels side by side: this checkout's against a git revision's, forward by forward.

A change of the kernels' order or blocking is a change of speed as well as of bits. This runs
`benchmarks/forward_cost.py` of each build in its own process (the revision's from a temporary git worktree,
its kernels built into the same cache), alternating the two `--pairs` times in shuffled order, and prints each
forward's median milliseconds under both and the mean ratio of the pairs with a 95% bootstrap interval over
them (each ratio within one pair of runs made back to back, so the machine's drift between pairs cancels). Where
memory bandwidth swings from one minute to the next, even back-to-back runs differ by more than a change does, so
each forward is also given in steps (its time over the same run's one-row step: the swing cancels within a run)
and the pairs' mean ratio of those (a change that moves the step itself shows in the milliseconds only). The last
stdout line is one JSON object.

    python benchmarks/kernel_ab.py --baseline HEAD~1 --pairs 3 --rounds 12 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lossless.stats import bootstrap_mean

ROOT = Path(__file__).resolve().parents[1]


def forward_cost(tree: Path, args) -> dict:
    """One forward_cost.py run of the checkout at `tree` (its own package first on the path): its JSON line."""
    cmd = [sys.executable, str(tree / "benchmarks" / "forward_cost.py"), "--model", args.model, "--attn", "exact",
           "--dtype", args.dtype,
           "--fused", "", "--rounds", str(args.rounds), "--threads", str(args.threads), "--cache", str(args.cache)]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"kernel_ab: error: forward_cost.py failed in {tree}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="the git revision whose kernels to compare against")
    ap.add_argument("--pairs", type=int, default=3, help="runs of each build, alternating")
    ap.add_argument("--rounds", type=int, default=12, help="forward_cost.py's rounds per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--model", default="smollm2-135m", help="forward_cost.py's --model (e.g. random:qwen3-1.7b)")
    ap.add_argument("--cache", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.pairs < 2:
        print("kernel_ab: error: --pairs must be at least 2 (the interval is over pairs)", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        base = Path(tmp) / "baseline"
        made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
                              capture_output=True, text=True)
        if made.returncode != 0:
            print(f"kernel_ab: error: git cannot check out {args.baseline}: {made.stderr.strip()}", file=sys.stderr)
            return 2
        try:
            runs: dict[str, list[dict]] = {"baseline": [], "this": []}
            for _ in range(args.pairs):
                order = ["baseline", "this"]
                rng.shuffle(order)
                for name in order:
                    runs[name].append(forward_cost(base if name == "baseline" else ROOT, args))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    table = {}
    for name in runs["this"][0]["forwards"]["exact"]:
        old = [r["forwards"]["exact"][name]["ms"] for r in runs["baseline"]]
        new = [r["forwards"]["exact"][name]["ms"] for r in runs["this"]]
        ratios = [b / a for a, b in zip(old, new)]
        boot = bootstrap_mean(ratios)
        lo, hi = boot["ci95"]
        old_steps = [r["forwards"]["exact"][name]["vs_step"] for r in runs["baseline"]]
        new_steps = [r["forwards"]["exact"][name]["vs_step"] for r in runs["this"]]
        in_steps = bootstrap_mean([b / a for a, b in zip(old_steps, new_steps)])
        table[name] = {"rows": runs["this"][0]["forwards"]["exact"][name]["rows"],
                       "variant": runs["this"][0]["forwards"]["exact"][name].get("variant"),
                       "baseline_ms": round(statistics.median(old), 2), "this_ms": round(statistics.median(new), 2),
                       "ratio": round(boot["mean"], 3), "ci": [round(lo, 3), round(hi, 3)],
                       "baseline_steps": round(statistics.median(old_steps), 3),
                       "this_steps": round(statistics.median(new_steps), 3),
                       "steps_ratio": round(in_steps["mean"], 3), "steps_ci": [round(v, 3) for v in in_steps["ci95"]]}
    print(f"exact {args.dtype} forwards, cache {args.cache}, {args.threads} threads: this checkout against "
          f"{args.baseline}, {args.pairs} alternating pairs of {args.rounds} rounds")
    print(f"{'forward':<26}{'rows':>5}{'baseline ms':>13}{'this ms':>10}{'this/baseline':>15}  {'95% CI':<16}"
          f"{'steps before':>13}{'after':>7}{'ratio':>7}  95% CI")
    for name, row in table.items():
        ci = f"[{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]"
        print(f"{name:<26}{row['rows']:>5}{row['baseline_ms']:>13.2f}{row['this_ms']:>10.2f}{row['ratio']:>15.3f}"
              f"  {ci:<16}"
              f"{row['baseline_steps']:>13.3f}{row['this_steps']:>7.3f}{row['steps_ratio']:>7.3f}"
              f"  [{row['steps_ci'][0]:.3f}, {row['steps_ci'][1]:.3f}]")
    print(json.dumps({"baseline": args.baseline, "pairs": args.pairs, "rounds": args.rounds, "threads": args.threads,
                      "dtype": args.dtype, "cache": args.cache, "forwards": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
