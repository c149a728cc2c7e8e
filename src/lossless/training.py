"""Training the draft head by distillation from the frozen AR view.

Per training sequence (prompt + the model's own greedy response):
1. teacher: one AR pass without gradients gives every layer's keys/values and the teacher logits;
2. draft: `anchors` blocks `[x_a, MASK x (k-1)]` at random anchor positions a in the response run in one
   draft-view pass; each block attends to AR keys strictly before its anchor and bidirectionally to
   itself (`dualview.block_visibility`);
3. loss: forward KL(p_AR || q_draft) (or cross-entropy on the teacher's argmax) at block positions
   0..k-2, whose targets are the AR distributions at positions a..a+k-2.

Only head parameters train; the backbone is frozen. Step s draws its sequences and anchors from an RNG
seeded by (seed, s), so `--resume` continues bit for bit from a checkpoint. Runs under
`accelerate launch` (DDP; gloo on CPU): each process takes its share of a step's sequences.

This module does not generate the distillation data (see `distill.py`) or parse arguments.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .dualview import DraftSpec, additive_mask, block_visibility
from .errors import LosslessError
from .jsonio import atomic_write
from .model import OrthrusLM

CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"
    out: str = "heads/my-head"
    k: int = 8
    steps: int = 1000
    lr: float = 3e-4
    warmup: int = 50
    loss: str = "kl"  # "kl" | "ce"
    seed: int = 0
    seqs_per_step: int = 4
    anchors: int = 16
    save_every: int = 100
    eval_every: int = 200
    eval_prompts: int = 4
    eval_tokens: int = 64
    dtype: str = "fp32"
    encoding: str = "full"
    data: list[str] = field(default_factory=list)
    prompts: str = ""
    max_new_tokens: int = 128
    distill_batch: int = 16


def step_rng(seed: int, step: int, slot: int = 0) -> random.Random:
    """The RNG of one (step, slot): deterministic, so a resumed run draws what the original would."""
    return random.Random(f"{seed}:{step}:{slot}")


class DistillLoss(nn.Module):
    """Wraps an OrthrusLM so DDP sees one module whose forward returns the loss of one sequence."""

    def __init__(self, model: OrthrusLM, k: int, loss: str = "kl"):
        super().__init__()
        if loss not in ("kl", "ce"):
            raise LosslessError(f"unknown loss '{loss}': choose kl or ce")
        self.model, self.k, self.loss = model, k, loss

    def forward(self, ids: list[int], n_prompt: int, anchors: list[int]) -> tuple[torch.Tensor, int]:
        """Loss (mean over valid block positions) and number of positions, for one sequence."""
        m, k = self.model, self.k
        device = m.device
        seq = torch.tensor([ids], device=device)
        length = len(ids)
        # 1. teacher: AR view without gradients; keys/values of every layer + logits
        with torch.no_grad():
            cache = m.new_cache()
            teacher_logits = m._lm_forward(seq, 0, cache).float()  # [L, V]
            context = [(layer.keys, layer.values) for layer in cache.layers]
        # 2. draft view over all blocks in one pass
        anchor_t = torch.tensor(anchors, device=device)
        embeds = m.block_embeddings(seq[0, anchor_t], k)  # [1, n*k, d]
        positions = (anchor_t[:, None] + torch.arange(k, device=device)).reshape(1, -1)
        mask = additive_mask(block_visibility(anchors, k, length), m.dtype).to(device)
        draft_logits = m.draft_hidden(embeds, positions, spec=DraftSpec(context_mask=mask, context=context))
        draft_logits = draft_logits.float().view(len(anchors), k, -1)[:, : k - 1]  # [n, k-1, V]
        # 3. targets: teacher rows a..a+k-2, kept where the target token lies inside the sequence
        target_pos = anchor_t[:, None] + torch.arange(k - 1, device=device)  # [n, k-1]
        valid = target_pos <= length - 2
        q_logp = F.log_softmax(draft_logits[valid], dim=-1)
        p_logits = teacher_logits[target_pos[valid]]
        if self.loss == "kl":
            p_logp = F.log_softmax(p_logits, dim=-1)
            loss = (p_logp.exp() * (p_logp - q_logp)).sum(-1).mean()
        else:
            loss = F.nll_loss(q_logp, p_logits.argmax(-1))
        return loss, int(valid.sum())


def choose_anchors(rng: random.Random, n_prompt: int, length: int, n: int) -> list[int]:
    """Up to n distinct anchors in the response: a in [n_prompt - 1, length - 2]."""
    lo, hi = max(n_prompt - 1, 0), length - 2
    if hi < lo:
        return []
    pool = list(range(lo, hi + 1))
    return sorted(rng.sample(pool, min(n, len(pool))))


def lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


@torch.no_grad()
def heldout_tokens_per_step(model: OrthrusLM, prompt_ids: list[list[int]], max_new_tokens: int, k: int) -> float:
    """Mean tokens per draft+verify cycle of greedy Orthrus over held-out prompts."""
    from .decoding import DecodeConfig, decode

    committed, steps = 0, 0
    for ids in prompt_ids:
        state = decode(model, ids, "orthrus", DecodeConfig(max_new_tokens=max_new_tokens, k=k))
        committed += len(state.generated) - 1
        steps += state.stats.steps
    return committed / max(steps, 1)


def train(model: OrthrusLM, records: list[dict], cfg: TrainConfig, heldout: list[list[int]] | None = None,
          resume: bool = False, accelerator=None, progress: bool = True, stop_at: int | None = None) -> dict:
    """Train `model`'s head on distillation `records` ({"prompt_ids", "response_ids"}). Returns a summary.

    stop_at: leave after this step with a checkpoint (the schedule still spans cfg.steps), e.g. to
    time-box a session and `--resume` later."""
    from accelerate import Accelerator

    accelerator = accelerator or Accelerator(cpu=model.device.type == "cpu")
    out = Path(cfg.out)
    torch.manual_seed(cfg.seed)
    sequences = [(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])) for r in records
                 if len(r["response_ids"]) >= 2]
    if not sequences:
        raise LosslessError("no training sequences: the data holds no responses of 2 or more tokens")
    head_params = list(model.head_parameters().values())
    for p in model.backbone_parameters().values():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(head_params, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    history: list[dict] = []
    start_step = 0
    ckpt_path = out / CHECKPOINT
    if resume:
        if not ckpt_path.exists():
            raise LosslessError(f"--resume: no checkpoint at {ckpt_path}; start without --resume")
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        with torch.no_grad():
            for name, p in model.head_parameters().items():
                p.copy_(state["head"][name])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step, history = state["step"], state["history"]
    loss_module = DistillLoss(model, cfg.k, cfg.loss)
    ddp, optimizer = accelerator.prepare(loss_module, optimizer)
    world, rank = accelerator.num_processes, accelerator.process_index

    def save(step: int) -> None:
        if not accelerator.is_main_process:
            return
        out.mkdir(parents=True, exist_ok=True)
        state = {"step": step, "head": {n: p.detach().cpu().clone() for n, p in model.head_parameters().items()},
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "config": asdict(cfg), "history": history}
        tmp = out / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        tmp.replace(ckpt_path)
        model.save_head(out, training={**asdict(cfg), "step": step, "history": history[-5:]}, encoding=cfg.encoding)

    bar = tqdm(total=cfg.steps, initial=start_step, desc="train head", unit="step",
               disable=not (progress and accelerator.is_main_process))
    step = start_step
    t0, tokens = time.perf_counter(), 0
    try:
        while step < min(cfg.steps, stop_at or cfg.steps):
            rng = step_rng(cfg.seed, step)
            picks = [rng.randrange(len(sequences)) for _ in range(cfg.seqs_per_step)]
            mine = picks[rank::world]
            total_loss, total_pos = 0.0, 0
            optimizer.zero_grad(set_to_none=True)
            for j, idx in enumerate(mine):
                ids, n_prompt = sequences[idx]
                anchors = choose_anchors(step_rng(cfg.seed, step, j * world + rank + 1), n_prompt, len(ids), cfg.anchors)
                sync = contextlib.nullcontext() if j == len(mine) - 1 else accelerator.no_sync(ddp)
                with sync:
                    loss, n_pos = ddp(ids, n_prompt, anchors)
                    accelerator.backward(loss / len(mine))
                total_loss += float(loss.detach()) / len(mine)
                total_pos += n_pos
                tokens += len(ids)
            optimizer.step()
            scheduler.step()
            step += 1
            record = {"step": step, "loss": round(total_loss, 5), "lr": scheduler.get_last_lr()[0]}
            if heldout and cfg.eval_every and step % cfg.eval_every == 0 and accelerator.is_main_process:
                model.eval()
                record["heldout_tokens_per_step"] = round(
                    heldout_tokens_per_step(model, heldout, cfg.eval_tokens, cfg.k), 4)
            history.append(record)
            elapsed = time.perf_counter() - t0
            bar.set_postfix(loss=f"{total_loss:.4f}", tok_s=f"{tokens * world / max(elapsed, 1e-9):.0f}",
                            **({"tps": record["heldout_tokens_per_step"]} if "heldout_tokens_per_step" in record else {}))
            bar.update(1)
            if cfg.save_every and step % cfg.save_every == 0:
                save(step)
    except KeyboardInterrupt:
        save(step)  # Ctrl-C leaves a usable checkpoint and head
        bar.close()
        raise
    bar.close()
    save(step)
    accelerator.wait_for_everyone()
    return {"steps": step, "history": history, "seconds": time.perf_counter() - t0,
            "tokens": tokens * world, "out": str(out)}


def write_summary(out: str | Path, summary: dict) -> None:
    atomic_write(Path(out, "train_summary.json"), json.dumps(summary, indent=2) + "\n")
