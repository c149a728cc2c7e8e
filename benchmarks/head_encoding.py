"""Tokens per step of the draft head as trained (fp32, from the training checkpoint) against the same
head as shipped (int8 deltas over the AR weights), and against the untrained (copied) head.

    python benchmarks/head_encoding.py --head heads/smollm2-135m --limit 8 --max-new-tokens 96

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import lossless
from lossless import paths
from lossless.training.distill import read_prompts
from lossless.text import encode_prompt
from lossless.training.train import CHECKPOINT


def tokens_per_step(model, encoded, max_new_tokens):
    rows = []
    for ids in encoded:
        s = lossless.decode(model, ids, "orthrus", lossless.DecodeConfig(max_new_tokens=max_new_tokens))
        rows.append((len(s.generated) - 1) / max(s.stats.steps, 1))
    return statistics.mean(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default=str(paths.HEADS_DIR / "smollm2-135m"))
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--suite", default=str(paths.HELDOUT_PROMPTS))
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    head = Path(args.head)
    model = lossless.load_model(args.model, args.dtype, head="none")
    encoded = [encode_prompt(model.tokenizer, p["prompt"]) for p in read_prompts(args.suite)[: args.limit]]
    results = {"untrained": tokens_per_step(model, encoded, args.max_new_tokens)}
    model.load_head(head)
    results["shipped"] = tokens_per_step(model, encoded, args.max_new_tokens)
    results["shipped_encoding"] = model.head_info.encoding
    ckpt = head / CHECKPOINT
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        with torch.no_grad():
            for name, p in model.head_parameters().items():
                p.copy_(state["head"][name].to(p.dtype))
        results["full_precision"] = tokens_per_step(model, encoded, args.max_new_tokens)
    size = sum(f.stat().st_size for f in head.glob("head.*"))
    results["shipped_bytes"] = size
    print(f"model={args.model} dtype={args.dtype} prompts={len(encoded)} max_new_tokens={args.max_new_tokens}")
    print(f"{'head':<22}{'tokens/step':>12}")
    for key in ("untrained", "full_precision", "shipped"):
        if key in results:
            label = key + (f" ({results['shipped_encoding']})" if key == "shipped" else "")
            print(f"{label:<22}{results[key]:>12.3f}")
    print(f"shipped head files: {size / 2**20:.1f} MiB")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
