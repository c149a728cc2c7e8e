"""Self-distillation responses on a tiny model: records that resume, split across processes, name their
set-up, and feed `lossless train --distill-dir`."""

import json

import pytest

from conftest import save_tiny_model_dir
from lossless.training import distill
from lossless.cli import main
from lossless.errors import LosslessError
from lossless.decoding.models import load_model
from lossless.study.records import read_records


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    model_dir = save_tiny_model_dir(root / "tiny", "llama")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": " ".join(f"w{(i * 7 + j) % 50 + 1}" for j in range(3 + i % 4))})
                               + "\n" for i in range(10)))
    return {"root": root, "model": str(model_dir), "prompts": prompts}


def test_responses_are_greedy_resume_and_split_by_shard(setup, tmp_path):
    model = load_model(setup["model"], "fp32", attn="sdpa", head="none", k=4)
    prompts = distill.read_prompts(setup["prompts"])
    whole = tmp_path / "whole"
    assert distill.generate_responses(model, prompts, whole, 6, batch_size=4, progress=False) == 10
    by_key = {r["key"]: r for r in read_records(whole, at_rest=True)}  # a finished run leaves segments only
    assert sorted(by_key) == sorted(p["id"] for p in prompts)
    # each response is the model's own greedy continuation of its prompt (batching and padding aside)
    for r in list(by_key.values())[:3]:
        ar = model.generate(r["prompt_ids"], "ar", max_new_tokens=6, chat_template=False).token_ids
        assert r["response_ids"] == ar[: len(r["response_ids"])]
    assert distill.generate_responses(model, prompts, whole, 6, progress=False) == 0  # nothing left to do
    split = tmp_path / "split"
    assert distill.generate_responses(model, prompts, split, 6, batch_size=4, progress=False, shard=(0, 2)) == 5
    assert distill.generate_responses(model, prompts, split, 6, batch_size=4, progress=False, shard=(1, 2)) == 5
    assert {r["key"] for r in read_records(split)} == set(by_key)


def test_a_directory_keeps_one_set_up(setup, tmp_path):
    d = tmp_path / "r"
    distill.open_distillation(d, setup["model"], "fp32", 8, setup["prompts"])
    distill.open_distillation(d, setup["model"], "fp32", 8, setup["prompts"])  # the same set-up reopens
    with pytest.raises(LosslessError, match="max_new_tokens"):
        distill.open_distillation(d, setup["model"], "fp32", 16, setup["prompts"])
    assert distill.check_source(d, setup["prompts"])["dtype"] == "fp32"
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "z", "prompt": "w3 w4"}) + "\n")
    with pytest.raises(LosslessError, match="another prompt file"):
        distill.check_source(d, other)


def test_distill_then_train_from_the_directory(setup, tmp_path, capsys):
    out = tmp_path / "data"
    common = ["--model", setup["model"], "--prompts", str(setup["prompts"])]
    assert main(["distill", *common, "--dtype", "fp32", "--out", str(out), "--max-new-tokens", "8", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["responses"] == 10 and summary["response_tokens"] > 10
    assert main(["train", *common, "--out", str(tmp_path / "head"), "--distill-dir", str(out), "--k", "4",
                 "--steps", "2", "--anchors", "4", "--seqs-per-step", "2", "--eval-prompts", "0", "--no-progress",
                 "--log", str(tmp_path / "log.jsonl")]) == 0
    assert (tmp_path / "head" / "head.json").exists()
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2


def test_train_scores_held_out_sequences_teacher_forced_and_refuses_its_own_prompts(setup, tmp_path, capsys):
    data, held = tmp_path / "data", tmp_path / "held"
    held_prompts = tmp_path / "held.jsonl"
    held_prompts.write_text("".join(json.dumps({"id": f"h{i}", "prompt": f"v{i} v{i + 3} v{2 * i}"}) + "\n"
                                    for i in range(4)))
    common = ["--model", setup["model"], "--dtype", "fp32", "--max-new-tokens", "10", "--no-progress"]
    assert main(["distill", *common, "--prompts", str(setup["prompts"]), "--out", str(data)]) == 0
    assert main(["distill", *common, "--prompts", str(held_prompts), "--out", str(held)]) == 0
    train = ["train", "--model", setup["model"], "--prompts", str(setup["prompts"]), "--distill-dir", str(data),
             "--k", "4", "--steps", "2", "--anchors", "3", "--seqs-per-step", "2", "--eval-prompts", "0",
             "--eval-every", "2", "--no-progress"]
    capsys.readouterr()
    assert main([*train, "--out", str(tmp_path / "h"), "--eval-distill-dir", str(held), "--eval-sequences", "3",
                 "--log", str(tmp_path / "log.jsonl")]) == 0
    last = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()][-1]
    assert 1.0 <= last["forced_tokens_per_cycle"] <= 4.0 and 0 < sum(last["forced_accepted"]) <= 9
    # the training responses themselves are not held out
    capsys.readouterr()
    assert main([*train, "--out", str(tmp_path / "h2"), "--eval-distill-dir", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert "also training prompts" in err and len(err.splitlines()) == 1
    assert main([*train, "--out", str(tmp_path / "h3"), "--eval-distill-dir", str(tmp_path / "none")]) == 2
    assert "lossless distill" in capsys.readouterr().err
