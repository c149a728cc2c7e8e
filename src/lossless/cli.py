"""Command line: `lossless <command> ...`. Every command is a thin call into the library.

Owns argument parsing and what each command prints. User errors (`LosslessError`) print one line to
stderr and exit with code 2, without a traceback; inputs are checked before any model loads. It does
not know how decoding, training, the audit or the evaluation work: each `cmd_*` calls the library.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from .errors import LosslessError
from .names import (ATTN_KERNELS, AUTO, CYCLE_LOOKUPS, CYCLE_TREES, CYCLES, DEFAULT_BATCH, DEFAULT_LOOKUP, DEFAULT_TREE, DTYPE_NAMES, EXACT, MODES,
                    PREFILL_CHUNK, check_cycle, check_tree)


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error style: one line `lossless: error: ...` and exit code 2, no usage block."""

    def error(self, message: str):
        message = " ".join(message.split())
        self.exit(2, f"lossless: error: {message} (see `{self.prog} --help`)\n")


def _number(kind, option: str, *, at_least=None, above=None, at_most=None, note: str = ""):
    """An argparse `type` for a numeric option: `kind` (int or float), finite, within the bounds. Nonsense
    raises LosslessError, which the CLI prints as one line (exit 2) before anything loads."""
    bounds = " and ".join(b for b in (f">= {at_least}" if at_least is not None else "",
                                      f"> {above}" if above is not None else "",
                                      f"<= {at_most}" if at_most is not None else "") if b)

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise LosslessError(f"{option} '{text}': expected {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise LosslessError(f"{option} must be a finite number, got {text}")
        if (at_least is not None and value < at_least) or (above is not None and value <= above) \
                or (at_most is not None and value > at_most):
            raise LosslessError(f"{option} must be {bounds}{note}, got {text}")
        return value

    parse.__name__ = "integer" if kind is int else "number"
    return parse


SEED_MAX = 2**63 - 1  # the largest seed taken (as torch's generators take)


def _add_model_args(p: argparse.ArgumentParser, dtype: str = "fp32", *, head: bool = True, attn: bool = True,
                    dtype_list: bool = False, attn_list: bool = False, auto: bool = False) -> None:
    """--model, --head, --dtype (or --dtypes), --device, --attn: the options every model-loading command
    shares. `dtype_list`/`attn_list`: comma-separated lists (commands that run several configurations).
    `auto`: --dtype and --attn default to "auto", the fastest lossless configuration of the device."""
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (embedded), a local Hugging Face model directory, or a hub id")
    if head:
        p.add_argument("--head", default=None,
                       help="draft-head directory; 'none' for an untrained head (default: the shipped head, if any)")
    if dtype_list:
        p.add_argument("--dtypes", default=dtype, help=f"comma-separated compute precisions: {', '.join(DTYPE_NAMES)}")
    else:
        p.add_argument("--dtype", default=AUTO if auto else dtype,
                       help=f"compute precision: {' | '.join(DTYPE_NAMES)}" + (
                           f" | {AUTO} (default: bf16 where the CPU has native bf16 dot products, else fp32)" if auto
                           else ""))
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (exact mode runs on the CPU only)")
    if attn:
        kinds = " | ".join(ATTN_KERNELS)
        p.add_argument("--attn", default=AUTO if auto else "sdpa",
                       help=(f"comma-separated attention kernels: {kinds}" if attn_list else f"attention kernel: {kinds}")
                       + " (exact: batch-invariant kernels, Orthrus equals AR bit for bit)"
                       + (f"; {AUTO} (default): exact on the CPU, sdpa on CUDA" if auto else ""))


def _add_cycle_args(p: argparse.ArgumentParser) -> None:
    """--cycle and --groups: how orthrus spends its forwards."""
    p.add_argument("--cycle", default="two-pass", choices=CYCLES,
                   help="orthrus cycle: two-pass (draft, then verify: two forwards, the authors' Orthrus) or fused "
                        "(one forward verifies a block and drafts the next)")
    p.add_argument("--groups", type=_number(int, "--groups", at_least=1), default=None,
                   help="fused: draft groups per forward, for acceptance counts 0..groups-1 (default: all)")


def _check_cycle_args(args) -> None:
    check_cycle(args.cycle)
    if args.groups is not None and args.groups < 1:
        raise LosslessError(f"--groups must be >= 1, got {args.groups}")


def cmd_generate(args) -> int:
    from .decoding.models import load_model
    from .decoding.sampling import SamplingConfig

    # inputs first: nothing loads for a request that cannot run
    if not args.prompt.strip():
        raise LosslessError("the prompt is empty: give some text to continue")
    if args.max_new_tokens < 1:
        raise LosslessError("--max-new-tokens must be >= 1")
    if args.k is not None and args.k < 1:
        raise LosslessError(f"--k must be >= 1, got {args.k}")
    _check_cycle_args(args)
    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)  # refused early
    if args.mode == "orthrus":  # explicit choices only: the defaults adapt to the request
        check_tree(args.tree or 0, args.cycle, args.lookup or 0)
    model = load_model(args.model, args.dtype, args.device, args.attn, head=args.head)
    stream = (lambda s: (sys.stdout.write(s), sys.stdout.flush())) if not args.json else None
    out = model.generate(args.prompt, mode=args.mode, max_new_tokens=args.max_new_tokens, k=args.k,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                         chat_template=not args.no_chat_template, cycle=args.cycle, groups=args.groups, tree=args.tree,
                         lookup=args.lookup, on_text=stream)
    if args.json:
        print(json.dumps(out.to_dict(), ensure_ascii=False))
    else:
        s = out.stats
        if out.config.get("choice"):
            print(f"\n[default cycle: {out.config['choice']['why']}]", end="", file=sys.stderr)
        gave_way = f", AR from token {s['ar_from']}" if s.get("ar_from") is not None else ""
        print(f"\n[{_config_label(out.config)}{gave_way} | {s['new_tokens']} tokens, {s['steps']} steps, "
              f"{s['forwards']} forwards, {s['tokens_per_step']:.2f} tokens/step, "
              f"{s['tokens_per_second']:.1f} tokens/s, finish={out.finish_reason}]", file=sys.stderr)
    return 0


def _config_label(config: dict) -> str:
    """What ran, in a few words: "orthrus tree 8 + lookup 16, bf16 exact (kernels dd02839c.../avx512bf16), AR's
    tokens"."""
    what = config["mode"]
    if what == "orthrus":
        parts = [f"tree {config['tree']}" if config["tree"] else (f"k={config['k']} chain" if config["cycle"] == "two-pass"
                                                                   else f"fused k={config['k']}")]
        if config["lookup"]:
            parts.append(f"lookup {config['lookup']}")
        what += " " + " + ".join(parts)
    kernels = f" (kernels {config['kernels']})" if config.get("kernels") else ""
    versus = {"tokens": ", AR's tokens", "distribution": ", AR's distribution, not its tokens",
              "not guaranteed": ", AR's tokens not guaranteed"}.get(config.get("versus_ar"), "")
    return f"{what}, {config['dtype']} {config['attn']}{kernels}{versus}"


def _distill_inputs(args, allow_empty: bool = False) -> tuple[str, list[dict]]:
    """The prompt file and its prompts, checked against every evaluation set before any model loads.
    An empty prompt file is refused unless `allow_empty` (training on --data alone)."""
    from .training import distill, reserved
    from . import paths

    prompts_file = str(args.prompts or paths.TRAIN_PROMPTS)
    prompts = distill.read_prompts(prompts_file)
    if not prompts and not allow_empty:
        raise LosslessError(f"prompt file {prompts_file} holds no prompts: give JSONL lines {{\"prompt\": \"...\"}}")
    reserved.check_disjoint_all([p["prompt"] for p in prompts], skip={reserved.TRAINING_SET})
    return prompts_file, prompts


def cmd_distill(args) -> int:
    from .training import distill
    from .study.audit import launcher_state, parse_shard
    from .decoding.models import load_model

    from .paths import check_writable_dir

    prompts_file, prompts = _distill_inputs(args)
    parse_shard(args.shard)
    distill.check_meta(args.out, args.model, args.dtype, args.max_new_tokens, prompts_file)
    check_writable_dir(args.out)
    launcher = None if args.shard else launcher_state()
    shard = parse_shard(args.shard) if launcher is None else (launcher.process_index, launcher.num_processes)
    distill.open_distillation(args.out, args.model, args.dtype, args.max_new_tokens, prompts_file)
    model = load_model(args.model, args.dtype, args.device, attn="sdpa", head="none")  # batched: stock kernels
    written = distill.generate_responses(model, prompts, args.out, args.max_new_tokens, args.batch,
                                         progress=not args.no_progress, shard=shard)
    records = distill.load_records(args.out)
    print(json.dumps({"out": args.out, "written": written, "prompts": len(prompts), "responses": len(records),
                      "response_tokens": sum(len(r["response_ids"]) for r in records)}))
    return 0


def cmd_train(args) -> int:
    from accelerate import Accelerator

    from .training import distill, train as training

    from . import paths
    from .decoding.models import load_model

    cfg = training.TrainConfig(
        model=args.model, out=args.out, k=args.k, steps=args.steps, lr=args.lr, warmup=args.warmup, loss=args.loss,
        seed=args.seed, seqs_per_step=args.seqs_per_step, anchors=args.anchors, save_every=args.save_every,
        eval_every=args.eval_every, eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens, dtype=args.dtype,
        encoding=args.encoding, data=list(args.data), prompts=str(args.prompts or paths.TRAIN_PROMPTS),
        max_new_tokens=args.max_new_tokens, distill_batch=args.distill_batch, autocast=args.autocast,
        position_decay=args.position_decay, mask_lr_mult=args.mask_lr_mult, log=args.log or "",
        publish=args.publish or "", position_weights=_floats(args.position_weights, "--position-weights"),
        init_head=args.init_head or "", draft_adapter=args.draft_adapter, adapter_lr_mult=args.adapter_lr_mult,
        eval_distill=args.eval_distill_dir or "", eval_sequences=args.eval_sequences)
    training.check_config(cfg)
    out = Path(cfg.out)
    if (out / training.CHECKPOINT).exists() and not args.resume:
        raise LosslessError(f"{out} already holds a training run: add --resume to continue it, or choose another --out")
    # every input is checked before the model loads
    _, prompts = _distill_inputs(args, allow_empty=bool(cfg.data))
    if cfg.eval_prompts:
        paths.require(paths.HELDOUT_PROMPTS, "the held-out prompts")
    distill.text_files(cfg.data)
    if args.distill_dir:  # responses made by `lossless distill`: read only
        data_dir = Path(args.distill_dir)
        distill.check_source(data_dir, cfg.prompts)
    if cfg.eval_distill:
        distill.check_model(cfg.eval_distill, cfg.model)
        if cfg.eval_sequences < 1:
            raise LosslessError(f"--eval-sequences must be >= 1, got {cfg.eval_sequences}")
    training.position_weights(cfg.k, cfg.position_decay, cfg.position_weights)  # refuse bad weights now
    if cfg.init_head:
        if args.resume:
            raise LosslessError("--init-head starts a new run; --resume continues one: give one of them")
        from .decoding.head import read_head_config

        read_head_config(cfg.init_head)
    if args.resume:  # a truncated checkpoint, or nothing to resume from, is refused before the model loads
        training.check_resume(cfg)
    if not args.distill_dir:
        distill.check_meta(distill.default_dir(cfg.model, cfg.prompts, cfg.max_new_tokens, cfg.dtype), cfg.model,
                           cfg.dtype, cfg.max_new_tokens, cfg.prompts)
    # every place the run writes is checked before any work: a read-only or full disk is found now, not at the
    # first checkpoint (also for a run with nothing left to do)
    training.check_outputs(cfg, distill_dir=None if args.distill_dir else
                           distill.default_dir(cfg.model, cfg.prompts, cfg.max_new_tokens, cfg.dtype))
    accelerator = Accelerator(cpu=args.device == "cpu")
    # the head to train starts untrained (copies of the AR weights), or from --init-head; never from a shipped
    # head by default
    model = load_model(cfg.model, cfg.dtype, str(accelerator.device), attn="sdpa", head="none", k=cfg.k)
    if cfg.init_head:
        model.load_head(cfg.init_head)
        model.k = model.head_info.k = cfg.k  # a head's weights do not depend on k: an arm may train another k
    if cfg.draft_adapter and model.draft_adapter != cfg.draft_adapter:
        if model.draft_adapter:
            raise LosslessError(f"--init-head {cfg.init_head} has draft adapters of rank {model.draft_adapter}; "
                                f"give --draft-adapter {model.draft_adapter} or leave it out")
        model.set_draft_adapter(cfg.draft_adapter)
    if not args.distill_dir:
        data_dir = distill.default_dir(cfg.model, cfg.prompts, cfg.max_new_tokens, cfg.dtype)
        if accelerator.is_main_process:
            distill.open_distillation(data_dir, cfg.model, cfg.dtype, cfg.max_new_tokens, cfg.prompts)
            distill.generate_responses(model, prompts, data_dir, cfg.max_new_tokens, cfg.distill_batch,
                                       progress=not args.no_progress)
        accelerator.wait_for_everyone()
    done = {r["key"]: r for r in distill.load_records(data_dir)}
    missing = sum(p["id"] not in done for p in prompts)
    if missing and accelerator.is_main_process:
        print(f"note: {missing} of {len(prompts)} prompts have no response in {data_dir} yet; training on the rest",
              file=sys.stderr)
    records = [done[p["id"]] for p in prompts if p["id"] in done]
    if cfg.data:
        records += distill.text_records(cfg.data, model.tokenizer)
    heldout = []
    if cfg.eval_prompts:
        from .text import encode_prompt

        # the last held-out prompts: the speed benchmark's (the first ones) never choose a head
        heldout = [encode_prompt(model.tokenizer, p["prompt"])
                   for p in distill.read_prompts(paths.HELDOUT_PROMPTS)[-cfg.eval_prompts:]]
    forced = None
    if cfg.eval_distill:
        held = distill.load_records(cfg.eval_distill)
        seen = {tuple(r["prompt_ids"]) for r in records}
        clash = sum(tuple(r["prompt_ids"]) in seen for r in held)
        if clash:
            raise LosslessError(f"{clash} prompts of {cfg.eval_distill} are also training prompts: held-out sequences "
                                "must come from prompts the head does not train on")
        forced = training.forced_blocks(held, cfg.eval_sequences, cfg.k, cfg.anchors, cfg.seed)
    model.train(False)
    summary = training.train(model, records, cfg, heldout=heldout, resume=args.resume, accelerator=accelerator,
                             progress=not args.no_progress, stop_at=args.stop_at, forced=forced)
    if accelerator.is_main_process:
        summary["records"] = len(records)
        summary["config"] = asdict(cfg)
        training.write_summary(out, summary)
        last = summary["history"][-1] if summary["history"] else {}
        print(json.dumps({"out": str(out), "steps": summary["steps"], "seconds": round(summary["seconds"], 1),
                          "tokens": summary["tokens"], "last": last}), file=sys.stdout)
    return 0


def _floats(text: str | None, option: str) -> list[float]:
    """'0,1,1' -> [0.0, 1.0, 1.0]; None or '' -> []. Every number must be finite."""
    try:
        values = [float(x) for x in text.split(",")] if text else []
    except ValueError:
        raise LosslessError(f"{option} '{text}': expected comma-separated numbers, e.g. 0,1,1,1") from None
    if not all(math.isfinite(v) for v in values):
        raise LosslessError(f"{option} '{text}': every number must be finite")
    return values


def cmd_curve(args) -> int:
    from .training.curve import write_curve
    from .errors import read_utf8
    from .paths import check_writable_dir

    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.logs):
        raise LosslessError(f"--labels names {len(labels)} curves for {len(args.logs)} logs; give one label per log")
    for log in args.logs:
        if not Path(log).is_file():
            raise LosslessError(f"training log {log} does not exist: give the --log file of `lossless train`")
        read_utf8(log, "training log")
    check_writable_dir(args.out)
    curves = write_curve(args.logs, args.out, labels)
    print(json.dumps({label: {"evaluations": len(c["evaluations"]),
                              "last": c["evaluations"][-1]["heldout_tokens_per_step"], "trend": c["trend"]}
                      for label, c in curves.items()}))
    return 0


def cmd_audit(args) -> int:
    from .study import audit
    from . import paths
    from .study.candidates import check_kernel, parse_candidates
    from .dtypes import dtype_name
    from .names import AUDIT_KERNELS

    dtypes = [dtype_name(d) for d in args.dtypes.split(",") if d]
    attns = [a for a in args.attn.split(",") if a]
    for a in attns:
        if a not in AUDIT_KERNELS:
            raise LosslessError(f"unknown attention kernel '{a}': choose from {', '.join(AUDIT_KERNELS)}")
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
    _check_cycle_args(args)
    names = parse_candidates(args.candidates)
    if args.cycle == "fused":  # --cycle fused audits the fused cycle: the orthrus-fused candidate
        names = list(dict.fromkeys("orthrus-fused" if n == "orthrus" else n for n in names))
    for attn in attns:
        for name in names:
            check_kernel(name, attn)
    cfg = audit.AuditConfig(model=args.model, head=args.head, suite=str(args.suite or paths.DEFAULT_SUITE),
                            dtypes=dtypes, attns=attns, max_new_tokens=args.max_new_tokens, k=args.k,
                            limit_per_domain=args.limit_per_domain, device=args.device, configs=configs,
                            candidates=names, groups=args.groups)
    result = audit.run_audit(cfg, args.out, shard=args.shard, command=["lossless", *args.argv],
                             progress=not args.no_progress)
    print(json.dumps(result))
    return 0


def cmd_report(args) -> int:
    from .paths import check_writable_dir
    from .study.records import RECORDS_DIR
    from .study.report import write_report

    if not Path(args.run_dir).is_dir():
        raise LosslessError(f"run directory {args.run_dir} does not exist: pass the --out directory of `lossless audit`")
    out = Path(args.out or args.run_dir)
    check_writable_dir(out)
    if args.at_rest and (Path(args.run_dir) / RECORDS_DIR).is_dir():
        check_writable_dir(Path(args.run_dir) / RECORDS_DIR, "run directory")
    if args.at_rest:
        from .study.records import roll_all

        from .study.backfill import BACKFILL_DIR

        for seg in roll_all(args.run_dir) + roll_all(args.run_dir, BACKFILL_DIR):
            print(f"rolled unrolled records into {seg}")
    summary = write_report(args.run_dir, out, at_rest=args.at_rest, reference=args.reference,
                           reference_from=args.reference_from)
    if summary.get("corrupt_lines"):
        bad = summary["corrupt_lines"]
        print(f"lossless: warning: skipped {len(bad)} record line(s) that are not records ({', '.join(bad[:3])}"
              f"{' ...' if len(bad) > 3 else ''}); the report says so", file=sys.stderr)
    print(f"report: {out / 'report.md'}")
    print(f"page: {out / 'report.html'} (open it in a browser: the trajectory viewer of every pair)")
    for c in summary["configs"]:
        lo, hi = c["ci95"]
        label = c["label"]
        tps = "" if c["mean_tokens_per_step"] is None else f", {c['mean_tokens_per_step']:.2f} tokens/step"
        print(f"  {label}: exact match {100 * c['exact_match_rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] "
              f"(n={c['n']}){tps}")
    against = summary.get("reference_comparison")
    if against:
        print(f"against {against['reference']['label']}:")
        for c in against["configs"]:
            ar = "the reference" if c["is_reference"] else f"{100 * c['ar']['rate']:.1f}%"
            print(f"  {c['label']}: AR {ar}, candidate {100 * c['candidate']['rate']:.1f}% (n={c['n']})")
    return 0


def cmd_backfill(args) -> int:
    from .paths import check_writable_dir
    from .study.backfill import left_line, run_backfill

    if not Path(args.run_dir).is_dir():
        raise LosslessError(f"run directory {args.run_dir} does not exist: pass the --out directory of `lossless audit`")
    check_writable_dir(Path(args.run_dir), "run directory")
    result = run_backfill(args.run_dir, progress=not args.no_progress, limit=args.limit, shard=args.shard)
    if hint := left_line(result):
        print(f"lossless: {hint}", file=sys.stderr)
    print(json.dumps(result))
    return 0


def cmd_probe(args) -> int:
    from .decoding.models import load_model
    from .study.probe import format_table, probe

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
    from .evaluation.report import render_table
    from .evaluation.tasks import resolve_tasks
    from .evaluation.run import EvalConfig, parse_dtype_list, parse_modes, run_eval
    from .names import check_attn

    check_attn(args.attn)
    _check_cycle_args(args)
    cfg = EvalConfig(model=args.model, tasks=resolve_tasks(args.tasks), modes=parse_modes(args.modes),
                     dtypes=parse_dtype_list(args.dtypes), attn=args.attn, head=args.head, k=args.k,
                     cycle=args.cycle, groups=args.groups, limit=args.limit,
                     confirm_unsafe=args.confirm_run_unsafe_code, device=args.device)
    summary = run_eval(cfg, args.out, command=["lossless", *args.argv], progress=not args.no_progress)
    print(render_table(summary))
    print(f"wrote {Path(args.out) / 'summary.json'} and {Path(args.out) / 'report.md'}")
    return 0


def cmd_tasks(args) -> int:
    from .evaluation.tasks import write_tasks
    from .paths import check_writable_dir

    check_writable_dir(args.out)
    print(write_tasks(args.out))
    return 0


PROFILE_NEEDS_EXACT = ("cycle profiles are recorded on exact kernels, where every cycle commits AR's tokens: drop "
                       "--attn or pass --attn exact (on the CPU)")


def cmd_costs(args) -> int:
    """This CPU's forward costs, each candidate cycle's predicted speed-up over AR, and the default they choose."""
    from .decoding import cycles
    from .decoding.head import UNTRAINED
    from .decoding.models import load_model
    from .paths import make_dir, write_atomically
    from .text import encode_prompt

    prompts = None
    if args.profile and args.max_new_tokens < 2:
        raise LosslessError("--max-new-tokens must be >= 2 for a profile (the first token comes from the prompt's "
                            "forward; cycles start with the second)")
    if args.profile:
        from .training.distill import read_prompts

        if args.attn not in (AUTO, EXACT):
            raise LosslessError(PROFILE_NEEDS_EXACT)

        prompts = ([row["prompt"] for row in read_prompts(args.prompts)] if args.prompts
                   else cycles.default_profile_prompts())
        if not prompts:
            raise LosslessError(f"{args.prompts}: no prompts")
    model = load_model(args.model, args.dtype, args.device, args.attn, head=args.head)
    if args.profile and model.head_digest == UNTRAINED:
        raise LosslessError("this model has an untrained head, whose default is the chain (no tree to choose): "
                            "pass a trained head with --head DIR")
    if args.profile:
        if model.attn != EXACT:
            raise LosslessError(PROFILE_NEEDS_EXACT)
        from tqdm.auto import tqdm

        ids = [encode_prompt(model.tokenizer, p, True) for p in prompts]
        with tqdm(total=len(ids) * len(cycles.CANDIDATES), desc="cycle profile", unit="decode",
                  disable=args.json) as bar:
            profile = cycles.record_profile(model, ids, args.max_new_tokens, progress=bar.update)
        out = cycles.recorded_profile_path(model)
        make_dir(out.parent)
        write_atomically(out, json.dumps(profile, indent=1) + "\n")
        print(f"cycle profile of head {model.head_digest}: {out}", file=sys.stderr)
    costs = cycles.cached_costs(model, remeasure=args.remeasure)
    choice = model.default_choice() if model.head_digest != UNTRAINED else cycles.Choice(
        "orthrus", 0, DEFAULT_LOOKUP, f"{cycles.label(0, DEFAULT_LOOKUP)}: the head is untrained (its runners-up are "
        f"not worth verifying; --head DIR loads a trained one)", {})
    # the default by the prompt's length: past the short context the measured costs grow with it
    contexts = [n for n in cycles.SHOWN_CONTEXTS if n < model.max_positions] if costs.get("long") else []
    by_context = {n: model.default_choice(context=n) for n in contexts} if model.head_digest != UNTRAINED else {}
    sampled = model.sampling_choice() if model.head_digest != UNTRAINED else None  # a sampled request's default
    if args.json:
        print(json.dumps({"costs": costs, "choice": choice.to_dict(), "profile": str(cycles.profile_path(model)),
                          "by_context": {str(n): c.to_dict() for n, c in by_context.items()},
                          "sampled": sampled.to_dict() if sampled is not None else None}))
        return 0
    step, long = cycles.cost_at(costs, 1), costs.get("long")
    print(f"forward costs on {costs['cpu']} ({costs['variant']}, {costs['threads']} threads, {model.dtype_name} "
          f"{model.attn}; measured {costs['date']}, cached in {cycles.costs_path(model)}):")
    after = [f"after {costs.get('cache_len', '?')}"] + ([f"after {long['cache_len']}"] if long else [])
    print(f"  {'forward':<18}" + "".join(f"{a + ': ms':>18}{'steps':>8}" for a in after))

    def line(name: str, *ms: float) -> None:
        steps = [step] + ([cycles.cost_at(long, 1)] if long else [])
        print(f"  {name:<18}" + "".join(f"{m:>18.2f}{m / s:>8.2f}" for m, s in zip(ms, steps)))
    for rows, ms in costs["rows"].items():
        line("verify " + rows + " row" + ("s" if rows != "1" else ""), ms, *([cycles.cost_at(long, int(rows))] if long else []))
    line("draft pass k=" + str(model.k), costs["draft"], *([long["draft"]] if long else []))
    keep = costs.get("bookkeeping", {})
    if keep:
        print(f"bookkeeping outside the forwards: {keep['ar']:.2f} ms per AR step, {keep['chain']:.2f} ms per chain "
              f"cycle, {keep['tree 32']:.2f} ms per 32-node tree cycle; sampling, {keep.get('ar sampled', 0):.2f} ms "
              f"per AR step, {keep.get('chain sampled', 0):.2f} ms per chain cycle and "
              f"{keep.get(f'tree {cycles.SAMPLED_TREE} sampled', 0):.2f} ms per {cycles.SAMPLED_TREE}-node tree cycle")
    if choice.predicted:
        print("predicted speed-up over AR (the head's cycle profile at these costs):")
        for name, x in sorted(choice.predicted.items(), key=lambda kv: -kv[1]):
            mark = " <- default" if choice.mode == "orthrus" and name == cycles.label(choice.tree, choice.lookup) else ""
            print(f"  {name:<22}{x:>6.2f}x{mark}")
    print(f"default: {choice.why}")
    if by_context:
        print("the default by the prompt's length:")
        for n, c in by_context.items():
            best = max(c.predicted.values(), default=None)
            said = f" (the best cycle predicts {best:.2f}x AR)" if best is not None else ""
            print(f"  after {n:>6,} tokens: {cycles.label(c.tree, c.lookup) if c.mode == 'orthrus' else 'AR'}{said}")
    if sampled is not None:
        print(f"sampled requests (--temperature): {sampled.why}")
    return 0


def _check_bindable(host: str, port: int) -> None:
    """Refuse, in one line, an address the server could not listen on (in use, or not this machine's)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise LosslessError(f"--host {host}: not an address of this machine (e.g. 127.0.0.1 or 0.0.0.0)") from None
    family, kind, _, _, address = infos[0]
    with socket.socket(family, kind) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise LosslessError(f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port or --host") \
                from None


def cmd_serve(args) -> int:
    import logging
    import os
    import signal

    from .decoding.head import UNTRAINED
    from .decoding.models import load_model
    from .decoding.sampling import SamplingConfig

    key = args.api_key or os.environ.get("LOSSLESS_API_KEY") or None
    _check_cycle_args(args)
    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # refuses nonsense early
    if args.mode == "orthrus" and (args.tree or args.lookup):
        check_tree(args.tree or 0, args.cycle, args.lookup or 0)
    import uvicorn

    from .serving import Defaults, create_app

    if args.batch is not None and args.batch > 1 and args.attn not in (AUTO, EXACT):
        raise LosslessError(f"--batch {args.batch} needs exact kernels (a request's tokens must not depend on its "
                            f"neighbours): serve with --attn exact, or --batch 1")
    _check_bindable(args.host, args.port)  # before minutes of loading
    if args.host not in ("127.0.0.1", "localhost", "::1") and not key:
        print(f"lossless: warning: serving on {args.host} without --api-key: anyone who reaches this port can "
              f"use the model", file=sys.stderr)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    model = load_model(args.model, args.dtype, args.device, args.attn, head=args.head)
    if args.k is not None and args.k > model.k:
        raise LosslessError(f"--k must be at most the head's k ({model.k}), got {args.k}")
    defaults = Defaults(mode=args.mode, k=args.k, cycle=args.cycle, groups=args.groups, tree=args.tree,
                        lookup=args.lookup, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed, max_tokens=min(args.max_tokens, model.max_positions - 1))
    if args.batch is not None and args.batch > 1 and model.attn != EXACT:  # --attn auto chose stock kernels here
        raise LosslessError(f"--batch {args.batch} needs exact kernels, which this device has not: --batch 1")
    batch = args.batch if args.batch is not None else DEFAULT_BATCH if model.attn == EXACT else 1
    if model.head_digest != UNTRAINED:  # this CPU's costs measured now (once per CPU), not inside a request
        logging.getLogger("lossless.serve").info("greedy two-pass requests with no tree, lookup or k of their own: %s",
                                                 model.default_choice().why)
    app = create_app(model, defaults, model_name=args.served_model_name, api_key=key, max_queue=args.max_queue,
                     max_body=args.max_body, batch=batch, prefill_chunk=args.prefill_chunk,
                     max_per_client=args.max_per_client)
    logging.getLogger("lossless.serve").info(
        "serving %s (%s %s, head %s, %s) on http://%s:%d/v1%s", args.served_model_name or model.name,
        model.dtype_name, model.attn, model.head_digest[:12],
        f"up to {batch} requests decoding together" if batch > 1 else "one request at a time", args.host, args.port,
        " (API key required)" if key else "")
    engine = app.state.engine
    failed: list[Exception] = []

    def on_failure(exc: Exception) -> None:  # the decoding thread died: stop serving, exit 1 (a supervisor restarts)
        failed.append(exc)
        os.kill(os.getpid(), signal.SIGTERM)
    engine.on_failure = on_failure

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT/SIGTERM: cancel the decodes now, so every stream ends in time
            engine.stop_soon()  # not here: this thread may hold the engine's lock (submit, a request's clean-up)
            super().handle_exit(sig, frame)

    # uvicorn shuts down gracefully, then raises the signal again under the handlers it found: these make that a
    # clean exit (0) instead of death by signal; the caller's handlers come back afterwards
    stopped, previous = [], {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda signum, _frame: stopped.append(signum))
    try:
        Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                              timeout_graceful_shutdown=5, limit_concurrency=args.max_connections,
                              timeout_keep_alive=5)).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed:
        print(f"lossless: error: the decoding engine failed ({type(failed[0]).__name__}: {failed[0]}); see the log "
              f"above, and restart the server", file=sys.stderr)
        return 1
    logging.getLogger("lossless.serve").info("stopped%s", f" ({signal.Signals(stopped[0]).name})" if stopped else "")
    return 0


def _generate_parser(sub) -> None:
    """`lossless generate`'s options."""
    g = sub.add_parser("generate", help="decode one prompt with ar or orthrus")
    _add_model_args(g, auto=True)
    g.add_argument("--mode", default="orthrus", choices=MODES, help="orthrus (draft + verify) or ar (one token per forward)")
    g.add_argument("--max-new-tokens", type=_number(int, "--max-new-tokens", at_least=1), default=128,
                   help="stop after this many generated tokens")
    g.add_argument("--k", type=_number(int, "--k", at_least=1), default=None, help="block size (default: the head's k; --cycle fused: at most 3)")
    _add_cycle_args(g)
    g.add_argument("--tree", type=_number(int, "--tree", at_least=0, note=" (0 = none)"), nargs="?", const=DEFAULT_TREE, default=None, metavar="NODES",
                   help=f"two-pass, greedy or sampled: verify a tree of NODES draft candidates (the top drafts and their runners-up; "
                        f"{DEFAULT_TREE} without a number) instead of one chain; 0 = the chain (default: when greedy and two-pass "
                        f"with a trained head and none of --tree, --lookup, --k given, the cycle this CPU's measured "
                        f"forward costs predict fastest, or AR where none pays (see `lossless costs`), and when "
                        f"sampled the {DEFAULT_TREE}-node tree; otherwise {DEFAULT_TREE} when greedy, two-pass and "
                        f"the head is trained, else 0)")
    g.add_argument("--lookup", type=_number(int, "--lookup", at_least=0, note=" (0 = none)"), nargs="?", const=DEFAULT_LOOKUP, default=None, metavar="TOKENS",
                   help=f"greedy or sampled: prompt lookup beside the drafts: copy up to TOKENS tokens that followed the "
                        f"context's last tokens where they occurred before ({DEFAULT_LOOKUP} without a number) and verify "
                        f"them too; a match of 2+ tokens is verified alone, without a draft pass; 0 = none (default: "
                        f"chosen with --tree from this CPU's costs, as there; otherwise {DEFAULT_LOOKUP} when greedy, "
                        f"else 0)")
    g.add_argument("--temperature", type=_number(float, "--temperature", at_least=0, note=" (0 = greedy)"),
                   default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=_number(int, "--top-k", at_least=0, note=" (0 = no top-k filter)"), default=0,
                   help="sample from the k most likely tokens (0 = no filter)")
    g.add_argument("--top-p", type=_number(float, "--top-p", above=0, at_most=1), default=1.0,
                   help="sample from the smallest set with this mass (1 = no filter)")
    g.add_argument("--seed", type=_number(int, "--seed", at_least=0, at_most=SEED_MAX), default=0,
                   help="seed of the sampling draws (each token's draw is keyed by the seed and its position)")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    g.add_argument("prompt", help="the text to continue")
    g.set_defaults(func=cmd_generate)


def _costs_parser(sub) -> None:
    c = sub.add_parser("costs", help="this CPU's forward costs and the default cycle they choose (measured once, cached)")
    _add_model_args(c, auto=True)
    c.add_argument("--remeasure", action="store_true", help="measure the forward costs again (e.g. after a BIOS or "
                                                              "power-setting change) instead of reading the cache")
    c.add_argument("--profile", action="store_true",
                   help="first record the head's cycle profile: decode --prompts with every candidate cycle (tree "
                        f"{', '.join(map(str, CYCLE_TREES))} x lookup {', '.join(map(str, CYCLE_LOOKUPS))}) "
                        "and count each one's forwards (exact kernels; minutes)")
    c.add_argument("--prompts", default=None, help="with --profile: a JSONL of {\"prompt\": ...} lines (default: 2 "
                                                   "prompts per domain of the default suite and 12 held-out chat prompts)")
    c.add_argument("--max-new-tokens", type=_number(int, "--max-new-tokens", at_least=1), default=128,
                   help="with --profile: tokens per prompt")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_costs)


def _serve_parser(sub) -> None:
    """`lossless serve`'s options."""
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions, streaming)")
    _add_model_args(sv, auto=True)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    sv.add_argument("--port", type=_number(int, "--port", at_least=0, at_most=65535), default=8000, help="TCP port")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on every route but /health (default: $LOSSLESS_API_KEY)")
    sv.add_argument("--served-model-name", default=None, help="the model's id in the API (default: --model)")
    sv.add_argument("--max-queue", type=_number(int, "--max-queue", at_least=1), default=16,
                    help="requests that may wait; past that the server answers 429 at once")
    sv.add_argument("--max-tokens", type=_number(int, "--max-tokens", at_least=1), default=2048,
                    help="the most tokens a request may generate (also its default, where the context has room)")
    sv.add_argument("--max-body", type=_number(int, "--max-body", at_least=1024), default=1 << 20,
                    help="the largest request body in bytes (413 past it); a body must arrive within 30 s (408)")
    sv.add_argument("--max-per-client", type=_number(int, "--max-per-client", at_least=1), default=None,
                    help="requests one client (an API key, else an address) may have waiting or decoding; past that "
                         "it gets 429 (default: no limit beyond --max-queue)")
    sv.add_argument("--max-connections", type=_number(int, "--max-connections", at_least=1), default=256,
                    help="open connections at once; past that the server answers 503 at once (uvicorn's "
                         "limit_concurrency; idle keep-alive connections close after 5 s)")
    sv.add_argument("--batch", type=_number(int, "--batch", at_least=1), default=None,
                    help=f"decode up to this many requests together, one forward per step (exact kernels; each "
                         f"request's tokens are AR's, sampled ones its seed's; AR steps with prompt lookup; a request "
                         f"alone decodes in its own cycle where that gives AR's tokens); 1 = one at a time, each in the "
                         f"configuration it asks for (default: {DEFAULT_BATCH} with exact kernels, else 1)")
    sv.add_argument("--prefill-chunk", type=_number(int, "--prefill-chunk", at_least=1), default=None, metavar="ROWS",
                    help=f"with --batch > 1: the most prompt rows one step runs beside the decoding requests, so a "
                         f"long prompt joins in chunks instead of stalling them (default: {PREFILL_CHUNK})")
    sv.add_argument("--mode", default="orthrus", choices=MODES, help="default decoding mode of a request")
    sv.add_argument("--k", type=_number(int, "--k", at_least=1), default=None, help="default block size (default: the head's k)")
    _add_cycle_args(sv)
    sv.add_argument("--tree", type=_number(int, "--tree", at_least=0), default=None, metavar="NODES",
                    help=f"default tree of a request (default: with a trained head, what this CPU's costs "
                         f"choose for a request that sets none of tree, lookup, k: see `lossless costs`; a sampled "
                         f"one's the {DEFAULT_TREE}-node tree; else {DEFAULT_TREE} with a trained head)")
    sv.add_argument("--lookup", type=_number(int, "--lookup", at_least=0), default=None, metavar="TOKENS",
                    help=f"default prompt lookup of a request (default: chosen with --tree; else "
                         f"{DEFAULT_LOOKUP} when greedy or batched, 0 when sampled alone)")
    sv.add_argument("--temperature", type=_number(float, "--temperature", at_least=0, at_most=2), default=0.0,
                    help="default temperature (0 = greedy, as `lossless generate`; the OpenAI API's default is 1)")
    sv.add_argument("--top-k", type=_number(int, "--top-k", at_least=0), default=0, help="default top-k (0 = none)")
    sv.add_argument("--top-p", type=_number(float, "--top-p", above=0, at_most=1), default=1.0, help="default top-p")
    sv.add_argument("--seed", type=_number(int, "--seed", at_least=0, at_most=SEED_MAX), default=None,
                    help="seed of a request that names none (default: a fresh one per request, said in the answer)")
    sv.set_defaults(func=cmd_serve)


def _distill_parser(sub) -> None:
    """`lossless distill`'s options."""
    d = sub.add_parser("distill", help="generate self-distillation responses (greedy) into a record directory")
    _add_model_args(d, "bf16", head=False, attn=False)
    d.add_argument("--prompts", default=None, help="JSONL prompts {id, prompt} (default: the shipped training prompts)")
    d.add_argument("--out", required=True, help="record directory (resumes; segments can be committed)")
    d.add_argument("--max-new-tokens", type=_number(int, "--max-new-tokens", at_least=1), default=128,
                   help="length of each response")
    d.add_argument("--batch", type=_number(int, "--batch", at_least=1), default=32, help="prompts per generate call")
    d.add_argument("--shard", default=None, help="i/n: this process takes every n-th prompt from the i-th "
                                                  "(default: from the rank under accelerate launch, else all)")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_distill)


def _train_parser(sub) -> None:
    """`lossless train`'s options."""
    t = sub.add_parser("train", help="train a draft head by distillation (backbone frozen)")
    _add_model_args(t, head=False, attn=False)
    t.add_argument("--out", required=True, help="head directory to write (checkpoint + head files)")
    t.add_argument("--k", type=_number(int, "--k", at_least=2, note=" to train a drafter"), default=8, help="block size")
    t.add_argument("--prompts", default=None, help="JSONL prompts for self-distillation (default: the shipped training prompts)")
    t.add_argument("--data", nargs="*", default=[], help="extra plain-text files/directories or JSONL with a 'text' field")
    t.add_argument("--steps", type=_number(int, "--steps", at_least=1), default=1000, help="optimiser steps")
    t.add_argument("--lr", type=_number(float, "--lr", above=0), default=3e-4, help="peak learning rate")
    t.add_argument("--warmup", type=_number(int, "--warmup", at_least=0), default=50, help="linear warm-up steps")
    t.add_argument("--loss", default="kl", choices=["kl", "ce"], help="KL(AR || draft) or cross-entropy on AR tokens")
    t.add_argument("--seqs-per-step", type=_number(int, "--seqs-per-step", at_least=1), default=4,
                   help="training sequences per step")
    t.add_argument("--anchors", type=_number(int, "--anchors", at_least=1), default=16,
                   help="blocks drafted per sequence per step")
    t.add_argument("--save-every", type=_number(int, "--save-every", at_least=0, note=" (0 = only at the end)"),
                   default=100, help="write a checkpoint every this many steps (0: only at the end)")
    t.add_argument("--eval-every", type=_number(int, "--eval-every", at_least=0, note=" (0 = never)"), default=200,
                   help="measure tokens per step on held-out prompts this often (0: never)")
    t.add_argument("--eval-prompts", type=_number(int, "--eval-prompts", at_least=0, note=" (0 = none)"), default=4,
                   help="held-out prompts per evaluation (0 = none)")
    t.add_argument("--max-new-tokens", type=_number(int, "--max-new-tokens", at_least=1), default=128,
                   help="length of self-distillation responses")
    t.add_argument("--distill-batch", type=_number(int, "--distill-batch", at_least=1), default=16,
                   help="prompts per batch when generating responses")
    t.add_argument("--distill-dir", default=None,
                   help="record directory of the responses (e.g. made by `lossless distill`; default: the user cache)")
    t.add_argument("--eval-tokens", type=_number(int, "--eval-tokens", at_least=1), default=64, help="tokens per held-out prompt at each evaluation")
    t.add_argument("--eval-distill-dir", default=None, metavar="DIR",
                   help="responses to held-out prompts (made by `lossless distill`): each evaluation also scores the "
                        "head teacher-forced on fixed blocks of them, and publishing follows that score")
    t.add_argument("--eval-sequences", type=_number(int, "--eval-sequences", at_least=1), default=64, help="held-out sequences scored teacher-forced per evaluation "
                                                                 "(--anchors blocks each)")
    t.add_argument("--autocast", default="auto", choices=["auto", "bf16", "off"],
                   help="products in bf16 with fp32 head weights (auto: where the CPU multiplies bf16 natively, or CUDA)")
    t.add_argument("--position-decay", type=_number(float, "--position-decay", above=0), default=1.0, help="loss weight of block position j: decay**j")
    t.add_argument("--position-weights", default=None,
                   help="loss weight per block position, k-1 comma-separated numbers (overrides --position-decay); "
                        "0,1,1,.. trains for the fused cycle, whose drafts start at block position 1")
    t.add_argument("--mask-lr-mult", type=_number(float, "--mask-lr-mult", at_least=0), default=1.0, help="the mask embedding's learning rate / --lr")
    t.add_argument("--init-head", default=None,
                   help="start from this head's weights at its training step with a fresh optimiser (e.g. to compare "
                        "objectives from one head)")
    t.add_argument("--draft-adapter", type=_number(int, "--draft-adapter", at_least=0, note=" (a rank; 0 = none)"),
                   default=0, metavar="RANK",
                   help="train draft-only MLP adapters of this rank with the head (more capacity for the draft view; "
                        "the AR view is untouched); 0: none")
    t.add_argument("--adapter-lr-mult", type=_number(float, "--adapter-lr-mult", at_least=0), default=1.0, help="the draft adapters' learning rate / --lr")
    t.add_argument("--log", default=None, help="JSONL training log, rewritten at every checkpoint (e.g. under results/)")
    t.add_argument("--publish", default=None,
                   help="head directory written whenever held-out tokens per cycle beats every earlier evaluation")
    t.add_argument("--encoding", default="full", choices=["full", "delta_int8"], help="how the head is stored")
    t.add_argument("--seed", type=_number(int, "--seed", at_least=0, at_most=SEED_MAX), default=0,
                   help="seed of data order and anchors")
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    t.add_argument("--stop-at", type=_number(int, "--stop-at", at_least=1), default=None, help="leave after this step with a checkpoint (resume later)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train)


def _curve_parser(sub) -> None:
    """`lossless curve`'s options."""
    c = sub.add_parser("curve", help="learning curve of draft-head training logs: plot, table, fitted trend")
    c.add_argument("logs", nargs="+", help="training logs (`lossless train --log`)")
    c.add_argument("--out", required=True, help="directory for learning_curve.png and learning_curve.md")
    c.add_argument("--labels", default=None, help="comma-separated curve names, one per log")
    c.set_defaults(func=cmd_curve)


def _audit_parser(sub) -> None:
    """`lossless audit`'s options."""
    a = sub.add_parser("audit", help="AR vs Orthrus (or any candidate decoder) trajectories over a prompt suite, "
                                     "appended to a run directory")
    _add_model_args(a, "fp32,bf16", dtype_list=True, attn_list=True)
    a.add_argument("--suite", default=None, help="JSONL {id, domain, prompt} or JSON {domain: [prompts]}")
    a.add_argument("--configs", default=None,
                   help="the plan instead of --dtypes x --attn: comma-separated dtype/attn[:prompts per domain], "
                        "run in this order, e.g. bf16/sdpa,fp32/sdpa,fp16/sdpa:20; attn llama.cpp decodes with "
                        "llama.cpp's server ($LLAMA_SERVER) on the embedded GGUF requantized to the dtype")
    a.add_argument("--max-new-tokens", type=_number(int, "--max-new-tokens", at_least=1), default=128,
                   help="tokens generated per prompt")
    a.add_argument("--k", type=_number(int, "--k", at_least=1), default=None, help="block size (default: the head's k; --cycle fused: at most 3)")
    _add_cycle_args(a)
    a.add_argument("--candidates", default="orthrus",
                   help="comma-separated decoders compared with AR: orthrus, orthrus-fused, orthrus-tree, orthrus-lookup "
                        "(prompt lookup beside the drafts), orthrus-tree-lookup (both), oracle (the reference "
                        "as drafter), prompt-lookup, self-assisted, hf-greedy, or module:function (a callable "
                        "(model, prompt_ids, max_new_tokens) -> token ids); --cycle fused turns orthrus into "
                        "orthrus-fused. Under the kernel llama.cpp (--configs bf16/llama.cpp): llama.cpp's "
                        "speculative modes llama.cpp-ngram-simple, -ngram-map-k, -ngram-map-k4v, -ngram-mod, "
                        "-ngram-cache, -draft, against llama.cpp's own greedy AR")
    a.add_argument("--limit-per-domain", type=_number(int, "--limit-per-domain", at_least=1), default=None, help="first N prompts of each domain")
    a.add_argument("--shard", default=None,
                   help="i/n: run every n-th item starting at i (default: the process's rank under accelerate "
                        "launch or torchrun, else everything)")
    a.add_argument("--out", required=True, help="run directory, e.g. runs/NAME")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")
    a.set_defaults(func=cmd_audit)


def _report_parser(sub) -> None:
    """`lossless report`'s options."""
    r = sub.add_parser("report", help="write report.md, plots and summary.json for an audit run")
    r.add_argument("run_dir", help="the --out directory of `lossless audit`")
    r.add_argument("--out", default=None, help="where to write (default: the run directory)")
    r.add_argument("--reference", default=None, metavar="DTYPE/KERNEL",
                   help="the AR trajectories every configuration is also compared with, e.g. fp32/sdpa or bf16/exact "
                        "(default: fp32 AR where the run has it)")
    r.add_argument("--reference-from", default=None, metavar="RUN_DIR",
                   help="take --reference's AR trajectories from this other audit run (same suite), e.g. the "
                        "full study's fp32/sdpa for a run of llama.cpp")
    r.add_argument("--at-rest", action="store_true",
                   help="first roll every writer's plain records into compressed segments (safe while an "
                        "audit runs), then report from the segments only: what a checkout of them holds")
    r.set_defaults(func=cmd_report)


def _backfill_parser(sub) -> None:
    """`lossless backfill`'s options."""
    bf = sub.add_parser("backfill", help="top tokens at the divergence for records made before audits kept them: "
                                         "each such pair decoded again up to its divergence, on the machine it names")
    bf.add_argument("run_dir", help="the --out directory of `lossless audit`")
    bf.add_argument("--limit", type=_number(int, "--limit", at_least=1), default=None, help="at most this many pairs (default: all; it resumes)")
    bf.add_argument("--shard", default=None, metavar="I/N",
                    help="every N-th pair, from the I-th: processes side by side (one per core, OMP_NUM_THREADS=1)")
    bf.add_argument("--no-progress", action="store_true", help="no progress bar")
    bf.set_defaults(func=cmd_backfill)


def _probe_parser(sub) -> None:
    """`lossless probe`'s options."""
    pr = sub.add_parser("probe", help="name the first op where a block pass differs from one-token-at-a-time")
    _add_model_args(pr, dtype="bf16")
    pr.add_argument("--k", type=_number(int, "--k", at_least=2, note=" to compare a block with single tokens"),
                    default=8, help="block size compared with single steps")
    pr.add_argument("--all", action="store_true", help="list every op, not only the differing ones")
    pr.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    pr.add_argument("text", help="text whose last k tokens are compared")
    pr.set_defaults(func=cmd_probe)


def _eval_parser(sub) -> None:
    """`lossless eval`'s options."""
    e = sub.add_parser("eval", help="task scores of ar and orthrus side by side, through lm-evaluation-harness")
    _add_model_args(e, "bf16", dtype_list=True)
    e.add_argument("--tasks", default="humaneval,arith,capitals", help="comma-separated: humaneval, arith, capitals")
    e.add_argument("--modes", default="ar,orthrus", help=f"comma-separated decoding modes: {', '.join(MODES)}")
    e.add_argument("--k", type=_number(int, "--k", at_least=1), default=None, help="block size (default: the head's k; --cycle fused: at most 3)")
    _add_cycle_args(e)
    e.add_argument("--limit", type=_number(int, "--limit", at_least=1), default=None, help="items per task (default: all)")
    e.add_argument("--confirm-run-unsafe-code", action="store_true",
                   help="allow tasks that execute model-written code (humaneval)")
    e.add_argument("--out", required=True, help="output directory, e.g. runs/eval")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_eval)


def _tasks_parser(sub) -> None:
    """`lossless tasks`'s options."""
    tk = sub.add_parser("tasks", help="write the local lm-eval tasks (data + YAML) for --include_path")
    tk.add_argument("--out", required=True, help="directory to write")
    tk.set_defaults(func=cmd_tasks)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lossless", description="Orthrus dual-view decoding, audited for exactness")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _costs_parser(sub)
    _distill_parser(sub)
    _train_parser(sub)
    _curve_parser(sub)
    _audit_parser(sub)
    _report_parser(sub)
    _backfill_parser(sub)
    _probe_parser(sub)
    _eval_parser(sub)
    _tasks_parser(sub)
    return parser


# options whose number may be left out; argparse would take the word after a bare one (the prompt) as its value
OPTIONAL_NUMBERS = {"--tree": DEFAULT_TREE, "--lookup": DEFAULT_LOOKUP}


def with_optional_numbers(argv: list[str]) -> list[str]:
    """`--tree "Summarise: ..."` -> `--tree 8 "Summarise: ..."`: a bare optional-number option gets its default
    spelled out when the next word is not a number, so it never swallows the prompt."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in OPTIONAL_NUMBERS and i + 1 < len(argv) and not argv[i + 1].lstrip("-").isdigit() \
                and not argv[i + 1].startswith("-"):
            out.append(str(OPTIONAL_NUMBERS[arg]))
    return out


def _output_places(args) -> list[Path]:
    """The directories a command writes into (for messages, and to sweep its temporary files)."""
    places = [getattr(args, name, None) for name in ("out", "run_dir", "publish")]
    if getattr(args, "log", None):
        places.append(str(Path(args.log).parent))
    if args.command == "train" and not args.distill_dir:
        from .training import distill
        from . import paths

        places.append(str(distill.default_dir(args.model, args.prompts or paths.TRAIN_PROMPTS, args.max_new_tokens,
                                              args.dtype)))
    return [Path(p) for p in places if p]


def _rerun_advice(args) -> str:
    """What to do once space is free: what a rerun of this command keeps."""
    if args.command in ("audit", "distill", "eval"):
        return "rerun: the run resumes where it stopped"
    if args.command == "train":
        from .training.train import CHECKPOINT

        if (Path(args.out) / CHECKPOINT).exists():
            return "rerun with --resume: training continues from the last checkpoint"
    return "rerun"


def _write_fault(args, exc: OSError) -> str:
    """One line for a write the environment refused (full disk, read-only or foreign place), mid-run."""
    from . import paths

    places = _output_places(args)
    where = exc.filename or (places[0] if places else "an output file")
    line = paths.write_fault(where, exc)
    if exc.errno in paths.DISK_FULL:
        line = line.removesuffix("rerun") + _rerun_advice(args)
    return line


def main(argv: list[str] | None = None) -> int:
    typed = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(with_optional_numbers(typed))
    except LosslessError as exc:  # a numeric option's type refused its value
        print(f"lossless: error: {exc}", file=sys.stderr)
        return 2
    args.argv = typed  # what the user typed, for run records
    try:
        return int(args.func(args) or 0)
    except LosslessError as exc:
        print(f"lossless: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        from . import paths

        if exc.errno not in paths.WRITE_FAULTS:
            raise
        print(f"lossless: error: {_write_fault(args, exc)}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:  # a reader that did not name its file
        print(f"lossless: error: an input file is not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lossless: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
