"""The trajectory audit: for every prompt and configuration (dtype, attention kernel), the AR greedy
reference and Orthrus greedy, compared token for token.

One JSON line per (prompt, configuration) pair is appended to the run directory and flushed to disk
before the next pair starts, so a killed run loses at most the pair in flight and a rerun skips what
is done. `--shard i/n` takes every n-th pair; each shard writes its own file and `report` merges them.
`run.json` records the configuration, the environment and the command; a run directory holding a
different configuration is refused.

This module runs decodes and records them. Statistics and the report are in `stats.py`/`report.py`.
"""

from __future__ import annotations

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

from .decoding import DecodeConfig, decode
from .dtypes import dtype_name
from .errors import LosslessError
from .model import OrthrusLM
from .stats import first_divergence, levenshtein
from .text import encode_prompt

RUN_FILE = "run.json"


# ------------------------------------------------------------------------------------------------ suite
def load_suite(path: str | Path) -> list[dict]:
    """Prompts `{"id", "domain", "prompt"}` from JSONL lines or a JSON object {"domain": [prompts]}."""
    path = Path(path)
    if not path.exists():
        raise LosslessError(f"suite {path} does not exist")
    text = path.read_text(encoding="utf-8")
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

    def configs(self) -> list[tuple[str, str]]:
        return [(d, a) for d in self.dtypes for a in self.attns]


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


def environment() -> dict:
    import transformers

    return {
        "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "decoding": "greedy (seeds unused)",
    }


def records_file(run_dir: Path, shard: tuple[int, int]) -> Path:
    i, n = shard
    return run_dir / ("records.jsonl" if n == 1 else f"records.shard-{i}-of-{n}.jsonl")


def open_run(run_dir: Path, cfg: AuditConfig, planned: int, command: list[str]) -> None:
    """Create run.json, or check that an existing one holds the same configuration."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_FILE
    mine = asdict(cfg)
    if path.exists():
        old = json.loads(path.read_text())
        # the suite is identified by its content hash, so a moved checkout (another path) still resumes
        diff = sorted(k for k in mine if k != "suite" and old.get("config", {}).get(k) != mine[k])
        if diff:
            raise LosslessError(
                f"{run_dir} holds a run with a different configuration ({', '.join(diff)}); rerun its own command "
                f"to resume (see {path}) or choose another --out"
            )
        return
    info = {"config": mine, "planned": planned, "environment": environment(), "command": command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path.write_text(json.dumps(info, indent=2) + "\n")


def done_keys(path: Path) -> set[str]:
    """Keys already recorded; a torn last line (killed mid-write) is cut off so appends stay valid."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    keys = set()
    for line in data.decode("utf-8").splitlines():
        try:
            keys.add(json.loads(line)["key"])
        except (json.JSONDecodeError, KeyError):
            continue
    return keys


# ------------------------------------------------------------------------------------------------ pairs
@torch.no_grad()
def response_log_ppl(model: OrthrusLM, prompt_ids: list[int], response: list[int]) -> float:
    """log PPL(response | prompt): mean negative log-likelihood per response token, one teacher-forced pass."""
    if not response:
        return float("nan")
    ids = torch.tensor([prompt_ids + response], device=model.device)
    logits = model.backbone(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(response, device=model.device))
    return float(nll)


def pair_record(prompt: dict, prompt_ids: list[int], dtype: str, attn: str, reference_attn: str, k: int,
                max_new_tokens: int, ar, orth, log_ppl: float) -> dict:
    """The audit record of one AR reference run against one Orthrus run (both DecodeStates)."""
    a, o = ar.generated, orth.generated
    div = first_divergence(a, o)

    def margin(margins, i):
        return round(margins[i], 6) if i is not None and i < len(margins) else None

    key = f"{prompt['id']}|{dtype}|{attn}" + (f"|ref-{reference_attn}" if reference_attn != attn else "")
    return {
        "key": key, "prompt_id": prompt["id"], "domain": prompt["domain"], "dtype": dtype, "attn": attn,
        "reference_attn": reference_attn, "k": k, "max_new_tokens": max_new_tokens, "prompt_tokens": len(prompt_ids),
        "ar_ids": a, "orthrus_ids": o, "exact_match": a == o, "first_divergence": div,
        "levenshtein": levenshtein(a, o),
        "ref_margin_at_divergence": margin(ar.margins, div), "orthrus_margin_at_divergence": margin(orth.margins, div),
        "ref_log_ppl": None if math.isnan(log_ppl) else round(log_ppl, 6), "response_length": len(a),
        "accepted": orth.stats.accepted, "tokens_per_step": round(orth.stats.tokens_per_step, 4),
        "ar_forwards": ar.stats.forwards, "orthrus_forwards": orth.stats.forwards,
        "ar_seconds": round(ar.stats.seconds, 4), "orthrus_seconds": round(orth.stats.seconds, 4),
    }


def reference_kernels(attn: str) -> list[str]:
    """AR references an Orthrus kernel is compared with: its own, and for exact mode also stock SDPA."""
    return [attn, "sdpa"] if attn == "exact" else [attn]


def audit_prompt(models: dict, prompt: dict, dtype: str, attn: str, cfg: AuditConfig) -> list[dict]:
    """Decode one prompt with Orthrus under `attn` and with each AR reference; one record per reference."""
    model = models[(dtype, attn)]
    ids = encode_prompt(model.tokenizer, prompt["prompt"])
    dcfg = DecodeConfig(max_new_tokens=cfg.max_new_tokens, k=cfg.k, record_margins=True)
    orth = decode(model, ids, "orthrus", dcfg)
    k = model.k if cfg.k is None else cfg.k
    records = []
    for ref_attn in reference_kernels(attn):
        reference = models[(dtype, ref_attn)]
        ar = decode(reference, ids, "ar", dcfg)
        log_ppl = response_log_ppl(reference, ids, ar.generated)
        records.append(pair_record(prompt, ids, dtype, attn, ref_attn, k, cfg.max_new_tokens, ar, orth, log_ppl))
    return records


def run_audit(cfg: AuditConfig, out: str | Path, shard: str | None = None, command: list[str] | None = None,
              progress: bool = True, load=None) -> dict:
    """Run (or resume) an audit into `out`. `load(dtype, attn)` builds models (default: models.load_model)."""
    from .models import load_model

    cfg.dtypes = [dtype_name(d) for d in cfg.dtypes]
    shard_t = parse_shard(shard)
    suite = load_suite(cfg.suite)
    cfg.suite_sha256 = hashlib.sha256(Path(cfg.suite).read_bytes()).hexdigest()[:16]
    prompts = interleave_domains(limit_per_domain(suite, cfg.limit_per_domain))
    if not prompts:
        raise LosslessError(f"suite {cfg.suite} is empty after filtering")
    configs = cfg.configs()
    work = [(p, d, a) for p in prompts for d, a in configs]  # interleave configs: partial runs cover all
    planned = sum(len(reference_kernels(a)) for _, _, a in work)
    run_dir = Path(out)
    load = load or (lambda d, a: load_model(cfg.model, d, cfg.device, a, head=cfg.head))
    open_run(run_dir, cfg, planned, command or sys.argv)
    path = records_file(run_dir, shard_t)
    done = done_keys(path)
    mine = [w for j, w in enumerate(work) if j % shard_t[1] == shard_t[0]]
    todo = [w for w in mine if f"{w[0]['id']}|{w[1]}|{w[2]}" not in done]  # an item's first record key
    models: dict[tuple[str, str], OrthrusLM] = {}
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc="audit pairs", unit="pair", disable=not progress)
    n_new = 0
    with open(path, "a", encoding="utf-8") as f:
        for prompt, dtype, attn in todo:
            for kernel in reference_kernels(attn):
                if (dtype, kernel) not in models:
                    models[(dtype, kernel)] = load(dtype, kernel)
            records = audit_prompt(models, prompt, dtype, attn, cfg)
            # all records of an item in one write: a kill leaves the item wholly done or wholly to redo
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
            n_new += len(records)
            bar.set_postfix(match=records[0]["exact_match"], tps=records[0]["tokens_per_step"])
            bar.update(1)
    bar.close()
    return {"run_dir": str(run_dir), "records_file": str(path), "new_records": n_new, "shard_items": len(mine),
            "planned_records": planned}
