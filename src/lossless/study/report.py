"""The audit report: read a run directory's records, summarise them, write report.md, plots and summary.json.

Owns: reading a run's records (through `records.py`; first occurrence of a key wins), grouping
records by configuration (dtype, attention kernel, reference kernel, candidate decoder) and domain, the summary schema,
the replication's published figures it is compared against, the markdown layout and the plots.

Does not know: how trajectories are generated or compared (the records already say whether they
match), which process wrote which shard or how a run resumes, or any statistics beyond calling
`lossless.stats`.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from ..errors import LosslessError
from ..names import EXACT as EXACT_KERNEL
from ..jsonio import atomic_write
from ..plots import new_figure, save_figure
from ..stats import bootstrap_mean, logistic_regression, wilson_interval
from . import backfill
from . import reference as refcmp
from .records import read_records, record_files, record_id

# The replication's figures (ORTHRUS.md §2). Coefficients are paired with the two models in the order
# the paper lists them: the authors' checkpoint first, the independently trained one second.
PUBLISHED = {
    "source": "arXiv 2609.15504 (How Lossless Is Lossless Speculative Decoding?)",
    "setup": {"prompts": 1190, "domains": 12, "max_new_tokens": 128, "decoding": "greedy",
              "attn": "eager", "reference": "Hugging Face generate (plain AR model)"},
    "bf16_exact_match": {"authors_checkpoint": {"rate": 0.45, "plus_minus": 0.03},
                         "independently_trained": {"rate": 0.43, "plus_minus": 0.03}},
    "fp32_exact_match": {"authors_checkpoint": {"rate": 1.0}, "independently_trained": {"rate": 1.0}},
    "log_ppl_coef": {"authors_checkpoint": {"estimate": -8.1, "ci95": [-10.5, -5.7]},
                     "independently_trained": {"estimate": -10.9, "ci95": [-13.6, -8.2]}},
    "mean_ppl": {"matching": 1.11, "diverging": 1.28},
}

# --- loading -------------------------------------------------------------------------------------

def load_run(run_dir, at_rest: bool = False) -> tuple[list[dict], dict]:
    """All records of a run (every writer's segments and plain files merged, or with `at_rest` only the
    compressed segments a checkout holds; the first record seen for a key wins; torn lines are skipped; complete
    lines that are not records are skipped and named in run_info["corrupt_lines"] as "file:line"),
    sorted by key so the summary depends on the records alone, and the run's `run.json` ({} if absent, as
    in old runs; a torn or non-object one raises LosslessError)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise LosslessError(f"run directory {run_dir} does not exist: pass the --out directory of `lossless audit`")
    corrupt: list = []
    records = sorted(read_records(run_dir, at_rest, corrupt), key=lambda r: record_id(r))
    run_info: dict = {}
    info_path = run_dir / "run.json"
    if info_path.is_file():
        fix = "restore it from git or remove it and rerun `lossless audit` with the same options"
        try:
            run_info = json.loads(info_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LosslessError(f"run.json in {run_dir} is not valid JSON: {fix}") from None
        if not isinstance(run_info, dict):
            raise LosslessError(f"run.json in {run_dir} is not a JSON object: {fix}")
    notes = backfill.annotations(run_dir, at_rest, corrupt)
    if notes:  # top tokens decoded again for records from before the audit kept them (`backfill.py`)
        records = backfill.apply(records, notes)
    if corrupt:  # said in the summary, the report and (by the CLI) on stderr; never silently dropped
        run_info = {**run_info, "corrupt_lines": [f"{name}:{line}" for name, line in corrupt]}
    records, split = name_kernel_versions(records)
    if split:
        run_info = {**run_info, "kernel_versions": split}
    return records, run_info


EARLIER = "earlier kernels"  # exact-mode records from before records named their kernels


def _build(value) -> str:
    """The kernel source digest of a record's `kernels` field ("<digest>/<variant>": the variant never changes a
    bit, so it does not split), or EARLIER."""
    return str(value).split("/")[0][:8] if value else EARLIER


def name_kernel_versions(records: list[dict]) -> tuple[list[dict], list[str]]:
    """Never pool exact-mode rows of different kernel builds: where one configuration holds records decoded by
    more than one build (on either side of the pair), those records' kernel names carry their build ("exact
    (kernels 1a2b3c4d)", "exact (earlier kernels)"), so the report and the page show the builds side by side.
    Returns the records (renamed copies where needed) and one line per configuration split."""
    builds: dict[tuple, set] = defaultdict(set)
    for r in records:
        dtype, attn, ref, candidate = _config(r)
        if EXACT_KERNEL in (attn, ref):
            builds[(dtype, attn, ref, candidate)].add((_build(r.get("kernels")) if attn == EXACT_KERNEL else None,
                                                       _build(r.get("reference_kernels")) if ref == EXACT_KERNEL else None))
    split = {key for key, seen in builds.items() if len(seen) > 1}
    if not split:
        return records, []
    out = []
    for r in records:
        key = _config(r)
        if key in split:
            r = dict(r)
            if key[1] == EXACT_KERNEL:
                r["attn"] = f"{EXACT_KERNEL} ({_name(r.get('kernels'))})"
            if key[2] == EXACT_KERNEL:
                r["reference_attn"] = f"{EXACT_KERNEL} ({_name(r.get('reference_kernels'))})"
        out.append(r)
    notes = []
    for key in sorted(split):
        names = sorted({b for pair in builds[key] for b in pair if b})
        notes.append(f"{config_label(*key)} holds records of {len(names)} kernel builds ({', '.join(names)}), "
                     f"reported separately")
    return out, notes


def _name(value) -> str:
    build = _build(value)
    return build if build == EARLIER else f"kernels {build}"



# --- summarising ---------------------------------------------------------------------------------

def _match(r: dict) -> bool:
    if r.get("exact_match") is not None:
        return bool(r["exact_match"])
    return r.get("ar_ids") == r.get("orthrus_ids")


def _mean(values) -> float | None:
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(xs) / len(xs) if xs else None


def _ppl(log_ppl: float) -> float:
    return math.exp(min(float(log_ppl), 700.0))  # a runaway NLL must not crash the report


def _candidate(r: dict) -> str:
    """The record's candidate decoder; records from before candidates are Orthrus in their cycle."""
    return str(r.get("candidate") or ("orthrus-fused" if r.get("cycle") == "fused" else "orthrus"))


def _config(r: dict) -> tuple[str, str, str, str]:
    attn = str(r.get("attn", "?"))
    return (str(r.get("dtype", "?")), attn, str(r.get("reference_attn") or attn), _candidate(r))


def config_label(dtype: str, attn: str, reference_attn: str, candidate: str = "orthrus") -> str:
    """`bf16/sdpa`, or `bf16/<candidate kernel> vs AR-<reference kernel>` when the two kernels differ; a
    candidate other than orthrus is appended (`bf16/sdpa prompt-lookup`; `bf16/sdpa fused` for orthrus-fused,
    as the fused cycle was labelled before candidates)."""
    label = f"{dtype}/{attn}" if reference_attn == attn else f"{dtype}/{attn} vs AR-{reference_attn}"
    suffix = {"orthrus": "", "orthrus-fused": " fused"}.get(candidate, f" {candidate}")
    return label + suffix


def _rate(recs: list[dict]) -> tuple[float | None, list[float]]:
    n, k = len(recs), sum(_match(r) for r in recs)
    lo, hi = wilson_interval(k, n)
    return (k / n if n else None), [lo, hi]


def _decode_seconds(records: list[dict]) -> dict[str, float]:
    """The decode time charged to each record (by key), so that summing over records counts every
    computation once. A candidate run yields one record per AR reference it is compared with (under
    `--attn exact`: exact AR and stock-SDPA AR), each carrying the run's seconds: they are charged to the
    record compared with the reference of the run's own kernel. An AR reference is charged to the first
    record (by key) that computed it, i.e. not marked `reference_reused`; early candidate runs left the flag
    unset on every candidate sharing one computation, so a reference counts once per (prompt, dtype,
    reference kernel, machine). The reference's perplexity pass is not counted."""
    ordered = sorted(records, key=lambda r: record_id(r))
    runs: dict[tuple, dict] = {}
    for r in ordered:
        dtype, attn, ref, candidate = _config(r)
        run = (r["prompt_id"], dtype, attn, candidate) if r.get("prompt_id") is not None else (record_id(r),)
        if run not in runs or (ref == attn and _config(runs[run])[2] != attn):
            runs[run] = r
    charged_runs = {record_id(r) for r in runs.values()}
    seconds, references = {}, set()
    for r in ordered:
        key = record_id(r)
        dtype, _, ref, _ = _config(r)
        t = float(r.get("orthrus_seconds") or 0.0) if key in charged_runs else 0.0
        reference = (r["prompt_id"], dtype, ref, str(r.get("machine") or "")) if r.get("prompt_id") is not None \
            else (key,)
        if not r.get("reference_reused") and reference not in references:
            references.add(reference)
            t += float(r.get("ar_seconds") or 0.0)
        seconds[key] = t
    return seconds


def _speed(recs: list[dict]) -> dict | None:
    """The candidate's speed against its AR reference on the same prompts: the geometric mean of AR seconds over
    candidate seconds per pair, with a bootstrap 95% interval over the pairs (timings of the audit itself, on a
    machine that may have been doing other work: a benchmark's numbers are its own)."""
    logs = [math.log(r["ar_seconds"] / r["orthrus_seconds"]) for r in recs
            if (r.get("ar_seconds") or 0) > 0 and (r.get("orthrus_seconds") or 0) > 0]
    if not logs:
        return None
    b = bootstrap_mean(logs)
    return {"n": len(logs), "ratio": math.exp(b["mean"]), "ci95": [math.exp(x) for x in b["ci95"]]}


def _diverging_first(recs: list[dict]) -> float | None:
    return _mean(r.get("first_divergence") for r in recs if not _match(r))


def _leads(logits: dict, first, second) -> bool:
    """`first` has the highest logit of the known top tokens and `second` the highest of the others (ties count
    as either place)."""
    if first not in logits or second not in logits:
        return False
    return logits[first] >= max(logits.values()) and logits[second] >= max(v for t, v in logits.items() if t != first)


def _trade_places(r: dict) -> bool | None:
    """Whether a diverging pair's two tokens trade places where it parts: the candidate's token is the
    reference's runner-up and the reference's token the candidate's. None where a side's top tokens (two at
    least) or its token there are not known."""
    ref, cand, d = r.get("ref_top_at_divergence"), r.get("orthrus_top_at_divergence"), r.get("first_divergence")
    a, o = r.get("ar_ids") or [], r.get("orthrus_ids") or []
    if not ref or not cand or len(ref) < 2 or len(cand) < 2 or d is None or d >= len(a) or d >= len(o):
        return None
    x, y = a[d], o[d]
    return _leads(_best(ref), x, y) and _leads(_best(cand), y, x)


def _best(top) -> dict:
    """Token id -> its logit in a top list (the highest, should an id appear twice)."""
    out: dict = {}
    for t, v in top:
        out[t] = max(v, out.get(t, v))
    return out


def _divergence_margins(recs: list[dict]) -> dict:
    """The reference's top-1 minus top-2 logit where diverging pairs part: how near a tie verification
    flipped. Ties (margin 0) and near-ties (at most 0.25, two bf16 steps near logit 4-8) are counted, and, where
    both sides' top tokens are known, the flips in which the two tokens trade places (`_trade_places`)."""
    diverging = [r for r in recs if not _match(r)]
    m = sorted(float(r["ref_margin_at_divergence"]) for r in diverging if r.get("ref_margin_at_divergence") is not None)
    median = None if not m else (m[len(m) // 2] if len(m) % 2 else (m[len(m) // 2 - 1] + m[len(m) // 2]) / 2)
    traded = [t for t in map(_trade_places, diverging) if t is not None]
    return {"n_diverging": len(diverging), "n_margins": len(m), "median_margin": median,
            "ties": sum(x <= 0 for x in m), "near_ties": sum(x <= 0.25 for x in m),
            "n_tops_known": len(traded), "trade_places": sum(traded)}


def _group(records: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[_config(r)].append(r)
    return dict(sorted(groups.items()))


def _finite(obj):
    """JSON-safe copy: non-finite floats become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def summarise(records: list[dict], run_info: dict, reference: str | None = None,
              reference_run: tuple[str, list[dict]] | None = None) -> dict:
    """The summary.json object (see `write_report`). `reference`: "dtype/kernel" of the AR trajectories every
    configuration is also compared with (default: fp32 AR where the run has it; see `reference.choose`), taken
    from `reference_run` ((name, records) of another run) where given."""
    groups = _group(records)
    seconds = _decode_seconds(records)
    configs, domains, regression, ppl = [], {}, {}, {}
    for (dtype, attn, ref, candidate), recs in groups.items():
        label = config_label(dtype, attn, ref, candidate)
        rate, ci = _rate(recs)
        cycle = recs[0]["cycle"] if "cycle" in recs[0] else "two-pass"
        configs.append({"label": label, "dtype": dtype, "attn": attn, "reference_attn": ref, "n": len(recs),
                        "candidate": candidate, "n_match": sum(_match(r) for r in recs),
                        "exact_match_rate": rate, "ci95": ci, "margin_at_divergence": _divergence_margins(recs),
                        "mean_tokens_per_step": _mean(r.get("tokens_per_step") for r in recs),
                        "mean_first_divergence": _diverging_first(recs),
                        "speed_vs_ar": _speed(recs),
                        "mean_levenshtein": _mean(r.get("levenshtein") for r in recs),
                        "cycle": cycle,
                        "mean_seconds_per_pair": _mean(seconds[record_id(r)] for r in recs),
                        "compute_hours": sum(seconds[record_id(r)] for r in recs) / 3600})
        by_domain: dict[str, list[dict]] = defaultdict(list)
        for r in recs:
            by_domain[str(r.get("domain", "?"))].append(r)
        domains[label] = []
        for dom, drecs in sorted(by_domain.items()):
            drate, dci = _rate(drecs)
            domains[label].append({"domain": dom, "n": len(drecs), "exact_match_rate": drate, "ci95": dci,
                                   "mean_first_divergence": _diverging_first(drecs),
                                   "mean_tokens_per_step": _mean(r.get("tokens_per_step") for r in drecs)})
        regression[label] = logistic_regression(recs)
        with_ppl = [r for r in recs if r.get("ref_log_ppl") is not None]
        matching = [_ppl(r["ref_log_ppl"]) for r in with_ppl if _match(r)]
        diverging = [_ppl(r["ref_log_ppl"]) for r in with_ppl if not _match(r)]
        ppl[label] = {"matching_mean_ppl": _mean(matching), "diverging_mean_ppl": _mean(diverging),
                      "n_matching": len(matching), "n_diverging": len(diverging)}
    planned = run_info.get("planned")
    machines: dict[str, int] = defaultdict(int)
    for r in records:
        machines[str(r.get("machine") or "not recorded")] += 1
    source_name, source = reference_run if reference_run else (None, None)
    chosen = refcmp.choose(records if source is None else source, reference)
    against = refcmp.compare(records, chosen, _config, lambda key: config_label(*key), source, source_name) \
        if chosen else None
    extra = {k: run_info[k] for k in ("corrupt_lines", "kernel_versions") if run_info.get(k)}
    tops = backfill.top_token_counts(records)
    if tops["backfilled"] or tops["not_reproduced"] or tops["missing"]:  # said only where not all were recorded
        extra["top_tokens"] = tops
    # a pair decoded again by another kernel build is one planned pair with two records (named, not pooled)
    again = len(records) - len({str(r["key"]) for r in records})
    extra.update({"n_decoded_again": again} if again else {})
    return _finite({"n_records": len(records), "planned": planned if isinstance(planned, int) else None,
                    **extra, "configs": configs, "reference_comparison": against,
                    "domains": domains, "regression": regression, "ppl": ppl,
                    "machines": dict(sorted(machines.items())),
                    "heads": sorted({str(r["head"]) for r in records if r.get("head")}),
                    "replication": PUBLISHED, "plots": []})


# --- markdown ------------------------------------------------------------------------------------

def _pct(rate, ci=None) -> str:
    if rate is None:
        return "n/a"
    s = f"{100 * rate:.1f}%"
    return s + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def _num(x, fmt=".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _coef(x) -> str:
    """Two decimals for coefficients of ordinary size, three significant digits for tiny ones."""
    return _num(x, ".2f" if x is None or abs(x) >= 0.1 else ".3g")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return out + [""]


def _progress(summary: dict) -> str:
    again = summary.get("n_decoded_again", 0)
    n, planned = summary["n_records"] - again, summary["planned"]
    more = f" {again} more records hold pairs decoded again by another kernel build, reported separately (the rows " \
        "named by build say how many pairs each build has)." if again else ""
    if planned:
        done = "complete" if n >= planned else f"{100 * n / planned:.0f}%"
        return f"{n} of {planned} planned pairs done ({done})." + more
    return f"{n} pairs." + more


def _run_lines(run_info: dict) -> list[str]:
    lines = []
    cmd = run_info.get("command")
    if isinstance(cmd, list):
        cmd = " ".join(map(str, cmd))
    if isinstance(cmd, str) and cmd:
        lines.append(f"Command: `{cmd}`")
    for key in ("config", "environment"):
        block = run_info.get(key)
        if isinstance(block, dict):
            items = [f"{k}={str(v)[:80]}" for k, v in block.items() if isinstance(v, (str, int, float, bool))]
            if items:
                lines.append(f"{key.capitalize()}: " + ", ".join(items))
    return [ln + "  " for ln in lines] + ([""] if lines else [])


def _regression_block(label: str, reg: dict) -> list[str]:
    lines = [f"### {label}", ""]
    if "error" in reg:
        return lines + [f"Not fit (`{reg['formula']}`, n={reg['n']}): {reg['error']}.", ""]
    lines.append(f"`{reg['formula']}`, n={reg['n']}, method {reg.get('method', 'mle')}, "
                 f"converged {reg['converged']}, McFadden pseudo-R² {_num(reg.get('pseudo_r2'), '.3f')}.")
    lines.append("")
    rows = [[term, _coef(c["estimate"]), f"[{_coef(c['ci95'][0])}, {_coef(c['ci95'][1])}]",
             _num(c["p_value"], ".2g")] for term, c in reg["coef"].items()]
    lines += _table(["term", "coefficient", "95% CI", "p-value"], rows)
    if reg.get("note"):
        lines += [f"Note: {reg['note']}.", ""]
    return lines


def _comparison(summary: dict) -> list[str]:
    pub = PUBLISHED
    a, b = pub["bf16_exact_match"]["authors_checkpoint"], pub["bf16_exact_match"]["independently_trained"]
    ca, cb = pub["log_ppl_coef"]["authors_checkpoint"], pub["log_ppl_coef"]["independently_trained"]
    published = {
        "BF16 exact match": f"{a['rate']:.0%} ± {a['plus_minus']:.0%} (authors' checkpoint); "
                            f"{b['rate']:.0%} ± {b['plus_minus']:.0%} (independently trained)",
        "FP32 exact match": "100% (both models)",
        "log-PPL coefficient": f"{ca['estimate']} [{ca['ci95'][0]}, {ca['ci95'][1]}] (authors' checkpoint); "
                               f"{cb['estimate']} [{cb['ci95'][0]}, {cb['ci95'][1]}] (independently trained)",
        "mean PPL, matching": f"{pub['mean_ppl']['matching']}",
        "mean PPL, diverging": f"{pub['mean_ppl']['diverging']}",
    }
    ours: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for c in summary["configs"]:
        label = c["label"]
        cell = f"{_pct(c['exact_match_rate'], c['ci95'])}, n={c['n']}"
        if c["dtype"] in ("bf16", "fp32"):
            ours[f"{c['dtype'].upper()} exact match"].append((cell, label))
        reg = summary["regression"][label]
        if "error" in reg:
            coef = f"not fit: {reg['error']}"
        elif "log_ppl" in reg["coef"]:
            lp = reg["coef"]["log_ppl"]
            coef = f"{_num(lp['estimate'])} [{_num(lp['ci95'][0])}, {_num(lp['ci95'][1])}]"
            if reg.get("method") != "mle":
                coef += f" ({reg.get('method')})"
        else:
            coef = "log_ppl not in the fitted model"
        ours["log-PPL coefficient"].append((coef, label))
        p = summary["ppl"][label]
        ours["mean PPL, matching"].append((f"{_num(p['matching_mean_ppl'], '.3f')} (n={p['n_matching']})", label))
        ours["mean PPL, diverging"].append((f"{_num(p['diverging_mean_ppl'], '.3f')} (n={p['n_diverging']})", label))
    rows = []
    for quantity, pub_cell in published.items():
        entries = ours.get(quantity) or [("not run", "")]
        for i, (cell, label) in enumerate(entries):
            rows.append([quantity if i == 0 else "", pub_cell if i == 0 else "", cell, label])
    setup = pub["setup"]
    return ([f"Published: {pub['source']}; {setup['prompts']} prompts, {setup['domains']} domains, "
             f"{setup['decoding']}, max_new_tokens={setup['max_new_tokens']}, {setup['attn']} attention. "
             "Published ± is the reported interval half-width; ours are Wilson 95% intervals.", ""]
            + _table(["quantity", "published", "ours", "our config"], rows))


def _several_candidates(summary: dict) -> bool:
    return {c["candidate"] for c in summary["configs"]} != {"orthrus"}


def _speed_cell(s: dict | None) -> str:
    return "—" if not s else f"{s['ratio']:.2f}x [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]"


def _candidates_section(summary: dict) -> list[str]:
    """Exact match by candidate (rows) and configuration (columns), where a run has several candidates."""
    if not _several_candidates(summary):
        return []
    cols = list(dict.fromkeys(config_label(c["dtype"], c["attn"], c["reference_attn"]) for c in summary["configs"]))
    cands = list(dict.fromkeys(c["candidate"] for c in summary["configs"]))
    cell = {(c["candidate"], config_label(c["dtype"], c["attn"], c["reference_attn"])): c for c in summary["configs"]}

    def show(c):
        return "—" if c is None else f"{_pct(c['exact_match_rate'], c['ci95'])} ({c['n_match']}/{c['n']})"

    L = ["## Candidates", "",
         "Exact match with the AR greedy reference by candidate decoder and configuration (matching/pairs, "
         "Wilson 95% intervals). `oracle` drafts the reference itself and `self-assisted` drafts the model's "
         "own greedy choices, so every divergence of theirs comes from verifying several tokens in one forward.", ""]
    L += _table(["candidate", *cols], [[name, *(show(cell.get((name, col))) for col in cols)] for name in cands])
    return L


def _traded_cell(d: dict) -> str:
    return f"{d['trade_places']}/{d['n_tops_known']}" if d.get("n_tops_known") else "—"


def _divergence_section(summary: dict) -> list[str]:
    """Where each configuration's diverging pairs part, and the candidate's speed against its AR reference."""
    L = ["## Where pairs part", "",
         "The reference's top-1 minus top-2 logit at the first divergence "
         "(tie = 0; near-tie = at most 0.25; llama.cpp gives log-probabilities, whose differences are the "
         "logits'). Tokens trade places: of the pairs whose two sides' top tokens at the divergence are known, those "
         "where the candidate's token is the reference's runner-up and the reference's token the candidate's "
         "(tied logits count as either place). Speed: AR seconds over the "
         "candidate's on the same prompt, geometric mean over the pairs with a bootstrap 95% interval, timed during "
         "the audit (a benchmark's numbers are its own).", ""]
    L += _table(["candidate", "config", "diverging", "median margin", "ties", "near-ties", "tokens trade places",
                 "mean first divergence", "speed vs AR [95% CI]"],
                [[c["candidate"], config_label(c["dtype"], c["attn"], c["reference_attn"]),
                  (d := c["margin_at_divergence"])["n_diverging"], _num(d["median_margin"], ".3g"), d["ties"],
                  d["near_ties"], _traded_cell(d), _num(c["mean_first_divergence"], ".1f"),
                  _speed_cell(c.get("speed_vs_ar"))]
                 for c in summary["configs"]])
    return L


def _markdown(summary: dict, run_dir: Path, run_info: dict, plots: list[tuple[str, str]]) -> str:
    L = ["# Trajectory audit report", "", f"Run: `{run_dir}`  ", _progress(summary) + "  ",
         f"Report `{summary.get('report_id', '?')}` (report.md, summary.json and report.html of one report carry "
         "the same id).", ""]
    for note in summary.get("kernel_versions", []):
        L += [f"Not pooled: {note}.", ""]
    if summary.get("corrupt_lines"):
        bad = summary["corrupt_lines"]
        L += [f"**{len(bad)} record line(s) could not be read and were skipped**: "
              + ", ".join(f"`{b}`" for b in bad[:10]) + (" ..." if len(bad) > 10 else "") + ".", ""]
    if summary.get("top_tokens"):
        t = summary["top_tokens"]
        L += [f"Top tokens at the divergence: {t['diverging']} diverging pairs; recorded by the audit for "
              f"{t['recorded']}, decoded again up to the divergence for {t['backfilled']} (`lossless backfill`), "
              f"not reproduced on decoding again for {t['not_reproduced']}, not known for {t['missing']}.", ""]
    L += _run_lines(run_info)
    L += ["Exact match = identical generated token-id lists (length included), AR greedy reference vs "
          "the candidate decoder (Orthrus unless named). Intervals are Wilson 95%. First divergence and Levenshtein are in tokens; first "
          "divergence is averaged over diverging pairs only.", ""]
    L += ["## Configurations", ""]
    L += _table(["candidate", "dtype", "attn", "reference attn", "n", "exact match [95% CI]", "mean tokens/step",
                 "mean first divergence", "mean Levenshtein", "s per pair"],
                [[c["candidate"], c["dtype"], c["attn"], c["reference_attn"], c["n"],
                  _pct(c["exact_match_rate"], c["ci95"]),
                  _num(c["mean_tokens_per_step"]), _num(c["mean_first_divergence"], ".1f"),
                  _num(c["mean_levenshtein"], ".1f"), _num(c.get("mean_seconds_per_pair"), ".1f")]
                 for c in summary["configs"]])
    L += _candidates_section(summary)
    L += _divergence_section(summary)
    L += refcmp.markdown(summary.get("reference_comparison"), _table)
    L += ["## Per domain", ""]
    for label, rows in summary["domains"].items():
        L += [f"### {label}", ""]
        L += _table(["domain", "n", "exact match [95% CI]", "mean first divergence", "mean tokens/step"],
                    [[d["domain"], d["n"], _pct(d["exact_match_rate"], d["ci95"]),
                      _num(d["mean_first_divergence"], ".1f"), _num(d["mean_tokens_per_step"])] for d in rows])
    L += ["## Response perplexity of the reference: matching vs diverging", "",
          "PPL = exp(mean NLL per response token) of the AR reference response under the reference model, "
          "averaged over pairs.", ""]
    L += _table(["config", "n matching", "mean PPL matching", "n diverging", "mean PPL diverging"],
                [[label, p["n_matching"], _num(p["matching_mean_ppl"], ".3f"), p["n_diverging"],
                  _num(p["diverging_mean_ppl"], ".3f")] for label, p in summary["ppl"].items()])
    L += ["## Logistic regression: P(exact match) ~ log PPL + length + domain", ""]
    for label, reg in summary["regression"].items():
        L += _regression_block(label, reg)
    L += ["## Compute", "",
          "Decode time per pair, each computation counted once: the candidate's run on its pair with the AR "
          "reference of its own kernel (an exact-mode run compared with stock-SDPA AR too is not counted again "
          "there), the AR reference on the pair that computed it (a reused one is not counted again; the "
          "reference's perplexity pass is not counted). The decode hours add up to the run's. Then the machines "
          "the records were made on: bf16 and fp16 rounding depend on the CPU, its ISA, the torch build and "
          "the thread count.", ""]
    L += _table(["config", "pairs", "mean s per pair", "decode hours"],
                [[c["label"], c["n"], _num(c.get("mean_seconds_per_pair"), ".1f"), _num(c.get("compute_hours"), ".2f")]
                 for c in summary["configs"]])
    L += _table(["machine", "pairs"], [[m, n] for m, n in summary.get("machines", {}).items()])
    if summary.get("heads"):
        L += ["Head digest(s): " + ", ".join(f"`{h}`" for h in summary["heads"]), ""]
    L += ["## Comparison with the published replication", ""]
    L += _comparison(summary)
    L += ["## Plots", ""]
    if not plots:
        L += ["No plots (no data to draw).", ""]
    for name, caption in plots:
        L += [f"![{caption}]({name})", "", f"*{caption}*", ""]
    return "\n".join(L)


# --- plots ---------------------------------------------------------------------------------------

def _yerr(rates, cis):
    return [[r - c[0] for r, c in zip(rates, cis)], [c[1] - r for r, c in zip(rates, cis)]]


def _plot_configs(summary, groups, out: Path):
    cs = [c for c in summary["configs"] if c["exact_match_rate"] is not None]
    if not cs:
        return None
    fig, ax = new_figure(max(4.0, 1.2 * len(cs) + 2), 4.0)
    rates = [c["exact_match_rate"] for c in cs]
    ax.errorbar(range(len(cs)), rates, yerr=_yerr(rates, [c["ci95"] for c in cs]), fmt="o", capsize=4)
    ax.axhline(PUBLISHED["bf16_exact_match"]["authors_checkpoint"]["rate"], ls="--", lw=1, color="grey",
               label="published BF16 (authors' checkpoint)")
    ax.set_xticks(range(len(cs)), [f"{c['label']}\nn={c['n']}" for c in cs])
    ax.set_ylim(-0.02, 1.05)
    ax.set_ylabel("exact-match rate")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, out / "config_match_rate.png")
    return ("config_match_rate.png",
            "Exact-match rate per configuration with Wilson 95% intervals; dashed: published BF16 45%.")


def _plot_ppl_bins(summary, groups, out: Path, max_bins: int = 5):
    import numpy as np

    series = []
    for (dtype, attn, ref, candidate), recs in groups.items():
        pts = [(float(r["ref_log_ppl"]), _match(r)) for r in recs if r.get("ref_log_ppl") is not None]
        if pts:
            series.append((config_label(dtype, attn, ref, candidate), pts))
    if not series:
        return None
    fig, ax = new_figure()
    for label, pts in series:
        x = np.array([p[0] for p in pts])
        y = np.array([p[1] for p in pts])
        n_bins = max(1, min(max_bins, len(x) // 10))
        edges = np.unique(np.quantile(x, np.linspace(0, 1, n_bins + 1)))
        which = np.searchsorted(edges[1:-1], x, side="right") if len(edges) > 2 else np.zeros(len(x), int)
        xs, rates, cis = [], [], []
        for b in np.unique(which):
            sel = which == b
            k, n = int(y[sel].sum()), int(sel.sum())
            xs.append(float(x[sel].mean()))
            rates.append(k / n)
            cis.append(wilson_interval(k, n))
        ax.errorbar(xs, rates, yerr=_yerr(rates, cis), fmt="o-", capsize=3, label=label)
    ax.set_xlabel("log PPL(response | prompt) of the reference (bin mean)")
    ax.set_ylabel("exact-match rate")
    ax.set_ylim(-0.02, 1.05)
    ax.legend(fontsize=8)
    save_figure(fig, out / "match_vs_log_ppl.png")
    return ("match_vs_log_ppl.png",
            f"Exact-match rate vs the reference's log response perplexity, up to {max_bins} quantile bins "
            "per config, Wilson 95% bars.")


def _plot_margins(summary, groups, out: Path):
    import numpy as np

    series = []
    for (dtype, attn, ref, candidate), recs in groups.items():
        m = [float(r["ref_margin_at_divergence"]) for r in recs
             if not _match(r) and r.get("ref_margin_at_divergence") is not None]
        if m:
            series.append((config_label(dtype, attn, ref, candidate), np.array(m)))
    if not series:
        return None
    allm = np.concatenate([m for _, m in series])
    pos = allm[allm > 0]
    zeros = int((allm <= 0).sum())
    log_x = pos.size > 0 and pos.max() / pos.min() > 100
    fig, ax = new_figure()
    if log_x:
        bins = np.geomspace(pos.min(), pos.max() * 1.0001, 30)
        for label, m in series:
            ax.hist(m[m > 0], bins=bins, histtype="step", lw=1.5, label=label)
        ax.set_xscale("log")
        scale = f"log x-axis; {zeros} exact ties (margin 0) not drawn"
    else:
        hi = float(allm.max()) if allm.max() > 0 else 1.0
        bins = np.linspace(0.0, hi * 1.0001, 30)
        for label, m in series:
            ax.hist(m, bins=bins, histtype="step", lw=1.5, label=label)
        scale = f"linear x-axis; {zeros} exact ties (margin 0) in the first bin"
    ax.set_title(scale, fontsize=9)
    ax.set_xlabel("reference top-1 minus top-2 logit at the divergence step")
    ax.set_ylabel("diverging pairs")
    ax.legend(fontsize=8)
    save_figure(fig, out / "ref_margin_at_divergence.png")
    return ("ref_margin_at_divergence.png",
            f"Reference logit margin at the first divergence (small = near-tie); {scale}.")


def _plot_first_divergence(summary, groups, out: Path):
    import numpy as np

    series = []
    for (dtype, attn, ref, candidate), recs in groups.items():
        fd = [int(r["first_divergence"]) for r in recs if not _match(r) and r.get("first_divergence") is not None]
        if fd:
            series.append((config_label(dtype, attn, ref, candidate), fd))
    if not series:
        return None
    top = max(max(fd) for _, fd in series)
    top = max(top + 1, max((int(r.get("max_new_tokens") or 0) for recs in groups.values() for r in recs), default=0))
    bins = np.linspace(0, top, min(32, top) + 1)
    fig, ax = new_figure()
    for label, fd in series:
        ax.hist(fd, bins=bins, histtype="step", lw=1.5, label=label)
    ax.set_xlabel("first divergence position (generated token index)")
    ax.set_ylabel("diverging pairs")
    ax.legend(fontsize=8)
    save_figure(fig, out / "first_divergence.png")
    return "first_divergence.png", "Where diverging trajectories first differ (token index in the response)."


def _plot_domains(summary, groups, out: Path):
    import numpy as np

    labels = [label for label, rows in summary["domains"].items() if rows]
    if not labels:
        return None
    doms = sorted({d["domain"] for label in labels for d in summary["domains"][label]})
    fig, ax = new_figure(min(12.0, max(6.0, 0.3 * len(doms) * len(labels) + 2)), 4.5)
    width = 0.8 / len(labels)
    base = np.arange(len(doms))
    for i, label in enumerate(labels):
        rows = {d["domain"]: d for d in summary["domains"][label]}
        xs = [base[j] + (i - (len(labels) - 1) / 2) * width for j, dom in enumerate(doms) if dom in rows]
        present = [rows[dom] for dom in doms if dom in rows]
        rates = [d["exact_match_rate"] for d in present]
        ax.bar(xs, rates, width=width, yerr=_yerr(rates, [d["ci95"] for d in present]), capsize=2, label=label)
    ax.set_xticks(base, doms, rotation=30, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("exact-match rate")
    ax.legend(fontsize=8, ncols=min(4, len(labels)), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    save_figure(fig, out / "domain_match_rate.png")
    return "domain_match_rate.png", "Exact-match rate per domain and configuration, Wilson 95% bars."


def _plot_candidates(summary, groups, out: Path):
    """Exact match by candidate (x) and configuration (one series each), with Wilson bars."""
    import numpy as np

    if not _several_candidates(summary):
        return None
    cs = [c for c in summary["configs"] if c["exact_match_rate"] is not None]
    cands = list(dict.fromkeys(c["candidate"] for c in cs))
    series = list(dict.fromkeys(config_label(c["dtype"], c["attn"], c["reference_attn"]) for c in cs))
    fig, ax = new_figure(max(6.0, 1.3 * len(cands) + 2), 4.0)
    width = 0.8 / max(1, len(series))
    for i, label in enumerate(series):
        row = [(j, c) for j, name in enumerate(cands) for c in cs
               if c["candidate"] == name and config_label(c["dtype"], c["attn"], c["reference_attn"]) == label]
        if not row:
            continue
        xs = [j + (i - (len(series) - 1) / 2) * width for j, _ in row]
        rates = [c["exact_match_rate"] for _, c in row]
        ax.errorbar(xs, rates, yerr=_yerr(rates, [c["ci95"] for _, c in row]), fmt="o", capsize=4, label=label)
    ax.set_xticks(np.arange(len(cands)), cands)
    ax.set_ylim(-0.02, 1.05)
    ax.set_ylabel("exact-match rate")
    ax.legend(fontsize=8, loc="lower left")
    save_figure(fig, out / "candidate_match_rate.png")
    return ("candidate_match_rate.png",
            "Exact match with AR greedy by candidate decoder and configuration, Wilson 95% intervals.")


def _plot_reference(summary, groups, out: Path):
    return refcmp.plot(summary.get("reference_comparison"), out)


_PLOTS = (_plot_configs, _plot_candidates, _plot_reference, _plot_ppl_bins, _plot_margins, _plot_first_divergence,
          _plot_domains)


# --- entry point ---------------------------------------------------------------------------------

def write_report(run_dir, out_dir=None, at_rest: bool = False, html: bool = True, tokenizer="from-run",
                 reference: str | None = None, reference_from: str | Path | None = None) -> dict:
    """Write report.md, the PNG plots, summary.json and (`html`) report.html for the run in `run_dir` (into
    `out_dir`, default `run_dir`) and return the summary. `tokenizer`: what report.html decodes tokens with
    (default: the run's model's; None: ids only). Works on partial runs; `at_rest` reports only the committed
    (compressed) records, as a checkout would.

    summary.json: {"n_records", "planned" (int or null), "configs": [{"label", "dtype", "attn",
    "reference_attn", "candidate", "cycle", "n", "n_match", "exact_match_rate", "ci95", "margin_at_divergence":
    {"n_diverging", "n_margins", "median_margin", "ties", "near_ties", "n_tops_known", "trade_places"}, "speed_vs_ar",
    "mean_tokens_per_step" (null for
    candidates outside the decode loop), "mean_first_divergence", "mean_levenshtein", "mean_seconds_per_pair",
    "compute_hours"}], "domains": {label: [{"domain", "n", "exact_match_rate", "ci95",
    "mean_first_divergence", "mean_tokens_per_step"}]}, "regression": {label: logistic_regression(...)},
    "ppl": {label: {"matching_mean_ppl", "diverging_mean_ppl", "n_matching", "n_diverging"}},
    "reference_comparison": null or {"reference": {"dtype", "attn", "label", "n_prompts"}, "configs": [{"label",
    "dtype", "attn", "reference_attn", "candidate_name", "n", "is_reference", "ar", "candidate", "domains"}]}
    (`ar`/`candidate`: {"n_equal", "rate", "ci95", "mean_common_prefix"}; see `reference.py`),
    "corrupt_lines" (only when some were skipped: ["file:line"]), "replication": PUBLISHED, "plots": [file
    names written]}.

    A configuration's `compute_hours` (and `mean_seconds_per_pair`, the same over its pairs) is the decode
    time its records were the first to spend, so the configurations' hours add up to the run's without
    counting anything twice: a candidate run is charged to its pair with the AR reference of its own kernel
    (`bf16/exact vs AR-sdpa` holds no candidate time: the `bf16/exact` pairs carry it), an AR reference to
    the pair that computed it (none where it was reused from another configuration or candidate). See
    `_decode_seconds`.
    """
    run_dir = Path(run_dir)
    records, run_info = load_run(run_dir, at_rest)
    if not records:
        raise LosslessError(f"no records in {run_dir}: expected records*.jsonl written by `lossless audit`")
    out = Path(out_dir) if out_dir is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    reference_run = None
    if reference_from is not None:  # the reference trajectories of another run (e.g. the full study's fp32 AR)
        if not Path(reference_from).is_dir():
            raise LosslessError(f"--reference-from {reference_from} is not a run directory: pass another audit's --out")
        theirs, their_info = load_run(Path(reference_from), at_rest)
        mine, other = run_info.get("config", {}), their_info.get("config", {})
        for key in ("suite_sha256", "max_new_tokens", "model"):
            if mine.get(key) != other.get(key):
                raise LosslessError(f"--reference-from {reference_from} has {key} {other.get(key)!r}, this run "
                                    f"{mine.get(key)!r}: its trajectories are not comparable with these")
        if reference is None and refcmp.choose(theirs) is None:
            raise LosslessError(f"--reference-from {reference_from} has no fp32 AR: name one of its references with "
                                "--reference DTYPE/KERNEL")
        reference_run = (str(reference_from), theirs)
    summary = summarise(records, run_info, reference, reference_run)
    summary["report_id"] = report_id(records, summary)
    groups = _group(records)
    plots = [p for p in (draw(summary, groups, out) for draw in _PLOTS) if p is not None]
    summary["plots"] = [name for name, _ in plots]
    if at_rest:  # which committed segments this summary was built from, so it can be rebuilt from exactly them
        summary["record_segments"] = [f.name for f in record_files(run_dir, at_rest=True)]
        if notes := record_files(run_dir, True, backfill.BACKFILL_DIR):
            summary["backfill_segments"] = [f.name for f in notes]
    markdown = _markdown(summary, run_dir, run_info, plots)
    atomic_write(out / "report.md", markdown)  # a full disk leaves the old file, never half of a new one
    atomic_write(out / "summary.json", json.dumps(summary, indent=2, allow_nan=False) + "\n")
    if html:
        ref = summary.get("reference_comparison")
        write_page(out, records, run_info, markdown, plots, tokenizer,
                   (ref["reference"]["dtype"], ref["reference"]["attn"]) if ref else None,
                   reference_run[1] if reference_run else None, ref["reference"]["label"] if ref else None)
    return summary


def report_id(records: list[dict], summary: dict) -> str:
    """The id report.md, summary.json and report.html of one report share: a digest of the records, the reference
    they were compared with and the package version, so a reader can tell the files of one report from a set
    that mixes two (a report killed mid-way leaves the previous one's page beside the new markdown)."""
    import hashlib

    from .. import __version__

    h = hashlib.sha256(__version__.encode())
    ref = summary.get("reference_comparison")
    h.update(json.dumps(ref and ref["reference"], sort_keys=True).encode())
    for r in records:
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()[:16]


FROM_RUN = "from-run"  # write_report's default tokenizer: the run's own model's, when it can be loaded here


def write_page(out: Path, records: list[dict], run_info: dict, markdown: str, plots: list[tuple[str, str]],
               tokenizer=FROM_RUN, reference: tuple[str, str] | None = None,
               reference_records: list[dict] | None = None, reference_label: str | None = None) -> Path:
    """report.html (see `htmlreport`): the prompts from the run's suite and token texts from its model's
    tokenizer where this machine has them; what is missing is said on the page. `reference`: (dtype, kernel) of
    the report's reference configuration, whose AR trajectory the viewer shows beside each pair's own."""
    from . import htmlreport

    notes = []
    cfg = run_info.get("config") if isinstance(run_info.get("config"), dict) else {}
    prompts = _suite_prompts(cfg.get("suite"))
    if not prompts:
        notes.append(f"The suite {cfg.get('suite') or '(not recorded)'} is not on this machine: prompts show by id.")
    if tokenizer == FROM_RUN:
        tokenizer = _run_tokenizer(cfg.get("model"))
    if tokenizer is None:
        notes.append(f"The tokenizer of model {cfg.get('model') or '(not recorded)'} could not be loaded here: "
                     "tokens show as ids.")
    labels = {record_id(r): config_label(*_config(r)[:3]) for r in records}
    against = None
    if reference:  # the viewer shows each pair against the report's reference too
        against = {"label": reference_label or refcmp.label(*reference),
                   "ids": refcmp.trajectories(records if reference_records is None else reference_records, reference)}
    return htmlreport.write_html(out, records, labels, markdown, plots, prompts, tokenizer, notes, against)


def _suite_prompts(suite) -> dict[str, str]:
    """{prompt id: text} of the suite a run recorded (as given, or relative to the install's data), else {}."""
    from .audit import load_suite
    from ..paths import ROOT

    if not isinstance(suite, str) or not suite:
        return {}
    for path in (Path(suite), ROOT / suite):
        if path.is_file():
            try:
                return {str(p["id"]): str(p["prompt"]) for p in load_suite(path)}
            except LosslessError:
                return {}
    return {}


def _run_tokenizer(model):
    """The tokenizer of the run's model, or None where this machine cannot load it (no network needed)."""
    from ..decoding.models import load_tokenizer

    if not isinstance(model, str) or not model:
        return None
    try:
        return load_tokenizer(model)
    except LosslessError:
        return None
