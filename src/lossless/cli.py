"""Command line: `lossless <command> ...`. Every command is a thin call into the library.

User errors (`LosslessError`) print one line to stderr and exit with code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import LosslessError


def _add_model_args(p: argparse.ArgumentParser, dtype: str = "fp32") -> None:
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a local HF model directory, or a hub id")
    p.add_argument("--head", default=None, help="draft-head directory (default: the shipped head, if any)")
    p.add_argument("--dtype", default=dtype, help="fp32 | bf16 | fp16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attn", default="sdpa", help="attention kernel: sdpa | eager")


def cmd_generate(args) -> int:
    from .models import load_model
    from .sampling import SamplingConfig

    # inputs first: nothing loads for a request that cannot run
    if not args.prompt.strip():
        raise LosslessError("the prompt is empty: give some text to continue")
    if args.max_new_tokens < 1:
        raise LosslessError("--max-new-tokens must be >= 1")
    if args.k is not None and args.k < 1:
        raise LosslessError(f"--k must be >= 1, got {args.k}")
    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    model = load_model(args.model, args.dtype, args.device, args.attn, head=args.head)
    stream = (lambda s: (sys.stdout.write(s), sys.stdout.flush())) if not args.json else None
    out = model.generate(args.prompt, mode=args.mode, max_new_tokens=args.max_new_tokens, k=args.k,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                         chat_template=not args.no_chat_template, on_text=stream)
    if args.json:
        print(json.dumps(out.to_dict(), ensure_ascii=False))
    else:
        s = out.stats
        print(f"\n[{args.mode} {model.dtype_name} | {s['new_tokens']} tokens, {s['steps']} steps, "
              f"{s['forwards']} forwards, {s['tokens_per_step']:.2f} tokens/step, "
              f"{s['tokens_per_second']:.1f} tokens/s, finish={out.finish_reason}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lossless", description="Orthrus dual-view decoding, audited for exactness")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt with ar or orthrus")
    _add_model_args(g)
    g.add_argument("--mode", default="orthrus", choices=["orthrus", "ar"])
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--k", type=int, default=None, help="block size (default: the head's k)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-chat-template", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)

    from . import commands

    commands.register(sub, _add_model_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the user typed, for run records
    try:
        return int(args.func(args) or 0)
    except LosslessError as exc:
        print(f"lossless: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lossless: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
