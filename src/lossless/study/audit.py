"""The trajectory audit: for every prompt and configuration (dtype, attention kernel), the AR greedy
reference and each candidate decoder's greedy trajectory (Orthrus by default; prompt lookup, assisted
generation, the oracle drafter or your own, see `candidates.py`), compared token for token.

A run is a plan of configurations, each over all prompts of the suite or the first n per domain
(`--configs bf16/sdpa,fp16/sdpa:20`, or the cross product of `--dtypes` and `--attn`), worked through
configuration by configuration in the order given (cheap ones first, so a partial run is complete for
them), prompts round-robin over domains. One JSON line per (prompt, configuration, reference) pair goes
to the run's record store (`records.py`): flushed and fsynced per item, compressed into gzip segments
that are committed, so a run resumes from any checkout on any machine and never repeats a pair. An
exact-mode pair is done when today's kernel build decoded it: after a change to the exact kernels' sources
the same command decodes those pairs again, beside the earlier records (which the report names, not pools).

- `--shard i/n` takes every n-th item; under `accelerate launch` (or `torchrun`) each process takes
  the shard of its rank. Shards write their own files; readers merge them.
- `run.json` records the plan, the head's digest and the first writer's environment, with paths relative
  to the checkout; a run directory holding another configuration or another head is refused. A study
  pinned to a head that is no longer the default finds it among `heads/` by its digest.
- Each record names its machine (CPU, ISA, torch, threads): bf16 rounding depends on it.
- An AR reference is computed once per (prompt, dtype, kernel) and machine and shared by every candidate
  of the item; exact mode's comparison with stock AR reuses the stock configuration's record when one exists.
- Record keys: `id|dtype|attn`, then `|ref-<kernel>` when the reference ran another kernel, then
  `|<candidate>` for every candidate but `orthrus` (`|fused` for `orthrus-fused`, the key the fused cycle
  always had). The `orthrus_*` fields hold the candidate's trajectory whatever the candidate (the study's
  record format predates candidates); `candidate` names it.

This module runs decodes and records them. Statistics and the report are in `lossless.stats` and `report.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from . import candidates as cands
from . import llamacpp
from ..decoding.loop import DecodeConfig, decode
from ..dtypes import dtype_name
from ..errors import LosslessError, not_utf8
from ..names import AUDIT_KERNELS, EXACT, LLAMA_CPP, positive_int
from ..paths import check_writable_dir, exclusive_lock, make_dir, write_atomically
from ..decoding.model import OrthrusLM
from .records import RecordStore, read_records, record_id, writer_name
from ..stats import first_divergence, levenshtein
from ..text import encode_prompt

RUN_FILE = "run.json"


# ------------------------------------------------------------------------------------------------ suite
def load_suite(path: str | Path) -> list[dict]:
    """Prompts `{"id", "domain", "prompt"}` from JSONL lines or a JSON object {"domain": [prompts]}."""
    path = Path(path)
    if not path.is_file():
        raise LosslessError(f"suite {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc, "suite") from None
    rows: list[dict] = []
    stripped = text.lstrip()
    if stripped.startswith("{") and path.suffix == ".json":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LosslessError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not all(isinstance(v, list) for v in obj.values()):
            raise LosslessError(f"{path}: expected {{\"domain\": [\"prompt\", ...], ...}}")
        for domain, prompts in obj.items():
            for i, prompt in enumerate(prompts):
                if not isinstance(prompt, str) or not prompt.strip():
                    raise LosslessError(f"{path}: domain '{domain}' item {i} is not a non-empty string")
                rows.append({"id": f"{domain}-{i:03d}", "domain": domain, "prompt": prompt})
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LosslessError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
                raise LosslessError(f"{path}:{lineno}: expected an object with a non-empty \"prompt\" string")
            domain = str(obj.get("domain", "default"))
            rows.append({"id": str(obj.get("id", f"{domain}-{lineno:04d}")), "domain": domain, "prompt": obj["prompt"]})
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise LosslessError(f"{path}: duplicate prompt id '{dup}'")
    return rows


def limit_per_domain(rows: list[dict], n: int | None) -> list[dict]:
    if not n:
        return rows
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        if seen.get(r["domain"], 0) < n:
            out.append(r)
            seen[r["domain"]] = seen.get(r["domain"], 0) + 1
    return out


def interleave_domains(rows: list[dict]) -> list[dict]:
    """Round-robin over domains (first prompt of each domain, then the second, ...), so that a partial
    run covers every domain about equally."""
    by_domain: dict[str, list[dict]] = {}
    for r in rows:
        by_domain.setdefault(r["domain"], []).append(r)
    out = []
    for i in range(max((len(v) for v in by_domain.values()), default=0)):
        out.extend(v[i] for v in by_domain.values() if i < len(v))
    return out


# ----------------------------------------------------------------------------------------------- config
@dataclass
class AuditConfig:
    model: str = "smollm2-135m"
    head: str | None = None
    suite: str = ""
    suite_sha256: str = ""
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    attns: list[str] = field(default_factory=lambda: ["sdpa"])
    max_new_tokens: int = 128
    k: int | None = None
    limit_per_domain: int | None = None
    device: str = "cpu"
    configs: list[str] | None = None  # the plan as "dtype/attn[:n per domain]", in order; None = dtypes x attns
    head_digest: str = ""  # the head every record of the run was made with (set from the loaded model)
    candidates: list[str] = field(default_factory=lambda: [cands.DEFAULT])  # decoders compared with AR
    groups: int | None = None  # orthrus-fused: draft groups per forward (None = all)

    def plan(self) -> list[tuple[str, str, int | None]]:
        """(dtype, attn, prompts per domain or None for all), in the order the run works through them."""
        if self.configs:
            return [parse_config(c) for c in self.configs]
        return [(d, a, self.limit_per_domain) for d in self.dtypes for a in self.attns]


def parse_config(text: str) -> tuple[str, str, int | None]:
    """`bf16/sdpa` -> ("bf16", "sdpa", None); `fp16/exact:20` -> ("fp16", "exact", 20)."""
    spec, _, limit = text.strip().partition(":")
    dtype, _, attn = spec.partition("/")
    if not dtype or not attn:
        raise LosslessError(f"config '{text}': expected dtype/attn[:prompts per domain], e.g. bf16/sdpa or fp16/sdpa:20")
    if attn not in AUDIT_KERNELS:
        raise LosslessError(f"config '{text}': unknown attention kernel '{attn}'; choose from {', '.join(AUDIT_KERNELS)}")
    n = positive_int(limit, f"config '{text}': the prompts per domain after ':' must be a positive integer") \
        if limit else None
    return dtype_name(dtype), attn, n


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise LosslessError(f"--shard '{text}': expected i/n, e.g. 0/2") from None
    if not (n >= 1 and 0 <= i < n):
        raise LosslessError(f"--shard '{text}': need 0 <= i < n")
    return i, n


def launcher_state():
    """accelerate's view of this process under `accelerate launch` / `torchrun` (None when run alone)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=True)


def machine_id() -> str:
    """What a record's bf16/fp16 rounding depends on: CPU model and ISA, torch build, intra-op threads."""
    from ..decoding.kernels import cpu_flags, cpu_model

    cpu = cpu_model()
    isa = torch.backends.cpu.get_cpu_capability()
    native = sorted(f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16") if f in cpu_flags())
    threads = torch.get_num_threads()
    return f"{cpu} ({isa}{''.join(', ' + f for f in native)}), torch {torch.__version__}, {threads} thread" + \
        ("s" if threads != 1 else "")


def environment() -> dict:
    import transformers

    return {
        "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "machine": machine_id(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "decoding": "greedy (seeds unused)",
    }


def portable_path(path: str | Path) -> str:
    """A path as committed files should hold it: relative to the working directory when inside it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def read_run_file(run_dir: Path) -> dict | None:
    """The run's run.json (None for a new run), or a one-line error when it is unreadable: a torn or emptied
    file (an older version wrote it in place, so a full disk could empty it) must not mix two runs."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        if path.exists():
            raise LosslessError(f"{path} is not a file: remove it, or choose another --out")
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        info = exc
    if not isinstance(info, dict) or not isinstance(info.get("config", {}), dict):
        raise LosslessError(f"{path} is corrupt: restore it (e.g. `git checkout {path}`), or delete it and rerun the "
                            "run's own command to write it anew; the records are kept")
    return info


def check_same_run(run_dir: Path, cfg: AuditConfig, old: dict | None = None) -> None:
    """Refuse a run directory whose run.json holds another configuration (the head is checked once it is
    loaded, in `open_run`). Writes nothing."""
    old = read_run_file(run_dir) if old is None else old
    if old is None:
        return
    old_cfg, mine = old.get("config", {}), asdict(cfg)
    # the suite and head are identified by content hashes, so a moved checkout or a versioned head
    # directory still resumes; a run made before heads were recorded adopts this one
    skip = {"suite", "head", "head_digest"}
    diff = sorted(k for k in mine if k not in skip and _recorded(old_cfg, k) != mine[k])
    if diff:
        raise LosslessError(
            f"{run_dir} holds a run with a different configuration ({', '.join(diff)}); rerun its own command "
            f"to resume (see {Path(run_dir) / RUN_FILE}) or choose another --out"
        )


def open_run(run_dir: Path, cfg: AuditConfig, planned: int, command: list[str]) -> None:
    """Create run.json, or check that an existing one holds the same configuration and head. run.json is
    replaced atomically: a full disk leaves the old file or none, never an empty one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_FILE
    mine = asdict(cfg)
    old = read_run_file(run_dir)
    if old is not None:
        old_cfg = old.get("config", {})
        if old_cfg.get("head_digest") and old_cfg["head_digest"] != cfg.head_digest:
            raise LosslessError(
                f"{run_dir} was run with head {old_cfg['head_digest']}, not {cfg.head_digest}: one study keeps "
                f"one head; pass --head with that head's directory, or choose another --out")
        check_same_run(run_dir, cfg, old)
        check_same_llama_cpp(run_dir, cfg, old)
        if not old_cfg.get("head_digest"):
            old.setdefault("config", {})["head_digest"] = cfg.head_digest
            write_atomically(path, json.dumps(old, indent=2) + "\n")
        return
    mine["suite"] = portable_path(cfg.suite)
    if cfg.head:
        mine["head"] = portable_path(cfg.head)
    env = {**environment(), **llama_cpp_environment(cfg)}
    info = {"config": mine, "planned": planned, "environment": env, "command": command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_atomically(path, json.dumps(info, indent=2) + "\n")


def llama_cpp_environment(cfg: AuditConfig) -> dict:
    """What a run of llama.cpp configurations depends on beside its own settings: the server's build and the
    options of each mode ({} for runs without llama.cpp)."""
    if not any(attn == LLAMA_CPP for _, attn, _ in cfg.plan()):
        return {}
    return {"llama_server": llamacpp.server_version(),
            "llama_cpp_modes": {f"{LLAMA_CPP}-{mode}": " ".join(o) for mode, o in llamacpp.MODES.items()}}


def check_same_llama_cpp(run_dir: Path, cfg: AuditConfig, old: dict) -> None:
    """Refuse to resume a run of llama.cpp with another llama-server build or other mode options than its records'."""
    mine, env = llama_cpp_environment(cfg), old.get("environment", {})
    for key, value in mine.items():
        if key in env and env[key] != value:
            raise LosslessError(f"{run_dir} was decoded with {key} {env[key]!r}, not {value!r}: resume it with that "
                                f"build (set {llamacpp.SERVER_ENV}), or choose another --out")


_DEFAULTS = {"configs": None, "groups": None}  # fields added after the first runs: absent in old run.json means the default


def _recorded(old_cfg: dict, name: str):
    """A configuration field as an existing run.json holds it; runs from before candidates named their
    Orthrus cycle instead (`cycle: fused` is the `orthrus-fused` candidate)."""
    if name == "candidates" and name not in old_cfg:
        return ["orthrus-fused" if old_cfg.get("cycle") == "fused" else cands.DEFAULT]
    return old_cfg.get(name, _DEFAULTS.get(name))


def pinned_head(run_dir: Path) -> str:
    """The head digest a run directory is pinned to ('' for a new run; an unreadable run.json is refused)."""
    info = read_run_file(run_dir)
    return "" if info is None else info.get("config", {}).get("head_digest", "")


# ------------------------------------------------------------------------------------------------ pairs
@torch.no_grad()
def response_log_ppl(model: OrthrusLM, prompt_ids: list[int], response: list[int]) -> float:
    """log PPL(response | prompt): mean negative log-likelihood per response token, one teacher-forced pass."""
    return -float(model.score(prompt_ids, response)[0].mean()) if response else float("nan")


@dataclass
class Reference:
    """One AR greedy trajectory, as pair records need it (computed now, or read back from a record)."""
    ids: list[int]
    margins: list[float]
    log_ppl: float | None
    forwards: int
    seconds: float
    reused: bool = False
    tops: list[list[list]] | None = None  # the top [[id, logit], ...] per token (not kept in records: None when reused)

    @classmethod
    def from_record(cls, r: dict) -> "Reference":
        return cls(r["ar_ids"], r["ar_margins"], r["ref_log_ppl"], r["ar_forwards"], r["ar_seconds"], reused=True)


def record_key(prompt_id: str, dtype: str, attn: str, reference_attn: str | None = None,
               candidate: str = cands.DEFAULT) -> str:
    """`id|dtype|attn`, then `|ref-<kernel>` when the reference ran another kernel, then `|<candidate>`
    unless the candidate is `orthrus` (`|fused` for `orthrus-fused`)."""
    suffix = "" if candidate == cands.DEFAULT else "|fused" if candidate == "orthrus-fused" else f"|{candidate}"
    return (f"{prompt_id}|{dtype}|{attn}" + (f"|ref-{reference_attn}" if reference_attn not in (None, attn) else "")
            + suffix)


def kernel_build(attn: str) -> str | None:
    """Which exact-mode kernels decode under `attn`: "<source digest>/<variant>" (their bits are the same on any
    machine, not across kernel versions), None for stock kernels (whose bits the record's machine names)."""
    if attn != EXACT:
        return None
    from ..decoding import kernels

    return kernels.build_name()


def top_at(tops, i):
    """The top tokens and logits of position `i` as records keep them (4 decimals, as the margins), or None (also
    where the decoder gave none for that token: llama.cpp's accepted drafts)."""
    return [[t, round(v, 4)] for t, v in tops[i]] if tops and i is not None and i < len(tops) and tops[i] else None


def pair_record(prompt: dict, prompt_ids: list[int], dtype: str, attn: str, reference_attn: str,
                max_new_tokens: int, ref: Reference, run: cands.CandidateRun, candidate: str = cands.DEFAULT,
                machine: str = "", head: str = "") -> dict:
    """The audit record of one AR reference against one candidate trajectory."""
    a, o = ref.ids, run.ids
    div = first_divergence(a, o)

    def margin(margins, i):
        known = margins is not None and i is not None and i < len(margins) and margins[i] is not None
        return round(margins[i], 6) if known and math.isfinite(margins[i]) else None

    return {
        "key": record_key(prompt["id"], dtype, attn, reference_attn, candidate), "prompt_id": prompt["id"],
        "domain": prompt["domain"], "dtype": dtype, "attn": attn, "reference_attn": reference_attn,
        "candidate": candidate, "cycle": run.cycle, "k": run.k, "max_new_tokens": max_new_tokens,
        "prompt_tokens": len(prompt_ids),
        "ar_ids": a, "orthrus_ids": o, "exact_match": a == o, "first_divergence": div,
        "levenshtein": levenshtein(a, o),
        "ref_margin_at_divergence": margin(ref.margins, div), "orthrus_margin_at_divergence": margin(run.margins, div),
        "ref_top_at_divergence": top_at(ref.tops, div), "orthrus_top_at_divergence": top_at(run.tops, div),
        "ref_log_ppl": ref.log_ppl, "response_length": len(a),
        "accepted": run.accepted, "tokens_per_step": run.tokens_per_step,
        "ar_forwards": ref.forwards, "orthrus_forwards": run.forwards,
        "ar_seconds": round(ref.seconds, 4), "orthrus_seconds": round(run.seconds, 4),
        "reference_reused": ref.reused,
        # the reference's top-1 minus top-2 logit per token (4 decimals: bf16 steps are far coarser), so a
        # later configuration can reuse this reference and still report its margin at divergence
        "ar_margins": [None if m is None else round(m, 4) for m in ref.margins],
        "machine": machine, "head": head,
        "kernels": kernel_build(attn), "reference_kernels": kernel_build(reference_attn),
    }


def reference_kernels(attn: str) -> list[str]:
    """AR references a candidate under `attn` is compared with: its own kernel's, and for exact mode also
    stock SDPA's."""
    return [attn, "sdpa"] if attn == "exact" else [attn]


def compute_reference(model: OrthrusLM, ids: list[int], dcfg: DecodeConfig) -> Reference:
    if isinstance(model, llamacpp.Engine):  # llama.cpp's own greedy decoding, its log-probabilities
        d = model.decode(llamacpp.GREEDY, ids, dcfg.max_new_tokens)
        log_ppl = d.log_ppl()
        return Reference(d.ids, d.margins, None if log_ppl is None else round(log_ppl, 6), len(d.ids), d.seconds,
                         tops=d.tops)
    ar = decode(model, ids, "ar", dcfg)
    log_ppl = response_log_ppl(model, ids, ar.generated)
    return Reference(ar.generated, ar.margins, None if math.isnan(log_ppl) else round(log_ppl, 6),
                     ar.stats.forwards, ar.stats.seconds, tops=ar.tops)


def item_ids(prompt_id: str, dtype: str, attn: str, candidate: str) -> list[str]:
    """The ids (`records.record_id`) of the records one candidate of one item writes today (one per reference
    kernel): an exact-mode item decoded by an earlier kernel build is still to do on today's."""
    build = kernel_build(attn)
    return [record_id({"key": record_key(prompt_id, dtype, attn, ref_attn, candidate), "kernels": build})
            for ref_attn in reference_kernels(attn)]


def decode_config(max_new_tokens: int, k: int | None, groups: int | None, stop_after: int | None = None) -> DecodeConfig:
    """What every decode of an audit runs with (`stop_after`: see DecodeConfig; the backfill's)."""
    return DecodeConfig(max_new_tokens=max_new_tokens, k=k, record_margins=True, groups=groups, stop_after=stop_after)


def suite_digest(path: str | Path) -> str:
    """The suite's content hash as run.json keeps it (16 hex digits of sha256)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def audit_prompt(models: dict, prompt: dict, dtype: str, attn: str, cfg: AuditConfig,
                 known: dict[tuple[str, str, str], dict] | None = None, machine: str = "",
                 candidates: list[str] | None = None) -> list[dict]:
    """Run each candidate (default: the run's) on one prompt under `attn` and compare it with each AR
    reference, computed once for all of them; one record per (candidate, reference). `known` maps
    (prompt id, dtype, reference kernel) to an earlier record of this machine whose reference can be reused."""
    model = models[(dtype, attn)]
    ids = encode_prompt(model.tokenizer, prompt["prompt"])
    dcfg = decode_config(cfg.max_new_tokens, cfg.k, cfg.groups)
    refs: dict[str, Reference] = {}
    for ref_attn in reference_kernels(attn):
        earlier = (known or {}).get((prompt["id"], dtype, ref_attn))
        refs[ref_attn] = Reference.from_record(earlier) if earlier is not None else \
            compute_reference(models[(dtype, ref_attn)], ids, dcfg)
    records = []
    for name in candidates or cfg.candidates:
        cands.check_kernel(name, attn)
        # the oracle drafts the reference of its own kernel
        run = cands.resolve(name).run(model, ids, dcfg, refs[attn].ids)
        for ref_attn, ref in refs.items():
            records.append(pair_record(prompt, ids, dtype, attn, ref_attn, cfg.max_new_tokens, ref, run, name,
                                       machine=machine, head=cfg.head_digest))
        # the next candidates share these references: their records count the reference's cost as reused
        refs = {kernel: dataclasses.replace(ref, reused=True) for kernel, ref in refs.items()}
    return records


def plan_work(cfg: AuditConfig, suite: list[dict]) -> list[tuple[dict, str, str]]:
    """Every (prompt, dtype, attn) item of the plan, configuration by configuration."""
    work = []
    for dtype, attn, limit in cfg.plan():
        work.extend((p, dtype, attn) for p in interleave_domains(limit_per_domain(suite, limit)))
    return work


def _reusable(records: list[dict], machine: str) -> dict[tuple[str, str, str], dict]:
    """Records whose AR reference another item or candidate may reuse, by (prompt id, dtype, reference
    kernel): references made on this machine (exact ones by today's exact kernels), with their margins."""
    return {(r["prompt_id"], r["dtype"], r["reference_attn"]): r for r in records
            if r.get("machine") == machine and "ar_margins" in r and r.get("reference_attn")
            and r.get("reference_kernels") == kernel_build(r["reference_attn"])}  # an exact reference: today's kernels


def run_audit(cfg: AuditConfig, out: str | Path, shard: str | None = None, command: list[str] | None = None,
              progress: bool = True, load=None, roll_seconds: float = 600.0) -> dict:
    """Run (or resume) an audit into `out`. `load(dtype, attn)` builds models (default: models.load_model).

    Records are rolled into a compressed segment every `roll_seconds` and when the run stops (finished,
    interrupted or failed).

    Every setting, the suite, the run directory's run.json and whether the directory can be written are
    checked before any model loads and before anything is written; then the writer takes an exclusive lock
    on the directory (`.lock`, or `.lock-shard-i-of-n` per shard) for the whole run, so a second audit into
    the same place is refused instead of computing the same pairs."""
    from ..decoding.models import load_model

    check_settings(cfg)
    cfg.dtypes = [dtype_name(d) for d in cfg.dtypes]
    parse_shard(shard)
    launcher = None if shard else launcher_state()
    shard_t = parse_shard(shard) if launcher is None else (launcher.process_index, launcher.num_processes)
    suite = load_suite(cfg.suite)
    cfg.suite_sha256 = suite_digest(cfg.suite)
    cfg.candidates = cands.parse_candidates(cfg.candidates)
    for _, attn, _ in cfg.plan():  # every candidate can run under every kernel of the plan, or nothing runs
        for name in cfg.candidates:
            cands.check_kernel(name, attn)
    if any(attn == LLAMA_CPP for _, attn, _ in cfg.plan()):  # its server and GGUF exist before anything is written
        llamacpp.require_server()
        for dtype in {d for d, attn, _ in cfg.plan() if attn == LLAMA_CPP}:
            llamacpp.server_gguf(cfg.model, dtype)
    work = plan_work(cfg, suite)
    if not work:
        raise LosslessError(f"suite {cfg.suite} is empty after filtering")
    planned = sum(len(reference_kernels(a)) for _, _, a in work) * len(cfg.candidates)
    run_dir = Path(out)
    check_same_run(run_dir, cfg)  # an unreadable run.json or another configuration: refused before any work
    check_writable_dir(run_dir)
    make_dir(run_dir)  # the other ranks may be checking it (making and removing it) meanwhile
    writer = writer_name(shard_t)
    lock = run_dir / (LOCK_FILE if shard_t[1] == 1 else f"{LOCK_FILE}-{writer}")
    what = run_dir if shard_t[1] == 1 else f"shard {shard_t[0]}/{shard_t[1]} of {run_dir}"
    with exclusive_lock(lock, f"another audit is writing {what} (pid {{pid}}): wait for it or use another --out"):
        return _run_locked(cfg, run_dir, suite, work, planned, shard_t, launcher, command, progress, load,
                           roll_seconds)


LOCK_FILE = ".lock"  # held by the writer of a run directory (one per shard: `.lock-shard-i-of-n`) while it runs


def check_settings(cfg: AuditConfig) -> None:
    """Refuse settings no audit can run with, before anything loads or is written."""
    for option, value, least in (("--max-new-tokens", cfg.max_new_tokens, 1), ("--k", cfg.k, 1),
                                 ("--limit-per-domain", cfg.limit_per_domain, 1), ("--groups", cfg.groups, 1)):
        if value is None and option != "--max-new-tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise LosslessError(f"{option} must be an integer >= {least}, got {value!r}")
    for c in cfg.configs or []:
        parse_config(c)


def check_requests(model: OrthrusLM, cfg: AuditConfig, prompts: list[dict]) -> None:
    """Refuse, once the first model is loaded and before run.json is written, a block size the head cannot
    draft or a prompt whose response would run past the model's context."""
    from ..decoding.loop import validate

    if model.tokenizer is None or not prompts:
        return
    if isinstance(model, llamacpp.Engine):  # no head; the server's context holds the longest prompt and its answer
        longest = max(len(encode_prompt(model.tokenizer, p["prompt"])) for p in prompts)
        if longest + cfg.max_new_tokens > llamacpp.CONTEXT:
            raise LosslessError(f"llama.cpp's server holds {llamacpp.CONTEXT} tokens: the longest prompt ({longest}) "
                                f"and --max-new-tokens {cfg.max_new_tokens} do not fit; lower --max-new-tokens")
        return
    longest = max((encode_prompt(model.tokenizer, p["prompt"]) for p in prompts), key=len)
    cycles = {"fused" if n == "orthrus-fused" else "two-pass" for n in cfg.candidates}
    for cycle in sorted(cycles):
        validate(model, longest, DecodeConfig(max_new_tokens=cfg.max_new_tokens, k=cfg.k, groups=cfg.groups,
                                              cycle=cycle), "orthrus")


def _run_locked(cfg: AuditConfig, run_dir: Path, suite: list[dict], work: list, planned: int,
                shard_t: tuple[int, int], launcher, command, progress: bool, load, roll_seconds: float) -> dict:
    """`run_audit`'s work, under the run directory's writer lock."""
    from ..decoding.models import load_model

    pinned = pinned_head(run_dir)
    head = cfg.head
    if pinned and load is None:
        head = locate_head(cfg.model, cfg.head, pinned)
    load = llamacpp.engine_loader(load or (lambda d, a: load_model(cfg.model, d, cfg.device, a, head=head)),
                                  cfg.model)
    models: dict[tuple[str, str], OrthrusLM] = {}
    first = work[0][1:]
    models[first] = load(*first)
    cfg.head_digest = getattr(models[first], "head_digest", "")
    mine = [w for j, w in enumerate(work) if j % shard_t[1] == shard_t[0]]
    check_requests(models[first], cfg, list({p["id"]: p for p, _, _ in mine}.values()))
    if launcher is None or launcher.is_main_process:
        open_run(run_dir, cfg, planned, command or sys.argv)
    if launcher is not None:
        launcher.wait_for_everyone()  # run.json exists (or the mismatch was raised) before any shard works
        open_run(run_dir, cfg, planned, command or sys.argv)
    store = RecordStore(run_dir, writer_name(shard_t), roll_seconds=roll_seconds)
    existing = read_records(run_dir)
    done = {record_id(r) for r in existing}
    machine = machine_id()
    known = _reusable(existing, machine)
    del existing

    def missing(item) -> list[str]:
        """The candidates of an item still to run (an item's records are written together, per run)."""
        prompt, dtype, attn = item
        return [c for c in cfg.candidates if not all(i in done for i in item_ids(prompt["id"], dtype, attn, c))]

    todo = [(w, m) for w in mine if (m := missing(w))]
    last_of = {(dtype, attn): i for i, ((_, dtype, attn), _) in enumerate(todo)}  # a configuration's last item
    n_new = 0
    with store.session(), tqdm(total=len(mine), initial=len(mine) - len(todo), desc="audit pairs", unit="item",
                               disable=not progress) as bar:
        for i, ((prompt, dtype, attn), names) in enumerate(todo):
            for kernel in reference_kernels(attn):
                if (dtype, kernel) not in models:
                    if kernel != attn and (prompt["id"], dtype, kernel) in known:
                        continue  # this reference comes from an earlier record
                    models[(dtype, kernel)] = load(dtype, kernel)
            if (dtype, attn) not in models:
                models[(dtype, attn)] = load(dtype, attn)
            records = [r for r in audit_prompt(models, prompt, dtype, attn, cfg, known, machine, names)
                       if record_id(r) not in done]
            # all records of an item in one write: a kill leaves the item wholly done or wholly to redo
            store.append(records)
            known.update(_reusable(records, machine))
            n_new += len(records)
            bar.set_postfix(match=f"{sum(r['exact_match'] for r in records)}/{len(records)}")
            bar.update(1)
            if attn == LLAMA_CPP and last_of[(dtype, attn)] == i:
                llamacpp.close(dtype)  # this configuration's servers are done with
    return {"run_dir": str(run_dir), "records_dir": str(store.dir), "writer": store.writer, "new_records": n_new,
            "shard_items": len(mine), "planned_records": planned}


def locate_head(model: str, head: str | None, digest: str) -> str | Path | None:
    """The head a study is pinned to: `head` if it has that digest, else a directory under heads/ that does."""
    from ..decoding import head as headfile
    from ..paths import HEADS_DIR

    default = HEADS_DIR / model if head is None else Path(head)
    candidates = [default] + sorted(p for p in HEADS_DIR.glob("*") if p.is_dir() and p != default) \
        if HEADS_DIR.is_dir() else [default]
    for path in candidates:
        if (path / "head.json").exists() and headfile.stored_head_digest(path) == digest:
            return path
    if digest == headfile.UNTRAINED:
        return "none"
    raise LosslessError(f"this run is pinned to head {digest}, and no directory under {HEADS_DIR} holds it: "
                        f"pass --head with that head's directory")
