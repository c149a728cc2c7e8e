"""How far the default cycle is from the best choice of cycle at every position, on this CPU's forward costs.

In exact mode every cycle commits AR's tokens, so what any cycle would commit at any position of a greedy decode
follows from one record per position: the draft's top candidates at each block position (as the tree cycle drafts
them there) and prompt lookup's proposal. This benchmark decodes each prompt once with AR, records those at every
position, and replays policies on the record, each forward costed as `cycles.predict` costs it from this CPU's
measured forward costs (`cycles.cached_costs`: forwards of 1 to 40 rows, the draft pass, at the prompt's context),
with each cycle's bookkeeping (a lookup verified alone builds no tree: the chain's):

- `ar`, and every candidate of the default's choice (a tree of 0 to 32 nodes, lookup of 0, 16 or 32 tokens);
- `default`: the candidate the default chooses for the prompt at these costs (`cycles.choose`), as decoding runs it;
- `fallback`: the default, going to AR for FALLBACK_STEPS steps whenever its last WINDOW drafted cycles (lookup's
  cycles aside, which run as they are) predict less than AR's speed: a request's own acceptance, as a sampled
  request's default uses it;
- `oracle`: the cheapest sequence of cycles with every position's outcome known (dynamic programming over AR and
  every candidate's cycle): a bound no policy that decides before it drafts can reach.

Per prompt, each policy's predicted speed-up over AR (the prefill aside); the table gives the mean over prompts
with a bootstrap 95% interval, the least, and the prompts below 1.0x. The replay is checked against decoding: the
default's replayed tokens per cycle, cycle by cycle, equal a real decode's (`--check`: the first prompts).

    python benchmarks/cycle_policy.py --limit 40
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import lossless
from lossless import paths
from lossless.decoding import cycles, loop
from lossless.decoding.sampling import top_candidates
from lossless.errors import LosslessError
from lossless.paths import write_atomically
from lossless.stats import bootstrap_mean
from lossless.text import encode_prompt
from lossless.training.distill import read_prompts

WINDOW, FALLBACK_STEPS = 8, 16


def record(model, ids: list[int], max_new_tokens: int) -> dict:
    """AR's tokens after `ids`, and at every position what a tree cycle drafts there and what lookup proposes."""
    cfg = lossless.DecodeConfig(max_new_tokens=max_new_tokens, eos_ids=tuple(model.eos_token_ids()))
    k, longest = model.k, max(cycles.CYCLE_LOOKUPS)
    rows = []
    with model.weights_fixed():
        state = loop.prefill(model, ids, cfg, None)
        while state.finished is None:
            made = len(state.generated)
            depth = min(k - 1, max_new_tokens - made - 1)  # as tree_cycle drafts at this position
            row = {"lookup": loop.lookup_proposal(state.tokens, min(longest, max_new_tokens - made - 1))}
            if depth >= 1:
                probs, ranks = top_candidates(model.draft(state.cache, state.tokens[-1], depth + 1), loop.TREE_WIDTH)
                row["probs"], row["ranks"] = probs, ranks
            rows.append(row)
            loop.ar_cycle(model, state, cfg, None)
    return {"context": len(ids), "truth": state.generated, "rows": rows, "max_new_tokens": max_new_tokens}


class Replay:
    """One prompt's record costed at this CPU's costs after its prompt."""

    def __init__(self, rec: dict, costs: dict):
        self.rec, self.truth, self.rows, self.n = rec, rec["truth"], rec["rows"], len(rec["truth"])
        self.costs = cycles.at_context(costs, rec["context"])
        self.step = cycles.cost_at(self.costs, 1) + self.costs.get("bookkeeping", {}).get("ar", 0.0)

    def cycle(self, p: int, tree: int, lookup: int) -> tuple[int, float]:
        """(tokens committed, milliseconds) of the cycle (tree, lookup) after p + 1 tokens were generated: as
        `loop.lookup_cycle` / `loop.tree_cycle` run it."""
        row, made = self.rows[p], p + 1
        proposal, matched = row["lookup"]
        proposal = proposal[: min(lookup, self.rec["max_new_tokens"] - made - 1)] if lookup else []
        if lookup and matched >= loop.LOOKUP_ALONE and proposal:  # verified alone, without a draft pass
            tokens, _, children = loop.token_tree((), [], proposal)
            return (self._accepted(made, children),
                    cycles.cost_at(self.costs, len(tokens) + 1) + cycles.bookkeeping_at(self.costs, 0))
        if "ranks" not in row:  # nothing left to draft: one row
            return 1, cycles.cost_at(self.costs, 1) + cycles.bookkeeping_at(self.costs, 0)
        depth = len(row["ranks"])
        paths = loop.build_tree(tree, row["probs"]) if tree else tuple((0,) * j for j in range(1, depth + 1))
        tokens, _, children = loop.token_tree(paths, row["ranks"], proposal[: loop.LOOKUP_BESIDE])
        ms = self.costs["draft"] + cycles.cost_at(self.costs, len(tokens) + 1) + cycles.bookkeeping_at(self.costs, tree)
        return self._accepted(made, children), ms

    def _accepted(self, made: int, children: dict[int, dict[int, int]]) -> int:
        """Tokens committed: the path the AR tokens follow down the tree, and the AR token after it."""
        accepted, node = 0, 0
        while made + accepted < self.n and (node := children.get(node, {}).get(self.truth[made + accepted])) is not None:
            accepted += 1
        return min(accepted + 1, self.n - made)

    def run(self, choose) -> tuple[float, list]:
        """(milliseconds, history) of the decode after its first token under `choose(p, history)` -> (tree, lookup),
        or None for an AR step; history: [(kind, tokens, ms)] of the cycles so far ("ar", "lookup", "drafted")."""
        p, spent, history = 0, 0.0, []
        while p < self.n - 1:
            pick = choose(p, history)
            if pick is None:
                tokens, ms, kind = 1, self.step, "ar"
            else:
                tokens, ms = self.cycle(p, *pick)
                kind = "lookup" if pick[1] and self.rows[p]["lookup"][1] >= loop.LOOKUP_ALONE else "drafted"
            history.append((kind, tokens, ms))
            spent, p = spent + ms, p + tokens
        return spent, history

    def oracle(self, candidates) -> float:
        """The least milliseconds any sequence of AR steps and candidates' cycles takes, every outcome known."""
        best = [0.0] * self.n
        for p in range(self.n - 2, -1, -1):
            options = [self.step + best[p + 1]]
            for tree, lookup in candidates:
                tokens, ms = self.cycle(p, tree, lookup)
                options.append(ms + best[p + tokens])
            best[p] = min(options)
        return best[0]

    def ar(self) -> float:
        return (self.n - 1) * self.step


def fixed(pick):
    return lambda p, history: pick


def fallback(pick, replay: Replay):
    """`pick`, going to AR for FALLBACK_STEPS steps whenever its last WINDOW drafted cycles (since it last went to
    AR) predict less than AR's speed; a lookup match long enough to be verified alone is verified all the same."""
    def choose(p, history):
        if pick[1] and replay.rows[p]["lookup"][1] >= loop.LOOKUP_ALONE:
            return pick
        drafted, since_ar = [], 0
        for kind, tokens, ms in reversed(history):
            if kind == "ar":
                if drafted:
                    break
                since_ar += 1
            elif kind == "drafted":
                drafted.append((tokens, ms))
        if 0 < since_ar < FALLBACK_STEPS:
            return None
        if since_ar == 0 and len(drafted) >= WINDOW:
            window = drafted[:WINDOW]
            if sum(t for t, _ in window) * replay.step < sum(ms for _, ms in window):
                return None
        return pick
    return choose


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--suite", default=str(paths.HELDOUT_PROMPTS))
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--check", type=int, default=2, help="prompts whose replay of the default is checked against a decode")
    ap.add_argument("--costs", default=None, help="a costs file (`~/.cache/lossless/cycles/costs-*.json`) to replay at, "
                                                  "instead of this CPU's cached costs: memory speed moves them by the hour")
    ap.add_argument("--records", default=None, help="a JSON file of the prompts' records: read where it exists (no "
                                                    "decoding; replayed on this CPU's costs), else written")
    args = ap.parse_args(argv)
    try:
        model = lossless.load_model(args.model, args.dtype, attn="exact")
        prompts = [encode_prompt(model.tokenizer, p["prompt"]) for p in read_prompts(args.suite)[: args.limit]]
        if not prompts:
            raise LosslessError(f"{args.suite}: no prompts")
        costs = cycles.cached_costs(model) if args.costs is None else json.loads(Path(args.costs).read_text())
        if not cycles.valid_costs(costs):
            raise LosslessError(f"{args.costs}: not a costs file of `lossless costs`")
    except (LosslessError, OSError, ValueError) as exc:
        print(f"cycle_policy: error: {exc}", file=sys.stderr)
        return 2
    candidates = list(cycles.CANDIDATES)
    names = ["ar", "default", "fallback"] + [cycles.label(*c) for c in candidates] + ["oracle"]
    speedups: dict[str, list[float]] = {name: [] for name in names}
    chosen = []
    kept = Path(args.records) if args.records else None
    held = json.loads(kept.read_text()) if kept is not None and kept.exists() else None
    records = held["records"] if held is not None else None
    if held is not None and (held["head"] != model.head_digest or [r["prompt"] for r in records] != prompts
                             or any(r["max_new_tokens"] != args.max_new_tokens for r in records)):
        print(f"cycle_policy: error: {kept} holds another head's records, or other prompts or lengths: give another "
              f"--records file", file=sys.stderr)
        return 2
    made = []
    for i, ids in enumerate(prompts):
        rec = records[i] if records is not None else record(model, ids, args.max_new_tokens)
        made.append({**rec, "prompt": ids})
        replay = Replay(rec, costs)
        if replay.n < 2:
            continue
        choice = (model.default_choice(context=len(ids)) if args.costs is None  # (the default at the given costs)
                  else cycles.choose(cycles.load_profile(model), costs, context=len(ids)))
        pick = None if choice.mode == "ar" else (choice.tree, choice.lookup)
        chosen.append(cycles.label(*pick) if pick else "AR")
        ar = replay.ar()
        if i < args.check and pick is not None:  # the replay against decoding itself
            state = lossless.decode(model, ids, "orthrus", lossless.DecodeConfig(
                max_new_tokens=args.max_new_tokens, tree=pick[0], lookup=pick[1]))
            replayed = [tokens for _, tokens, _ in replay.run(fixed(pick))[1]]
            decoded, done = [], 1  # tokens each cycle committed (a verify may accept drafts past EOS)
            for accepted in state.stats.accepted:
                decoded.append(min(accepted + 1, replay.n - done))
                done += decoded[-1]
            if state.generated != rec["truth"] or decoded != replayed:
                print(f"cycle_policy: error: prompt {i}: the replay committed {replayed} tokens a cycle, decoding "
                      f"{decoded}", file=sys.stderr)
                return 1
        speedups["ar"].append(1.0)
        speedups["default"].append(ar / replay.run(fixed(pick))[0])
        speedups["fallback"].append(ar / replay.run(fallback(pick, replay))[0] if pick else 1.0)
        for c in candidates:
            speedups[cycles.label(*c)].append(ar / replay.run(fixed(c))[0])
        speedups["oracle"].append(ar / replay.oracle(candidates))
        print(f"prompt {i}: {len(ids)} prompt tokens, {replay.n} new, default {speedups['default'][-1]:.2f}x, "
              f"fallback {speedups['fallback'][-1]:.2f}x, oracle {speedups['oracle'][-1]:.2f}x")
    if kept is not None and records is None:
        write_atomically(kept, json.dumps({"head": model.head_digest, "records": made}))
    summary = {}
    print(f"{args.model} {args.dtype} exact, {len(speedups['ar'])} prompts of {args.suite}, {args.max_new_tokens} tokens, "
          f"{'this CPU' if args.costs is None else args.costs}'s costs ({cycles._cost_words(costs)}, a step "
          f"{cycles.cost_at(costs, 1):.2f} ms, {costs.get('threads')} threads); the default chose "
          f"{dict(sorted(_count(chosen).items()))}")
    print(f"{'policy':24s} {'vs AR':>7s} {'95% CI':>15s} {'least':>6s} {'below 1':>8s}")
    for name in names:
        xs = speedups[name]
        boot = bootstrap_mean(xs)
        summary[name] = {"mean": round(boot["mean"], 3), "ci95": [round(x, 3) for x in boot["ci95"]],
                         "least": round(min(xs), 3), "below_1": sum(x < 0.9995 for x in xs)}
        s_ = summary[name]
        print(f"{name:24s} {s_['mean']:6.3f}x [{s_['ci95'][0]:.3f}, {s_['ci95'][1]:.3f}] {s_['least']:6.2f} "
              f"{s_['below_1']:4d}/{len(xs)}")
    print(json.dumps({"benchmark": "cycle_policy", "model": args.model, "dtype": args.dtype, "suite": args.suite,
                      "prompts": len(speedups["ar"]), "max_new_tokens": args.max_new_tokens, "window": WINDOW,
                      "costs": {"step_ms": cycles.cost_at(costs, 1), "rows": costs["rows"], "draft": costs["draft"]},
                      "fallback_steps": FALLBACK_STEPS, "policies": summary}))
    return 0


def _count(items):
    from collections import Counter

    return Counter(items)


if __name__ == "__main__":
    sys.exit(main())
