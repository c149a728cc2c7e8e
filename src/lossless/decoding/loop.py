"""The decode loops: `ar` (the reference) and `orthrus`, in one of two cycles:

- `two-pass` (the authors' Orthrus, the default): draft -> verify -> accept -> commit, two forwards;
  with `tree` > 0, the verify pass checks a tree of draft candidates (the top drafts and their runners-up,
  `build_tree`) instead of one chain, and keeps the longest path the AR view agrees with (greedy) or its draws
  take (sampled: the token AR's draw chooses at each node, while a child holds it);
- `fused`: one forward verifies the pending block and drafts the next one for every possible acceptance
  count (`OrthrusLM.verify_and_draft`) -> accept -> commit -> keep the drafts of the group that matches.

All loops share prefill, stopping and commit, so they differ only in how a cycle proposes tokens.
State travels in `DecodeState`; `commit` is the one place that appends tokens, applies EOS and
max_new_tokens, and crops the cache (through `commit_cache`, which checks the invariant "cache holds
every committed token but the last"): decoding owns the cache length.

The model is seen only through `DecodingModel` (prefill, verify, step, draft, k, ...), which
`model.DecodingModel` satisfies; this module imports no model. It does not know about tokenizers, chat
templates or files.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from contextlib import AbstractContextManager
from typing import Callable, Protocol

import torch

from ..errors import LosslessError
from ..names import DEFAULT_LOOKUP, DEFAULT_TREE, check_cycle, check_mode, check_tree
from .cycles import FALLBACK_CYCLES
from .sampling import DRAFT, RESIDUAL, TEST, Draws, SamplingConfig, argmax, sample, top_candidates


class DecodingModel(Protocol):
    """What the decode loops need of a model (`DecodingModel` is one)."""

    k: int  # the head's block size
    device: torch.device
    max_positions: int

    def eos_token_ids(self) -> list[int]: ...

    def weights_fixed(self) -> AbstractContextManager:
        """A block within which no weight changes (one decode call): the model may check its weights once."""

    def prefill(self, prompt_ids: list[int]) -> tuple[object, torch.Tensor]:
        """(a cache holding the prompt, last-position logits [V])."""

    def verify(self, cache, block_ids: list[int]) -> torch.Tensor:
        """AR logits [len(block), V]; appends the block to the cache."""

    def step(self, cache, token: int) -> torch.Tensor:
        """AR next-token logits [V]; appends the token to the cache."""

    def draft(self, cache, last_token: int, k: int) -> torch.Tensor:
        """Draft logits [k-1, V]; reads the cache, never writes it."""

    def verify_and_draft(self, cache, block_ids: list[int], anchors: list[int],
                         width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward: AR logits [len(block), V] (appending the block to the cache) and, for each block
        offset in `anchors`, a draft group's logits [len(anchors), width, V]."""

    def verify_tree(self, cache, ids: list[int], parents: list[int]) -> torch.Tensor:
        """AR logits [len(ids), V] of a token tree (row 0 the root, row i's parent row parents[i] < i), each
        row seeing the cache and its ancestors; appends every row to the cache."""

    def keep_cache_rows(self, cache, start: int, rows: list[int]) -> None:
        """Move the cache entries of tree rows `rows` (offsets from `start`) to start, start+1, ..."""


def commit_cache(cache, n_committed: int) -> None:
    """Crop the cache so it holds positions 0..n_committed-2 (the last committed token is not yet fed)."""
    target = n_committed - 1
    extra = cache.get_seq_length() - target
    if extra < 0:
        raise AssertionError(f"cache holds {cache.get_seq_length()} positions, fewer than {target}")
    if extra:
        cache.crop(-extra)
    assert cache.get_seq_length() == target, "cache length invariant broken"


# The fused cycle's default block size: a forward carries k verify rows plus k groups of k rows, so rows
# grow as k^2 while the head's later drafts are rarely right. Measured side by side (bf16, 2-core AVX-512
# CPU, 6 held-out prompts, results/speed/speed_bf16_fused.txt): k=3 with all groups was fastest, 0.87x HF
# generate; k=4 with 2 or 4 groups 0.83x, k=5 with 2 groups 0.81x; k=8 with 8 groups is 72 rows (2.9x a step).
FUSED_K = 3

# Candidate trees (two-pass): a tree is a set of paths of candidate ranks, one rank per block
# position, e.g. (0, 1) = the top draft at block position 1, then the runner-up at position 2. Each cycle
# builds its own tree from the draft's probabilities: a path's score is the product of its candidates'
# probabilities, and a budget of N nodes takes the N best paths. Measured against one fixed tree built from
# how often each rank was right (bf16, 12 held-out prompts, 96 tokens, the step-500 head): 2.65 / 2.87 /
# 2.99 tokens per cycle at 8 / 16 / 24 nodes against 2.62 / 2.82 / 2.91, and it needs no table per head.
TREE_WIDTH = 4  # candidates per block position a tree may use


def build_tree(budget: int, scores) -> tuple[tuple[int, ...], ...]:
    """The `budget` best candidate paths (prefix-closed, parents before children) under `scores[j][r]`, the
    probability of the rank-r candidate at block position j+1 (rows sorted descending); a path's score is
    the product along it. A sure top draft everywhere gives the chain `((0,), (0, 0), ...)`."""
    import heapq

    frontier = [(-float(p), (r,)) for r, p in enumerate(scores[0])] if len(scores) else []
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < budget:
        neg_p, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(scores):  # a child never scores above its parent: the set stays prefix-closed
            for r, p in enumerate(scores[len(path)]):
                heapq.heappush(frontier, (neg_p * float(p), path + (r,)))
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))


# Prompt lookup: the drafter that costs nothing. Summaries, translations, edits, code and verse copy spans of
# their prompt or of themselves, and a copy whose context matched is often right for many tokens. Offline,
# on the bf16 reference trajectories of the 1,190-prompt suite: a 3-token match's first copied token is
# right 83% of the time (2-token: 53%, 1-token: 24%).
LOOKUP_NGRAMS = (3, 2, 1)  # context suffix lengths the lookup tries, longest first
LOOKUP_ALONE = 2  # a match this long (or longer) is verified alone, in one forward without a draft pass
LOOKUP_BESIDE = 4  # a shorter match adds at most this many tokens beside the drafts


def lookup_proposal(tokens: list[int], n: int) -> tuple[list[int], int]:
    """`n` tokens that followed the most recent earlier occurrence of the context's last 3 (else 2, else 1)
    tokens, and the length of the match (0: none, and no tokens). The copy may run on into itself, so a
    context that repeats a short span proposes further repeats of it."""
    if n <= 0:
        return [], 0
    for size in LOOKUP_NGRAMS:
        if len(tokens) <= size:
            continue
        suffix, last = tokens[-size:], len(tokens) - size
        first = suffix[0]
        for start in range(last - 1, -1, -1):
            if tokens[start] == first and tokens[start: start + size] == suffix:
                copy = tokens[start + size: start + size + n]
                period = len(tokens) - start - size  # where the copy reaches the context's end, it copies itself
                while len(copy) < n:
                    copy.append(copy[len(copy) - period])
                return copy, size
    return [], 0


@dataclass
class DecodeConfig:
    max_new_tokens: int = 128
    k: int | None = None  # block size; None = the head's k (two-pass) or FUSED_K (fused)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_ids: tuple[int, ...] = ()
    record_margins: bool = False  # keep the top-1 minus top-2 logit margin (and the top tokens) of every committed token
    cycle: str = "two-pass"  # how orthrus spends forwards: "two-pass" (draft, then verify) or "fused"
    groups: int | None = None  # fused: draft groups per forward, for acceptance counts 0..groups-1 (None = all)
    tree: int = 0  # two-pass: verify a tree of this many draft candidates (0 = the chain of top drafts)
    lookup: int = 0  # either cycle: verify up to this many tokens copied from earlier context (0 = none)
    # orthrus: after cycles.FALLBACK_CYCLES cycles, AR for the rest of the request once the tokens committed per
    # cycle so far fall below this (0: never; a sampled request's default, from this CPU's costs)
    ar_below: float = 0.0
    # end after the cycle that commits this many tokens (None = never), every forward as with max_new_tokens alone:
    # a decode cut short this way is the start of the full decode, to the bit (a smaller max_new_tokens drafts less)
    stop_after: int | None = None


@dataclass
class DecodeStats:
    steps: int = 0  # decode cycles after prefill (ar: single-token forwards; orthrus: draft+verify cycles)
    forwards: int = 0  # every model forward, prefill included
    new_tokens: int = 0
    seconds: float = 0.0
    accepted: list[int] = field(default_factory=list)  # drafts accepted per orthrus cycle
    ar_from: int | None = None  # tokens generated when an orthrus request gave way to AR (`ar_below`), if it did

    @property
    def tokens_per_step(self) -> float:
        """Tokens committed per cycle (the prefill's first token is not a cycle's)."""
        return (self.new_tokens - 1) / self.steps if self.steps else float(self.new_tokens > 0)

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "forwards": self.forwards,
            "new_tokens": self.new_tokens,
            "tokens_per_step": round(self.tokens_per_step, 4),
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "seconds": round(self.seconds, 4),
            "accepted": list(self.accepted),
            **({"ar_from": self.ar_from} if self.ar_from is not None else {}),
        }


@dataclass
class DecodeState:
    tokens: list[int]  # committed ids: prompt + generated
    n_prompt: int
    cache: object = None
    finished: str | None = None  # "eos" | "length" once done
    stats: DecodeStats = field(default_factory=DecodeStats)
    margins: list[float] = field(default_factory=list)  # per generated token, when cfg.record_margins
    tops: list[list[list]] = field(default_factory=list)  # per generated token, when cfg.record_margins: [[id, logit]] * TOP_N
    drafts: list[int] = field(default_factory=list)  # fused: drafted continuation of the last committed token
    draft_q: torch.Tensor | None = None  # fused, sampling: the drafts' distributions [len(drafts), V]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt:]


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]  # generated ids only
    stats: dict
    prompt_ids: list[int]
    finish_reason: str | None
    config: dict = field(default_factory=dict)  # what ran: dtype, attn, exact, mode, cycle, k, tree, lookup
    # the decode's cache, where it was asked for: whoever goes on with it owns it (a batch may make it its own)
    cache: object = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats,
                "finish_reason": self.finish_reason, "prompt_tokens": len(self.prompt_ids), "config": self.config}


class Drafter(Protocol):
    def __call__(self, model: DecodingModel, state: DecodeState, k: int, sampling: SamplingConfig,
                 draws: Draws) -> tuple[list[int], torch.Tensor | None]:
        """Propose k-1 draft ids for the next positions (and their sampling distributions q [k-1, V] when
        sampling)."""


TOP_N = 5  # top tokens kept per committed token when margins are recorded (what a reader sees at a divergence)


def top2_margins(logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 logit, per row of logits [..., V] (how close each choice was to a tie)."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return (top[..., 0] - top[..., 1]).reshape(-1).tolist()


def top_tokens(logits: torch.Tensor, n: int = TOP_N) -> list[list[list]]:
    """The n highest logits of each row of logits [m, V], as [[id, logit], ...] per row, highest first."""
    top = torch.topk(logits.float(), min(n, logits.shape[-1]), dim=-1)
    return [[[int(i), float(v)] for i, v in zip(ids, vals)] for ids, vals in zip(top.indices.tolist(), top.values.tolist())]


def propose(logits: torch.Tensor, sampling: SamplingConfig, draws: Draws,
            first: int) -> tuple[list[int], torch.Tensor | None]:
    """Draft ids from draft logits [m, V] for generated positions first, first + 1, ..: the argmax (greedy), or
    samples (each position's DRAFT draw) with their distributions q [m, V]."""
    if sampling.greedy:
        return argmax(logits).tolist(), None
    q = sampling.probs(logits)
    return [sample(q[j], draws.at(first + j, DRAFT)) for j in range(q.shape[0])], q


def model_drafter(model, state, k, sampling, draws):
    """The draft view: one forward over [last token, MASK x (k-1)]."""
    logits = model.draft(state.cache, state.tokens[-1], k)  # [k-1, V]
    state.stats.forwards += 1
    return propose(logits, sampling, draws, len(state.generated))


# ------------------------------------------------------------------------------------------ shared phases
def block_size(head_k: int, cfg: DecodeConfig) -> int:
    """The block size a request decodes with: `cfg.k`, else the head's k (two-pass) or FUSED_K (fused)."""
    if cfg.k is not None:
        return int(cfg.k)
    return min(FUSED_K, head_k) if cfg.cycle == "fused" else head_k


def versus_ar(mode: str, cycle: str, tree: int, greedy: bool, exact: bool) -> str:
    """What a decode holds against AR's, for a caller to say: "tokens" (AR's tokens, bit for bit: AR itself, or
    on exact kernels a greedy decode, or a sampled one in a two-pass tree, whose tokens are AR's draws),
    "distribution" (on exact kernels, a sampled chain or fused cycle: a draw from AR's distributions, by rejection
    sampling, not AR's draw) or "not guaranteed" (stock kernels: a verify block may round otherwise than AR's steps,
    and a near-tie go the other way; the study measures how often)."""
    if mode == "ar":
        return "tokens"
    if not exact:
        return "not guaranteed"
    return "tokens" if greedy or (cycle == "two-pass" and tree > 0) else "distribution"


def auto_cycle(mode: str, cycle: str, greedy: bool, trained_head: bool, tree: int | None,
               lookup: int | None) -> tuple[int, int]:
    """(tree, lookup) with None meaning the fastest lossless default: greedy orthrus verifies a DEFAULT_TREE-node
    tree (two-pass, with a trained head: an untrained one's runners-up are not worth verifying) and prompt lookup of
    DEFAULT_LOOKUP tokens; sampling, AR and the fused cycle's tree get none. Explicit values pass through."""
    speculative = mode == "orthrus" and greedy
    if tree is None:
        tree = DEFAULT_TREE if speculative and cycle == "two-pass" and trained_head else 0
    if lookup is None:
        lookup = DEFAULT_LOOKUP if speculative else 0
    return int(tree), int(lookup)


def validate(model: DecodingModel, prompt_ids: list[int], cfg: DecodeConfig, mode: str) -> int:
    """Check the request; return the block size k to use."""
    check_mode(mode)
    if not prompt_ids:
        raise LosslessError("the prompt is empty: give some text to continue")
    if cfg.stop_after is not None and (isinstance(cfg.stop_after, bool) or not isinstance(cfg.stop_after, int)
                                       or cfg.stop_after < 1):
        raise LosslessError(f"stop_after must be a positive integer or None, got {cfg.stop_after!r}")
    if cfg.max_new_tokens < 1:
        raise LosslessError("--max-new-tokens must be >= 1")
    if len(prompt_ids) + cfg.max_new_tokens > model.max_positions:
        raise LosslessError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the model's "
            f"context of {model.max_positions}: shorten the prompt or lower --max-new-tokens"
        )
    check_cycle(cfg.cycle)
    if cfg.groups is not None and cfg.groups < 1:
        raise LosslessError(f"--groups must be >= 1, got {cfg.groups}")
    check_tree(cfg.tree, cfg.cycle, cfg.lookup)
    k = block_size(model.k, cfg)
    if not 1 <= k <= model.k:
        raise LosslessError(f"--k must be between 1 and the head's k ({model.k}), got {k}")
    return k


def prefill(model: DecodingModel, prompt_ids: list[int], cfg: DecodeConfig, draws: Draws) -> DecodeState:
    """Phase 0: run the prompt, commit the first token from its last logits."""
    state = DecodeState(tokens=list(prompt_ids), n_prompt=len(prompt_ids))
    state.cache, logits = model.prefill(prompt_ids)
    state.stats.forwards += 1
    first = int(argmax(logits)) if cfg.sampling.greedy else cfg.sampling.token(logits, draws, 0)
    commit(state, [first], cfg, logits[None])
    return state


def commit(state: DecodeState, new_tokens: list[int], cfg: DecodeConfig, logits: torch.Tensor | None = None) -> list[int]:
    """Append tokens up to EOS (kept) or max_new_tokens; crop the cache; return what was committed.

    logits [len(new_tokens), V], when given, are the AR rows the tokens were chosen from (for margins)."""
    kept: list[int] = []
    for tok in new_tokens:
        state.tokens.append(int(tok))
        kept.append(int(tok))
        if tok in cfg.eos_ids:
            state.finished = "eos"
            break
        if len(state.generated) >= cfg.max_new_tokens:
            state.finished = "length"
            break
    commit_cache(state.cache, len(state.tokens))
    state.stats.new_tokens = len(state.generated)
    if cfg.record_margins and logits is not None:
        state.margins.extend(top2_margins(logits[: len(kept)]))
        state.tops.extend(top_tokens(logits[: len(kept)]))
    return kept


# ----------------------------------------------------------------------------------------------- cycles
def ar_cycle(model: DecodingModel, state: DecodeState, cfg: DecodeConfig, draws: Draws) -> list[int]:
    """One AR step: feed the last token, choose the next (sampled: by the draw of its position)."""
    logits = model.step(state.cache, state.tokens[-1])
    state.stats.forwards += 1
    tok = int(argmax(logits)) if cfg.sampling.greedy else cfg.sampling.token(logits, draws, len(state.generated))
    return commit(state, [tok], cfg, logits[None])


def accept_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix of drafts equal to the AR argmax, and the AR token after it.

    logits [k, V]: row j is the AR distribution for the token after block position j.
    """
    targets = argmax(logits).tolist()  # [k]
    n_accepted = 0
    while n_accepted < len(drafts) and drafts[n_accepted] == targets[n_accepted]:
        n_accepted += 1
    return n_accepted, targets[n_accepted]


def accept_sampling(drafts: list[int], q: torch.Tensor | None, logits: torch.Tensor, sampling: SamplingConfig,
                    draws: Draws, first: int) -> tuple[int, int]:
    """Sampled acceptance of drafts for generated positions first, first + 1, .. against the verify rows logits
    [len(drafts) + 1, V] (p: each row's processed distribution, taken row by row as an AR step takes its one).
    Drafts chosen without a draw (q None: copied from the context) are candidates: one is kept when it is the
    token AR's draw at its position chooses from p, else that token ends the cycle, so every committed token is
    the one an AR step would commit. Drafts drawn from q go through speculative rejection sampling: x kept with
    chance min(1, p(x) / q(x)) (the position's TEST draw), else a token drawn from normalize(max(0, p - q)) (its
    RESIDUAL draw): a draw from p. After the last draft, AR's own draw chooses the bonus token."""
    for j, x in enumerate(drafts):
        if q is None:
            token = sampling.token(logits[j], draws, first + j)
            if token == x:
                continue
            return j, token
        p = sampling.probs(logits[j])
        px, qx = float(p[x]), float(q[j, x])  # (a draft drawn from q has qx > 0; a given drafter's q may say 0:
        ratio = min(1.0, px / qx) if qx > 0 else (1.0 if px > 0 else 0.0)  # kept if p has it, never if p has not)
        if draws.at(first + j, TEST) < ratio:
            continue
        residual = (p - q[j]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q numerically: any draw from p is exact
            residual = p
        return j, sample(residual, draws.at(first + j, RESIDUAL))  # (weights: `sample` draws by their share)
    return len(drafts), sampling.token(logits[len(drafts)], draws, first + len(drafts))


def accept(state: DecodeState, drafts: list[int], q: torch.Tensor | None, logits: torch.Tensor,
           cfg: DecodeConfig, draws: Draws) -> tuple[int, int]:
    """Phase 3 of both Orthrus cycles: the longest agreeing prefix (greedy) or rejection sampling against the
    drafts' q, plus one AR token; logits [len(drafts) + 1, V] are the verify rows. Records the count."""
    if cfg.sampling.greedy:
        n_accepted, bonus_token = accept_greedy(drafts, logits)
    else:
        n_accepted, bonus_token = accept_sampling(drafts, q, logits, cfg.sampling, draws, len(state.generated))
    state.stats.accepted.append(n_accepted)
    return n_accepted, bonus_token


def orthrus_cycle(model: DecodingModel, state: DecodeState, cfg: DecodeConfig, k: int, draws: Draws,
                  drafter: Drafter = model_drafter) -> list[int]:
    """One Orthrus cycle: draft -> verify -> accept -> commit."""
    k = min(k, cfg.max_new_tokens - len(state.generated))  # never draft past max_new_tokens
    # 1. draft: k-1 proposals from one pass of the draft view (nothing to draft when k == 1)
    drafts, q = drafter(model, state, k, cfg.sampling, draws) if k > 1 else ([], None)
    # 2. verify: the AR view scores [last token, drafts...] in one forward, appending to the cache
    logits = model.verify(state.cache, [state.tokens[-1], *drafts])  # [k, V]
    state.stats.forwards += 1
    # 3. accept: longest agreeing prefix (greedy) or rejection sampling, plus one AR token
    n_accepted, bonus_token = accept(state, drafts, q, logits, cfg, draws)
    # 4. commit: accepted drafts + the AR token; crop the cache back to the committed length
    return commit(state, [*drafts[:n_accepted], bonus_token], cfg, logits[: n_accepted + 1])


def token_tree(paths, ranks: list[list[int]], branch=()) -> tuple[list[int], list[int], dict[int, dict[int, int]]]:
    """A cycle's token tree: (the tokens of rows 1.., each row's parent row with row 0 the root (the last committed
    token) first, and each row's children by token) for candidate `paths` (rank tuples, parents before children;
    `ranks[j][r]` the rank-r candidate at block position j + 1) and a `branch` of tokens after the root, which shares
    the drafts' rows where it agrees with them."""
    row_of = {p: i + 1 for i, p in enumerate(paths)}
    tokens = [ranks[len(p) - 1][p[-1]] for p in paths]
    parents = [0] + [row_of.get(p[:-1], 0) for p in paths]
    children: dict[int, dict[int, int]] = {}
    for row, (parent, tok) in enumerate(zip(parents[1:], tokens), start=1):
        children.setdefault(parent, {})[tok] = row
    node = 0
    for tok in branch:
        if (row := children.get(node, {}).get(tok)) is None:
            tokens.append(tok)
            parents.append(node)
            row = len(tokens)
            children.setdefault(node, {})[tok] = row
        node = row
    return tokens, parents, children


def tree_cycle(model: DecodingModel, state: DecodeState, cfg: DecodeConfig, k: int, draws: Draws,
               branch: list[int] = ()) -> list[int]:
    """One two-pass cycle that verifies a tree of draft candidates: draft -> choose this cycle's
    tree (cfg.tree nodes, or the chain of top drafts) and add `branch` (tokens after the last committed one,
    e.g. a lookup's) -> verify it in one forward -> follow the AR argmax down the tree (sampled: the token AR's
    draw at each node's position chooses) -> keep the cache rows of the accepted path -> commit."""
    depth = min(k - 1, cfg.max_new_tokens - len(state.generated) - 1)  # never draft past max_new_tokens
    if depth < 1:
        return orthrus_cycle(model, state, cfg, 1, draws)
    # 1. draft, and the cfg.tree most probable paths through each position's top candidates (or the chain of
    #    top drafts when cfg.tree is 0)
    logits = model.draft(state.cache, state.tokens[-1], depth + 1)  # [depth, V]: the chain cycle's block
    state.stats.forwards += 1
    if cfg.tree:
        scores, ranks = top_candidates(logits, TREE_WIDTH)  # [depth, width] each
        paths = build_tree(cfg.tree, scores)
    else:
        paths = tuple((0,) * j for j in range(1, depth + 1))
        ranks = [[t] for t in argmax(logits).tolist()]
    tokens, parents, children = token_tree(paths, ranks, branch[: cfg.max_new_tokens - len(state.generated) - 1])
    # 2. verify: every node in one forward, each seeing the cache and its ancestors; a chain (no tree and
    #    nothing beside it) is the plain causal verify of `orthrus_cycle`, kernels and numerics included
    start = len(state.tokens) - 1  # the cache length: where the root goes
    block = [state.tokens[-1], *tokens]
    if all(parent == row for row, parent in enumerate(parents[1:])):
        verify = model.verify(state.cache, block)  # [len(block), V]
    else:
        verify = model.verify_tree(state.cache, block, parents)  # [len(block), V]
    state.stats.forwards += 1
    # 3. accept: follow the AR argmax from the root while a child holds it (sampling: the token the AR view's draw
    #    at each node's position chooses)
    path_rows = [0]
    if cfg.sampling.greedy:
        targets = argmax(verify).tolist()
        while (row := children.get(path_rows[-1], {}).get(targets[path_rows[-1]])) is not None:
            path_rows.append(row)
        bonus = targets[path_rows[-1]]
    else:  # the token AR's draw at each node's position chooses, while a child holds it
        first = len(state.generated)
        while True:
            bonus = cfg.sampling.token(verify[path_rows[-1]], draws, first + len(path_rows) - 1)
            if (row := children.get(path_rows[-1], {}).get(bonus)) is None:
                break
            path_rows.append(row)
    state.stats.accepted.append(len(path_rows) - 1)
    # 4. commit: the accepted path's cache rows move into place, then the path and the AR token are committed
    model.keep_cache_rows(state.cache, start, path_rows)
    return commit(state, [tokens[r - 1] for r in path_rows[1:]] + [bonus], cfg, verify[path_rows])


def lookup_cycle(model: DecodingModel, state: DecodeState, cfg: DecodeConfig, k: int, draws: Draws) -> list[int]:
    """One two-pass cycle with prompt lookup: if the context's last LOOKUP_ALONE or more tokens occurred
    earlier, verify what followed them (up to cfg.lookup tokens) in one forward, with no draft pass; otherwise
    a draft cycle (the chain, or cfg.tree's tree) whose tree also holds up to LOOKUP_BESIDE looked-up tokens.
    Sampled without a tree, that draft cycle is the sampled chain's (drafts drawn from q accept more often than
    the top drafts tried as candidates beside copied tokens)."""
    proposal, matched = lookup_proposal(state.tokens, min(cfg.lookup, cfg.max_new_tokens - len(state.generated) - 1))
    if matched >= LOOKUP_ALONE:
        return orthrus_cycle(model, state, cfg, len(proposal) + 1, draws, drafter=lambda *_: (proposal, None))
    if not cfg.sampling.greedy and not cfg.tree:
        return orthrus_cycle(model, state, cfg, k, draws)
    return tree_cycle(model, state, cfg, k, draws, proposal[:LOOKUP_BESIDE])


def fused_cycle(model: DecodingModel, state: DecodeState, cfg: DecodeConfig, k: int, draws: Draws,
                drafter: Drafter | None = None) -> list[int]:
    """One fused cycle: verify [last token, pending drafts] and draft every possible next block in one
    forward -> accept -> commit -> keep the drafts of the group anchored where acceptance stopped. With
    cfg.lookup, a context match of LOOKUP_ALONE or more tokens that copies further than the pending
    drafts is verified in their place (with groups for the first k acceptance counts).

    Group n is anchored at block position n (the last token kept when n drafts are accepted); its mask
    rows draft the tokens after the bonus token. A cycle with no pending drafts (the first one, or after
    an acceptance count with no group) is an AR step that also drafts."""
    remaining = cfg.max_new_tokens - len(state.generated)
    drafts = state.drafts[: remaining - 1]  # never verify past max_new_tokens
    q = state.draft_q[: len(drafts)] if state.draft_q is not None else None
    group_cap = len(drafts) + 1
    if cfg.lookup:  # a long enough context match replaces the pending drafts with its copy (sampled: kept by AR's draws)
        copy, matched = lookup_proposal(state.tokens, min(cfg.lookup, remaining - 1))
        if matched >= LOOKUP_ALONE and len(copy) > len(drafts):
            drafts, q, group_cap = copy, None, k  # groups where acceptance usually stops, not one per copied token
    block = [state.tokens[-1], *drafts]
    n_groups = 0 if k == 1 else min(len(block), group_cap, cfg.groups or len(block))
    # 1. verify + draft: one forward; the verify rows are exactly a verify pass, the groups never touch the cache
    logits, groups = model.verify_and_draft(state.cache, block, list(range(n_groups)), k - 1)  # [len(block), V]
    state.stats.forwards += 1
    # 2. accept: longest agreeing prefix (greedy) or rejection sampling against the drafts' q, plus one AR token
    n_accepted, bonus_token = accept(state, drafts, q, logits, cfg, draws)
    # 3. commit: accepted drafts + the AR token; the cache is cropped back to the committed length
    kept = commit(state, [*drafts[:n_accepted], bonus_token], cfg, logits[: n_accepted + 1])
    # 4. the next block's drafts: group n_accepted's mask rows (or a test's drafter), cut to what is left
    state.drafts, state.draft_q = [], None
    k_next = min(k, cfg.max_new_tokens - len(state.generated))
    if state.finished is None and k_next > 1:
        if drafter is not None:
            state.drafts, state.draft_q = drafter(model, state, k_next, cfg.sampling, draws)
        elif n_accepted < n_groups:
            state.drafts, state.draft_q = propose(groups[n_accepted, : k_next - 1], cfg.sampling, draws,
                                                  len(state.generated))
    return kept


# --------------------------------------------------------------------------------------------- the loop
def gives_way(state: DecodeState, cfg: DecodeConfig) -> bool:
    """Whether an orthrus request goes on as AR: it has run FALLBACK_CYCLES cycles and committed fewer than
    `cfg.ar_below` tokens per cycle (the prefill's token aside)."""
    steps = state.stats.steps
    return cfg.ar_below > 0 and steps >= FALLBACK_CYCLES and (len(state.generated) - 1) / steps < cfg.ar_below


def _stopping_after(n: int, stop: Callable[[DecodeState], bool] | None) -> Callable[[DecodeState], bool]:
    return lambda state: len(state.generated) >= n or (stop is not None and stop(state))


def decode(model: DecodingModel, prompt_ids: list[int], mode: str = "orthrus", cfg: DecodeConfig | None = None,
           on_tokens: Callable[[list[int]], None] | None = None, drafter: Drafter = model_drafter,
           stop: Callable[[DecodeState], bool] | None = None) -> DecodeState:
    """Generate from `prompt_ids` with `mode` ("ar" or "orthrus"). `on_tokens` gets each committed chunk.

    `stop(state)`, checked after every cycle, ends decoding early (finish reason "stop"), e.g. on a stop
    string. A cycle that commits several tokens may run past the stop point; callers that cut text at a
    stop string therefore get the same result from either mode whenever the token streams agree."""
    cfg = cfg or DecodeConfig()
    if not cfg.eos_ids:
        cfg = dataclasses.replace(cfg, eos_ids=tuple(model.eos_token_ids()))
    k = validate(model, prompt_ids, cfg, mode)
    if (cfg.tree or cfg.lookup) and drafter is not model_drafter:
        raise LosslessError("a candidate tree drafts with the model's own head; drop the tree/lookup or the drafter")
    with model.weights_fixed():
        return _decode(model, prompt_ids, mode, cfg, k, on_tokens, drafter, stop)


def _decode(model: DecodingModel, prompt_ids: list[int], mode: str, cfg: DecodeConfig, k: int,
            on_tokens: Callable[[list[int]], None] | None, drafter: Drafter,
            stop: Callable[[DecodeState], bool] | None) -> DecodeState:
    draws = cfg.sampling.draws()
    start = time.perf_counter()
    state = prefill(model, prompt_ids, cfg, draws)
    if mode == "orthrus" and cfg.cycle == "fused" and drafter is not model_drafter and state.finished is None:
        # a given drafter drafts the first block too (the model's own drafts come from the first fused forward)
        state.drafts, state.draft_q = drafter(model, state, min(k, cfg.max_new_tokens - 1), cfg.sampling, draws)
    if on_tokens:
        on_tokens(state.generated)
    if cfg.stop_after is not None:
        stop = _stopping_after(cfg.stop_after, stop)
    if stop is not None and state.finished is None and stop(state):
        state.finished = "stop"
    while state.finished is None:
        if mode == "orthrus" and gives_way(state, cfg):
            mode, state.stats.ar_from = "ar", len(state.generated)
        if mode == "ar":
            new = ar_cycle(model, state, cfg, draws)
        elif cfg.cycle == "fused":
            new = fused_cycle(model, state, cfg, k, draws, None if drafter is model_drafter else drafter)
        elif cfg.lookup:
            new = lookup_cycle(model, state, cfg, k, draws)
        elif cfg.tree:
            new = tree_cycle(model, state, cfg, k, draws)
        else:
            new = orthrus_cycle(model, state, cfg, k, draws, drafter)
        state.stats.steps += 1
        if on_tokens:
            on_tokens(new)
        if stop is not None and state.finished is None and stop(state):
            state.finished = "stop"
    state.stats.seconds = time.perf_counter() - start
    return state
