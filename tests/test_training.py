"""Draft-head training on tiny random models: the loss falls, the backbone stays frozen, the training
mask is the documented one, --resume is bit-for-bit, and DDP over 2 CPU processes works."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch

from conftest import tiny_orthrus
from lossless.dualview import block_visibility
from lossless.training import DistillLoss, TrainConfig, choose_anchors, step_rng, train


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
    loss0, n_pos = loss_fn(ids, n_prompt, anchors)
    assert n_pos > 0 and loss0.item() > 0
    loss0.backward()
    assert all(p.grad is None for p in model.backbone_parameters().values())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in head)
    opt.step()
    loss1, _ = loss_fn(ids, n_prompt, anchors)
    assert loss1.item() < loss0.item()
    for n, p in model.backbone_parameters().items():
        assert torch.equal(p, before[n]), n


def test_untrained_head_kl_is_not_zero_but_ce_option_runs():
    model = tiny_orthrus("llama", k=4)
    rec = synthetic_records(1)[0]
    ids = rec["prompt_ids"] + rec["response_ids"]
    anchors = [6, 10, 14]
    kl, _ = DistillLoss(model, 4, "kl")(ids, 6, anchors)
    ce, _ = DistillLoss(model, 4, "ce")(ids, 6, anchors)
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(Path(__file__).parent / "ddp_train_script.py"),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert torch.equal(r0["flat"], r1["flat"])
    assert (tmp_path / "head" / "head.safetensors").exists()
