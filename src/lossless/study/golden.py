"""Golden trajectories of exact mode: recorded on one machine, reproduced bit for bit on any other.

`fingerprint(model, prompt_ids, n)` decodes `n` tokens greedily (exact AR: a prefill, then one step per token) and
keeps the token ids and a digest of every step's logits; `op_digests` digests every op's output of one prefill, in
execution order (the probe's list of ops). `record` writes both for a few prompts per dtype, with the machine and
kernel variant that made them; `compare` decodes again and says what differs, naming the first op whose bits
differ when the logits do. Run `python -m lossless.study.golden --out FILE` to record.

This module observes the model; it changes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import re
from pathlib import Path

import torch

from ..decoding.model import OrthrusLM
from .probe import _observe, _op_modules, _Recorder


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


@torch.no_grad()
def fingerprint(model: OrthrusLM, prompt_ids: list[int], n: int) -> dict:
    """{"tokens": n greedy exact-AR ids, "logits": sha256 (16 hex) over every step's logits, in order}."""
    cache, logits = model.prefill(prompt_ids)
    digest, tokens = hashlib.sha256(), []
    for _ in range(n):
        digest.update(logits.contiguous().view(torch.uint8).numpy().tobytes())
        tokens.append(int(torch.argmax(logits)))
        logits = model.step(cache, tokens[-1])
    return {"tokens": tokens, "logits": digest.hexdigest()[:16]}


@torch.no_grad()
def op_digests(model: OrthrusLM, prompt_ids: list[int]) -> list[list[str]]:
    """[[op name, digest of its output]] over one prefill of `prompt_ids`, in execution order."""
    recorder = [_Recorder()]
    with _observe(model, recorder):
        model.prefill(prompt_ids)
    return [[name, _digest(recorder[0].rows(name))] for name, _ in _op_modules(model) if name in recorder[0].out]


def machine() -> dict:
    from ..decoding import kernels

    cpu = kernels.cpu_model()
    wide = sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16") if f in kernels.cpu_flags())
    return {"cpu": cpu, "flags": wide, "isa": kernels.isa(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "kernels": kernels.source_digest(), "date": datetime.date.today().isoformat()}


def record(models: dict[str, OrthrusLM], prompts: list[list[int]], n: int) -> dict:
    """The golden file's content: per dtype name, each prompt's fingerprint and the first prompt's op digests."""
    out = {"machine": machine(), "max_new_tokens": n, "prompts": prompts, "dtypes": {}}
    for name, model in models.items():
        out["dtypes"][name] = {"trajectories": [fingerprint(model, p, n) for p in prompts],
                               "ops": op_digests(model, prompts[0])}
    return out


def compare(model: OrthrusLM, golden: dict, dtype: str) -> list[str]:
    """What differs from the golden file for `dtype` on this machine (empty: every bit reproduced)."""
    want = golden["dtypes"][dtype]
    problems = []
    for i, (prompt, expected) in enumerate(zip(golden["prompts"], want["trajectories"])):
        got = fingerprint(model, prompt, golden["max_new_tokens"])
        if got != expected:
            first = next((j for j, (a, b) in enumerate(zip(got["tokens"], expected["tokens"])) if a != b), None)
            problems.append(f"{dtype} prompt {i}: " + (f"tokens part at {first}" if first is not None else
                                                        "same tokens, other logits bits"))
    if problems:
        mine = dict(map(tuple, op_digests(model, golden["prompts"][0])))
        first_op = next((name for name, digest in want["ops"] if mine.get(name) != digest), None)
        problems.append(f"{dtype}: first op whose bits differ in the prefill: {first_op or 'none (later steps)'}; "
                        f"recorded on {golden['machine']['cpu']} ({golden['machine']['isa']})")
    return problems


def main(argv: list[str] | None = None) -> None:
    from ..decoding.models import load_model
    from ..text import encode_prompt
    from ..jsonio import read_jsonl
    from .. import paths

    parser = argparse.ArgumentParser(prog="python -m lossless.study.golden", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the golden JSON file to write")
    parser.add_argument("--prompts-per-dtype", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    models = {d: load_model("smollm2-135m", d, attn="exact", head="none") for d in ("fp32", "bf16", "fp16")}
    tokenizer = models["fp32"].tokenizer
    rows, domains = [], set()
    for row in read_jsonl(paths.DEFAULT_SUITE, what="suite"):  # the first prompt of the first domains
        if row["domain"] not in domains and len(rows) < args.prompts_per_dtype:
            domains.add(row["domain"])
            rows.append(encode_prompt(tokenizer, row["prompt"]))
    content = record(models, rows, args.max_new_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text = re.sub(r"\[\s*(-?\d[\d,\s-]*?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split(",")).replace("\n", "")
                  .replace(" ", "").replace(",", ", ") + "]", json.dumps(content, indent=1))  # id lists on one line
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out} ({content['machine']['cpu']}, {content['machine']['isa']})")


if __name__ == "__main__":
    main()
