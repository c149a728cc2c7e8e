"""Prompts that training data must stay clear of: the evaluation sets and the shipped training prompts.

`reserved_prompts()` gathers, by name, every prompt text the project evaluates or trains on:

- "the audit suite": suites/default.jsonl;
- "the held-out prompts": data/heldout_prompts.jsonl (the speed benchmark);
- "the training prompts": data/train_prompts.jsonl;
- "the lossless_arith task" and "the lossless_capitals task": the questions of the local lm-eval tasks,
  test and few-shot items, as `lossless.evaluation.tasks` builds them.

A training prompt clashes with a set when its normalised text (`lossless.training.distill.normalise`) equals one
of the set's prompts, or, for the evaluation sets (all but the training prompts), when it contains one
of their prompts of `MIN_CONTAINED_CHARS` or more characters: a cheap guard against near-duplicates
that wrap an evaluation prompt in a few more words. `check_disjoint_all` raises on the first clash
(optionally skipping named sets); `reserved_filter` answers the same question one prompt at a time (the
prompt generator uses it).
"""

from __future__ import annotations

from typing import Callable, Collection

from ..evaluation import tasks as evaltasks

from .. import paths
from .distill import check_disjoint, normalise, read_prompts
from ..errors import LosslessError

TRAINING_SET = "the training prompts"
MIN_CONTAINED_CHARS = 40


def reserved_prompts() -> dict[str, list[str]]:
    """Every reserved prompt text, by the name of the set it belongs to."""
    arith = evaltasks.arith_items() + evaltasks.arith_items(evaltasks.FEWSHOT, seed=evaltasks.ARITH_SEED + 1)
    countries = [c for c, _ in evaltasks.CAPITALS + evaltasks.CAPITALS_SHOTS]
    def texts(path, what: str) -> list[str]:
        return [p["prompt"] for p in read_prompts(paths.require(path, what))]

    return {
        "the audit suite": texts(paths.DEFAULT_SUITE, "the default audit suite"),
        "the held-out prompts": texts(paths.HELDOUT_PROMPTS, "the held-out prompts"),
        TRAINING_SET: texts(paths.TRAIN_PROMPTS, "the training prompts"),
        "the lossless_arith task": [item["question"] for item in arith],
        "the lossless_capitals task": [f"What is the capital of {c}?" for c in countries],
    }


def _contained(reserved: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(normalised prompt, set name) of the evaluation prompts long enough for the containment guard."""
    return [(n, what) for what, texts in reserved.items() if what != TRAINING_SET
            for n in map(normalise, texts) if len(n) >= MIN_CONTAINED_CHARS]


def reserved_filter(reserved: dict[str, list[str]] | None = None) -> Callable[[str], str | None]:
    """A function of one prompt: the name of the reserved set it clashes with, or None."""
    reserved = reserved_prompts() if reserved is None else reserved
    exact: dict[str, str] = {}
    for what, texts in reserved.items():
        for text in texts:
            exact.setdefault(normalise(text), what)
    contained = _contained(reserved)

    def clash(prompt: str) -> str | None:
        n = normalise(prompt)
        if n in exact:
            return exact[n]
        return next((what for text, what in contained if text in n), None)

    return clash


def check_disjoint_all(prompts: list[str], skip: Collection[str] = ()) -> None:
    """Raise LosslessError, naming the set and one example, if any prompt clashes with a reserved set.

    `skip` names sets to leave out, such as the training prompts when `prompts` are those prompts.
    """
    reserved = {what: texts for what, texts in reserved_prompts().items() if what not in skip}
    for what, texts in reserved.items():
        check_disjoint(prompts, texts, what)
    norms = [normalise(p) for p in prompts]
    corpus = "\n".join(norms)  # one search per reserved text; normalised prompts hold no newlines
    for text, what in _contained(reserved):
        if text in corpus:
            hits = [n for n in norms if text in n]
            raise LosslessError(f"{len(hits)} training prompts contain a prompt of {what} (e.g. '{hits[0][:60]}'); "
                                "remove them from the training data")
