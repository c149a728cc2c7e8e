"""Top tokens at the divergence for records made before the audit recorded them.

A record of a diverging pair names both sides' top tokens and logits where the trajectories part
(`ref_top_at_divergence`, `orthrus_top_at_divergence`): that is where a reader sees how near a tie the flip
was. Records from before those fields hold neither, and a record whose AR reference was reused from such a
record (exact mode against stock AR) holds the candidate's side only. `backfill` decodes each such pair again, on the machine
and thread count that made it (the record's `machine`), up to its divergence only (`DecodeConfig.stop_after`:
every forward as in the full decode, so the start of a decode is the start of the full one, to the bit),
checks that the tokens up to and including the divergence are the recorded ones on both sides, and that the
reference's margin there is the recorded one, and then keeps both sides' top tokens there:

- annotations live in the run directory's `backfill/` folder, kept like the records (`records.py`: appended
  and fsynced per pair, gzip segments committed), one line per record, under the record's id; a run killed
  at any moment resumes where it stopped;
- a pair whose decode does not reproduce the recorded tokens (another torch build behind the same machine
  name, say) is annotated `reproduced: false` and keeps no tops: a table of top tokens the recorded decode
  did not see is never shown;
- records this machine cannot decode again are left for the machine they name (the summary says how many);
  so are exact-mode records of an earlier kernel build (no machine decodes them again) and candidates
  outside the decode loop (they never record top tokens).

`apply` is what the report does with the annotations: copies of the records with the tops filled in. This
module's readers (`annotations`, `apply`, `top_token_counts`) load no torch.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from pathlib import Path

from ..errors import LosslessError
from ..names import EXACT
from .records import RecordStore, read_records, record_id

BACKFILL_DIR = "backfill"
WRITER = "tops"
FIELDS = ("ref_top_at_divergence", "orthrus_top_at_divergence")
DECODE_LOOP = ("orthrus", "orthrus-fused", "orthrus-tree", "orthrus-lookup", "orthrus-tree-lookup", "oracle")


MARGIN_TOLERANCE = 2e-4  # a top table's top-1 minus top-2 (4 decimals each) against the recorded margin (6 decimals)


def annotations(run_dir: str | Path, at_rest: bool = False, corrupt: list | None = None) -> dict[str, dict]:
    """The run's backfilled annotations by record id (`at_rest`: the committed segments only; `corrupt`: gets
    one (file, line) per line that is not an annotation, as `read_records`)."""
    return {a["key"]: a for a in read_records(run_dir, at_rest, corrupt, folder=BACKFILL_DIR)}


def _candidate(r: dict) -> str:
    return str(r.get("candidate") or ("orthrus-fused" if r.get("cycle") == "fused" else "orthrus"))


def _diverging(r: dict) -> bool:
    return not r.get("exact_match", True) and r.get("first_divergence") is not None


def _sides(r: dict):
    """(field, trajectory, margin at the divergence) of the reference's side and the candidate's."""
    return (("ref_top_at_divergence", r.get("ar_ids") or [], r.get("ref_margin_at_divergence")),
            ("orthrus_top_at_divergence", r.get("orthrus_ids") or [], r.get("orthrus_margin_at_divergence")))


def _lacks(r: dict) -> list[str]:
    """The sides whose top tokens a diverging record lacks (a side that ended before the divergence has none)."""
    div = int(r["first_divergence"])
    return [field for field, ids, _ in _sides(r) if r.get(field) is None and div < len(ids)]


def wants_tops(r: dict) -> bool:
    """A diverging record of a decode-loop candidate that lacks the top tokens of a side: records from before they
    were kept, and the reference's side of records whose AR reference was reused from such a record (candidates
    outside the decode loop never have them)."""
    return _diverging(r) and _candidate(r) in DECODE_LOOP and bool(_lacks(r))


def consistent(r: dict, note: dict) -> bool:
    """Whether a note's top tables agree with what the record kept of the same logits: on each side, the top token
    is the one the trajectory chose at the divergence (or ties it), and the top-1 minus top-2 logit is the recorded margin there."""
    div = int(r["first_divergence"])
    for field, ids, margin in _sides(r):
        top = note.get(field)
        if div >= len(ids):  # this side ended (EOS) before the divergence: it has no token there
            if top is not None:
                return False
            continue
        # the chosen token leads the table, or ties its leader (a tie's order in the table is the sort's, not argmax's)
        if not top or len(top) < 2 or not any(t == ids[div] and v == top[0][1] for t, v in top):
            return False
        if margin is not None and abs((top[0][1] - top[1][1]) - margin) > MARGIN_TOLERANCE:
            return False
    return True


def apply(records: list[dict], notes: dict[str, dict]) -> list[dict]:
    """The records with the annotated tops filled in where they lack them (copies; a side the record holds keeps
    its own table). A note counts as reproduced only if it says so and both its tables agree with the record
    (`consistent`; a table the record holds is the note's own, decoded again)."""
    out = []
    for r in records:
        a = notes.get(record_id(r)) if notes and wants_tops(r) else None
        if a is not None:
            ok = bool(a.get("reproduced")) and consistent(r, a) and \
                all(r.get(f) is None or r[f] == a.get(f) for f in FIELDS)
            r = {**r, "tops_backfilled": ok, **({f: a.get(f) for f in _lacks(r)} if ok else {})}
        out.append(r)
    return out


def top_token_counts(records: list[dict]) -> dict[str, int]:
    """Where the top tokens of the diverging records of decode-loop candidates come from: recorded by the audit,
    backfilled, not reproduced on decoding again, or still missing."""
    c = Counter()
    for r in records:
        if not _diverging(r) or _candidate(r) not in DECODE_LOOP:
            continue
        c["diverging"] += 1
        if r.get("tops_backfilled") is False:
            c["not_reproduced"] += 1
        elif r.get("tops_backfilled"):
            c["backfilled"] += 1
        elif _lacks(r):  # a side is not known (both, or the reference's of a reused reference)
            c["missing"] += 1
        else:
            c["recorded"] += 1
    return {k: c[k] for k in ("diverging", "recorded", "backfilled", "not_reproduced", "missing")}


def _decodable(r: dict, machine: str) -> str | None:
    """Why this machine cannot decode the record again (None: it can)."""
    from ..decoding import kernels

    attn = r.get("attn")
    for field, kernel in (("kernels", attn), ("reference_kernels", r.get("reference_attn") or attn)):
        if kernel == EXACT and str(r.get(field) or "").split("/")[0] != kernels.source_digest():
            return "an earlier exact kernel build (no machine decodes it again)"
    if r.get("machine") != machine:
        return f"machine {r.get('machine') or '(not recorded)'}"
    return None


def backfill_pair(models, r: dict, prompt: str, cfg: dict, own_reference: list[int] | None = None) -> dict:
    """Decode one record's pair again up to its divergence; its annotation. `own_reference`: the AR trajectory of
    the candidate's own kernel on this prompt (what the oracle drafts; default the record's reference)."""
    from . import candidates as cands
    from ..text import encode_prompt
    from .audit import decode_config, top_at
    from ..decoding.loop import decode

    div = int(r["first_divergence"])
    attn = r["attn"]
    ref_model, cand_model = models(r["dtype"], r.get("reference_attn") or attn), models(r["dtype"], attn)
    ids = encode_prompt(cand_model.tokenizer, prompt)
    dcfg = decode_config(int(r.get("max_new_tokens") or cfg["max_new_tokens"]), cfg.get("k"), cfg.get("groups"),
                         stop_after=div + 1)
    start = time.perf_counter()
    ref = decode(ref_model, ids, "ar", dcfg)
    run = cands.resolve(_candidate(r)).run(cand_model, ids, dcfg, list(own_reference or r["ar_ids"]))
    a, o = list(r["ar_ids"]), list(r["orthrus_ids"])
    rounded = [round(m, 4) for m in ref.margins[: div + 1]]
    reproduced = (len(ids) == r.get("prompt_tokens", len(ids)) and ref.generated[: div + 1] == a[: div + 1]
                  and run.ids[: div + 1] == o[: div + 1]
                  and (r.get("ar_margins") is None or rounded == list(r["ar_margins"][: div + 1]))
                  and (r.get("accepted") is None or list(run.accepted or []) == list(r["accepted"])[: len(run.accepted or [])]))
    note = {"key": record_id(r), "reproduced": bool(reproduced), "machine": r.get("machine"),
            "seconds": round(time.perf_counter() - start, 3)}
    if reproduced:
        note.update({"ref_top_at_divergence": top_at(ref.tops, div), "orthrus_top_at_divergence": top_at(run.tops, div)})
        # the tables themselves against what the record kept of the same logits (the margins at the divergence)
        note["reproduced"] = consistent(r, note)
        if not note["reproduced"]:
            for f in FIELDS:
                note.pop(f)
    return note


def run_backfill(run_dir: str | Path, progress: bool = True, limit: int | None = None, load=None,
                 shard: str | None = None) -> dict:
    """Backfill the top tokens of every diverging record of `run_dir` this machine can decode again (at most
    `limit` pairs). `load(dtype, attn)` builds models (default: the run's model and pinned head). `shard` "i/n":
    every n-th of those records (processes side by side, one per core, each with its own writer and lock)."""
    from ..paths import exclusive_lock
    from .audit import parse_shard, read_run_file
    from .records import writer_name

    index, n_shards = parse_shard(shard)
    writer = WRITER if n_shards == 1 else f"{WRITER}-{writer_name((index, n_shards))}"
    run_dir = Path(run_dir)
    info = read_run_file(run_dir) if run_dir.is_dir() else None
    if info is None:
        raise LosslessError(f"{run_dir} holds no audit run (no run.json): pass the --out directory of `lossless audit`")
    cfg = info.get("config", {})
    (run_dir / BACKFILL_DIR).mkdir(exist_ok=True)
    with exclusive_lock(run_dir / BACKFILL_DIR / f".lock-{writer}",
                        f"another backfill is writing {run_dir / BACKFILL_DIR} as {writer} (pid {{pid}}): wait for it"):
        return _backfill_locked(run_dir, cfg, writer, (index, n_shards), progress, limit, load)


def _backfill_locked(run_dir: Path, cfg: dict, writer: str, shard: tuple[int, int], progress: bool,
                     limit: int | None, load) -> dict:
    """`run_backfill`'s work, under its writer's lock."""
    import torch
    from tqdm import tqdm

    from ..decoding.models import load_model
    from .audit import load_suite, locate_head, machine_id, suite_digest

    suite = cfg.get("suite", "")
    if cfg.get("suite_sha256") and (not Path(suite).is_file() or suite_digest(suite) != cfg["suite_sha256"]):
        raise LosslessError(f"the suite {suite} is not the one this run was made with (sha256 {cfg['suite_sha256']}):"
                            " restore it (e.g. `git checkout` it) before backfilling")
    every = read_records(run_dir)
    # the AR trajectory of each prompt, dtype and kernel (what an oracle candidate drafts from)
    own = {(r.get("prompt_id"), r.get("dtype"), r.get("reference_attn") or r.get("attn")): r["ar_ids"]
           for r in every if r.get("ar_ids") is not None}
    # one configuration after another (few models in memory), pairs of a configuration in record order; a
    # shard takes the records whose id hashes to it, so side-by-side shards never overlap, whatever is added later
    records = sorted((r for r in every if wants_tops(r)), key=lambda r: (r["dtype"], r["attn"],
                                                                         str(r.get("reference_attn") or r["attn"])))
    records = [r for r in records if zlib.crc32(record_id(r).encode()) % shard[1] == shard[0]]
    del every
    done = annotations(run_dir)
    machine = machine_id()
    todo, elsewhere = [], Counter()
    for r in records:
        if record_id(r) in done:
            continue
        why = _decodable(r, machine)
        if why is None:
            todo.append(r)
        else:
            elsewhere[why] += 1
    todo = todo[:limit] if limit is not None else todo
    prompts = {p["id"]: p["prompt"] for p in load_suite(suite)} if todo else {}
    if load is None:
        if not cfg.get("model"):
            raise LosslessError(f"{run_dir / 'run.json'} names no model: restore it from git")
        head = locate_head(cfg["model"], cfg.get("head"), cfg["head_digest"]) if cfg.get("head_digest") \
            else cfg.get("head")
        load = lambda d, a: load_model(cfg["model"], d, cfg.get("device", "cpu"), a, head=head)  # noqa: E731
    cache: dict[tuple[str, str], object] = {}

    def models(dtype, attn):
        if (dtype, attn) not in cache:
            cache[(dtype, attn)] = load(dtype, attn)
        return cache[(dtype, attn)]

    missing = sorted({r["prompt_id"] for r in todo if r["prompt_id"] not in prompts})
    if missing:
        raise LosslessError(f"the suite {suite} lacks prompt(s) {', '.join(missing[:3])} of this run: "
                            "restore the suite the run was made with")
    store = RecordStore(run_dir, writer, roll_seconds=600.0, folder=BACKFILL_DIR)
    n = Counter()
    with store.session(), torch.no_grad(), tqdm(total=len(todo), desc="backfill tops", unit="pair",
                                                disable=not progress) as bar:
        for r in todo:
            own_ids = own.get((r["prompt_id"], r["dtype"], r["attn"]))
            note = backfill_pair(models, r, prompts[r["prompt_id"]], cfg, own_ids)
            store.append([note])
            n["reproduced" if note["reproduced"] else "not_reproduced"] += 1
            bar.update(1)
    return {"run_dir": str(run_dir), "backfilled": n["reproduced"], "not_reproduced": n["not_reproduced"],
            "already_done": sum(1 for r in records if record_id(r) in done), "left": dict(sorted(elsewhere.items())),
            "machine": machine}


def left_line(result: dict) -> str | None:
    """A line for the CLI when records were left undone (None: none were)."""
    if not result["left"]:
        return None
    parts = ", ".join(f"{n} from {why}" for why, n in result["left"].items())
    threads = any(why.startswith("machine ") for why in result["left"])
    return f"left {sum(result['left'].values())} pair(s): {parts}" + \
        (" (a machine's name includes its torch thread count: run there with the same OMP_NUM_THREADS)" if threads else "")
