"""The default cycle from the running CPU's own costs.

Whether speculation pays depends on the CPU more than on the model: on a CPU whose multi-row forwards cost about
one decode step (AMX tiles, or a memory-bound Zen 4), bigger trees and longer lookups pay; where 9 rows cost 1.5
steps (VDPBF16PS on 2 Intel vCPUs), even the 8-node tree is AR's speed. So the default is computed, not fixed:

- a **cycle profile** says, for each candidate cycle (a tree of 0, 4, 8, 16 or 32 nodes, with prompt lookup of
  0, 16 or 32 tokens), what decoding a set of prompts takes: tokens, draft passes, and verify forwards by their
  row count. In exact mode these are the same on every CPU (the same tokens, the same drafts), so a profile is
  recorded once per head (`record_profile`; `lossless costs --profile` for a head of one's own) and the shipped
  head brings its own (`heads/<model>/cycles.json`);
- the **forward costs** of this CPU, measured once per kernel build, CPU model, thread count, model and dtype
  (`measure_costs`: forwards of 1 to 40 rows and the draft pass, alternating, the first quartile over rounds,
  after a short prompt and after a long one; a cycle's bookkeeping outside its forwards) and cached under
  `cache_dir()/cycles`; `lossless costs --remeasure` measures again. A long context makes every forward dearer and
  the many-row ones most (each row reads the whole cache): on machine D a 9-row verify cost 1.15 steps after 100
  tokens and 1.8 after 6,000, where the best cycle predicted 0.98x AR in that measurement;
- a **sampled** request's default (`sampling_choice`) is the tree of SAMPLED_TREE nodes, which gives way to AR
  for the rest of the request once, after FALLBACK_CYCLES cycles, the tokens it commits per cycle fall below what
  its cycle costs in steps on this CPU (times SAMPLING_MARGIN): how many drafts sampling accepts depends on the
  temperature and the text, so the request's own acceptance decides, not a profile. On machine D at temperature
  0.7 the chain ran at 0.85x AR without it;
- the **choice** (`choose`), for a request's context (its prompt's length): each candidate's predicted speed-up
  over AR is its tokens times a step's cost over the sum of its forwards' costs (row counts between the measured
  ones interpolated, contexts between and past the two measured ones linearly); the best one runs if it
  predicts at least MARGIN x AR, else AR does, so that the default is not slower than exact AR where the
  prediction errs by up to that much. The costs include each cycle's bookkeeping outside its forwards
  (accepting, committing, building the tree), measured on short decodes.

The model decides what ran and says why: `config["choice"]` in `--json`, the stderr summary, `lossless costs`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from ..errors import LosslessError
from ..names import CYCLE_LOOKUPS, CYCLE_TREES, DEFAULT_LOOKUP, DEFAULT_TREE, EXACT
from ..paths import cache_dir, write_atomically

CANDIDATES = tuple((t, l) for t in CYCLE_TREES for l in CYCLE_LOOKUPS)  # (tree nodes, lookup tokens)
COST_ROWS = (1, 5, 9, 13, 17, 24, 32, 40)  # verify rows whose cost is measured; others are interpolated
# a speculative cycle is the default only where it predicts at least this speed-up over AR: the predictions came
# within 3-6% of decoding's own (optimistic), and a profile's prompt mix is not every user's (the chat prompts
# commit fewer tokens per cycle than the suite's copy-heavy domains)
MARGIN = 1.15
# a sampled request's default cycle runs this many cycles before its tokens per cycle may send it to AR, and goes on while
# they predict at least SAMPLING_MARGIN x AR (the predictions came within 3-6% of decoding's own, optimistic)
FALLBACK_CYCLES = 8
SAMPLING_MARGIN = 1.05
# a sampled request's default tree: on machine D at temperature 0.7 (6 held-out prompts, 3 repeats, two runs) the
# 8-node tree committed 2.47 tokens a cycle against the chain's 2.24, at 1.11x and 1.02x AR against 0.99x and 0.91x
SAMPLED_TREE = 8
PROFILE_FILE = "cycles.json"
PROFILE_VERSION = 1
COSTS_VERSION = 5  # 4: the bookkeeping of sampled AR steps and chain cycles too; 5: of the sampled tree's cycles
LONG_CONTEXT = 4096  # the long prompt the costs are measured after too (or the model's longest that fits)
SHOWN_CONTEXTS = (500, 1000, 2000, 4000, 8000)  # the prompt lengths `lossless costs` says the default for
CYCLE_ENV = "LOSSLESS_CYCLE"  # "fixed": the fixed defaults (tree DEFAULT_TREE, lookup DEFAULT_LOOKUP), no measuring

log = logging.getLogger("lossless")


def label(tree: int, lookup: int) -> str:
    """"tree 8 + lookup 16", "chain", "chain + lookup 16"."""
    return " + ".join([f"tree {tree}" if tree else "chain"] + ([f"lookup {lookup}"] if lookup else []))


# ------------------------------------------------------------------------------------------ the choice
@dataclasses.dataclass(frozen=True)
class Choice:
    """What the default runs: AR (`mode` "ar") or an orthrus cycle (`tree`, `lookup`), and why."""

    mode: str
    tree: int
    lookup: int
    why: str
    predicted: dict  # {candidate label: predicted speed-up over AR}; empty when nothing was predicted
    ar_below: float = 0.0  # a sampled request's cycle: tokens per cycle under which it gives way to AR (0: never)

    def to_dict(self) -> dict:
        out = {"mode": self.mode, "tree": self.tree, "lookup": self.lookup, "why": self.why,
               "predicted": dict(self.predicted)}
        return {**out, "ar_below": self.ar_below} if self.ar_below else out


def fixed_choice(why: str) -> Choice:
    return Choice("orthrus", DEFAULT_TREE, DEFAULT_LOOKUP, why, {})


def cost_at(costs: dict, rows: int) -> float:
    """Milliseconds of a verify of `rows` rows: measured, or linear between the nearest measured row counts
    (beyond the largest, along the last segment)."""
    table = sorted((int(r), float(ms)) for r, ms in costs["rows"].items())
    if rows <= table[0][0]:
        return table[0][1]
    for (r0, c0), (r1, c1) in zip(table, table[1:]):
        if rows <= r1 or (r1, c1) == table[-1]:
            return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
    raise AssertionError("unreachable")


def bookkeeping_at(costs: dict, tree: int) -> float:
    """Milliseconds a cycle spends outside its forwards with a tree of `tree` nodes (0: the chain): linear between
    the chain's and the 32-node tree's, as measured."""
    keep = costs.get("bookkeeping", {})
    chain = keep.get("chain", 0.0)
    return chain + (keep.get("tree 32", chain) - chain) * tree / 32


def at_context(costs: dict, context: int | None) -> dict:
    """The costs of forwards after `context` cached positions: the measured short-context costs, or, where costs
    after a long prompt were measured too (`costs["long"]`), each forward's cost linear in the context through
    the two (past the long one along the same line; never below the short one's)."""
    long = costs.get("long")
    if context is None or not long or context <= int(costs["cache_len"]):
        return costs
    share = (context - int(costs["cache_len"])) / (int(long["cache_len"]) - int(costs["cache_len"]))
    line = lambda a, b: max(a, a + (b - a) * share)  # noqa: E731
    rows = {r: round(line(float(ms), cost_at(long, int(r))), 3) for r, ms in costs["rows"].items()}
    return {**costs, "rows": rows, "draft": round(line(float(costs["draft"]), float(long["draft"])), 3),
            "context": int(context)}


def predict(entry: dict, costs: dict) -> float:
    """Predicted speed-up over AR of one profiled candidate at these costs: the time AR takes for its tokens
    (a step and its bookkeeping each) over the time of the candidate's draft passes, verifies and cycles'
    bookkeeping."""
    cycles_run = sum(entry["verifies"].values())
    spent = (entry["drafts"] * costs["draft"] + sum(n * cost_at(costs, int(r)) for r, n in entry["verifies"].items())
             + cycles_run * bookkeeping_at(costs, entry["tree"]))
    return entry["tokens"] * (cost_at(costs, 1) + costs.get("bookkeeping", {}).get("ar", 0.0)) / spent


def choose(profile: dict, costs: dict, margin: float = MARGIN, context: int | None = None) -> Choice:
    """The candidate of `profile` predicting the highest speed-up over AR at `costs` after `context` cached
    positions (None: the short context they were measured at), if it reaches `margin`; else AR. (A profile that
    decoded nothing has nothing to predict from: the fixed default.)"""
    costs = at_context(costs, context)
    ran = [e for e in profile["candidates"] if e["tokens"] > 0 and (e["drafts"] or e["verifies"])]
    if not ran:
        return fixed_choice(f"{label(DEFAULT_TREE, DEFAULT_LOOKUP)}: the fixed default (the head's cycle profile "
                            f"decoded no cycles; record it again with more --max-new-tokens)")
    predicted = {}
    for entry in ran:
        predicted[label(entry["tree"], entry["lookup"])] = round(predict(entry, costs), 3)
    best = max(ran, key=lambda e: predicted[label(e["tree"], e["lookup"])])
    name, speedup = label(best["tree"], best["lookup"]), predicted[label(best["tree"], best["lookup"])]
    steps = _cost_words(costs)
    if speedup < margin:
        return Choice("ar", 0, 0, f"AR: on this CPU's costs ({steps}) the best cycle, {name}, predicts "
                                  f"{speedup:.2f}x AR, below the {margin:.2f}x a cycle must predict", predicted)
    return Choice("orthrus", int(best["tree"]), int(best["lookup"]),
                  f"{name}: predicts {speedup:.2f}x AR on this CPU's costs ({steps}), the best of "
                  f"{len(predicted)} cycles", predicted)


def sampling_choice(costs: dict | None, k: int, context: int | None = None) -> Choice:
    """A sampled request's default: the tree of SAMPLED_TREE nodes (its candidates kept where AR's draws choose them, one
    verify of SAMPLED_TREE + 1 rows: as many as the chain's of block size 8, and it commits about a tenth more
    tokens a cycle), giving way to AR once its tokens per cycle (after FALLBACK_CYCLES cycles) fall below the
    break-even these costs give after `context` cached positions (a draft pass, the tree's verify and a cycle's
    bookkeeping, in steps) times SAMPLING_MARGIN. No costs: the tree alone. (`k`, the request's block size, caps
    the tree's depth, not its rows.)"""
    name = f"tree {SAMPLED_TREE}"
    if costs is None:
        return Choice("orthrus", SAMPLED_TREE, 0, f"{name} (no forward costs measured here)", {})
    costs = at_context(costs, context)
    keep = costs.get("bookkeeping", {})
    step = cost_at(costs, 1) + keep.get("ar sampled", keep.get("ar", 0.0))
    cycle = keep.get(f"{name} sampled", keep.get("chain sampled", keep.get("chain", 0.0)))
    even = (costs["draft"] + cost_at(costs, SAMPLED_TREE + 1) + cycle) / step
    below = round(even * SAMPLING_MARGIN, 3)
    return Choice("orthrus", SAMPLED_TREE, 0, f"{name}, giving way to AR if after {FALLBACK_CYCLES} cycles it commits "
                                              f"fewer than {below:.2f} tokens a cycle (a cycle costs {even:.2f} steps "
                                              f"on this CPU's costs: {_cost_words(costs)})", {}, below)


def _cost_words(costs: dict) -> str:
    step = cost_at(costs, 1)
    where = f" after {costs['context']:,} tokens" if "context" in costs else ""
    return (f"9 rows {cost_at(costs, 9) / step:.2f}, 17 rows {cost_at(costs, 17) / step:.2f}, "
            f"draft {costs['draft'] / step:.2f} steps{where}")


# ------------------------------------------------------------------------------------------ profiles
def cycles_dir() -> Path:
    """Where measured costs and recorded profiles are kept."""
    return cache_dir() / "cycles"


def recorded_profile_path(model) -> Path:
    """Where `lossless costs --profile` keeps the profile it records for the model's head."""
    return cycles_dir() / f"profile-{model.head_digest}.json"


def profile_path(model) -> Path | None:
    """Where the profile of the model's head is looked for: the cache (profiles one recorded), then the head's
    own directory (the shipped head's)."""
    cached = recorded_profile_path(model)
    if cached.exists() or model.head_dir is None:
        return cached
    return Path(model.head_dir) / PROFILE_FILE


def profile_stamp(model) -> tuple:
    """(where the profile is looked for, its modification time or None): a profile recorded later shows."""
    path = profile_path(model)
    try:
        return str(path), path.stat().st_mtime_ns
    except OSError:
        return str(path), None


def load_profile(model) -> dict | None:
    """The cycle profile of the model's loaded head, or None (an untrained head, or none recorded)."""
    path = profile_path(model)
    if path is None or not path.exists():
        return None
    try:
        profile = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("ignoring an unreadable cycle profile %s", path)
        return None
    if not valid_profile(profile) or profile.get("head") != model.head_digest:
        if isinstance(profile, dict) and profile.get("head") == model.head_digest:
            log.warning("ignoring a cycle profile of another version or shape: %s", path)
        return None
    return profile


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def valid_profile(profile) -> bool:
    """Whether `profile` has this version's shape: candidates of (tree, lookup, tokens, drafts, verifies)."""
    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION:
        return False
    entries = profile.get("candidates")
    return isinstance(entries, list) and bool(entries) and all(
        isinstance(e, dict) and all(_count(e.get(f)) for f in ("tree", "lookup", "tokens", "drafts"))
        and isinstance(e.get("verifies"), dict)
        and all(str(r).isdigit() and int(r) > 0 and _count(n) for r, n in e["verifies"].items()) for e in entries)


def valid_costs(costs) -> bool:
    """Whether `costs` has this version's shape: positive times of at least two row counts and the draft pass, and
    if it has them, the same after a long prompt longer than the short one."""
    if not isinstance(costs, dict) or costs.get("version") != COSTS_VERSION:
        return False
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and 0 <= x < 1e9  # noqa: E731

    def forwards(c) -> bool:
        rows = c.get("rows") if isinstance(c, dict) else None
        return (isinstance(rows, dict) and len(rows) >= 2 and "1" in rows
                and all(str(r).isdigit() and number(ms) and ms > 0 for r, ms in rows.items())
                and number(c.get("draft")) and c["draft"] > 0)

    keep, long = costs.get("bookkeeping", {}), costs.get("long")
    return (forwards(costs) and isinstance(keep, dict) and all(number(v) for v in keep.values())
            and ("cache_len" not in costs or _count(costs["cache_len"]))
            and (long is None or (forwards(long) and _count(long.get("cache_len")) and _count(costs.get("cache_len"))
                                  and long["cache_len"] > costs["cache_len"])))


class _Watching:
    """Counts the forwards a model runs while decoding (draft passes; verifies by their row count) and the time
    spent inside them (a forward that calls another counts once)."""

    PASSES = ("prefill", "step", "draft", "verify", "verify_tree")  # what else a cycle does is its bookkeeping

    def __init__(self, model):
        self.model, self.drafts, self.verifies, self.seconds, self._depth = model, 0, {}, 0.0, 0
        self._before: dict = {}

    def __enter__(self):
        for name in self.PASSES:
            self._before[name] = self.model.__dict__.get(name)  # a wrapper already there (a watch inside a watch)
            setattr(self.model, name, self._watched(name, getattr(self.model, name)))
        return self

    def _watched(self, name, fn):
        def call(*args, **kwargs):
            if name == "draft":
                self.drafts += 1
            elif name in ("verify", "verify_tree"):
                rows = len(args[1])
                self.verifies[rows] = self.verifies.get(rows, 0) + 1
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds += time.perf_counter() - start
        return call

    def __exit__(self, *exc):
        for name in self.PASSES:
            if self._before[name] is None:
                self.model.__dict__.pop(name, None)
            else:
                self.model.__dict__[name] = self._before[name]


def record_profile(model, prompts: list[list[int]], max_new_tokens: int, candidates=CANDIDATES,
                   progress=None) -> dict:
    """Decode every prompt (token ids) with every candidate (tree, lookup) and count what it took. In exact
    mode every candidate commits AR's tokens; a candidate whose tokens differ from the first one's is refused
    (the counts would compare different texts)."""
    from .loop import DecodeConfig, decode
    from .sampling import SamplingConfig

    entries, reference = [], None
    for tree, lookup in candidates:
        tokens = []
        with _Watching(model) as counts:
            for ids in prompts:
                cfg = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(), tree=tree, lookup=lookup)
                state = decode(model, ids, "orthrus", cfg)
                tokens.append(state.generated)
                if progress:
                    progress()
        if reference is None:
            reference = tokens
        elif tokens != reference:
            raise LosslessError(f"{label(tree, lookup)} decoded other tokens than {label(*candidates[0])}: record "
                                f"cycle profiles on exact kernels (--attn exact)")
        # the prefill is the same for every candidate and for AR: only the decode cycles count
        verifies = dict(counts.verifies)
        entries.append({"tree": tree, "lookup": lookup, "tokens": sum(len(t) - 1 for t in tokens),
                        "drafts": counts.drafts, "verifies": {str(r): n for r, n in sorted(verifies.items())}})
    return {"version": PROFILE_VERSION, "head": model.head_digest, "model": model.name, "dtype": model.dtype_name,
            "attn": model.attn, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "candidates": entries}


# --------------------------------------------------------------------------------------------- costs
def costs_key(model) -> str:
    """What the costs depend on: the kernels (exact mode's sources and variant, or torch's), the CPU, the thread
    count, the model's shapes and dtype, and the head's block size and draft adapter (the draft pass)."""
    from . import kernels

    parts = [str(COSTS_VERSION), model.attn, model.dtype_name, model.fingerprint, str(torch.get_num_threads()),
             torch.__version__, kernels.cpu_model(), " ".join(sorted(kernels.cpu_flags())),
             f"k={model.k} adapter={model.head_info.draft_adapter}"]  # the draft pass's rows and its modules
    if model.attn == EXACT:
        parts += [kernels.source_digest(), kernels.isa()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def costs_path(model) -> Path:
    return cycles_dir() / f"costs-{costs_key(model)}.json"


def measure_costs(model, rounds: int = 12, cache_len: int = 100, decode_tokens: int = 32,
                  long_len: int = LONG_CONTEXT) -> dict:
    """This CPU's costs, in milliseconds: verify forwards of COST_ROWS rows and a draft pass at `cache_len` cached
    positions, each timed once per round in alternation (so a slow moment of the machine hits all of them), the
    first quartile of `rounds` kept after one round to warm up; the same (half the rounds) after `long_len` cached
    positions (or the most the model's positions leave room for; none where that is under twice `cache_len`), in
    `"long"`; and the bookkeeping of a decode cycle outside its forwards (accepting, committing, building the tree,
    moving the accepted path's cache rows), from `decode_tokens`-token decodes of AR, the chain and the 32-node
    tree (the least of two), and of AR, the chain and the SAMPLED_TREE-node tree sampling at temperature 1 (each
    processed distribution, rejection sampling, a tree's candidates tried)."""
    from . import kernels
    from .loop import DecodeConfig, decode
    from .sampling import SamplingConfig

    vocab = int(model.config.vocab_size)
    long_len = min(long_len, model.max_positions - max(COST_ROWS) - model.k - 2)
    tokens = [(7 * i + 100) % vocab for i in range(max(cache_len, long_len))]  # what they are does not change the cost
    prompt = tokens[:cache_len]
    with torch.no_grad():  # as decoding runs (inference mode's tensors make these forwards slower, not faster)
        short = _forward_costs(model, prompt, rounds)
        long = None
        if long_len >= 2 * cache_len:  # half the rounds: each forward there is dearer, and the times steadier
            long = {"cache_len": long_len, **_forward_costs(model, tokens[:long_len], max(1, rounds // 2))}
        bookkeeping = {}
        sampled = SamplingConfig(temperature=1.0, seed=0)
        for name, mode, tree in (("ar", "ar", 0), ("chain", "orthrus", 0), ("tree 32", "orthrus", 32),
                                 ("ar sampled", "ar", 0), ("chain sampled", "orthrus", 0),
                                 (f"tree {SAMPLED_TREE} sampled", "orthrus", SAMPLED_TREE)):
            per_cycle = []
            for _ in range(2):
                with _Watching(model) as watch:
                    cfg = DecodeConfig(max_new_tokens=decode_tokens, tree=tree, eos_ids=(-1,),
                                       sampling=sampled if name.endswith("sampled") else SamplingConfig())
                    state = decode(model, prompt, mode, cfg)
                per_cycle.append(max(state.stats.seconds - watch.seconds, 0.0) / max(state.stats.steps, 1))
            bookkeeping[name] = round(1000 * min(per_cycle), 3)
    costs = {"version": COSTS_VERSION, "key": costs_key(model), "cpu": kernels.cpu_model(),
             "variant": kernels.isa() if model.attn == EXACT else "stock", "threads": torch.get_num_threads(),
             "model": model.name, "dtype": model.dtype_name, "attn": model.attn, "rounds": rounds,
             "cache_len": cache_len, "date": time.strftime("%Y-%m-%d"), **short, "bookkeeping": bookkeeping}
    if long is not None:
        costs["long"] = long
    return costs


def _forward_costs(model, prompt: list[int], rounds: int) -> dict:
    """{"rows": {rows: ms}, "draft": ms} of forwards after `prompt` (see `measure_costs`)."""
    from .loop import commit_cache

    token = prompt[-1]
    cache, _ = model.prefill(prompt)
    n = cache.get_seq_length()
    calls = {str(r): (lambda r=r: (model.verify(cache, [token] * r), commit_cache(cache, n))) for r in COST_ROWS}
    calls["draft"] = lambda: model.draft(cache, token, model.k)
    times = {name: [] for name in calls}
    for round_ in range(rounds + 1):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - start)
    ms = {name: round(1000 * _low_quartile(t), 3) for name, t in times.items()}
    return {"rows": {r: ms[r] for r in map(str, COST_ROWS)}, "draft": ms["draft"]}


def _low_quartile(seconds: list[float]) -> float:
    """The first quartile: on a shared machine a forward's time is its cost plus whatever else ran meanwhile,
    so the lower times are the steadier estimate (the median moved by 25% between runs, this by a few %)."""
    return statistics.quantiles(seconds, n=4, method="inclusive")[0] if len(seconds) > 1 else seconds[0]


def cached_costs(model, remeasure: bool = False) -> dict:
    """This CPU's costs for the model: from the cache, else measured (about 10 s on the embedded model, a minute
    or more at 1B and up: most of it the long prompt) and cached."""
    path = costs_path(model)
    if not remeasure and path.exists():
        try:
            costs = json.loads(path.read_text())
            if valid_costs(costs) and costs.get("key") == costs_key(model):
                return costs
        except (OSError, ValueError):
            pass
    log.info("measuring this CPU's forward costs for the default cycle, after a short prompt and a long one (once; "
             "seconds to minutes by the model's size; cached in %s)", path.parent)
    costs = measure_costs(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(costs, indent=1) + "\n")
    except OSError as exc:  # a read-only cache costs a measurement per process, nothing else
        log.warning("could not cache the forward costs in %s (%s)", path, exc)
    return costs


def default_inputs(model, remeasure: bool = False) -> Choice | tuple[dict, dict]:
    """What the default is chosen from: (the head's cycle profile, this CPU's costs), or the fixed default's
    Choice where there is nothing to choose from."""
    if os.environ.get(CYCLE_ENV, "").strip() == "fixed":
        return fixed_choice(f"{label(DEFAULT_TREE, DEFAULT_LOOKUP)}: the fixed default ({CYCLE_ENV}=fixed)")
    if model.device.type != "cpu":
        return fixed_choice(f"{label(DEFAULT_TREE, DEFAULT_LOOKUP)}: the fixed default (forward costs are measured "
                            f"on the CPU only)")
    profile = load_profile(model)
    if profile is None:
        return fixed_choice(f"{label(DEFAULT_TREE, DEFAULT_LOOKUP)}: the fixed default (no cycle profile for this "
                            f"head; `lossless costs --profile` records one)")
    return profile, cached_costs(model, remeasure)


def sampling_inputs(model, remeasure: bool = False) -> dict | None:
    """The costs a sampled request's default is chosen from, or None where none are measured (as for
    `default_inputs`: `LOSSLESS_CYCLE=fixed`, a device other than the CPU)."""
    if os.environ.get(CYCLE_ENV, "").strip() == "fixed" or model.device.type != "cpu":
        return None
    return cached_costs(model, remeasure)


def default_profile_prompts(per_domain: int = 2, heldout: int = 12) -> list[str]:
    """The prompts a profile is recorded on by default: `per_domain` prompts of each domain of the default suite
    (code, maths, translation, chat, ...: what is copied and what is drafted differs by domain) and the first
    `heldout` held-out chat prompts (the README's speed prompts)."""
    from collections import Counter

    from ..jsonio import read_jsonl
    from ..paths import DEFAULT_SUITE, HELDOUT_PROMPTS

    taken: Counter = Counter()
    prompts = []
    for row in read_jsonl(DEFAULT_SUITE, what="prompt file"):
        taken.update([row["domain"]])
        if taken[row["domain"]] <= per_domain:
            prompts.append(row["prompt"])
    return prompts + [row["prompt"] for row in read_jsonl(HELDOUT_PROMPTS, what="prompt file")[:heldout]]
