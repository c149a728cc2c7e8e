"""Draft heads side by side: how far each one drafts on held-out prompts, in both Orthrus cycles.

For every head (greedy decoding on one loaded backbone, heads swapped in turn):
- two-pass: tokens per draft+verify cycle at the head's own k, the acceptance histogram, and the rate at
  which draft j is accepted once drafts 1..j-1 were;
- two-pass with a candidate tree (`--tree`, default 16 nodes): tokens per cycle;
- fused (k=3, a group for every acceptance count): tokens per forward, prefill included;
- with `--forced DIR` (responses to prompts no compared head trained on, made by `lossless distill`):
  tokens per cycle teacher-forced on fixed blocks of those sequences (`lossless.training.train.forced_eval`),
  thousands of cycles on the same blocks for every head, so small differences between heads show.

Prompts: by default the held-out prompts that neither the speed benchmark (the first 6) nor head
publishing during training (the last 8) looks at, so no head was chosen on them. Every head after the
first is compared with the first on the same prompts: the mean per-prompt difference in tokens per cycle
with its 95% t-interval (per sequence for the forced score). The last stdout line is one JSON object.

    python benchmarks/heads.py heads/smollm2-135m heads/smollm2-135m-ab37ba07 --dtype bf16 --max-new-tokens 96 --tree 16

`data/distill/smollm2-135m-bf16-128-train-prompts` (responses to `data/train_prompts.jsonl`) is held out for
heads trained on `data/distill_prompts.jsonl` (the `make head` run and its arms), not for the head of
`heads/smollm2-135m-ab37ba07`, which trained on those prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from scipy import stats

import lossless
from lossless import paths
from lossless.training.distill import read_prompts
from lossless.errors import LosslessError
from lossless.decoding.head import read_head_config
from lossless.text import encode_prompt


def parse_range(text: str, n: int) -> range:
    """'6:-8' -> range over the held-out prompts (Python slice syntax)."""
    try:
        start, _, stop = text.partition(":")
        return range(n)[slice(int(start) if start else None, int(stop) if stop else None)]
    except ValueError:
        raise LosslessError(f"--prompts '{text}': expected a slice such as 6:-8") from None


def acceptance_rates(hist: list[int]) -> list[float]:
    """From a histogram of drafts accepted per cycle, P(draft j accepted | drafts before it were), j = 1.."""
    rates = []
    for j in range(1, len(hist)):
        reached = sum(hist[j - 1:])
        rates.append(round(sum(hist[j:]) / reached, 3) if reached else 0.0)
    return rates


def forced(model, blocks: list[tuple[list[int], list[int]]]) -> dict:
    """Teacher-forced tokens per cycle on the held-out blocks: overall and per sequence."""
    from lossless.training.train import DistillLoss, forced_accepted, tokens_per_cycle

    loss = DistillLoss(model, model.k)
    per_seq, hist = [], torch.zeros(model.k, dtype=torch.long)
    with torch.no_grad():
        for ids, anchors in blocks:
            accepted = forced_accepted(loss, ids, anchors)
            per_seq.append(float(accepted.float().mean()) + 1)
            hist += torch.bincount(accepted, minlength=model.k)
    return {"forced_tokens_per_cycle": round(tokens_per_cycle(hist), 4), "forced_per_sequence": per_seq,
            "forced_acceptance_by_draft": acceptance_rates(hist.tolist())}


def measure(model, prompts: list[list[int]], max_new_tokens: int, fused_k: int, tree: int) -> dict:
    per_prompt, committed, cycles, hist = [], 0, 0, [0] * model.k
    fused_tokens, fused_forwards, tree_tokens, tree_cycles = 0, 0, 0, 0
    for ids in prompts:
        two = lossless.decode(model, ids, "orthrus", lossless.DecodeConfig(max_new_tokens=max_new_tokens)).stats
        per_prompt.append(two.tokens_per_step)
        committed += two.new_tokens - 1
        cycles += two.steps
        for n in two.accepted:
            hist[n] += 1
        fused = lossless.decode(model, ids, "orthrus", lossless.DecodeConfig(max_new_tokens=max_new_tokens, k=fused_k,
                                                                             cycle="fused")).stats
        fused_tokens += fused.new_tokens
        fused_forwards += fused.forwards
        if tree:
            treed = lossless.decode(model, ids, "orthrus", lossless.DecodeConfig(max_new_tokens=max_new_tokens,
                                                                                 tree=tree)).stats
            tree_tokens += treed.new_tokens - 1
            tree_cycles += treed.steps
    return {"k": model.k, "digest": model.head_digest, "tokens_per_cycle": round(committed / max(cycles, 1), 4),
            "per_prompt": [round(x, 4) for x in per_prompt], "accepted_histogram": hist,
            "acceptance_by_draft": acceptance_rates(hist),
            "fused_tokens_per_forward": round(fused_tokens / max(fused_forwards, 1), 4),
            "tree_tokens_per_cycle": round(tree_tokens / max(tree_cycles, 1), 4) if tree else None}


def paired(a: list[float], b: list[float]) -> dict:
    """Mean of b - a over prompts with its 95% t-interval."""
    diff = [y - x for x, y in zip(a, b)]
    mean = statistics.fmean(diff)
    if len(diff) < 2 or statistics.pstdev(diff) == 0:
        return {"mean": round(mean, 4), "ci95": [round(mean, 4), round(mean, 4)]}
    lo, hi = stats.t.interval(0.95, len(diff) - 1, loc=mean, scale=stats.sem(diff))
    return {"mean": round(mean, 4), "ci95": [round(float(lo), 4), round(float(hi), 4)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+", help="head directories; the first is the one the others are compared with")
    ap.add_argument("--labels", default=None, help="comma-separated names of the heads (default: their paths)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompts", default="6:-8", help="slice of the held-out prompts (default: those no head saw)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--fused-k", type=int, default=3, help="block size of the fused cycle")
    ap.add_argument("--tree", type=int, default=16, help="nodes of the candidate tree measured (0 = none)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--forced", default=None, metavar="DIR",
                    help="also score the heads teacher-forced on held-out responses in DIR (made by `lossless distill`)")
    ap.add_argument("--forced-sequences", type=int, default=256, help="sequences of DIR scored")
    ap.add_argument("--forced-anchors", type=int, default=32, help="fixed blocks per sequence")
    ap.add_argument("--no-decode", action="store_true", help="the forced score only (no decoding of held-out prompts)")
    args = ap.parse_args(argv)
    try:
        labels = args.labels.split(",") if args.labels else list(args.heads)
        if len(labels) != len(args.heads):
            raise LosslessError(f"--labels names {len(labels)} heads for {len(args.heads)} directories")
        for head in args.heads:
            read_head_config(head)
        if args.threads:
            torch.set_num_threads(args.threads)
        rows = read_prompts(paths.HELDOUT_PROMPTS)
        chosen = [rows[i] for i in parse_range(args.prompts, len(rows))]
        if not chosen:
            raise LosslessError(f"--prompts '{args.prompts}' selects no held-out prompt")
        held = []
        if args.forced:
            from lossless.training.distill import check_model, load_records

            check_model(args.forced, args.model)
            held = load_records(args.forced)
        elif args.no_decode:
            raise LosslessError("--no-decode leaves nothing to measure without --forced DIR")
        model = lossless.load_model(args.model, args.dtype, head=args.heads[0])
    except LosslessError as exc:
        print(f"heads: error: {exc}", file=sys.stderr)
        return 2
    prompts = [encode_prompt(model.tokenizer, p["prompt"]) for p in chosen]
    from lossless.training.train import forced_blocks

    blocks = forced_blocks(held, args.forced_sequences, model.k, args.forced_anchors) if held else []
    results: dict[str, dict] = {}
    for label, head in zip(labels, args.heads):
        model.load_head(head)
        results[label] = {} if args.no_decode else measure(model, prompts, args.max_new_tokens, args.fused_k, args.tree)
        if blocks:
            results[label].update(forced(model, blocks))
        print(f"measured {label}", file=sys.stderr)
    first = labels[0]
    for label in labels[1:]:
        if not args.no_decode:
            results[label]["vs_first"] = paired(results[first]["per_prompt"], results[label]["per_prompt"])
        if blocks:
            results[label]["forced_vs_first"] = paired(results[first]["forced_per_sequence"],
                                                       results[label]["forced_per_sequence"])
    def vs_text(vs: dict | None) -> str:
        return f"{vs['mean']:+.3f} [{vs['ci95'][0]:+.3f}, {vs['ci95'][1]:+.3f}]" if vs else "-"

    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()}")
    if not args.no_decode:
        print(f"decoding: prompts={len(prompts)} (held-out {args.prompts}) max_new_tokens={args.max_new_tokens}")
        print(f"{'head':<28}{'k':>3}{'tok/cycle':>11}{'vs first [95% CI]':>28}{'tree tok/cycle':>16}"
              f"{'fused tok/fwd':>15}  accepted: draft 1, 2, 3..")
        for label, r in results.items():
            rates = ", ".join(f"{x:.2f}" for x in r["acceptance_by_draft"][:4])
            tree_text = f"{r['tree_tokens_per_cycle']:.3f}" if r["tree_tokens_per_cycle"] else "-"
            print(f"{label:<28}{r['k']:>3}{r['tokens_per_cycle']:>11.3f}{vs_text(r.get('vs_first')):>28}"
                  f"{tree_text:>16}{r['fused_tokens_per_forward']:>15.3f}  {rates}")
    if blocks:
        print(f"teacher-forced: {len(blocks)} sequences of {args.forced}, {sum(len(a) for _, a in blocks)} blocks")
        print(f"{'head':<28}{'tok/cycle':>11}{'vs first [95% CI]':>28}  accepted: draft 1, 2, 3..")
        for label, r in results.items():
            rates = ", ".join(f"{x:.2f}" for x in r["forced_acceptance_by_draft"][:4])
            print(f"{label:<28}{r['forced_tokens_per_cycle']:>11.3f}{vs_text(r.get('forced_vs_first')):>28}  {rates}")
    print(json.dumps({"prompts": 0 if args.no_decode else len(prompts), "dtype": args.dtype,
                      "max_new_tokens": args.max_new_tokens, "forced_sequences": len(blocks),
                      "heads": {label: {k: v for k, v in r.items() if k not in ("per_prompt", "forced_per_sequence")}
                                for label, r in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
