"""Draft-head training on tiny random models: the loss falls, the backbone stays frozen, the training
mask is the documented one, --resume is bit-for-bit, and DDP over 2 CPU processes works."""

import copy
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import NO_EOS, ar_reference, free_port, perturb_head, tiny_orthrus
from lossless.decoding.loop import DecodeConfig, decode
from lossless.decoding.dualview import block_visibility
from lossless.errors import LosslessError
from lossless.training.train import (DistillLoss, FrozenCast, TrainConfig, choose_anchors, position_weights, step_rng,
                               train)


def synthetic_records(n: int = 8, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(1, 60, (6,), generator=g).tolist(),
             "response_ids": torch.randint(1, 60, (24,), generator=g).tolist()} for _ in range(n)]


def test_block_visibility_matches_hand_drawn_example():
    # two blocks of k=3 at anchors 2 and 4 over a context of 5 AR keys
    got = block_visibility([2, 4], 3, 5).int().tolist()
    #          ctx: 0 1 2 3 4 | blk0 0 1 2 | blk1 0 1 2
    expected = [[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]] * 3
    assert got == expected


def test_one_step_lowers_the_loss_and_only_the_head_gets_gradients():
    model = tiny_orthrus("qwen3", k=4)
    before = copy.deepcopy({n: p.detach().clone() for n, p in model.backbone_parameters().items()})
    rec = synthetic_records(1)[0]
    ids, n_prompt = rec["prompt_ids"] + rec["response_ids"], len(rec["prompt_ids"])
    anchors = choose_anchors(step_rng(0, 0), n_prompt, len(ids), 8)
    loss_fn = DistillLoss(model, 4)
    head = list(model.head_parameters().values())
    opt = torch.optim.Adam(head, lr=1e-3)
    loss0, n_pos, _ = loss_fn(ids, n_prompt, anchors)
    assert n_pos > 0 and loss0.item() > 0
    loss0.backward()
    assert all(p.grad is None for p in model.backbone_parameters().values())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in head)
    opt.step()
    loss1, _, _ = loss_fn(ids, n_prompt, anchors)
    assert loss1.item() < loss0.item()
    for n, p in model.backbone_parameters().items():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_draft_attention_with_grouped_query_attention_in_the_kernel_equals_the_stock_path(family, monkeypatch):
    """The draft view's own SDPA call (grouped-query attention inside the kernel) gives the loss, the head's
    gradients and the draft logits that Hugging Face's SDPA path (keys/values copied per query head) gives."""
    from lossless.decoding import dualview

    model = tiny_orthrus(family, k=4)
    perturb_head(model)
    rec = synthetic_records(1)[0]
    ids, n_prompt = rec["prompt_ids"] + rec["response_ids"], len(rec["prompt_ids"])
    anchors = choose_anchors(step_rng(0, 0), n_prompt, len(ids), 6)
    cache, _ = model.prefill(ids[:12])
    results = []
    for kernels in (dualview.GQA_IN_KERNEL, ()):
        monkeypatch.setattr(dualview, "GQA_IN_KERNEL", kernels)
        loss, _, _ = DistillLoss(model, 4)(ids, n_prompt, anchors)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.head_parameters().items() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            results.append((loss.detach(), grads, model.draft(cache, ids[12], 4)))
    (loss_a, grads_a, draft_a), (loss_b, grads_b, draft_b) = results
    assert grads_a and grads_a.keys() == grads_b.keys()
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(draft_a, draft_b, rtol=1e-5, atol=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("anchors", [[5, 8, 11, 12, 17, 20, 26], [17, 5, 26, 8, 0]])
def test_draft_attention_in_chunks_of_blocks_equals_one_masked_attention(family, anchors):
    """The draft pass in chunks of 1, 2 or 3 blocks (each chunk's rows against the context keys they may see
    and their own rows), also with unsorted anchors and an anchor at 0 that sees no context: the loss, the
    agreement counts and the head's gradients of one masked attention over all rows."""
    model = tiny_orthrus(family, k=4)
    perturb_head(model)
    rec = synthetic_records(1)[0]
    ids = rec["prompt_ids"] + rec["response_ids"]
    results = []
    for blocks in (0, 1, 2, 3):
        loss, n_pos, agree = DistillLoss(model, 4, chunk_blocks=blocks)(ids, 6, anchors)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.head_parameters().items() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results.append((loss.detach(), n_pos, agree, grads))
    loss_a, n_a, agree_a, grads_a = results[0]
    assert grads_a and n_a > 0
    for loss_b, n_b, agree_b, grads_b in results[1:]:
        assert n_b == n_a and torch.equal(agree_b, agree_a) and grads_b.keys() == grads_a.keys()
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6)


def test_chunk_masks_cover_the_block_layout_and_bad_chunk_sizes_are_refused():
    from lossless.decoding.dualview import chunked_block_masks

    chunks = chunked_block_masks([2, 4, 7], 3, 2, torch.float32)
    assert [(a, b, n) for a, b, n, _ in chunks] == [(0, 6, 4), (6, 9, 7)]
    assert torch.equal(chunks[0][3][0, 0] == 0, block_visibility([2, 4], 3, 4))
    assert torch.equal(chunks[1][3][0, 0] == 0, block_visibility([7], 3, 7))
    with pytest.raises(LosslessError, match="chunk"):
        chunked_block_masks([2], 3, 0, torch.float32)


def test_untrained_head_kl_is_not_zero_but_ce_option_runs():
    model = tiny_orthrus("llama", k=4)
    rec = synthetic_records(1)[0]
    ids = rec["prompt_ids"] + rec["response_ids"]
    anchors = [6, 10, 14]
    kl, _, _ = DistillLoss(model, 4, "kl")(ids, 6, anchors)
    ce, _, _ = DistillLoss(model, 4, "ce")(ids, 6, anchors)
    assert kl.item() > 0 and ce.item() > 0


def test_resume_continues_bit_for_bit(tmp_path):
    cfg = dict(k=4, steps=6, lr=1e-3, warmup=2, seqs_per_step=2, anchors=4, save_every=3, eval_every=0)
    straight = tiny_orthrus("llama", k=4)
    train(straight, synthetic_records(), TrainConfig(out=str(tmp_path / "a"), **cfg), progress=False)
    interrupted = tiny_orthrus("llama", k=4)
    train(interrupted, synthetic_records(), TrainConfig(out=str(tmp_path / "b"), **cfg), progress=False, stop_at=3)
    resumed = tiny_orthrus("llama", k=4)
    summary = train(resumed, synthetic_records(), TrainConfig(out=str(tmp_path / "b"), **cfg), resume=True,
                    progress=False)
    assert summary["steps"] == 6 and [h["step"] for h in summary["history"]] == list(range(1, 7))
    for (n, p), (_, q) in zip(straight.head_parameters().items(), resumed.head_parameters().items()):
        assert torch.equal(p, q), n
    # the checkpoint's head is a usable head file
    fresh = tiny_orthrus("llama", k=4)
    fresh.load_head(tmp_path / "b")
    for (n, p), (_, q) in zip(resumed.head_parameters().items(), fresh.head_parameters().items()):
        assert torch.equal(p, q), n


def test_two_process_ddp_run_keeps_processes_in_sync(tmp_path):
    here = Path(__file__).parent  # the script imports this folder's tests and the conftest above it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--main_process_port", str(free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no", str(Path(__file__).parent / "ddp_train_script.py"),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert torch.equal(r0["flat"], r1["flat"])
    assert (tmp_path / "head" / "head.safetensors").exists()


def _head_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.head_parameters().items()}


def test_bf16_autocast_lowers_the_loss_and_keeps_the_backbone_bitwise_frozen_in_fp32(tmp_path):
    model = tiny_orthrus("qwen3", k=4)
    frozen = {n: p.detach().clone() for n, p in model.backbone_parameters().items()}
    records = synthetic_records(4)
    rec = records[0]
    ids, n_prompt = rec["prompt_ids"] + rec["response_ids"], len(rec["prompt_ids"])
    anchors = choose_anchors(step_rng(0, 0), n_prompt, len(ids), 8)
    before = DistillLoss(model, 4)(ids, n_prompt, anchors)[0].item()
    cfg = TrainConfig(out=str(tmp_path / "h"), k=4, steps=12, lr=3e-3, warmup=1, seqs_per_step=2, anchors=8,
                      save_every=0, eval_every=0, autocast="bf16")
    train(model, records, cfg, progress=False)
    after = DistillLoss(model, 4)(ids, n_prompt, anchors)[0].item()
    assert after < 0.9 * before, (before, after)
    for n, p in model.backbone_parameters().items():  # fp32 again after training, and untouched
        assert p.dtype == torch.float32 and torch.equal(p, frozen[n]), n
    assert all(p.dtype == torch.float32 for p in model.head_parameters().values())


def test_frozen_cast_runs_products_in_bf16_and_restores_the_fp32_weights():
    model = tiny_orthrus("llama", k=4)
    weight = model.backbone.model.layers[0].mlp.up_proj.weight
    cast = FrozenCast(model, torch.bfloat16)
    with cast.step():
        assert weight.dtype == torch.bfloat16
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    assert weight.dtype == torch.float32
    assert FrozenCast(model, None).params == []


def test_a_sigterm_mid_step_in_bf16_leaves_a_checkpoint_that_resumes_bit_for_bit(tmp_path, monkeypatch):
    cfg = dict(k=4, steps=6, lr=1e-3, warmup=2, seqs_per_step=3, anchors=4, save_every=0, eval_every=0,
               autocast="bf16")
    straight = tiny_orthrus("llama", k=4)
    train(straight, synthetic_records(), TrainConfig(out=str(tmp_path / "a"), **cfg), progress=False)

    calls = {"n": 0}
    forward = DistillLoss.forward

    def interrupted_forward(self, *args):
        calls["n"] += 1
        if calls["n"] == 3 * 3 + 2:  # the second sequence of step 4
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, *args)

    monkeypatch.setattr(DistillLoss, "forward", interrupted_forward)
    cut = tiny_orthrus("llama", k=4)
    with pytest.raises(KeyboardInterrupt):
        train(cut, synthetic_records(), TrainConfig(out=str(tmp_path / "b"), **cfg), progress=False)
    monkeypatch.setattr(DistillLoss, "forward", forward)
    state = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 3 and len(state["history"]) == 3
    assert all(p.dtype == torch.float32 for p in cut.backbone_parameters().values())
    resumed = tiny_orthrus("llama", k=4)
    summary = train(resumed, synthetic_records(), TrainConfig(out=str(tmp_path / "b"), **cfg), resume=True,
                    progress=False)
    assert summary["steps"] == 6
    for (n, p), (_, q) in zip(straight.head_parameters().items(), resumed.head_parameters().items()):
        assert torch.equal(p, q), n


def test_the_mask_embedding_has_its_own_learning_rate(tmp_path):
    model = tiny_orthrus("llama", k=4)
    before = _head_state(model)
    cfg = TrainConfig(out=str(tmp_path / "h"), k=4, steps=2, lr=1e-3, warmup=1, seqs_per_step=2, anchors=4,
                      save_every=0, eval_every=0, mask_lr_mult=0.0, autocast="off")
    train(model, synthetic_records(), cfg, progress=False)
    after = _head_state(model)
    assert torch.equal(before["mask_embedding"], after["mask_embedding"])
    assert any(not torch.equal(before[n], after[n]) for n in before if n != "mask_embedding")


def test_position_decay_weights_block_positions():
    model = tiny_orthrus("llama", k=4)
    rec = synthetic_records(1)[0]
    ids, n_prompt = rec["prompt_ids"] + rec["response_ids"], len(rec["prompt_ids"])
    anchors = [6, 10, 14, 20]
    losses = {d: DistillLoss(model, 4, weights=position_weights(4, d))(ids, n_prompt, anchors)[0].item()
              for d in (1.0, 1e-9, 1e9)}
    # decay -> 0 leaves position 0 alone, decay -> inf the last position: with an untrained head their KLs
    # differ, and the even weighting lies between them
    lo, hi = sorted((losses[1e-9], losses[1e9]))
    assert lo < losses[1.0] < hi
    # explicit weights: one-hot weights give each position's own loss, and their mean is the even weighting
    alone = [DistillLoss(model, 4, weights=position_weights(4, weights=w))(ids, n_prompt, anchors)[0].item()
             for w in ([1, 0, 0], [0, 1, 0], [0, 0, 1])]
    assert alone[0] == pytest.approx(losses[1e-9], rel=1e-5) and alone[2] == pytest.approx(losses[1e9], rel=1e-5)
    assert min(alone) < losses[1.0] < max(alone)
    with pytest.raises(LosslessError, match="position-decay"):
        position_weights(4, 0.0)
    for bad in ([1, 1], [0, 0, 0], [1, -1, 1]):
        with pytest.raises(LosslessError, match="position-weights"):
            position_weights(4, weights=bad)


def test_the_log_holds_tokens_positions_and_evaluations_and_publish_gets_the_best_head(tmp_path):
    model = tiny_orthrus("llama", k=4)
    cfg = TrainConfig(out=str(tmp_path / "h"), k=4, steps=4, lr=1e-3, warmup=1, seqs_per_step=2, anchors=4,
                      save_every=2, eval_every=2, eval_tokens=8, log=str(tmp_path / "log.jsonl"),
                      publish=str(tmp_path / "best"), autocast="off")
    train(model, synthetic_records(), cfg, heldout=[[1, 5, 9, 3]], progress=False)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert all(b["tokens"] > a["tokens"] and b["positions"] > a["positions"] for a, b in zip(log, log[1:]))
    assert "heldout_tokens_per_step" in log[1] and len(log[1]["agree"]) == 3
    assert sum(log[1]["heldout_accepted"]) > 0 and len(log[1]["heldout_accepted"]) == 4
    assert (tmp_path / "best" / "head.json").exists()  # the first evaluation always beats "none yet"


def test_the_learning_curve_fits_a_trend_and_predicts_ten_times_the_tokens(tmp_path):
    from lossless.training.curve import write_curve

    # a log whose tokens per cycle rises by 0.1 per decade of tokens: the fit must find slope 0.1
    history = []
    for step in range(1, 41):
        rec = {"step": step, "loss": 3.0 - step * 0.01, "lr": 1e-3, "tokens": step * 1000, "positions": step * 700}
        if step % 10 == 0:
            rec["heldout_tokens_per_step"] = 2.0 + 0.1 * math.log10(step * 1000)
            rec["agree"] = [0.8, 0.4, 0.1]
            rec["heldout_accepted"] = [10, 50, 30, 10]  # cycles accepting 0, 1, 2, 3 drafts
            rec["forced_tokens_per_cycle"] = 2.5 + step / 1000  # teacher-forced held-out score
        history.append(rec)
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in history))
    curves = write_curve([log], tmp_path / "out", ["run"])
    trend = curves["run"]["trend"]
    assert abs(trend["b"] - 0.1) < 1e-9 and abs(trend["a"] - 2.0) < 1e-9
    assert abs(trend["predicted_10x"] - (2.0 + 0.1 * math.log10(400_000))) < 1e-9
    assert (tmp_path / "out" / "learning_curve.png").stat().st_size > 1000
    table = (tmp_path / "out" / "learning_curve.md").read_text()
    assert "| 40 | 40,000 |" in table and "0.80 0.40 0.10" in table
    assert "| 0.90 0.40 0.10 |" in table  # at least 1, 2, 3 drafts accepted
    assert "| 2.540 | 0.90 0.40 0.10 |" in table  # the forced score beside it



def test_publish_leaves_a_head_that_is_already_there_unless_beaten(tmp_path):
    # the publish directory holds this very head: a run whose head does not change cannot beat it
    tiny_orthrus("llama", k=4).save_head(tmp_path / "pub")
    before = (tmp_path / "pub" / "head.json").read_text()
    model = tiny_orthrus("llama", k=4)
    perturb_head(model, 3.0)  # the model in training drafts worse than the published head ...
    own = {n: p.detach().clone() for n, p in model.head_parameters().items()}
    cfg = TrainConfig(out=str(tmp_path / "run"), k=4, steps=2, lr=0.0, warmup=1, seqs_per_step=2, anchors=4,
                      save_every=0, eval_every=2, eval_tokens=16, autocast="off", publish=str(tmp_path / "pub"))
    summary = train(model, synthetic_records(), cfg, heldout=[[1, 5, 9, 3], [7, 7, 2]], progress=False)
    # ... and measuring the published head did not leave it in the model (lr 0: nothing else moves it)
    assert all(torch.equal(p, own[n]) for n, p in model.head_parameters().items())
    from lossless.training.train import heldout_tokens_per_step

    ours = summary["history"][-1]["heldout_tokens_per_step"]
    theirs = round(heldout_tokens_per_step(tiny_orthrus("llama", k=4), [[1, 5, 9, 3], [7, 7, 2]], 16, 4), 4)
    assert ours < theirs
    assert (tmp_path / "pub" / "head.json").read_text() == before


def test_resume_on_a_new_machine_continues_from_the_head_this_run_published(tmp_path, capsys):
    cfg = dict(out=str(tmp_path / "run"), k=4, steps=6, lr=1e-3, warmup=1, seqs_per_step=2, anchors=4, save_every=0,
               eval_every=2, eval_tokens=8, autocast="off", log=str(tmp_path / "log.jsonl"),
               publish=str(tmp_path / "pub"))
    model = tiny_orthrus("llama", k=4)
    train(model, synthetic_records(), TrainConfig(**cfg), heldout=[[1, 5, 9, 3]], progress=False, stop_at=4)
    published = json.loads((tmp_path / "pub" / "head.json").read_text())["training"]["step"]
    (tmp_path / "run" / "checkpoint.pt").unlink()  # a new machine: the checkpoint stayed behind
    fresh = tiny_orthrus("llama", k=4)
    summary = train(fresh, synthetic_records(), TrainConfig(**cfg), heldout=[[1, 5, 9, 3]], resume=True, progress=False)
    assert "continuing from the head published at step" in capsys.readouterr().err
    steps = [h["step"] for h in summary["history"]]
    assert steps == list(range(1, 7)) and summary["steps"] == 6
    assert summary["history"][published]["tokens"] > summary["history"][published - 1]["tokens"]
    # a head published by another run (another log) is not a place to continue from
    (tmp_path / "run" / "checkpoint.pt").unlink()
    other = TrainConfig(**{**cfg, "log": str(tmp_path / "other.jsonl")})
    with pytest.raises(LosslessError, match="no head published by this run"):
        train(tiny_orthrus("llama", k=4), synthetic_records(), other, resume=True, progress=False)


def test_an_arm_from_init_head_starts_at_that_heads_step_and_matches_the_run_it_branches_from(tmp_path):
    cfg = dict(out=str(tmp_path / "run"), k=4, steps=6, lr=1e-3, warmup=1, seqs_per_step=2, anchors=4, save_every=0,
               eval_every=0, autocast="off", log=str(tmp_path / "log.jsonl"), publish=str(tmp_path / "pub"))
    model = tiny_orthrus("llama", k=4)
    train(model, synthetic_records(), TrainConfig(**cfg), progress=False, stop_at=3)
    model.save_head(tmp_path / "at3", training={"step": 3})
    (tmp_path / "run" / "checkpoint.pt").unlink()
    model.save_head(tmp_path / "pub", training={**cfg, "step": 3})  # as if the run had published at step 3
    # the run itself, continued from its published head (fresh optimiser) ...
    run = tiny_orthrus("llama", k=4)
    train(run, synthetic_records(), TrainConfig(**cfg), resume=True, progress=False)
    # ... and an arm with the same objective, started from the same head with --init-head
    arm = tiny_orthrus("llama", k=4)
    arm.load_head(tmp_path / "at3")
    arm_cfg = TrainConfig(**{**cfg, "out": str(tmp_path / "arm"), "log": "", "publish": "",
                             "init_head": str(tmp_path / "at3")})
    summary = train(arm, synthetic_records(), arm_cfg, progress=False)
    assert [h["step"] for h in summary["history"]] == [4, 5, 6]
    assert all(torch.equal(a, b) for a, b in zip(_head_state(run).values(), _head_state(arm).values()))
    # another objective from the same head trains another head
    other = tiny_orthrus("llama", k=4)
    other.load_head(tmp_path / "at3")
    train(other, synthetic_records(), TrainConfig(**{**cfg, "out": str(tmp_path / "other"), "log": "", "publish": "",
                                                     "init_head": str(tmp_path / "at3"),
                                                     "position_weights": [0.0, 1.0, 1.0]}), progress=False)
    assert not all(torch.equal(a, b) for a, b in zip(_head_state(run).values(), _head_state(other).values()))


def test_teacher_forced_acceptance_is_what_decoding_its_own_trajectory_accepts(family):
    # fp32: Orthrus decodes the AR trajectory; at the anchors its cycles start from, the teacher-forced
    # count of leading drafts equal to the AR argmax is the count decoding accepted, cycle by cycle
    from lossless.training.train import forced_accepted

    model = tiny_orthrus(family, k=4)
    perturb_head(model, 0.02)  # a head that is not the AR view's copy
    loss = DistillLoss(model, 4)
    seen = []
    for prompt in ([1, 5, 9, 3], [7, 7, 2, 8, 8], [30, 2, 44]):
        ref = ar_reference(model, prompt, 40)
        state = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=40, k=4, eos_ids=NO_EOS))
        assert state.generated == ref
        ids, anchors, a = prompt + ref, [], len(prompt)  # the first cycle drafts after the prefill's token
        for n in state.stats.accepted:
            anchors.append(a)
            a += n + 1
        full = [i for i, a in enumerate(anchors) if a <= len(ids) - 4 - 1]  # blocks and bonus token inside ids
        got = forced_accepted(loss, ids, [anchors[i] for i in full]).tolist()
        assert got == [state.stats.accepted[i] for i in full]
        seen += got
    assert len(set(seen)) >= 2  # the comparison saw cycles that accepted different numbers of drafts


def test_forced_blocks_are_fixed_full_blocks_and_score_tokens_per_cycle():
    from lossless.training.train import forced_accepted, forced_blocks, forced_eval

    records = synthetic_records(6) + [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}]  # too short for k=4
    for i, r in enumerate(records):
        r["key"] = f"p{5 - i}"  # key order is the reverse of list order
    blocks = forced_blocks(records, 10, k=4, anchors=5, seed=3)
    assert blocks == forced_blocks(records[::-1], 10, k=4, anchors=5, seed=3) and len(blocks) == 6
    records = records[:6][::-1]  # in key order
    assert [ids for ids, _ in forced_blocks(records, 2, k=4, anchors=5, seed=3)] == [
        records[i]["prompt_ids"] + records[i]["response_ids"] for i in (0, 3)]  # spread over the records
    for (ids, anchors), r in zip(blocks, records):
        assert len(anchors) == 5 and anchors == sorted(set(anchors))
        assert all(len(r["prompt_ids"]) <= a <= len(ids) - 4 for a in anchors)
    model = tiny_orthrus("llama", k=4)
    loss = DistillLoss(model, 4)
    mean, hist = forced_eval(loss, blocks)
    per_block = torch.cat([forced_accepted(loss, ids, anchors) for ids, anchors in blocks])
    assert hist == torch.bincount(per_block, minlength=4).tolist() and sum(hist) == 30
    assert mean == pytest.approx(float(per_block.float().mean()) + 1)


def test_a_run_with_held_out_sequences_logs_forced_scores_and_publishes_by_them(tmp_path):
    from lossless.training.train import FORCED, forced_blocks, forced_eval

    held = forced_blocks(synthetic_records(4, seed=1), 4, k=4, anchors=6)
    good, bad = tiny_orthrus("llama", k=4), tiny_orthrus("llama", k=4)  # the AR view's copy, and a noisy head
    perturb_head(bad, 3.0)
    good_score, bad_score = (round(forced_eval(DistillLoss(m, 4), held)[0], 4) for m in (good, bad))
    assert good_score > bad_score
    for trained, there, published in ((bad, good, False), (good, bad, True)):
        there.save_head(tmp_path / "pub")
        before = (tmp_path / "pub" / "head.json").read_text()
        cfg = TrainConfig(out=str(tmp_path / f"run{published}"), k=4, steps=2, lr=0.0, warmup=1, seqs_per_step=2,
                          anchors=4, save_every=0, eval_every=1, autocast="off", publish=str(tmp_path / "pub"))
        history = train(trained, synthetic_records(), cfg, forced=held, progress=False)["history"]
        # lr 0: every evaluation scores the trained head as it came, on the same 24 blocks; no decoding
        assert [h[FORCED] for h in history] == [good_score if published else bad_score] * 2
        assert all(sum(h["forced_accepted"]) == 24 and "heldout_tokens_per_step" not in h for h in history)
        assert ((tmp_path / "pub" / "head.json").read_text() != before) == published
