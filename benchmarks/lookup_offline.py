"""What prompt lookup could add, measured offline on a study's AR reference trajectories (no model forwards).

For every record of one configuration (default bf16/sdpa, the Orthrus candidate), this walks the reference
response cycle by cycle with the Orthrus chain's own acceptance counts (up to the first divergence, where
the two trajectories are still one) and asks, at each cycle start, what `lossless.decoding.loop.lookup_proposal`
would copy from the prompt (chat template applied, as the audit decodes it) and the response so far:

- how often the context's last 3 / 2 / 1 tokens occurred before, and how often the first copied token is right;
- how many copied tokens agree with the reference (capped by `--tokens`), against the chain's accepted drafts;
- tokens per cycle of the chain alone and of the chain with the lookup beside it, by domain;
- with `--datastore DIR` (a `lossless distill` directory: the model's own greedy responses to other prompts),
  what a retrieval drafter would add in the cycles without a 2+ token context match: from the last
  `--datastore-n` tokens, follow the datastore's most frequent next token while it follows at least half of
  that n-gram's occurrences (and at least twice), and count how often that beats the chain's accepted drafts.

It reads the token ids the records keep, so it costs seconds. The last stdout line is one JSON object.

    python benchmarks/lookup_offline.py results/full-study --config bf16/sdpa --tokens 16
    python benchmarks/lookup_offline.py results/full-study --datastore data/distill/smollm2-135m-bf16-128
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict

import lossless
from lossless.decoding.loop import LOOKUP_ALONE, lookup_proposal
from lossless.training.distill import load_records
from lossless.errors import LosslessError
from lossless.jsonio import read_jsonl
from lossless.study.records import read_records
from lossless.text import encode_prompt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a study directory with records/ and run.json (e.g. results/full-study)")
    ap.add_argument("--config", default="bf16/sdpa", help="dtype/attn of the records to read")
    ap.add_argument("--tokens", type=int, default=16, help="tokens a lookup copies at most")
    ap.add_argument("--model", default="smollm2-135m", help="the model whose tokenizer encodes the prompts")
    ap.add_argument("--datastore", help="a `lossless distill` directory whose responses a retrieval drafter reads")
    ap.add_argument("--datastore-n", type=int, default=3, help="n-gram length the retrieval drafter matches")
    args = ap.parse_args(argv)
    try:
        dtype, _, attn = args.config.partition("/")
        run = json.load(open(f"{args.run}/run.json"))
        suite = {row["id"]: row for row in read_jsonl(run["config"]["suite"], what="suite")}
        records = [r for r in read_records(args.run, at_rest=True)
                   if r["dtype"] == dtype and r["attn"] == attn and r.get("candidate", "orthrus") == "orthrus"]
        if not records:
            raise LosslessError(f"{args.run}: no orthrus records for {args.config}")
        tokenizer = lossless.load_model(args.model, "fp32", head="none").tokenizer
        datastore = None
        if args.datastore:
            responses = load_records(args.datastore)
            if not responses:
                raise LosslessError(f"--datastore {args.datastore}: no responses there (a `lossless distill` directory)")
            datastore = next_tokens(responses, args.datastore_n)
    except (LosslessError, OSError, KeyError) as exc:
        print(f"lookup_offline: error: {exc}", file=sys.stderr)
        return 2
    by_size = defaultdict(lambda: {"cycles": 0, "first_right": 0, "copied_right": 0, "gain": 0})
    by_domain = defaultdict(lambda: {"cycles": 0, "chain": 0, "with_lookup": 0})
    retrieval = Counter()
    for r in records:
        prompt = encode_prompt(tokenizer, suite[r["prompt_id"]]["prompt"], True)
        ref = r["ar_ids"]
        stop = r["first_divergence"] if r["first_divergence"] is not None else len(ref)
        i = 1  # the prefill commits the first token
        for a in r["accepted"]:
            if i + a + 1 > stop:
                break
            copy, size = lookup_proposal(prompt + ref[:i], args.tokens)
            right = agreeing(copy, ref, i)
            s, d = by_size[size], by_domain[r["domain"]]
            s["cycles"] += 1
            s["first_right"] += right > 0
            s["copied_right"] += right
            s["gain"] += max(a, right) - a
            if datastore is not None and size < LOOKUP_ALONE:
                found = retrieve(datastore, prompt + ref[:i], args.datastore_n, args.tokens)
                hit = agreeing(found, ref, i)
                retrieval.update(cycles=1, proposed=bool(found), first_right=hit > 0, beats_chain=hit > a,
                                 gain=max(a, hit) - a)
            d["cycles"] += 1
            d["chain"] += a + 1
            d["with_lookup"] += max(a, right) + 1
            i += a + 1
    total = sum(s["cycles"] for s in by_size.values())
    print(f"{args.run}: {len(records)} records ({args.config}), {total} chain cycles, lookups of up to {args.tokens} tokens")
    print(f"{'match':>10}{'cycles':>9}{'first right':>13}{'right copied':>14}{'gain/cycle':>12}")
    sizes = {}
    for size in sorted(by_size, reverse=True):
        s = by_size[size]
        row = {"share_of_cycles": s["cycles"] / total, "first_right": s["first_right"] / s["cycles"],
               "right_copied_per_cycle": s["copied_right"] / s["cycles"], "gain_per_cycle": s["gain"] / s["cycles"]}
        sizes[str(size)] = {k: round(v, 3) for k, v in row.items()}
        name = f"{size} tokens" if size else "none"
        print(f"{name:>10}{row['share_of_cycles']:>9.0%}{row['first_right']:>13.0%}{row['right_copied_per_cycle']:>14.2f}"
              f"{row['gain_per_cycle']:>12.2f}")
    print(f"{'domain':<24}{'chain tok/cycle':>16}{'+ lookup':>10}{'ratio':>8}")
    domains = {}
    for name in sorted(by_domain) + ["all"]:
        d = by_domain[name] if name != "all" else {
            k: sum(v[k] for v in by_domain.values()) for k in ("cycles", "chain", "with_lookup")}
        chain, both = d["chain"] / d["cycles"], d["with_lookup"] / d["cycles"]
        domains[name] = {"chain": round(chain, 3), "with_lookup": round(both, 3)}
        print(f"{name:<24}{chain:>16.2f}{both:>10.2f}{both / chain:>8.2f}")
    out = {"run": args.run, "config": args.config, "tokens": args.tokens, "records": len(records),
           "cycles": total, "by_match": sizes, "by_domain": domains}
    if datastore is not None:
        n = max(retrieval["cycles"], 1)
        out["datastore"] = {"cycles_without_context_match": retrieval["cycles"],
                            "proposes": round(retrieval["proposed"] / n, 3),
                            "first_right_when_proposed": round(retrieval["first_right"] / max(retrieval["proposed"], 1), 3),
                            "beats_chain": round(retrieval["beats_chain"] / n, 3),
                            "gain_per_cycle": round(retrieval["gain"] / total, 3)}
        print(f"datastore ({args.datastore_n}-grams of {args.datastore}), in the {retrieval['cycles']} cycles without a "
              f"{LOOKUP_ALONE}+ token context match: proposes in {out['datastore']['proposes']:.0%}, first token right in "
              f"{out['datastore']['first_right_when_proposed']:.0%} of those, beats the chain's accepted drafts in "
              f"{out['datastore']['beats_chain']:.0%}; +{out['datastore']['gain_per_cycle']:.3f} tokens per cycle over all cycles")
    print(json.dumps(out))
    return 0


def next_tokens(records: list[dict], n: int) -> dict[tuple[int, ...], Counter]:
    """n-gram of a response -> how often each token followed it, over every response."""
    table: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for r in records:
        ids = r["response_ids"]
        for j in range(n, len(ids)):
            table[tuple(ids[j - n:j])][ids[j]] += 1
    return table


def retrieve(table: dict[tuple[int, ...], Counter], context: list[int], n: int, limit: int) -> list[int]:
    """Follow the most frequent next token from the context's last n tokens while it is the choice of at least
    half of the n-gram's occurrences (and seen twice)."""
    out, ctx = [], list(context[-n:])
    while len(out) < limit and (seen := table.get(tuple(ctx[-n:]))):
        token, count = seen.most_common(1)[0]
        if count < 2 or 2 * count < sum(seen.values()):
            break
        out.append(token)
        ctx.append(token)
    return out


def agreeing(proposal: list[int], ref: list[int], i: int) -> int:
    """How many leading tokens of `proposal` equal the reference from position i."""
    right = 0
    while right < len(proposal) and i + right < len(ref) and proposal[right] == ref[i + right]:
        right += 1
    return right


if __name__ == "__main__":
    sys.exit(main())
