"""Commands beyond `generate` (train, ...): each registers its arguments next to its thin call into
the library."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from .errors import LosslessError
from .jsonio import read_jsonl


def register(sub, add_model_args) -> None:
    """Add the subcommands to the `lossless` parser."""
    t = sub.add_parser("train", help="train a draft head by distillation (backbone frozen)")
    t.add_argument("--model", default="smollm2-135m")
    t.add_argument("--out", required=True, help="head directory to write (checkpoint + head files)")
    t.add_argument("--k", type=int, default=8, help="block size")
    t.add_argument("--prompts", default=None, help="JSONL prompts for self-distillation (default: data/train_prompts.jsonl)")
    t.add_argument("--data", nargs="*", default=[], help="extra plain-text files/directories or JSONL with a 'text' field")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--loss", default="kl", choices=["kl", "ce"])
    t.add_argument("--seqs-per-step", type=int, default=4)
    t.add_argument("--anchors", type=int, default=16, help="blocks drafted per sequence per step")
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=200)
    t.add_argument("--eval-prompts", type=int, default=4)
    t.add_argument("--max-new-tokens", type=int, default=128, help="length of self-distillation responses")
    t.add_argument("--distill-batch", type=int, default=16)
    t.add_argument("--encoding", default="full", choices=["full", "delta_int8"], help="how the head is stored")
    t.add_argument("--dtype", default="fp32")
    t.add_argument("--device", default="cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    t.add_argument("--stop-at", type=int, default=None, help="leave after this step with a checkpoint (resume later)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)

    a = sub.add_parser("audit", help="AR vs Orthrus trajectories over a prompt suite, appended to a run directory")
    a.add_argument("--model", default="smollm2-135m")
    a.add_argument("--head", default=None)
    a.add_argument("--suite", default=None, help="JSONL {id, domain, prompt} or JSON {domain: [prompts]}")
    a.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    a.add_argument("--attn", default="sdpa", help="comma-separated attention kernels: sdpa, eager, exact")
    a.add_argument("--configs", default=None,
                   help="the plan instead of --dtypes x --attn: comma-separated dtype/attn[:prompts per domain], "
                        "run in this order, e.g. bf16/sdpa,fp32/sdpa,fp16/sdpa:20")
    a.add_argument("--max-new-tokens", type=int, default=128)
    a.add_argument("--k", type=int, default=None)
    a.add_argument("--limit-per-domain", type=int, default=None)
    a.add_argument("--shard", default=None,
                   help="i/n: run every n-th item starting at i (default: the process's rank under accelerate "
                        "launch or torchrun, else everything)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--out", required=True, help="run directory, e.g. runs/NAME")
    a.add_argument("--no-progress", action="store_true")
    a.set_defaults(func=cmd_audit)

    r = sub.add_parser("report", help="write report.md, plots and summary.json for an audit run")
    r.add_argument("run_dir")
    r.add_argument("--out", default=None, help="where to write (default: the run directory)")
    r.add_argument("--at-rest", action="store_true",
                   help="only the compressed record segments (what is committed), not a running writer's plain file")
    r.set_defaults(func=cmd_report)

    pr = sub.add_parser("probe", help="name the first op where a block pass differs from one-token-at-a-time")
    add_model_args(pr, dtype="bf16")
    pr.add_argument("--k", type=int, default=8)
    pr.add_argument("--all", action="store_true", help="list every op, not only the differing ones")
    pr.add_argument("--json", action="store_true")
    pr.add_argument("text")
    pr.set_defaults(func=cmd_probe)

    e = sub.add_parser("eval", help="task scores of ar and orthrus side by side, through lm-evaluation-harness")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--head", default=None)
    e.add_argument("--tasks", default="humaneval,arith,capitals", help="comma-separated: humaneval, arith, capitals")
    e.add_argument("--modes", default="ar,orthrus")
    e.add_argument("--dtypes", default="bf16")
    e.add_argument("--attn", default="sdpa", help="sdpa | eager | exact")
    e.add_argument("--k", type=int, default=None)
    e.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    e.add_argument("--confirm-run-unsafe-code", action="store_true",
                   help="allow tasks that execute model-written code (humaneval)")
    e.add_argument("--device", default="cpu")
    e.add_argument("--out", required=True, help="output directory, e.g. runs/eval")
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=cmd_eval)

    tk = sub.add_parser("tasks", help="write the local lm-eval tasks (data + YAML) for --include_path")
    tk.add_argument("--out", required=True, help="directory to write")
    tk.set_defaults(func=cmd_tasks)


def text_files(paths: list[str]) -> list[Path]:
    """The files behind `--data`: files as given, directories as their *.txt files (sorted)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.rglob("*.txt")))
        elif p.exists():
            files.append(p)
        else:
            raise LosslessError(f"--data {p}: no such file or directory")
    return files


def _text_records(paths: list[str], tokenizer, chunk: int = 256) -> list[dict]:
    """Plain-text training data: files, directories of .txt, or JSONL with a 'text' field, chunked."""
    records = []
    for f in text_files(paths):
        if f.suffix == ".jsonl":
            texts = []
            for i, obj in enumerate(read_jsonl(f, what="--data file"), 1):
                if not isinstance(obj.get("text"), str):
                    raise LosslessError(f"{f}: record {i}: expected a JSON object with a \"text\" field")
                texts.append(obj["text"])
        else:
            texts = [f.read_text(encoding="utf-8")]
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            for s in range(0, max(len(ids) - 8, 1), chunk):
                piece = ids[s:s + chunk]
                if len(piece) > 8:
                    records.append({"id": f"{f.name}:{s}", "prompt_ids": piece[:1], "response_ids": piece[1:]})
    return records


def cmd_train(args) -> int:
    from accelerate import Accelerator

    from . import distill, paths, training
    from .models import cache_dir, load_model

    cfg = training.TrainConfig(
        model=args.model, out=args.out, k=args.k, steps=args.steps, lr=args.lr, warmup=args.warmup, loss=args.loss,
        seed=args.seed, seqs_per_step=args.seqs_per_step, anchors=args.anchors, save_every=args.save_every,
        eval_every=args.eval_every, eval_prompts=args.eval_prompts, dtype=args.dtype, encoding=args.encoding,
        data=list(args.data), prompts=str(args.prompts or paths.TRAIN_PROMPTS), max_new_tokens=args.max_new_tokens,
        distill_batch=args.distill_batch)
    if cfg.k < 2:
        raise LosslessError("--k must be >= 2 to train a drafter")
    out = Path(cfg.out)
    if (out / training.CHECKPOINT).exists() and not args.resume:
        raise LosslessError(f"{out} already holds a training run: add --resume to continue it, or choose another --out")
    # every input is checked before the model loads
    prompts = distill.read_prompts(cfg.prompts)
    suite = distill.read_prompts(paths.require(paths.DEFAULT_SUITE, "the default audit suite"))
    distill.check_disjoint([p["prompt"] for p in prompts], [p["prompt"] for p in suite])
    if cfg.eval_prompts:
        paths.require(paths.HELDOUT_PROMPTS, "the held-out prompts")
    text_files(cfg.data)
    accelerator = Accelerator(cpu=args.device == "cpu")
    # the head to train starts untrained (copies of the AR weights), never from a shipped head
    model = load_model(cfg.model, cfg.dtype, str(accelerator.device), head="none", k=cfg.k)
    records_path = cache_dir() / "distill" / f"{Path(cfg.model).name}__{Path(cfg.prompts).stem}__{cfg.max_new_tokens}.jsonl"
    if accelerator.is_main_process:
        distill.generate_responses(model, prompts, records_path, cfg.max_new_tokens, cfg.distill_batch,
                                   progress=not args.no_progress)
    accelerator.wait_for_everyone()
    done = {r["id"]: r for r in distill.load_records(records_path)}
    records = [done[p["id"]] for p in prompts if p["id"] in done]
    if cfg.data:
        records += _text_records(cfg.data, model.tokenizer)
    heldout = []
    if cfg.eval_prompts:
        from .text import encode_prompt

        heldout = [encode_prompt(model.tokenizer, p["prompt"]) for p in distill.read_prompts(paths.HELDOUT_PROMPTS)[: cfg.eval_prompts]]
    model.train(False)
    summary = training.train(model, records, cfg, heldout=heldout, resume=args.resume, accelerator=accelerator,
                             progress=not args.no_progress, stop_at=args.stop_at)
    if accelerator.is_main_process:
        summary["records"] = len(records)
        summary["config"] = asdict(cfg)
        training.write_summary(out, summary)
        last = summary["history"][-1] if summary["history"] else {}
        print(json.dumps({"out": str(out), "steps": summary["steps"], "seconds": round(summary["seconds"], 1),
                          "tokens": summary["tokens"], "last": last}), file=sys.stdout)
    return 0


def cmd_audit(args) -> int:
    from . import audit, paths
    from .dtypes import dtype_name
    from .models import ATTN_KERNELS

    dtypes = [dtype_name(d) for d in args.dtypes.split(",") if d]
    attns = [a for a in args.attn.split(",") if a]
    for a in attns:
        if a not in ATTN_KERNELS:
            raise LosslessError(f"unknown attention kernel '{a}': choose from {', '.join(ATTN_KERNELS)}")
    if not dtypes or not attns:
        raise LosslessError("--dtypes and --attn need at least one value each")
    configs = None
    if args.configs is not None:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        if not configs:
            raise LosslessError("--configs needs at least one dtype/attn")
        plan = [audit.parse_config(c) for c in configs]  # checks every entry before any work
        dtypes = list(dict.fromkeys(d for d, _, _ in plan))
        attns = list(dict.fromkeys(a for _, a, _ in plan))
    if args.shard:
        audit.parse_shard(args.shard)
    cfg = audit.AuditConfig(model=args.model, head=args.head, suite=str(args.suite or paths.DEFAULT_SUITE),
                            dtypes=dtypes, attns=attns, max_new_tokens=args.max_new_tokens, k=args.k,
                            limit_per_domain=args.limit_per_domain, device=args.device, configs=configs)
    result = audit.run_audit(cfg, args.out, shard=args.shard, command=["lossless", *args.argv],
                             progress=not args.no_progress)
    print(json.dumps(result))
    return 0


def cmd_report(args) -> int:
    from .report import write_report

    out = Path(args.out or args.run_dir)
    summary = write_report(args.run_dir, out, at_rest=args.at_rest)
    print(f"report: {out / 'report.md'}")
    for c in summary["configs"]:
        lo, hi = c["ci95"]
        label = c["label"]
        print(f"  {label}: exact match {100 * c['exact_match_rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] "
              f"(n={c['n']}), {c['mean_tokens_per_step']:.2f} tokens/step")
    return 0


def cmd_probe(args) -> int:
    from .models import load_model
    from .probe import format_table, probe

    if not args.text.strip():
        raise LosslessError("the text is empty")
    if args.k < 2:
        raise LosslessError("--k must be >= 2 to compare a block with single tokens")
    model = load_model(args.model, args.dtype, args.device, args.attn, head=args.head)
    if model.tokenizer is None:
        raise LosslessError("this model has no tokenizer; the probe needs text")
    ids = list(model.tokenizer(args.text)["input_ids"])
    result = probe(model, ids, args.k)
    print(format_table(result, only_differing=not args.all))
    if args.json:
        print(json.dumps(result.to_dict()))
    return 0


def cmd_eval(args) -> int:
    from .evaluation import parse_dtype_list, parse_modes, render_table, run_eval
    from .evaltasks import resolve_tasks
    from .names import check_attn

    check_attn(args.attn)
    tasks = resolve_tasks(args.tasks)
    modes = parse_modes(args.modes)
    dtypes = parse_dtype_list(args.dtypes)
    summary = run_eval(args.model, tasks, modes, dtypes, args.out, attn=args.attn, head=args.head, k=args.k,
                       limit=args.limit, confirm_unsafe=args.confirm_run_unsafe_code, device=args.device,
                       progress=not args.no_progress, command=["lossless", *args.argv])
    print(render_table(summary))
    print(f"wrote {Path(args.out) / 'summary.json'} and {Path(args.out) / 'report.md'}")
    return 0


def cmd_tasks(args) -> int:
    from .evaltasks import write_tasks

    print(write_tasks(args.out))
    return 0
