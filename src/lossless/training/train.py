"""Training the draft head by distillation from the frozen AR view.

Per training sequence (prompt + the model's own greedy response):
1. teacher: one AR pass without gradients gives every layer's keys/values, and the teacher logits on
   the rows some block needs;
2. draft: `anchors` blocks `[x_a, MASK x (k-1)]` at random anchor positions a in the response run in one
   draft-view pass; each block attends to AR keys strictly before its anchor and bidirectionally to
   itself (`dualview.block_visibility`);
3. loss: forward KL(p_AR || q_draft) (or cross-entropy on the teacher's argmax) at block positions
   0..k-2, whose targets are the AR distributions at positions a..a+k-2, weighted `position_decay`^j at
   block position j (1 = all alike), or by explicit `position_weights` (0,1,1,..: a head for the fused
   cycle, whose drafts start at block position 1). The LM head runs only on rows whose logits the loss uses.

Mixed precision (`autocast="bf16"`, the default where the CPU multiplies bf16 natively, or on CUDA):
the frozen backbone's weights are swapped for bf16 copies made once (no per-call casts), the head's
weights and optimiser state stay fp32, and products run in bf16 under `torch.autocast`. Outside a
step (evaluation, saving) the model is whole fp32 again.

Only head parameters train; the backbone is frozen. Step s draws its sequences and anchors from an RNG
seeded by (seed, s), so `--resume` continues bit for bit from a checkpoint (also after a step that a
Ctrl-C or SIGTERM cut short: the checkpoint holds the last finished step). Runs under `accelerate
launch` (DDP; gloo on CPU): each process takes its share of a step's sequences.

The history (one record per step: loss, lr, tokens and positions seen, held-out tokens per cycle at
evaluations, top-1 agreement by block position) is written to `log` at every save. `publish`, if set,
receives the head whenever held-out tokens per cycle beats every earlier evaluation and the head
already there (measured on the same prompts when training starts): teacher-forced on fixed blocks of
held-out sequences when the run has them (`forced_eval`: low noise, paired), else by decoding held-out
prompts.

This module does not generate the distillation data (see `distill.py`) or parse arguments.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..decoding.dualview import DraftSpec, additive_mask, block_visibility, chunked_block_masks
from ..errors import LosslessError, not_utf8
from ..jsonio import jsonl_text, read_jsonl
from ..decoding.model import OrthrusLM
from ..paths import check_writable_dir, write_atomically

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
    eval_distill: str = ""  # responses to held-out prompts (a `lossless distill` directory) for teacher-forced scores
    eval_sequences: int = 64  # how many of them each evaluation scores, at `anchors` fixed blocks each
    dtype: str = "fp32"
    encoding: str = "full"
    data: list[str] = field(default_factory=list)
    prompts: str = ""
    max_new_tokens: int = 128
    distill_batch: int = 16
    autocast: str = "auto"  # "auto" | "bf16" | "off"
    position_decay: float = 1.0  # loss weight of block position j is position_decay**j
    position_weights: list[float] = field(default_factory=list)  # explicit weights of block positions 0..k-2
    mask_lr_mult: float = 1.0  # the mask embedding's learning rate, as a multiple of lr
    log: str = ""  # JSONL training log, rewritten at every save
    publish: str = ""  # head directory written whenever held-out tokens per cycle improves (forced, else decoded)
    init_head: str = ""  # start from this head's weights at its training step (fresh optimiser), e.g. an arm
    draft_adapter: int = 0  # rank of draft-only MLP adapters to train with the head (0: none)
    adapter_lr_mult: float = 1.0  # the draft adapters' learning rate, as a multiple of lr


# (field, least value, whether the value must exceed it): what a run can be made of
_LIMITS = (("k", 2, False), ("steps", 1, False), ("lr", 0, False), ("warmup", 0, False), ("seqs_per_step", 1, False),
           ("anchors", 1, False), ("save_every", 0, False), ("eval_every", 0, False), ("eval_prompts", 0, False),
           ("eval_tokens", 1, False), ("eval_sequences", 1, False), ("max_new_tokens", 1, False),
           ("distill_batch", 1, False), ("position_decay", 0, True), ("mask_lr_mult", 0, False),
           ("draft_adapter", 0, False), ("adapter_lr_mult", 0, False))


def check_config(cfg: TrainConfig) -> None:
    """Refuse a configuration that cannot train a head (no steps, no sequences, a NaN or negative learning
    rate, ...) before anything loads or is written. The option named is the CLI's."""
    for name, least, strict in _LIMITS:
        value = getattr(cfg, name)
        option = "--" + name.replace("_", "-")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < least or (strict and value == least):
            raise LosslessError(f"{option} must be {'>' if strict else '>='} {least}, got {value}")
    if cfg.loss not in ("kl", "ce"):
        raise LosslessError(f"unknown loss '{cfg.loss}': choose kl or ce")
    if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in cfg.position_weights):
        raise LosslessError("--position-weights must be finite numbers")


def check_outputs(cfg: TrainConfig, distill_dir: str | Path | None = None) -> None:
    """Every place a run writes (its --out, --publish, --log's directory, the responses' directory), checked
    writable before any work, so a read-only or full disk is refused now rather than at the first save."""
    if cfg.log and Path(cfg.log).is_dir():
        raise LosslessError(f"--log {cfg.log} is a directory: give a file name, e.g. {Path(cfg.log) / 'train_log.jsonl'}")
    check_writable_dir(cfg.out)
    if cfg.publish:
        check_writable_dir(cfg.publish, "--publish")
    if cfg.log:
        check_writable_dir(Path(cfg.log).parent, "--log")
    if distill_dir is not None:
        check_writable_dir(distill_dir, "$LOSSLESS_CACHE")


CHECKPOINT_KEYS = ("step", "head", "optimizer", "scheduler", "history")


def _corrupt_checkpoint(path: Path, why: str) -> LosslessError:
    return LosslessError(f"corrupt checkpoint {path} ({why}): delete it to continue from the published head "
                         "(--publish), or start the run anew")


def check_checkpoint(path: str | Path) -> None:
    """Refuse a truncated or foreign checkpoint file cheaply (its archive's CRCs), without unpickling it."""
    import zipfile

    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise _corrupt_checkpoint(path, str(exc) or type(exc).__name__) from None
    if bad is not None:
        raise _corrupt_checkpoint(path, f"{bad} fails its checksum")


def read_checkpoint(path: str | Path) -> dict:
    """A training checkpoint, or a one-line error naming it when it is truncated or not one."""
    path = Path(path)
    check_checkpoint(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for a torn file
        raise _corrupt_checkpoint(path, str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__) from None
    if not isinstance(state, dict) or any(k not in state for k in CHECKPOINT_KEYS):
        raise _corrupt_checkpoint(path, "not a `lossless train` checkpoint")
    return state


def check_resume(cfg: TrainConfig) -> None:
    """`--resume` has something to continue from: a readable checkpoint, else a head this run published."""
    ckpt = Path(cfg.out) / CHECKPOINT
    if ckpt.exists():
        check_checkpoint(ckpt)
    else:
        _published_step(cfg)


def position_weights(k: int, decay: float = 1.0, weights: list[float] | tuple = ()) -> torch.Tensor:
    """Loss weight of each block position 0..k-2: `weights` when given (e.g. 0,1,1,.. for the fused cycle,
    whose drafts start at block position 1), else decay**j."""
    if weights:
        if len(weights) != k - 1:
            raise LosslessError(f"--position-weights gives {len(weights)} weights; a k={k} block has {k - 1} "
                                "positions with a target")
        if min(weights) < 0 or sum(weights) <= 0:
            raise LosslessError("--position-weights must be >= 0 with a positive sum")
        return torch.tensor([float(w) for w in weights], dtype=torch.float32)
    if not decay > 0:
        raise LosslessError(f"--position-decay must be > 0, got {decay}")
    return decay ** torch.arange(k - 1, dtype=torch.float32)


AUTOCAST = ("auto", "bf16", "off")


def resolve_autocast(choice: str, device: torch.device) -> torch.dtype | None:
    """The dtype products run in during training steps (None: the model's own)."""
    from ..decoding.exact import cpu_multiplies_natively

    if choice not in AUTOCAST:
        raise LosslessError(f"unknown --autocast '{choice}': choose one of {', '.join(AUTOCAST)}")
    if choice == "off":
        return None
    if choice == "bf16" or device.type == "cuda" or cpu_multiplies_natively(torch.bfloat16):
        return torch.bfloat16
    return None  # auto on a CPU that emulates bf16: fp32 is faster there


class StopFlag:
    """Set by Ctrl-C or SIGTERM while training: the loop stops between sequences, never inside an update."""

    requested = False


@contextlib.contextmanager
def stop_between_steps():
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def request(signum, frame):
        flag.requested = True

    previous = {s: signal.signal(s, request) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class FrozenCast:
    """The frozen backbone's weights in a lower precision during training steps, fp32 outside them.

    Copies are made once; entering swaps each frozen parameter's storage for its copy (no copy per step
    or per call), leaving restores the originals, so evaluation, saving and the head's int8 deltas see the
    exact fp32 backbone."""

    def __init__(self, model: OrthrusLM, dtype: torch.dtype | None):
        self.dtype = dtype
        frozen = model.backbone_parameters().values() if dtype is not None else []
        self.params = [p for p in frozen if p.is_floating_point() and p.dtype != dtype]
        self.copies = [p.detach().to(dtype) for p in self.params]
        self.originals: list[torch.Tensor] = []

    @contextlib.contextmanager
    def step(self):
        if self.dtype is None:
            yield
            return
        self.originals = [p.data for p in self.params]
        for p, c in zip(self.params, self.copies):
            p.data = c
        try:
            with torch.autocast(self.params[0].device.type if self.params else "cpu", dtype=self.dtype):
                yield
        finally:
            for p, o in zip(self.params, self.originals):
                p.data = o
            self.originals = []



def step_rng(seed: int, step: int, slot: int = 0) -> random.Random:
    """The RNG of one (step, slot): deterministic, so a resumed run draws what the original would."""
    return random.Random(f"{seed}:{step}:{slot}")


# The draft pass attends in chunks of this many blocks (anchors sorted): each chunk's rows are scored against
# the context keys they may see and their own rows only, not all rows (0: one masked attention over all).
# Measured side by side (bf16 autocast, 4 sequences of 220 tokens, 1 thread, 2-core AVX-512 CPU,
# results/head-training/train_throughput_chunks.txt): 64 blocks per sequence 29.3 s/step in one attention,
# 25.5 / 25.3 / 24.9 s in chunks of 4 / 8 / 16 blocks; 32 blocks 14.4 s either way.
CHUNK_BLOCKS = 16


class DistillLoss(nn.Module):
    """Wraps an OrthrusLM so DDP sees one module whose forward returns the loss of one sequence."""

    def __init__(self, model: OrthrusLM, k: int, loss: str = "kl", weights: torch.Tensor | None = None,
                 chunk_blocks: int = CHUNK_BLOCKS):
        super().__init__()
        if loss not in ("kl", "ce"):
            raise LosslessError(f"unknown loss '{loss}': choose kl or ce")
        self.model, self.k, self.loss, self.chunk_blocks = model, k, loss, chunk_blocks
        self.register_buffer("weights", position_weights(k) if weights is None else weights, persistent=False)

    def block_logits(self, ids: list[int], anchors: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher and draft logits of one sequence's blocks: (AR logits [P, V] without gradients, draft
        log-probabilities [P, V], valid [n, k-1] (the target lies inside the sequence), block position of each
        of the P valid rows)."""
        m, k = self.model, self.k
        device = m.device
        seq = torch.tensor([ids], device=device)
        length = len(ids)
        anchor_t = torch.tensor(anchors, device=device)
        target_pos = anchor_t[:, None] + torch.arange(k - 1, device=device)  # [n, k-1]
        valid = target_pos <= length - 2  # the target token lies inside the sequence
        rows = target_pos[valid]
        # 1. teacher: AR view without gradients; keys/values of every layer, logits on target rows only
        with torch.no_grad():
            cache = m.new_cache()
            out = m.backbone.model(input_ids=seq, position_ids=torch.arange(length, device=device)[None],
                                   cache=cache, use_cache=True)
            p_logits = m.backbone.lm_head(out.last_hidden_state[0, rows]).float()  # [P, V]
            context = [(layer.keys, layer.values) for layer in cache.layers]
        # 2. draft view over all blocks in one pass; the LM head on the rows with a target only
        embeds = m.block_embeddings(seq[0, anchor_t], k)  # [1, n*k, d]
        positions = (anchor_t[:, None] + torch.arange(k, device=device)).reshape(1, -1)
        if self.chunk_blocks:
            spec = DraftSpec(chunks=chunked_block_masks(anchors, k, self.chunk_blocks, m.dtype, device), context=context)
        else:
            spec = DraftSpec(context_mask=additive_mask(block_visibility(anchors, k, length), m.dtype).to(device),
                             context=context)
        hidden = m.draft_states(embeds, positions, spec=spec)
        hidden = hidden.view(len(anchors), k, -1)[:, : k - 1][valid]  # [P, d]
        q_logp = F.log_softmax(m.draft_logits(hidden).float(), dim=-1)
        slot = torch.arange(k - 1, device=device).expand_as(target_pos)[valid]
        return p_logits, q_logp, valid, slot

    def forward(self, ids: list[int], n_prompt: int, anchors: list[int]) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Loss (weighted mean over valid block positions), number of positions, and per block position
        [2, k-1] the count of positions whose draft argmax equals the teacher's, and of positions."""
        k, device = self.k, self.model.device
        p_logits, q_logp, valid, slot = self.block_logits(ids, anchors)
        # 3. loss per position, weighted by block position
        if self.loss == "kl":
            per = F.kl_div(q_logp, F.log_softmax(p_logits, dim=-1), log_target=True, reduction="none").sum(-1)
        else:
            per = F.nll_loss(q_logp, p_logits.argmax(-1), reduction="none")
        w = self.weights[slot]
        loss = (per * w).sum() / w.sum().clamp(min=1e-12)
        with torch.no_grad():
            hits = (q_logp.argmax(-1) == p_logits.argmax(-1)).float()
            agree = torch.stack([torch.zeros(k - 1, device=device).index_add_(0, slot, hits),
                                 torch.zeros(k - 1, device=device).index_add_(0, slot, torch.ones_like(hits))])
        return loss, int(valid.sum()), agree


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
def heldout_eval(model: OrthrusLM, prompt_ids: list[list[int]], max_new_tokens: int, k: int) -> tuple[float, list[int]]:
    """Greedy two-pass Orthrus over held-out prompts: (mean tokens per draft+verify cycle, how many cycles
    accepted 0, 1, .., k-1 drafts)."""
    from ..decoding.loop import DecodeConfig, decode

    committed, steps, hist = 0, 0, [0] * k
    for ids in prompt_ids:
        state = decode(model, ids, "orthrus", DecodeConfig(max_new_tokens=max_new_tokens, k=k))
        committed += len(state.generated) - 1
        steps += state.stats.steps
        for n in state.stats.accepted:
            hist[n] += 1
    return committed / max(steps, 1), hist


def forced_blocks(records: list[dict], n: int, k: int, anchors: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Held-out sequences for `forced_eval`: n records with room for a full block, spread evenly over the
    records in key order (the same ones on any machine, however the responses were sharded), each with up
    to `anchors` fixed anchors (drawn once from the seed, so every evaluation scores the same blocks) at
    response positions a whose block ends inside the sequence (a in [n_prompt, length - k]), the anchors a
    greedy cycle can start from after the prefill's token."""
    usable = sorted((r for r in records if len(r["response_ids"]) >= k), key=lambda r: str(r.get("key", "")))
    picked = [usable[i * len(usable) // n] for i in range(n)] if len(usable) > n else usable
    out = []
    for i, r in enumerate(picked):
        ids, n_prompt = r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])
        pool = list(range(n_prompt, len(ids) - k + 1))
        rng = random.Random(f"{seed}:forced:{i}")
        out.append((ids, sorted(rng.sample(pool, min(anchors, len(pool))))))
    return out


@torch.no_grad()
def forced_accepted(loss_module: "DistillLoss", ids: list[int], anchors: list[int]) -> torch.Tensor:
    """Per anchor, how many leading drafts of its block equal the AR view's argmax on the sequence `ids`:
    what a greedy two-pass cycle starting there accepts when the context is `ids` itself."""
    p_logits, q_logp, valid, _ = loss_module.block_logits(ids, anchors)
    hits = torch.zeros_like(valid)
    hits[valid] = q_logp.argmax(-1) == p_logits.argmax(-1)
    return hits.long().cumprod(dim=1).sum(dim=1).cpu()


@torch.no_grad()
def forced_eval(loss_module: "DistillLoss", blocks: list[tuple[list[int], list[int]]]) -> tuple[float, list[int]]:
    """Held-out tokens per cycle under teacher forcing: at each fixed anchor of each held-out sequence, the
    drafts a greedy two-pass cycle would accept there (the leading drafts equal to the AR view's argmax),
    plus the AR view's own token. Returns (mean tokens per cycle, how many blocks accepted 0..k-1 drafts).

    One AR pass and one draft pass per sequence score every anchor at once: thousands of cycles at the
    cost of a few training steps, on the same blocks at every evaluation, so two heads differ by their
    drafts alone (decoding held-out prompts scores a few hundred cycles, each head on its own path)."""
    k = loss_module.k
    hist = torch.zeros(k, dtype=torch.long)
    for ids, anchors in blocks:
        hist += torch.bincount(forced_accepted(loss_module, ids, anchors), minlength=k)
    return tokens_per_cycle(hist), hist.tolist()


def tokens_per_cycle(hist: torch.Tensor) -> float:
    """Mean tokens per cycle from a histogram of cycles that accepted 0..k-1 drafts (each adds one token)."""
    return float((hist * torch.arange(1, len(hist) + 1)).sum()) / max(int(hist.sum()), 1)


def heldout_tokens_per_step(model: OrthrusLM, prompt_ids: list[list[int]], max_new_tokens: int, k: int) -> float:
    return heldout_eval(model, prompt_ids, max_new_tokens, k)[0]


def _published_step(cfg: TrainConfig) -> tuple[int, list[dict]]:
    """The step and log history of the head this run published (`continue_from_published`), read without a model."""
    from ..decoding import head as headfile

    head_json = Path(cfg.publish) / "head.json" if cfg.publish else None
    training = headfile.read_head_config(cfg.publish)[1].training if head_json and head_json.exists() else None
    if not training or not cfg.log or training.get("log") != cfg.log or not Path(cfg.log).exists():
        raise LosslessError(f"--resume: no checkpoint at {Path(cfg.out) / CHECKPOINT} and no head published by this "
                            "run (--publish, with the same --log); start without --resume")
    step = int(training["step"])
    try:
        logged = read_jsonl(cfg.log, what="training log")
    except UnicodeDecodeError as exc:
        raise not_utf8(cfg.log, exc, "training log") from None
    history = [h for h in logged if isinstance(h.get("step"), int) and h["step"] <= step]
    if len(history) != step:
        raise LosslessError(f"--resume: {cfg.log} does not hold the {step} steps of the published head; start anew")
    return step, history


def continue_from_published(model: OrthrusLM, cfg: TrainConfig) -> tuple[int, list[dict]]:
    """Where `--resume` goes without a checkpoint (a new machine: checkpoints are not committed): the head
    this run last published, at its step, with the run's log up to that step. Only a head published by
    this very run (same log) counts. Returns (step, history)."""
    step, history = _published_step(cfg)
    model.load_head(cfg.publish)
    print(f"note: no checkpoint in {cfg.out}; continuing from the head published at step {step} "
          "(the optimiser state restarts)", file=sys.stderr)
    return step, history


def published_score(model: OrthrusLM, cfg: TrainConfig, measure) -> dict:
    """`measure()` (the evaluation's record) with the head in `cfg.publish`; the model's own head is restored
    after."""
    own = {n: p.detach().clone() for n, p in model.head_parameters().items()}
    identity, rank = (model.k, model.head_info, model.head_digest), model.draft_adapter
    try:
        model.load_head(cfg.publish)
        return measure()
    finally:
        if model.draft_adapter != rank:
            model.set_draft_adapter(rank)
        with torch.no_grad():
            for n, p in model.head_parameters().items():
                p.copy_(own[n])
        model.k, model.head_info, model.head_digest = identity


DECODED = "heldout_tokens_per_step"  # two-pass greedy decoding of held-out prompts
FORCED = "forced_tokens_per_cycle"  # teacher-forced cycles on held-out sequences (`forced_eval`)


def train(model: OrthrusLM, records: list[dict], cfg: TrainConfig, heldout: list[list[int]] | None = None,
          resume: bool = False, accelerator=None, progress: bool = True, stop_at: int | None = None,
          forced: list[tuple[list[int], list[int]]] | None = None) -> dict:
    """Train `model`'s head on distillation `records` ({"prompt_ids", "response_ids"}). Returns a summary.

    Every `cfg.eval_every` steps the head is scored by decoding the `heldout` prompts and, when given, on the
    `forced` blocks of held-out sequences (`forced_blocks`); the head is published when the forced score
    (else the decoded one) beats every earlier evaluation and the head already there.

    stop_at: leave after this step with a checkpoint (the schedule still spans cfg.steps), e.g. to
    time-box a session and `--resume` later."""
    from accelerate import Accelerator

    check_config(cfg)
    accelerator = accelerator or Accelerator(cpu=model.device.type == "cpu")
    out = Path(cfg.out)
    torch.manual_seed(cfg.seed)
    sequences = [(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])) for r in records
                 if len(r["response_ids"]) >= 2]
    if not sequences:
        raise LosslessError("no training sequences: the data holds no responses of 2 or more tokens")
    head = model.head_parameters()
    for p in model.backbone_parameters().values():
        p.requires_grad_(False)
    mask_params = [head["mask_embedding"]] if "mask_embedding" in head else []
    adapter_params = [p for n, p in head.items() if ".mlp_diff." in n]
    groups = [{"params": [p for n, p in head.items() if n != "mask_embedding" and ".mlp_diff." not in n],
               "lr": cfg.lr}]
    if mask_params:
        groups.append({"params": mask_params, "lr": cfg.lr * cfg.mask_lr_mult})
    if adapter_params:
        groups.append({"params": adapter_params, "lr": cfg.lr * cfg.adapter_lr_mult})
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    history: list[dict] = []
    start_step = 0
    ckpt_path = out / CHECKPOINT
    if resume and ckpt_path.exists():
        state = read_checkpoint(ckpt_path)
        if set(state["head"]) != set(head):
            trained = state["config"].get("draft_adapter", 0)
            raise LosslessError(f"--resume: the run in {out} trains a head with draft adapters of rank {trained}; "
                                f"resume it with --draft-adapter {trained}")
        with torch.no_grad():
            for name, p in model.head_parameters().items():
                p.copy_(state["head"][name])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step, history = state["step"], state["history"]
    elif resume or cfg.init_head:
        if resume:
            start_step, history = continue_from_published(model, cfg)
        else:  # the weights are the caller's (the head in cfg.init_head); the run continues at that head's step
            start_step = int(model.head_info.training.get("step", 0)) if model.head_info.training else 0
        # the schedule where the run was; the optimiser's moments start afresh
        scheduler.last_epoch = start_step
        for group, base, lam in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * lam(start_step)
    cast = FrozenCast(model, resolve_autocast(cfg.autocast, model.device))
    loss_module = DistillLoss(model, cfg.k, cfg.loss, position_weights(cfg.k, cfg.position_decay, cfg.position_weights))

    def evaluate() -> dict:
        model.eval()
        record = {}
        if heldout:
            tps, hist = heldout_eval(model, heldout, cfg.eval_tokens, cfg.k)
            record[DECODED], record["heldout_accepted"] = round(tps, 4), hist
        if forced:
            with cast.step():
                tpc, hist = forced_eval(loss_module, forced)
            record[FORCED], record["forced_accepted"] = round(tpc, 4), hist
        return record

    ddp, optimizer = accelerator.prepare(loss_module, optimizer)
    world, rank = accelerator.num_processes, accelerator.process_index
    metric = FORCED if forced else DECODED
    best = max((h[metric] for h in history if metric in h), default=0.0)
    if cfg.publish and (heldout or forced) and accelerator.is_main_process and (Path(cfg.publish) / "head.json").exists():
        # the head already there is the one to beat, measured now on the same prompts or blocks
        baseline = published_score(model, cfg, evaluate)[metric]
        what = "blocks of held-out sequences" if forced else "held-out prompts"
        print(f"note: the head in {cfg.publish} drafts {baseline:.3f} tokens per cycle on the {what}; "
              "a head is published when it beats that", file=sys.stderr)
        best = max(best, baseline)

    def save(step: int) -> None:
        if not accelerator.is_main_process:
            return
        out.mkdir(parents=True, exist_ok=True)
        state = {"step": step, "head": {n: p.detach().cpu().clone() for n, p in model.head_parameters().items()},
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "config": asdict(cfg), "history": history}
        save_checkpoint(state, ckpt_path)
        model.save_head(out, training={**asdict(cfg), "step": step, "history": history[-5:]}, encoding=cfg.encoding)
        if cfg.log:
            Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)  # checked writable at the start
            write_atomically(cfg.log, jsonl_text(history))

    def publish(step: int) -> None:
        if accelerator.is_main_process and cfg.publish:
            model.save_head(cfg.publish, training={**asdict(cfg), "step": step, "history": history[-5:]},
                            encoding=cfg.encoding)

    bar = tqdm(total=cfg.steps, initial=start_step, desc="train head", unit="step",
               disable=not (progress and accelerator.is_main_process))
    step = start_step
    last = history[-1] if history else {}
    tokens, positions = last.get("tokens", 0), last.get("positions", 0)
    agree = torch.zeros(2, cfg.k - 1)
    t0, tokens_at_start = time.perf_counter(), tokens
    def accumulate(step: int, stop: StopFlag) -> tuple[float, torch.Tensor]:
        """Gradients of this rank's share of step `step`; returns (mean loss, [tokens, positions]). Raises
        KeyboardInterrupt, with no update made, when a stop was requested."""
        rng = step_rng(cfg.seed, step)
        picks = [rng.randrange(len(sequences)) for _ in range(cfg.seqs_per_step)]
        mine = picks[rank::world]
        total_loss, counts = 0.0, torch.zeros(2, dtype=torch.float64)
        optimizer.zero_grad(set_to_none=True)
        with cast.step():
            for j, idx in enumerate(mine):
                if stop.requested:
                    break
                ids, n_prompt = sequences[idx]
                anchors = choose_anchors(step_rng(cfg.seed, step, j * world + rank + 1), n_prompt, len(ids),
                                         cfg.anchors)
                sync = contextlib.nullcontext() if j == len(mine) - 1 else accelerator.no_sync(ddp)
                with sync:
                    loss, n_pos, hits = ddp(ids, n_prompt, anchors)
                    accelerator.backward(loss / len(mine))
                total_loss += float(loss.detach()) / len(mine)
                counts += torch.tensor([len(ids), n_pos], dtype=torch.float64)
                agree.add_(hits.detach().cpu())
        if stop.requested:  # this step is abandoned whole; the checkpoint holds the last finished one
            raise KeyboardInterrupt
        return total_loss, counts

    try:
        with stop_between_steps() as stop:
            while step < min(cfg.steps, stop_at or cfg.steps):
                total_loss, counts = accumulate(step, stop)
                optimizer.step()
                scheduler.step()
                step += 1
                if world > 1:
                    counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
                tokens += int(counts[0])
                positions += int(counts[1])
                record = {"step": step, "loss": round(total_loss, 5), "lr": scheduler.get_last_lr()[0],
                          "tokens": tokens, "positions": positions}
                if cfg.eval_every and step % cfg.eval_every == 0:
                    record["agree"] = [round(float(a), 4) for a in agree[0] / agree[1].clamp(min=1)]
                    agree.zero_()
                    if accelerator.is_main_process:
                        record.update(evaluate())
                history.append(record)
                elapsed = time.perf_counter() - t0
                bar.set_postfix(loss=f"{total_loss:.4f}", tok_s=f"{(tokens - tokens_at_start) / max(elapsed, 1e-9):.0f}",
                                **({"tps": record[metric]} if metric in record else {}))
                bar.update(1)
                if record.get(metric, 0.0) > best:
                    best = record[metric]
                    publish(step)
                if cfg.save_every and step % cfg.save_every == 0:
                    save(step)
    except KeyboardInterrupt:
        save(step)  # Ctrl-C or SIGTERM leaves a usable checkpoint and head at the last finished step
        bar.close()
        raise
    bar.close()
    save(step)
    accelerator.wait_for_everyone()
    return {"steps": step, "history": history, "seconds": time.perf_counter() - t0,
            "tokens": tokens - tokens_at_start, "out": str(out)}


def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write a checkpoint atomically (`write_atomically`): the old checkpoint stays whole until the new one is,
    and a failed write (a full disk) leaves no temporary file to fill the disk. The state is serialised in
    memory first, so a write error is an OSError naming the file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomically(path, buffer.getvalue())


def write_summary(out: str | Path, summary: dict) -> None:
    write_atomically(Path(out, "train_summary.json"), json.dumps(summary, indent=2) + "\n")
