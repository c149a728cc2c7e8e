"""Continuous batching on exact kernels: sequences decode side by side in one forward per step, each getting
bitwise the logits, so the tokens, it gets alone.

Why this holds: in exact mode every row of a forward is computed from its own inputs only (linear layers, norms
and the MLP run one fixed chain per output whatever the other rows), and attention reads, for each row, exactly
the keys its visibility lets it see, in cache order (`exact.py`). So the sequences of a batch share one cache,
batch 1 in Hugging Face's terms: a forward appends its rows at the shared cache's end, and each row sees its
own sequence's keys (written in its positions' order) and the rows of its own sequence before it in this
forward, nothing else. Its positions are its own sequence's (0, 1, ... from its prompt on). The forward is one
layer-stack call over the rows of every sequence: the weights are read once per step for all of them, which
is what makes a step of B sequences cost far less than B steps on a memory-bound CPU.

A joining sequence's prompt runs in chunks of at most `prefill_chunk` rows a step (over all joining sequences),
beside the others' steps, so that a long prompt delays their next tokens by a chunk's cost, not its whole
prefill's; it makes its first choice at the step that runs its prompt's last row.

A sequence's keys are where its rows landed (`Slots`: their positions in the shared cache). Tokens the decode
loop does not keep (drafts a verify rejected) and sequences that ended leave rows nobody sees; `compact` copies
the live rows into a new cache, each sequence's together and in order, once the dead ones outnumber them or the
rows interleaved by steps since the last compaction grow (`MIXED_SHARE`): attention scores only the 16-key tiles
holding keys a row sees, so with each sequence's keys together a row reads its own context, not the batch's.

Each sequence is an ordinary `DecodeState` whose cache is its `Slots`, so `loop.commit` (EOS, length, cropping
the cache to the committed tokens) runs unchanged; the step reuses the loop's token choice, prompt lookup and
greedy acceptance. What a step may run: AR (greedy or sampled: a sequence's draws are its seed's, keyed by
position, `sampling.Draws`) and prompt lookup (`lookup`: tokens copied from earlier context verified in the same
forward, no draft pass; sampled, a copy is kept when it is the token AR's draw chooses). So a sequence commits
the tokens it commits alone, greedy or sampled. The draft view's passes stay with the single-sequence loops.

This module knows no server, tokenizer or text; `serving/engine.py` drives `BatchDecoder.step`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import LosslessError
from ..names import EXACT, PREFILL_CHUNK
from .loop import (LOOKUP_ALONE, DecodeConfig, DecodeState, DecodeStats, accept_greedy, accept_sampling, commit,
                   lookup_proposal, validate)
from .sampling import Draws, argmax

# Compaction copies every live row of the shared cache once; it runs when the rows nobody sees are more than the
# live ones and at least this many (a few steps of a full batch), so a step rarely pays for it.
COMPACT_AT = 256
# It also runs when the rows that steps of several sequences appended since the last one (each sequence's keys
# interleaved with the others', so a row's attention reads tiles of everyone's) reach a MIXED_SHARE-th of the live
# rows (and COMPACT_AT): compaction lays each sequence's keys out together again, and attention reads only the
# tiles holding a row's own keys. Measured with 8 sequences of 1,000 tokens on machine A: 1,040 interleaved rows
# added 3.4 ms to a 24 ms step, a compaction cost about 170 ms (the copy and the next step's key tiles), so it
# pays from about 1,000 such rows.
MIXED_SHARE = 8


class Slots:
    """One sequence's keys in the shared cache: the positions its rows were written at, in order, kept in a tensor
    that grows in place, so a step's mask takes each sequence's positions as they are instead of making them
    again from a list. It stands in for the sequence's own cache where `loop.commit` crops it (`get_seq_length`,
    `crop`)."""

    def __init__(self):
        self._pos, self._n = torch.empty(64, dtype=torch.long), 0

    @property
    def at(self) -> list[int]:
        return self._pos[:self._n].tolist()

    def index(self) -> torch.Tensor:
        """The positions, as a view (valid until the next change)."""
        return self._pos[:self._n]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._n

    def append(self, start: int, m: int) -> None:
        """The positions start .. start+m-1 follow."""
        if self._n + m > len(self._pos):
            grown = torch.empty(max(2 * len(self._pos), self._n + m), dtype=torch.long)
            grown[:self._n] = self._pos[:self._n]
            self._pos = grown
        torch.arange(start, start + m, out=self._pos[self._n:self._n + m])
        self._n += m

    def renumber(self, start: int) -> None:
        """The rows moved to start, start+1, ... (in the same order)."""
        n, self._n = self._n, 0
        self.append(start, n)

    def crop(self, max_length: int) -> None:
        """Keep the first max_length positions (negative: drop that many from the end), as `DynamicCache.crop`."""
        self._n = self._n + max_length if max_length < 0 else min(max_length, self._n)


@dataclass(eq=False)
class Sequence:
    """A request in the batch: its decode state (tokens, stats, finish reason), settings and pending rows."""

    state: DecodeState
    cfg: DecodeConfig
    draws: Draws
    on_tokens: Callable[[list[int]], None] | None = None
    pending: list[int] = field(default_factory=list)  # ids to feed: the prompt rows not run yet, then the last token
    drafts: list[int] = field(default_factory=list)  # this step's lookup tokens, after `pending`
    started: float = field(default_factory=time.perf_counter)
    error: Exception | None = None  # what ended it (finish reason "error"): its own choice, commit or callback failed

    @property
    def finished(self) -> str | None:
        return self.state.finished

    def finish(self, reason: str = "stop") -> None:
        """End the sequence early (a stop string, a client that left); its rows become dead."""
        if self.state.finished is None:
            self.state.finished = reason


class BatchDecoder:
    """Sequences of one exact-mode model decoding together: `add` a request, `step` until it is `finished`."""

    def __init__(self, model, prefill_chunk: int = PREFILL_CHUNK):
        self.check_prefill_chunk(prefill_chunk)
        if getattr(model, "attn", None) != EXACT:
            raise LosslessError("batched decoding needs exact kernels (each sequence's tokens must not depend on its "
                                f"neighbours): load the model with attn='exact' (got {getattr(model, 'attn', None)!r})")
        self.model, self.prefill_chunk = model, prefill_chunk
        self.cache = model.new_cache()
        self.sequences: list[Sequence] = []
        self.compactions = 0
        self.mixed = 0  # rows that steps of several sequences appended since the last compaction

    def add(self, prompt_ids: list[int], cfg: DecodeConfig, on_tokens=None, generated: list[int] = (),
            stats: DecodeStats | None = None, cache=None) -> Sequence:
        """A new sequence; it joins the next step (which runs its prompt beside the others' rows). `generated`:
        tokens a decode of this request already committed elsewhere (alone, in another cycle); the sequence
        goes on after them, its `stats` counting on from that decode's. Its first step runs the prompt and them
        (the same keys, so the same next tokens), unless that decode's `cache` is handed over: its keys and values
        of every token but the last (what an exact-mode decode holds after a commit) are then moved into the
        shared cache, and the sequence's first step is its next token's. The shared cache itself becomes that
        cache where no sequence has keys in it (nothing copied); otherwise its rows are appended."""
        if not cfg.eos_ids:
            cfg = dataclasses.replace(cfg, eos_ids=tuple(self.model.eos_token_ids()))
        validate(self.model, prompt_ids, cfg, "ar")
        if cfg.tree or cfg.cycle != "two-pass":
            raise LosslessError("a batch runs AR steps (with prompt lookup): candidate trees and the fused cycle "
                                "decode one sequence at a time")
        tokens = [*prompt_ids, *generated]
        if cache is not None and (not generated or cache.get_seq_length() != len(tokens) - 1):
            raise LosslessError(f"a handed-over cache holds the keys of every token but the last: "
                                f"{len(tokens) - 1} positions, got {cache.get_seq_length()}")
        state = DecodeState(tokens=list(tokens), n_prompt=len(prompt_ids), cache=Slots(), stats=stats or DecodeStats())
        seq = Sequence(state=state, cfg=cfg, draws=cfg.sampling.draws(), on_tokens=on_tokens,
                       pending=list(tokens), started=time.perf_counter() - state.stats.seconds)
        if cache is not None:
            state.cache.append(*self._move_in(cache))
            seq.pending = [tokens[-1]]
        self.sequences.append(seq)
        return seq

    def _move_in(self, cache) -> tuple[int, int]:
        """Where a handed-over cache's rows are in the shared cache: (first position, how many)."""
        n = cache.get_seq_length()
        if not any(s.state.cache.get_seq_length() for s in self.sequences):  # nobody's keys: it becomes the shared one
            self.cache, self.mixed = cache, 0
            return 0, n
        start = self.cache.get_seq_length()
        try:
            for i, layer in enumerate(cache.layers):
                self.cache.update(layer.keys, layer.values, i)
        except BaseException:  # (out of memory, say) no layer may keep rows the others lack: the others' keys
            for layer in self.cache.layers:
                if layer.get_seq_length() > start:
                    layer.crop(start - layer.get_seq_length())
            raise
        return start, n

    @staticmethod
    def check_prefill_chunk(prefill_chunk) -> None:
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise LosslessError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")

    @property
    def active(self) -> list[Sequence]:
        return [s for s in self.sequences if s.finished is None]

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One forward over the active sequences' rows (a joining one's next prompt chunk, while the step's
        `prefill_chunk` rows last): commit each one's new tokens (calling its `on_tokens`). Returns the sequences
        that finished in it or before it (e.g. by `finish`), which leave the batch. A sequence whose own part of
        the step fails (its token choice, its commit, its `on_tokens`) ends with finish reason "error" and the
        exception in `error`; the others' step goes on (the forward itself failing fails the step)."""
        fed = self._feed(self.active)  # sequence -> how many of its pending rows run now (a prompt: a chunk)
        if fed:
            for seq, n in fed.items():  # 1. propose: prompt lookup's copies after the last token, where it applies
                seq.drafts = self._lookup(seq) if n == len(seq.pending) else []
            logits = self._forward(fed)  # 2. verify: one forward, each sequence's rows seeing its own keys
            for seq, rows in logits.items():  # 3. accept, 4. commit (a sequence whose whole prompt has run)
                try:
                    self._commit(seq, rows)
                except Exception as exc:  # noqa: BLE001 - its sampling, commit or callback: it alone ends
                    seq.error = exc
                    seq.state.finished = "error"
        ended = [s for s in self.sequences if s.finished is not None]
        self.sequences = [s for s in self.sequences if s.finished is None]
        self._maybe_compact()
        return ended

    def _feed(self, live: list[Sequence]) -> dict[Sequence, int]:
        """How many pending rows each sequence runs this step: a decoding one its last token; a joining one the next
        chunk of its prompt, in the order they joined, while the step's `prefill_chunk` prompt rows last (one that
        finds none left waits a step; the first one always gets some)."""
        fed, room = {}, self.prefill_chunk
        for seq in live:
            n = len(seq.pending) if len(seq.pending) == 1 else min(len(seq.pending), room)
            if n:
                fed[seq] = n
                room -= n if len(seq.pending) > 1 else 0
        return fed

    def _lookup(self, seq: Sequence) -> list[int]:
        cfg, state = seq.cfg, seq.state
        if not cfg.lookup or not state.generated:
            return []
        room = cfg.max_new_tokens - len(state.generated) - 1  # never verify past max_new_tokens
        copy, size = lookup_proposal(state.tokens, min(cfg.lookup, room))
        # a match this short is right too rarely to pay for its rows beside every other sequence's
        return copy if size >= LOOKUP_ALONE else []

    def _forward(self, fed: dict[Sequence, int]) -> dict[Sequence, torch.Tensor]:
        """The shared forward over each sequence's first `fed[seq]` pending rows (and its lookup copies): per
        sequence that makes a choice now, the logits [len(rows), V] of the rows it needs (a prompt's last row, a
        step's row and its copies' rows). A chunk that leaves some of its prompt pending needs none."""
        n = self.cache.get_seq_length()
        live = list(fed)
        ids, positions, spans = [], [], []
        for seq in live:
            rows = [*seq.pending[:fed[seq]], *seq.drafts]
            spans.append((len(ids), len(rows)))
            ids += rows
            held = seq.state.cache.get_seq_length()
            positions += range(held, held + len(rows))
        r = len(ids)
        # each row sees its own sequence's keys and its sequence's rows before it in this forward: only the live
        # sequences' positions are written, the rest of the mask (dead rows, other sequences) stays hidden
        mask = torch.full((r, n + r), torch.finfo(self.model.dtype).min, dtype=self.model.dtype)
        for seq, (start, m) in zip(live, spans):
            if seq.state.cache.get_seq_length():
                mask[start:start + m].index_fill_(1, seq.state.cache.index(), 0)
            mask[start:start + m, n + start:n + start + m].triu_(1)  # 0 on and below the diagonal
        device = self.model.device
        out = self.model.backbone.model(input_ids=torch.tensor([ids], device=device),
                                        position_ids=torch.tensor([positions], device=device),
                                        attention_mask=mask[None, None].to(device), cache=self.cache, use_cache=True)
        # the LM head on the rows a choice is made from: a prompt's last row, a step's row and its copies' rows
        wanted = {}
        for seq, (start, m) in zip(live, spans):
            if fed[seq] == len(seq.pending):
                wanted[seq] = (start + fed[seq] - 1, start + m)
            else:
                seq.pending = seq.pending[fed[seq]:]
            seq.state.cache.append(n + start, m)
            seq.state.stats.forwards += 1
            if len(live) > 1 and m < 16:  # rows of a step, not a prompt chunk: interleaved with the others'
                self.mixed += m
        if not wanted:
            return {}
        index = torch.tensor([i for a, b in wanted.values() for i in range(a, b)], device=device)
        logits = self.model.backbone.lm_head(out.last_hidden_state[0].index_select(0, index))
        pieces, at = {}, 0
        for seq, (a, b) in wanted.items():
            pieces[seq] = logits[at:at + b - a]
            at += b - a
        return pieces

    def _commit(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Phases 3-4 for one sequence: logits [1 + len(drafts), V] from its last fed token on."""
        state, cfg = seq.state, seq.cfg
        prefill = not state.generated
        if cfg.sampling.greedy:
            n_accepted, token = accept_greedy(seq.drafts, logits) if seq.drafts else (0, int(argmax(logits[0])))
        elif seq.drafts:  # copies, kept where AR's draw chooses them
            n_accepted, token = accept_sampling(seq.drafts, None, logits, cfg.sampling, seq.draws, len(state.generated))
        else:
            n_accepted, token = 0, cfg.sampling.token(logits[0], seq.draws, len(state.generated))
        if seq.drafts:
            state.stats.accepted.append(n_accepted)
        new = commit(state, [*seq.drafts[:n_accepted], token], cfg, logits[: n_accepted + 1])
        if not prefill:
            state.stats.steps += 1
        seq.pending, seq.drafts = [state.tokens[-1]], []
        state.stats.seconds = time.perf_counter() - seq.started
        if seq.on_tokens is not None and new:
            seq.on_tokens(new)
        if state.finished is None and cfg.stop_after is not None and len(state.generated) >= cfg.stop_after:
            state.finished = "stop"

    def _maybe_compact(self) -> None:
        live = sum(s.state.cache.get_seq_length() for s in self.sequences)
        dead = self.cache.get_seq_length() - live
        if dead >= max(COMPACT_AT, live) or self.mixed >= max(COMPACT_AT, live // MIXED_SHARE):
            self.compact()

    def compact(self) -> None:
        """Copy the live rows of the shared cache into a new one, each sequence's in order (the same keys and
        values, so the same bits in every later forward)."""
        fresh = self.model.new_cache()
        if any(s.state.cache.get_seq_length() for s in self.sequences):
            index = torch.cat([s.state.cache.index() for s in self.sequences]).to(self.model.device)
            for i, layer in enumerate(self.cache.layers):
                fresh.update(layer.keys.index_select(2, index), layer.values.index_select(2, index), i)
        at = 0
        for s in self.sequences:
            s.state.cache.renumber(at)
            at += s.state.cache.get_seq_length()
        self.cache = fresh
        self.compactions += 1
        self.mixed = 0
