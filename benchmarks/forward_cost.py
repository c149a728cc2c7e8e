"""The cost model behind the cycles: what one forward costs as its rows grow, and where its time goes.

At a fixed cache length it times, alternating in one process (medians over rounds):
- AR forwards of 1, 2, 4, 8, 16 and 32 rows (a decode step and verify blocks),
- the two-pass draft pass (k rows of the draft view),
- fused forwards `verify_and_draft` for each `--fused k:groups` setting (k verify rows plus `groups`
  draft groups of k rows),
and profiles one decode step and one fused forward by op (linear layers, attention, LM head, the rest).
The last stdout line is one JSON object.

    python benchmarks/forward_cost.py --dtype bf16 --cache 200 --fused 4:2,4:4,8:8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import lossless
from lossless.decoding import commit_cache
from lossless.errors import LosslessError


def parse_fused(text: str) -> tuple[int, int]:
    k, _, groups = text.partition(":")
    try:
        return int(k), int(groups or k)
    except ValueError:
        raise LosslessError(f"--fused '{text}': expected k:groups, e.g. 4:2") from None


def profile_ops(fn, rounds: int = 3) -> dict[str, float]:
    """Milliseconds per call of fn by op family, from the PyTorch profiler's self CPU time."""
    from torch.profiler import profile

    fn()
    with profile(record_shapes=True) as prof:
        for _ in range(rounds):
            fn()
    out: dict[str, float] = {"linear (GEMM)": 0.0, "LM head (GEMM)": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages(group_by_input_shape=True):
        ms = e.self_cpu_time_total / 1000 / rounds
        if e.key in ("aten::mm", "aten::addmm", "aten::bmm"):
            lm_head = any(len(s) == 2 and s[-1] > 10000 for s in (e.input_shapes or []) if s)
            out["LM head (GEMM)" if lm_head else "linear (GEMM)"] += ms
        elif "attention" in e.key:
            out["attention"] += ms
        else:
            out["other"] += ms
    return {k: round(v, 2) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--cache", type=int, default=200, help="cache length the forwards run at")
    ap.add_argument("--fused", default="4:2,4:4,8:8", help="fused settings as k:groups, comma-separated")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args(argv)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        fused = [parse_fused(f) for f in args.fused.split(",") if f]
        model = lossless.load_model(args.model, args.dtype)
    except LosslessError as exc:
        print(f"forward_cost: error: {exc}", file=sys.stderr)
        return 2
    cache, _ = model.prefill([(7 * i) % 1000 + 100 for i in range(args.cache)])
    n = cache.get_seq_length()
    token = 42
    calls = {f"ar {r} row{'s' if r > 1 else ''}": (lambda r=r: model.verify(cache, [token] * r), r)
             for r in (1, 2, 4, 8, 16, 32)}
    calls[f"draft pass k={model.k}"] = (lambda: model.draft(cache, token, model.k), model.k)
    for k, g in fused:
        calls[f"fused k={k} groups={g}"] = (
            lambda k=k, g=g: model.verify_and_draft(cache, [token] * k, list(range(g)), k - 1), k + g * k)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for name, (fn, _) in calls.items():  # warm-up
        fn()
        commit_cache(cache, n + 1)
    for _ in range(args.rounds):
        for name, (fn, _) in calls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            commit_cache(cache, n + 1)
    step = statistics.median(times["ar 1 row"])
    summary = {name: {"rows": rows, "ms": round(1000 * statistics.median(times[name]), 2),
                      "vs_step": round(statistics.median(times[name]) / step, 3)} for name, (_, rows) in calls.items()}
    k0, g0 = fused[0] if fused else (4, 2)
    breakdown = {
        "step": profile_ops(lambda: (model.verify(cache, [token]), commit_cache(cache, n + 1))),
        f"fused k={k0} groups={g0}": profile_ops(lambda: (model.verify_and_draft(cache, [token] * k0, list(range(g0)),
                                                                                   k0 - 1), commit_cache(cache, n + 1))),
    }
    print(f"model={args.model} dtype={args.dtype} cache={n} rounds={args.rounds} threads={torch.get_num_threads()}")
    print(f"{'forward':<26}{'rows':>6}{'ms':>9}{'x step':>9}")
    for name, s in summary.items():
        print(f"{name:<26}{s['rows']:>6}{s['ms']:>9.1f}{s['vs_step']:>9.2f}")
    print("one forward by op (ms, profiler self time):")
    for name, ops in breakdown.items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in ops.items()))
    print(json.dumps({"forwards": summary, "breakdown": breakdown}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
