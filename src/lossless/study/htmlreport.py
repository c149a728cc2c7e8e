"""The audit's page: `report.html`, one self-contained file with the overview and a trajectory viewer.

Owns: turning a run's records into the page's data (token sequences deduplicated, each candidate stored as
its tail after the first divergence, the token texts the page shows, where two texts meet again), packing
that data into the page (JSON, gzip, base64; the browser unpacks it with its own `DecompressionStream`), and
rendering the page from its Jinja2 template (`templates/report.html.j2`, with `report.js` and `report.css` inline),
the overview being `report.md` rendered by markdown-it with the plots as data URIs. The page needs no
network and no server: it opens from disk.

An evaluation's page (`write_eval_html`, `templates/eval.html.j2`) is built the same way from the items whose
AR and Orthrus responses differ.

Does not know: how the records were made, what the summary holds beyond `report.md`'s text, or any
statistics (`report.py` owns those and calls `write_html`).
"""

from __future__ import annotations

import base64
import difflib
import gzip
import json
import math
import re
from pathlib import Path

from ..errors import LosslessError
from ..jsonio import atomic_write
from ..stats import first_divergence
from .records import record_id

REJOIN_TOKENS = 4  # two texts "meet again" where they share this many tokens in a row after the divergence
TEMPLATES = Path(__file__).resolve().parent / "templates"


def rejoin(ref: list[int], cand: list[int], div: int | None, min_run: int = REJOIN_TOKENS) -> list[int] | None:
    """Where the two texts meet again after diverging at `div`: [reference index, candidate index, run length]
    of the first run of at least `min_run` equal tokens after the divergence, or None (they never do)."""
    if div is None:
        return None
    matcher = difflib.SequenceMatcher(None, ref[div:], cand[div:], autojunk=False)
    for block in matcher.get_matching_blocks():
        if block.size >= min_run:
            return [div + block.a, div + block.b, block.size]
    return None


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def token_texts(tokenizer, ids) -> dict[str, str]:
    """Each token id's text as the page shows it (special tokens included); `{}` without a tokenizer, and the
    page then shows ids."""
    if tokenizer is None:
        return {}
    out = {}
    for i in sorted(ids):
        try:
            out[str(i)] = tokenizer.decode([i], skip_special_tokens=False)
        except Exception:  # an id outside this tokenizer's vocabulary: the page shows the id
            continue
    return out


def page_data(records: list[dict], labels: dict[str, str], prompts: dict[str, str], tokenizer,
              notes: list[str], against: dict | None = None) -> dict:
    """The viewer's data, column by column (one entry per record in `records` order).

    `labels`: record id (`records.record_id`) -> configuration label (dtype/kernel, without the candidate). Sequences are stored
    once (`seqs`); a pair holds the index of its reference (`ref`) and of its candidate's tail after the
    first divergence (`tail`; -1 when the two are equal), and of the report's reference configuration's AR
    trajectory on its prompt (`xref`; -1 when there is none)."""
    seqs: list[list[int]] = []
    index: dict[tuple, int] = {}

    def seq(ids) -> int:
        key = tuple(ids)
        if key not in index:
            index[key] = len(seqs)
            seqs.append(list(ids))
        return index[key]

    names: dict[str, list[str]] = {"domain": [], "config": [], "candidate": []}

    def name(kind: str, value: str) -> int:
        values = names[kind]
        if value not in values:
            values.append(value)
        return values.index(value)

    cols: dict[str, list] = {c: [] for c in ("key", "pid", "dom", "cfg", "cand", "match", "div", "rm", "om", "lev",
                                             "ref", "tail", "rt", "ot", "tb", "xref", "rejoin", "ppl")}
    used: set[int] = set()
    for r in records:
        a, o = list(r.get("ar_ids") or []), list(r.get("orthrus_ids") or [])
        match = a == o if r.get("exact_match") is None else bool(r["exact_match"])
        div = r.get("first_divergence")
        if not match and div is None:  # records from before first_divergence: compute it
            div = first_divergence(a, o)
        used.update(a)
        used.update(o)
        for top in (r.get("ref_top_at_divergence"), r.get("orthrus_top_at_divergence")):
            used.update(int(t) for t, _ in top or [])
        log_ppl = _finite(r.get("ref_log_ppl"))
        cols["key"].append(record_id(r))
        cols["pid"].append(str(r.get("prompt_id", "")))
        cols["dom"].append(name("domain", str(r.get("domain", "?"))))
        cols["cfg"].append(name("config", labels[record_id(r)]))
        cols["cand"].append(name("candidate", str(r.get("candidate") or "orthrus")))
        cols["match"].append(1 if match else 0)
        cols["div"].append(None if match else div)
        cols["rm"].append(_finite(r.get("ref_margin_at_divergence")))
        cols["om"].append(_finite(r.get("orthrus_margin_at_divergence")))
        cols["lev"].append(r.get("levenshtein"))
        cols["ref"].append(seq(a))
        cols["tail"].append(-1 if match else seq(o[div:]))
        cols["rt"].append(r.get("ref_top_at_divergence"))
        cols["ot"].append(r.get("orthrus_top_at_divergence"))
        # top tokens decoded again after the audit (`backfill.py`): 1 reproduced, 0 not reproduced, None recorded
        cols["tb"].append(None if r.get("tops_backfilled") is None else int(bool(r["tops_backfilled"])))
        # the report's reference configuration's AR trajectory of this prompt (-1: it has none)
        xref = (against or {}).get("ids", {}).get(str(r.get("prompt_id")))
        cols["xref"].append(-1 if xref is None else seq(xref))
        used.update(xref or [])
        cols["rejoin"].append(None if match else rejoin(a, o, div))
        cols["ppl"].append(None if log_ppl is None else round(math.exp(min(log_ppl, 700.0)), 4))
    used_prompts = {p: prompts[p] for p in dict.fromkeys(cols["pid"]) if p in prompts}
    return {"pairs": cols, "seqs": seqs, "names": names, "tokens": token_texts(tokenizer, used),
            "prompts": used_prompts, "notes": notes, "rejoin_tokens": REJOIN_TOKENS,
            "reference_label": (against or {}).get("label")}


def pack(data: dict) -> str:
    """JSON, gzip (no timestamp: the same data packs to the same bytes), base64."""
    raw = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    return base64.b64encode(gzip.compress(raw, compresslevel=9, mtime=0)).decode("ascii")


def unpack(page: str) -> dict:
    """The data inside a report.html's text (what the page's script unpacks)."""
    m = re.search(r'<script id="data" type="application/octet-stream">([^<]*)</script>', page)
    if m is None:
        raise LosslessError("this file is not a lossless report.html (no data inside)")
    return json.loads(gzip.decompress(base64.b64decode(m.group(1))))


def overview_html(markdown_text: str, plot_dir: Path, plots: list[tuple[str, str]]) -> str:
    """report.md as HTML, its plots inlined as data URIs."""
    from markdown_it import MarkdownIt

    for file_name, _ in plots:
        png = base64.b64encode((plot_dir / file_name).read_bytes()).decode("ascii")
        markdown_text = markdown_text.replace(f"]({file_name})", f"](data:image/png;base64,{png})")
    return MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown_text)


def render(template: str, script: str, **fields) -> str:
    """A page from `templates/<template>` with `templates/common.js`, `templates/<script>` and the shared styles
    inline."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    if not (TEMPLATES / template).is_file():
        raise LosslessError(f"the page template {TEMPLATES / template} is missing from this install: reinstall lossless")
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html", "j2"]),
                      keep_trailing_newline=True)
    # the script and styles go in as text, not as templates: nothing in them is read as Jinja syntax
    return env.get_template(template).render(
        styles=(TEMPLATES / "report.css").read_text(encoding="utf-8"),
        script="\n".join((TEMPLATES / name).read_text(encoding="utf-8") for name in ("common.js", script)), **fields)


def write_html(out: Path, records: list[dict], labels: dict[str, str], markdown_text: str,
               plots: list[tuple[str, str]], prompts: dict[str, str], tokenizer, notes: list[str],
               against: dict | None = None) -> Path:
    """Write `out/report.html`, the audit's page (see the module docstring); returns its path. `against`:
    {"label", "ids": {prompt id: AR ids}} of the report's reference configuration, or None."""
    data = page_data(records, labels, prompts, tokenizer, notes, against)
    page = render("report.html.j2", "report.js", title="Trajectory audit report",
                  overview=overview_html(markdown_text, out, plots), data=pack(data), n_pairs=len(records))
    return atomic_write(out / "report.html", page)


def write_eval_html(out: Path, markdown_text: str, plots: list[tuple[str, str]], items: list[dict],
                    notes: list[str]) -> Path:
    """Write `out/report.html`, an evaluation's page: its report.md, and the items whose AR and Orthrus
    responses differ (`items`: {"key", "task", "dtype", "mode", "doc_id", "prompt", "target", "ar", "orthrus",
    "ar_score", "orthrus_score"}), side by side; returns its path."""
    page = render("eval.html.j2", "eval.js", title="AR vs Orthrus task scores",
                  overview=overview_html(markdown_text, out, plots), data=pack({"items": items, "notes": notes}))
    return atomic_write(out / "report.html", page)
