"""Every configuration against one reference: how far each configuration's AR and candidate are from, say, fp32 AR.

A pair record compares a candidate with the AR reference of its own configuration. This module compares both
trajectories of every record with the AR trajectory of one chosen reference configuration on the same prompt
(default: fp32 AR, on the run's SDPA kernel where it has one): whether they are equal, with Wilson intervals,
per configuration and per domain, and how many tokens they share before they part. It answers "lossless against
which reference, in which precision": two correct bf16 kernels can part from each other, and from fp32, as often
as Orthrus parts from AR. Owns the choice of reference, the section of summary.json, its markdown and its plot.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from ..errors import LosslessError
from ..plots import new_figure, save_figure
from ..stats import first_divergence, wilson_interval

DEFAULT_DTYPE = "fp32"
PREFERRED_KERNELS = ("sdpa", "eager", "exact")


def label(dtype: str, kernel: str) -> str:
    return f"{dtype}/{kernel} AR"


def references(records: list[dict]) -> Counter:
    """(dtype, reference kernel) of every AR trajectory the run holds, with its number of prompts."""
    seen = {(str(r.get("prompt_id")), str(r.get("dtype")), str(r.get("reference_attn") or r.get("attn")))
            for r in records if r.get("prompt_id") is not None}
    return Counter((dtype, kernel) for _, dtype, kernel in seen)


def choose(records: list[dict], spec: str | None = None) -> tuple[str, str] | None:
    """The reference configuration: `spec` ("dtype/kernel", e.g. "fp32/sdpa"), else fp32 AR on the first of
    PREFERRED_KERNELS the run has (else its most common fp32 kernel); None when the run has no fp32 AR and no
    spec was given. An unknown spec is a LosslessError naming the ones there are."""
    have = references(records)
    if spec is not None:
        dtype, _, kernel = spec.partition("/")
        if (dtype, kernel) not in have:
            names = ", ".join(f"{d}/{k}" for d, k in sorted(have)) or "none"
            raise LosslessError(f"--reference {spec}: the run has no such AR reference; it has {names}")
        return dtype, kernel
    fp32 = {k: n for (d, k), n in have.items() if d == DEFAULT_DTYPE}
    if not fp32:
        return None
    for kernel in PREFERRED_KERNELS:
        if kernel in fp32:
            return DEFAULT_DTYPE, kernel
    return DEFAULT_DTYPE, max(fp32, key=lambda k: (fp32[k], k))


def _agreement(pairs: list[tuple[list[int], list[int]]]) -> dict:
    n = len(pairs)
    equal = sum(a == b for a, b in pairs)
    lo, hi = wilson_interval(equal, n)
    prefixes = [len(a) if d is None else d for a, b in pairs for d in [first_divergence(a, b)]]
    return {"n_equal": equal, "rate": equal / n if n else None, "ci95": [lo, hi],
            "mean_common_prefix": sum(prefixes) / n if n else None}


def trajectories(records: list[dict], reference: tuple[str, str]) -> dict[str, list[int]]:
    """The reference configuration's AR trajectory of every prompt that has one, by prompt id."""
    dtype, kernel = reference
    ref_ids: dict[str, list[int]] = {}
    for r in records:
        if str(r.get("dtype")) == dtype and str(r.get("reference_attn") or r.get("attn")) == kernel:
            ref_ids.setdefault(str(r["prompt_id"]), list(r["ar_ids"]))
    return ref_ids


def compare(records: list[dict], reference: tuple[str, str], config_of, label_of,
            source: list[dict] | None = None, source_name: str | None = None) -> dict:
    """The summary.json section: for each configuration (`config_of(record)` -> key, `label_of(key)` -> label)
    whose prompts have a reference trajectory, its AR's and its candidate's agreement with the reference, overall
    and per domain. The reference configuration's own AR is marked as the reference (it agrees with itself).
    `source`: the records (of another run, `source_name`) holding the reference trajectories, else `records`."""
    dtype, kernel = reference
    ref_ids = trajectories(records if source is None else source, reference)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if str(r.get("prompt_id")) in ref_ids:
            groups[config_of(r)].append(r)
    rows = []
    for key, recs in sorted(groups.items()):
        is_ref = source is None and key[0] == dtype and key[2] == kernel  # (another run's reference is not here)

        def both(rs):
            ar = _agreement([(list(r["ar_ids"]), ref_ids[str(r["prompt_id"])]) for r in rs])
            cand = _agreement([(list(r["orthrus_ids"]), ref_ids[str(r["prompt_id"])]) for r in rs])
            return ar, cand

        ar, cand = both(recs)
        by_domain: dict[str, list[dict]] = defaultdict(list)
        for r in recs:
            by_domain[str(r.get("domain", "?"))].append(r)
        domains = []
        for dom, drecs in sorted(by_domain.items()):
            dar, dcand = both(drecs)
            domains.append({"domain": dom, "n": len(drecs), "ar": dar, "candidate": dcand})
        rows.append({"label": label_of(key), "dtype": key[0], "attn": key[1], "reference_attn": key[2],
                     "candidate_name": key[3], "n": len(recs), "is_reference": is_ref, "ar": ar, "candidate": cand,
                     "domains": domains})
    name = label(dtype, kernel) + (f" of {source_name}" if source_name else "")
    ref = {"dtype": dtype, "attn": kernel, "label": name, "n_prompts": len(ref_ids)}
    return {"reference": {**ref, "run": source_name} if source_name else ref, "configs": rows}


def _pct(part: dict, with_ci: bool = True) -> str:
    if part["rate"] is None:
        return "n/a"
    s = f"{100 * part['rate']:.1f}%"
    return s + (f" [{100 * part['ci95'][0]:.1f}, {100 * part['ci95'][1]:.1f}]" if with_ci else "")


def markdown(section: dict | None, table) -> list[str]:
    """The report's section (`table(header, rows)` draws a markdown table)."""
    if not section:
        return []
    ref = section["reference"]
    L = [f"## Against one reference: {ref['label']}", "",
         f"Every configuration's AR trajectory and candidate trajectory against the {ref['label']} trajectory of the "
         f"same prompt ({ref['n_prompts']} prompts have one): equal token ids (length included), Wilson 95% "
         "intervals, and the mean number of tokens shared before they part (all pairs). A configuration can only "
         "be as lossless as its own AR is close to the reference: two correct kernels in one precision part at "
         "near-ties too.", ""]
    L += table(["config", "n", "AR equals reference", "candidate equals reference", "AR: mean common prefix",
                "candidate: mean common prefix"],
               [[c["label"], c["n"], "(the reference)" if c["is_reference"] else _pct(c["ar"]), _pct(c["candidate"]),
                 "-" if c["is_reference"] else f"{c['ar']['mean_common_prefix']:.1f}",
                 f"{c['candidate']['mean_common_prefix']:.1f}"] for c in section["configs"]])
    domains = sorted({d["domain"] for c in section["configs"] for d in c["domains"]})
    cols = [c for c in section["configs"] if not c["is_reference"]]
    if domains and cols:
        L += ["Per domain, AR / candidate equal to the reference (intervals in summary.json):", ""]
        cell = {(c["label"], d["domain"]): d for c in cols for d in c["domains"]}
        rows = []
        for dom in domains:
            row = [dom]
            for c in cols:
                d = cell.get((c["label"], dom))
                row.append("—" if d is None else f"{_pct(d['ar'], False)} / {_pct(d['candidate'], False)}")
            rows.append(row)
        L += table(["domain", *(c["label"] for c in cols)], rows)
    return L


def plot(section: dict | None, out: Path) -> tuple[str, str] | None:
    """reference_match_rate.png: per configuration, its AR and its candidate equal to the reference."""
    if not section or not section["configs"]:
        return None
    cs = section["configs"]
    fig, ax = new_figure(max(4.5, 1.3 * len(cs) + 2), 4.0)
    for offset, part, name in ((-0.12, "ar", "AR"), (0.12, "candidate", "candidate")):
        xs = [i + offset for i, c in enumerate(cs) if c[part]["rate"] is not None and not (part == "ar"
                                                                                         and c["is_reference"])]
        sel = [c for c in cs if c[part]["rate"] is not None and not (part == "ar" and c["is_reference"])]
        rates = [c[part]["rate"] for c in sel]
        err = [[r - c[part]["ci95"][0] for r, c in zip(rates, sel)], [c[part]["ci95"][1] - r for r, c in zip(rates, sel)]]
        ax.errorbar(xs, rates, yerr=err, fmt="o" if part == "ar" else "s", capsize=4, label=f"{name} = reference")
    ax.set_xticks(range(len(cs)), [f"{c['label']}\nn={c['n']}" for c in cs], fontsize=8)
    ax.set_ylim(-0.02, 1.05)
    ax.set_ylabel(f"equal to {section['reference']['label']}")
    ax.legend(loc="lower right", fontsize=8)
    name = "reference_match_rate.png"
    save_figure(fig, out / name)
    return name, (f"Each configuration's AR and candidate trajectories equal to the {section['reference']['label']} "
                  "trajectory of the same prompt, Wilson 95% intervals.")
