"""The self-distillation prompt corpus, data/distill_prompts.jsonl: size and balance over the audit's twelve
domains, record fields, uniqueness, disjointness from every reserved prompt set (lossless.training.reserved), and a
generator that rewrites the committed file byte for byte."""

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lossless.training.distill import normalise
from lossless.errors import LosslessError
from lossless.training.reserved import MIN_CONTAINED_CHARS, TRAINING_SET, check_disjoint_all, reserved_prompts

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "distill_prompts.jsonl"
GENERATOR = ROOT / "data" / "make_distill_prompts.py"
DOMAINS = {"code", "code_explanation", "math_word", "symbolic_math", "creative_writing", "poetry",
           "grammar_correction", "factual_qa", "advice", "translation", "summarisation", "instruction_following"}
RESERVED_SETS = {"the audit suite", "the held-out prompts", TRAINING_SET, "the lossless_arith task",
                 "the lossless_capitals task"}


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def reserved() -> dict[str, list[str]]:
    return reserved_prompts()


def test_corpus_is_large_and_covers_every_suite_domain(records):
    assert len(records) >= 10_000
    counts = Counter(r["domain"] for r in records)
    assert set(counts) == DOMAINS
    assert min(counts.values()) >= 800, counts
    suite_domains = {json.loads(line)["domain"] for line in (ROOT / "suites" / "default.jsonl").open(encoding="utf-8")}
    assert set(counts) == suite_domains


def test_records_have_unique_ids_a_source_and_a_licence(records):
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        assert set(r) == {"id", "domain", "prompt", "source", "licence"}, r["id"]
        assert r["source"].startswith(f"template:{r['domain']}/"), r["id"]
        assert r["licence"] == "MIT (this project's)", r["id"]
        assert r["prompt"].strip(), r["id"]


def test_no_two_prompts_are_equal_after_normalisation(records):
    counts = Counter(normalise(r["prompt"]) for r in records)
    repeated = [p for p, n in counts.items() if n > 1]
    assert not repeated, repeated[:3]


def test_corpus_is_disjoint_from_every_reserved_set(records, reserved):
    assert set(reserved) == RESERVED_SETS
    assert all(reserved.values())
    check_disjoint_all([r["prompt"] for r in records])


@pytest.mark.parametrize("what", sorted(RESERVED_SETS))
def test_a_planted_reserved_prompt_is_caught_despite_case_and_whitespace(records, reserved, what):
    planted = "  " + "\n ".join(reserved[what][0].swapcase().split()) + " \t"
    prompts = [r["prompt"] for r in records[:200]] + [planted]
    with pytest.raises(LosslessError, match=re.escape(f"appear in {what} ")) as err:
        check_disjoint_all(prompts)
    assert "\n" not in str(err.value)


def test_a_prompt_wrapping_a_long_evaluation_prompt_is_caught(records, reserved):
    inner = next(p for p in reserved["the held-out prompts"] if len(normalise(p)) >= MIN_CONTAINED_CHARS)
    prompts = [r["prompt"] for r in records[:200]] + [f"Please help with this. {inner} Thanks!"]
    with pytest.raises(LosslessError, match="contain a prompt of the held-out prompts") as err:
        check_disjoint_all(prompts)
    assert "\n" not in str(err.value)


def test_wrapping_a_training_prompt_is_allowed(reserved):
    inner = next(p for p in reserved[TRAINING_SET] if len(normalise(p)) >= MIN_CONTAINED_CHARS)
    check_disjoint_all([f"Please help with this. {inner} Thanks!"])


def test_skipped_sets_are_not_checked(reserved):
    prompts = [reserved["the held-out prompts"][0]]
    with pytest.raises(LosslessError, match="the held-out prompts"):
        check_disjoint_all(prompts)
    check_disjoint_all(prompts, skip={"the held-out prompts"})


def test_generator_rewrites_the_committed_file_byte_for_byte(tmp_path):
    out = tmp_path / "distill_prompts.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(GENERATOR), "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == CORPUS.read_bytes()
    assert "| all | 10,800 |" in done.stdout
