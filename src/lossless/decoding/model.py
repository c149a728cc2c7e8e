"""`OrthrusLM`: a frozen Hugging Face causal LM with a draft view, and its three forward passes.

- `prefill(ids)`: the AR view over the prompt; returns a fresh KV cache and the last position's logits.
- `verify(cache, block_ids)`: the AR view over a block, appending the block to the cache.
- `draft(cache, last_token, k)`: the draft view over `[last_token, MASK x (k-1)]`; reads the cache,
  never writes it, and returns the k-1 draft logits.

Positions are always passed explicitly (`pos` = absolute position of a block's first token) so the
cache length is the only state; `decoding.commit_cache` is the one function that shortens it.

This module owns the model's passes and its kernel choice (`set_attn`). It does not know decoding
policy (acceptance, sampling, stopping): `generate` hands the loop to `loop.py`, which sees the
model only through its `DecodingModel` protocol, so imports go one way (model -> decoding).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from . import exact, kernels
from .cache import GrowingLayer, growing_cache, stack_keep_rows
from . import head as headfile
from .loop import DecodeConfig, GenerationOutput, auto_cycle, block_size, decode, versus_ar
from ..dtypes import dtype_name
from .dualview import (DraftSpec, additive_mask, backbone_parameters, block_visibility, diff_parameters,
                       diff_reference_parameters, draft_adapter_rank, draft_adapters_restored_on_error,
                       install_dual_view, set_draft_adapter, tree_visibility)
from ..errors import LosslessError
from ..names import EXACT, EXACT_PREFILL_CHUNK, check_attn


class OrthrusLM(nn.Module):
    """A backbone with the dual view installed, plus its tokenizer and head identity.

    `k` is the head's block size (drafts per cycle = k - 1). When `mask_token_id` is None the block's
    mask positions use the learned `mask_embedding` (initialised to the mean token embedding).
    """

    def __init__(self, backbone: nn.Module, tokenizer=None, *, k: int = 8, mask_token_id: int | None = None,
                 name: str = "", attn: str = "sdpa"):
        super().__init__()
        install_dual_view(backbone)
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.name = name or getattr(backbone.config, "_name_or_path", "")
        self.attn = attn  # the kernel the backbone runs; change it with `set_attn`
        self.exact_ops: list[str] = []  # what exact mode replaced, when attn is "exact"
        self.k = int(k)
        self.mask_token_id = mask_token_id
        self.fingerprint = headfile.backbone_fingerprint(backbone)
        self.signature = headfile.backbone_signature(backbone)
        emb = backbone.get_input_embeddings().weight
        if mask_token_id is None:
            self.mask_embedding = nn.Parameter(emb.detach().float().mean(0).to(emb.dtype).clone())
        else:
            self.mask_embedding = None
        self.head_info = headfile.HeadConfig(k=self.k, backbone_fingerprint=self.fingerprint,
                                             backbone_signature=self.signature,
                                             mask_token_id=mask_token_id, backbone=self.name)
        self.head_digest = headfile.UNTRAINED  # identity of the loaded head (see head.head_digest)
        self.head_dir: Path | None = None  # the directory the head was loaded from (its cycle profile: `cycles`)
        self._choice = None  # (what it depends on, `cycles.default_inputs`) of `default_choice`
        self._sampling_costs = None  # (what they depend on, `cycles.sampling_inputs`) of `sampling_choice`
        self.eval()

    # ----------------------------------------------------------------------------------------- identity
    @property
    def config(self):
        return self.backbone.config

    def _held_parameter(self) -> torch.Tensor:
        """A parameter of the backbone that holds its values (exact mode keeps some weights as panels only, their
        `weight` a meta tensor): where the model lives and in which dtype."""
        emb = self.backbone.get_input_embeddings().weight
        if not emb.is_meta:
            return emb
        # where one was found last time (every forward asks, and a search over the parameters costs about 0.1 ms),
        # if it still holds its values: a frozen one where there is one (a norm's: never released nor replaced)
        # (looked up by its module's path, so a module put in that place answers, not one taken out of the model)
        path, name = self.__dict__.get("_held_at", (None, None))
        try:
            held = self.backbone.get_submodule(path)._parameters.get(name) if path is not None else None
        except AttributeError:
            held = None
        if held is None or held.is_meta or self.__dict__.get("_held_in") is not self.backbone:
            found = [(path, n, p) for path, m in self.backbone.named_modules() for n, p in m._parameters.items()
                     if p is not None and not p.is_meta]
            path, name, held = min(found, key=lambda f: f[2].requires_grad)  # the first frozen one, else the first
            self.__dict__["_held_at"], self.__dict__["_held_in"] = (path, name), self.backbone
        return held

    @property
    def device(self) -> torch.device:
        return self._held_parameter().device

    @property
    def dtype(self) -> torch.dtype:
        return self._held_parameter().dtype

    @property
    def dtype_name(self) -> str:
        return dtype_name(str(self.dtype).removeprefix("torch."))

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def eos_token_ids(self) -> list[int]:
        """Every EOS id the model declares: generation config, model config and tokenizer."""
        ids: list[int] = []
        sources = [getattr(self.backbone, "generation_config", None), self.config]
        for src in sources:
            value = getattr(src, "eos_token_id", None) if src is not None else None
            if value is None:
                continue
            ids.extend(value if isinstance(value, (list, tuple)) else [value])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted({int(i) for i in ids})

    # ------------------------------------------------------------------------------------------- head
    def head_parameters(self) -> dict[str, nn.Parameter]:
        """Trainable draft-head parameters by head-file name."""
        params = dict(diff_parameters(self.backbone))
        if self.mask_embedding is not None:
            params["mask_embedding"] = self.mask_embedding
        return params

    def backbone_parameters(self) -> dict[str, nn.Parameter]:
        return backbone_parameters(self.backbone)

    def set_draft_adapter(self, rank: int) -> None:
        """Give the draft view fresh MLP adapters of `rank` (drafts unchanged until trained), or none (0)."""
        set_draft_adapter(self.backbone, rank)
        self.head_info.draft_adapter = rank
        self._cover_new_modules()

    def _cover_new_modules(self) -> None:
        """In exact mode, put modules added since (a draft adapter) on the fixed-order kernels too."""
        if self.attn == EXACT:
            self.exact_ops = exact.make_batch_invariant(self.backbone)

    @property
    def draft_adapter(self) -> int:
        """The rank of the draft view's MLP adapters (0: none)."""
        return draft_adapter_rank(self.backbone)

    def save_head(self, path: str | Path, training: dict | None = None, encoding: str = "full") -> Path:
        """Write the current head. encoding "delta_int8" stores int8 deltas over the AR weights."""
        if encoding not in headfile.ENCODINGS:
            raise LosslessError(f"unknown head encoding '{encoding}': choose one of {', '.join(headfile.ENCODINGS)}")
        info = headfile.HeadConfig(**{**self.head_info.__dict__})
        info.encoding = encoding
        if training is not None:
            info.trained, info.training = True, training
        tensors = {n: p.detach().float() for n, p in self.head_parameters().items()}
        if encoding == "delta_int8":
            tensors = headfile.encode_delta_int8(tensors, diff_reference_parameters(self.backbone))
        return headfile.save_head(path, tensors, info)

    def load_head(self, path: str | Path) -> None:
        tensors, info = headfile.load_head(path)
        self.load_head_tensors(tensors, info, source=str(path))
        self.head_dir = Path(path) if Path(path).is_dir() else Path(path).parent  # where its cycle profile may be

    def load_head_tensors(self, tensors: dict[str, torch.Tensor], info: headfile.HeadConfig, source: str = "") -> None:
        if info.backbone_fingerprint != self.fingerprint or not headfile.signatures_match(info.backbone_signature,
                                                                                           self.signature):
            raise LosslessError(
                f"head {source} was made for another backbone ({info.backbone or info.backbone_fingerprint}); "
                f"train one for {self.name} or pass the matching --model"
            )
        digest = headfile.head_digest(tensors, info)
        if info.encoding not in headfile.ENCODINGS:
            raise LosslessError(f"head {source} uses unknown encoding '{info.encoding}'")
        with draft_adapters_restored_on_error(self.backbone):  # a refused head leaves the model's own head
            if info.draft_adapter != self.draft_adapter:
                set_draft_adapter(self.backbone, info.draft_adapter)
                self._cover_new_modules()
            if info.encoding == "delta_int8":
                tensors = headfile.decode_delta_int8(tensors, diff_reference_parameters(self.backbone))
            params = self.head_parameters()
            missing = sorted(set(params) - set(tensors))
            unexpected = sorted(set(tensors) - set(params))
            if missing or unexpected:
                raise LosslessError(f"corrupt head {source}: missing {missing[:3]} unexpected {unexpected[:3]}")
            for name, p in params.items():  # check everything before touching the model's weights
                if tensors[name].shape != p.shape:
                    raise LosslessError(f"corrupt head {source}: {name} has shape {tuple(tensors[name].shape)}, "
                                        f"expected {tuple(p.shape)}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors[name].to(p.dtype))
        self.k, self.head_info, self.head_digest, self.head_dir = int(info.k), info, digest, None

    # ------------------------------------------------------------------------------------------ kernels
    def set_attn(self, attn: str) -> list[str]:
        """Choose the kernels: "sdpa" or "eager" (stock), or "exact" (batch-invariant, CPU only; see `exact`).
        Returns what exact mode replaced ([] otherwise).

        Exact mode replaces module classes in place, so a model in exact mode stays there."""
        check_attn(attn)
        if self.attn == EXACT and attn != EXACT:
            raise LosslessError("this model runs exact kernels; load it again for another attention kernel")
        if attn == EXACT:
            exact.check_device(self.device)
            if self.attn != EXACT:
                self.exact_ops = exact.make_batch_invariant(self.backbone)
        else:
            self.backbone.set_attn_implementation(attn)
        self.attn = attn
        return self.exact_ops

    # ---------------------------------------------------------------------------------------- forwards
    def weights_fixed(self):
        """A block within which no weight changes (a decode call): exact mode's layer stack checks that it still
        holds the weights it was made from at its first forward in the block, not at every one."""
        return exact.weights_fixed()

    def new_cache(self) -> DynamicCache:
        return growing_cache(self.config)

    def _lm_forward(self, ids: torch.Tensor | list[int], pos: int, cache: DynamicCache,
                    last_only: bool = False) -> torch.Tensor:
        """AR view over `ids` ([1, q], or a list of q) at positions pos..pos+q-1, appending to `cache`. Returns
        logits [q, V] (or [1, V] for the last position only, which spares a prefill the LM head on every row)."""
        hidden = self._stack_rows(cache, pos, ids=ids)
        if hidden is None:
            ids = ids if isinstance(ids, torch.Tensor) else torch.tensor([ids], device=self.device)
            position_ids = torch.arange(pos, pos + ids.shape[1], device=self.device)[None]
            hidden = self._hidden(input_ids=ids, position_ids=position_ids, cache=cache, use_cache=True)
        hidden = hidden[None]
        # (the backbone's layers, then its LM head, as its own forward runs them)
        return self.backbone.lm_head(hidden[:, -1:] if last_only else hidden)[0]

    def _hidden(self, **kwargs) -> torch.Tensor:
        """The backbone's layers over one sequence: last hidden states [q, d] (exact mode: without the module call
        where it may)."""
        layers = self.backbone.model
        if isinstance(layers, exact.FusedStackMixin):
            return layers.lossless_hidden(**kwargs)
        return layers(**kwargs).last_hidden_state[0]

    def _stack_rows(self, cache: DynamicCache, start: int, **rows) -> torch.Tensor | None:
        """Exact mode's layer stack over a decode forward's rows, with no module call on the way
        (`FusedStackMixin.lossless_rows`): last hidden states [q, d], or None where the module path runs."""
        layers = self.backbone.model
        if isinstance(layers, exact.FusedStackMixin):
            return layers.lossless_rows(cache, start, **rows)
        return None

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
        """Run the prompt through the AR view. Returns (cache holding the prompt, last-position logits [V])."""
        cache = self.new_cache()
        ids = torch.tensor([prompt_ids], device=self.device)
        # in exact mode the prefill runs the fixed-order kernels too: every trajectory starts from its cache; in
        # chunks of EXACT_PREFILL_CHUNK rows, each attending to the keys the earlier ones wrote (the same keys in the
        # same order as one pass, so the same bits), which bounds the pass's working memory
        step = EXACT_PREFILL_CHUNK if self.attn == EXACT and EXACT_PREFILL_CHUNK else ids.shape[1]
        for start in range(0, ids.shape[1], step):
            logits = self._lm_forward(ids[:, start:start + step], start, cache, last_only=True)
        return cache, logits[-1]

    @torch.no_grad()
    def score(self, context: list[int], response: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced AR scoring of `response` after `context` (non-empty), in one stock-kernel pass.
        Returns (log p of each response token [n] in fp32, whether each was the argmax [n] bool).

        The one AR scoring path: the audit's response perplexity and the lm-eval log-likelihoods."""
        n = len(response)
        if not context:
            raise LosslessError("scoring needs at least one context token")
        if n == 0:
            return torch.empty(0, device=self.device), torch.empty(0, dtype=torch.bool, device=self.device)
        ids = torch.tensor([context + response[:-1]], device=self.device)
        with exact.stock_kernels():  # scoring needs no batch invariance
            logits = self.backbone(input_ids=ids, use_cache=False, logits_to_keep=n).logits[0, -n:]
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(response, device=self.device)
        return logp.gather(1, target[:, None])[:, 0], logp.argmax(-1) == target

    @torch.no_grad()
    def verify(self, cache: DynamicCache, block_ids: list[int]) -> torch.Tensor:
        """AR view over `block_ids`, which start at position cache length. Returns logits [len(block), V]."""
        return self._lm_forward(block_ids, cache.get_seq_length(), cache)

    @torch.no_grad()
    def step(self, cache: DynamicCache, token: int) -> torch.Tensor:
        """One AR decoding step: feed `token` at position cache length. Returns next-token logits [V]."""
        return self.verify(cache, [token])[-1]

    @torch.no_grad()
    def verify_tree(self, cache: DynamicCache, ids: list[int], parents: list[int]) -> torch.Tensor:
        """AR view over a token tree starting at position cache length: row 0 is the root, row i (> 0) has
        parent row parents[i] < i and sits one position after it. Each row sees the cache, its ancestors and
        itself; every row is appended to the cache (`keep_cache_rows` keeps a path). Returns logits [len(ids), V]."""
        pos = cache.get_seq_length()
        visible, depth = tree_visibility(parents, pos)
        hidden = self._stack_rows(cache, pos, ids=ids, depth=depth, visible=visible)
        if hidden is None:
            position_ids = torch.tensor([[pos + d for d in depth]], device=self.device)
            # exact mode reads which keys a row sees as they are; other kernels take the additive mask
            mask = visible[None, None] if self.attn == EXACT else additive_mask(visible, self.dtype).to(self.device)
            hidden = self._hidden(input_ids=torch.tensor([ids], device=self.device), position_ids=position_ids,
                                  attention_mask=mask, cache=cache, use_cache=True)
        return self.backbone.lm_head(hidden)

    @staticmethod
    def keep_cache_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
        """Move the cache entries at start + rows[j] to start + j (a tree's accepted path), in every layer; the
        caller crops what lies beyond."""
        if rows == list(range(len(rows))) or stack_keep_rows(cache.layers, start, rows):
            return
        index = None
        for layer in cache.layers:
            if index is None or index.device != layer.keys.device:
                index = torch.tensor(rows, device=layer.keys.device) + start
            current = isinstance(layer, GrowingLayer) and layer._tiles_current()
            for tensor in (layer.keys, layer.values):
                tensor[:, :, start: start + len(rows)] = tensor.index_select(2, index)
            if isinstance(layer, GrowingLayer):
                layer.keys_rewritten(start, current)

    def block_embeddings(self, anchor_ids: torch.Tensor, k: int) -> torch.Tensor:
        """Embeddings of blocks `[anchor, MASK x (k-1)]`: anchor_ids [n] -> [1, n*k, d]."""
        embed = self.backbone.get_input_embeddings()
        anchors = embed(anchor_ids)  # [n, d]
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(anchors.dtype)
        else:
            mask = embed(torch.tensor([self.mask_token_id], device=anchor_ids.device))[0]
        n = anchor_ids.shape[0]
        masks = mask.expand(n, k - 1, -1)  # [n, k-1, d]
        block = torch.cat([anchors[:, None], masks], dim=1)  # [n, k, d]
        return block.reshape(1, n * k, anchors.shape[-1])

    def draft_hidden(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache=None,
                     spec: DraftSpec | None = None) -> torch.Tensor:
        """Draft view over block embeddings [1, q, d] at `position_ids` [1, q]. Returns logits [q, V]."""
        return self.draft_logits(self.draft_states(embeds, position_ids, cache, spec))

    def draft_states(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache=None,
                     spec: DraftSpec | None = None) -> torch.Tensor:
        """The draft view's last hidden states [q, d] (before the LM head), for callers that need logits on
        some rows only (training). In exact mode a decoding draft runs the exact kernels (here faster than the
        stock ones, and any kernel may propose); a training step, which needs gradients, the stock ones."""
        return self._hidden(inputs_embeds=embeds, position_ids=position_ids, cache=cache, use_cache=False,
                            orthrus_draft=spec or DraftSpec())

    @torch.no_grad()
    def draft(self, cache: DynamicCache, last_token: int, k: int) -> torch.Tensor:
        """Draft k-1 tokens after `last_token` (position = cache length). Returns logits [k-1, V]."""
        pos = cache.get_seq_length()
        length_before = pos
        embeds = self.block_embeddings(torch.tensor([last_token], device=self.device), k)
        hidden = self._stack_rows(cache, pos, embeds=embeds[0], draft=True)
        if hidden is not None:
            logits = self.draft_logits(hidden)
        else:
            logits = self.draft_hidden(embeds, torch.arange(pos, pos + k, device=self.device).unsqueeze(0), cache)
        assert cache.get_seq_length() == length_before, "the draft pass must not write the cache"
        return logits[: k - 1]

    @torch.no_grad()
    def verify_and_draft(self, cache: DynamicCache, block_ids: list[int], anchors: list[int],
                         width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward, two views (the fused cycle). The AR view runs over `block_ids` at positions pos.. (pos =
        cache length), causal, appended to the cache: exactly a verify pass. In the same forward, for every
        block offset n in `anchors`, a draft group `[block_ids[n], MASK x width]` at positions pos+n..
        runs through the draft view, seeing the cache and the block's keys strictly before pos+n and its
        own group bidirectionally: the layout the head was trained on. Groups are never written to the cache,
        and no verify row sees a group row.

        Returns (verify logits [len(block_ids), V], each group's draft logits [len(anchors), width, V] at its mask
        positions): one pass of the LM head over both, so its weights are read once a cycle."""
        pos = cache.get_seq_length()
        v, g, rows = len(block_ids), len(anchors), width + 1
        held = self._held_parameter()
        device, dtype = held.device, held.dtype
        ids = torch.tensor(block_ids, device=device)
        offsets = torch.tensor(anchors, dtype=torch.long, device=device)
        embeds = torch.cat([self.backbone.get_input_embeddings()(ids)[None],
                            self.block_embeddings(ids[offsets], rows)], dim=1)  # [1, v + g*rows, d]
        steps = torch.arange(rows, device=device)
        position_ids = torch.cat([pos + torch.arange(v, device=device),
                                  (pos + offsets[:, None] + steps).reshape(-1)])[None]
        causal = torch.ones(v, pos + v, dtype=torch.bool).tril(pos)  # a chain: row r sees keys 0..pos+r
        verify_mask = additive_mask(causal, dtype).to(device)
        group_mask = additive_mask(block_visibility([pos + n for n in anchors], rows, pos + v), dtype)
        spec = DraftSpec(context_mask=group_mask.to(device), verify_rows=v, verify_mask=verify_mask)
        hidden = self._hidden(inputs_embeds=embeds, position_ids=position_ids, attention_mask=verify_mask, cache=cache,
                              use_cache=True, orthrus_draft=spec)  # [v + g*rows, d]
        assert cache.get_seq_length() == pos + v, "a fused forward writes exactly its verify rows"
        masks = hidden[v:].reshape(g, rows, hidden.shape[-1])[:, 1:]  # each group's mask rows
        logits = self.backbone.lm_head(torch.cat([hidden[:v], masks.reshape(g * width, hidden.shape[-1])]))
        return logits[:v], logits[v:].reshape(g, width, logits.shape[-1])

    def default_choice(self, remeasure: bool = False, context: int | None = None):
        """What a greedy orthrus request with no cycle of its own runs after `context` positions (its prompt's
        length; None: a short one): the cycle (or AR) that this CPU's measured forward costs and the head's cycle
        profile predict fastest (`cycles.choose`), from costs and a profile (`cycles.default_inputs`) kept per
        kernels and thread count."""
        from . import cycles

        key = (cycles.costs_key(self), self.head_digest, os.environ.get(cycles.CYCLE_ENV), cycles.profile_stamp(self),
               str(self.device))
        if remeasure or self._choice is None or self._choice[0] != key:
            self._choice = (key, cycles.default_inputs(self, remeasure))
        inputs = self._choice[1]
        return inputs if isinstance(inputs, cycles.Choice) else cycles.choose(*inputs, context=context)

    def choice_for(self, greedy: bool, context: int | None = None):
        """What an orthrus request with no cycle of its own runs after `context` positions: `default_choice` if it
        is greedy, else `sampling_choice`."""
        return self.default_choice(context=context) if greedy else self.sampling_choice(context=context)

    def sampling_choice(self, remeasure: bool = False, context: int | None = None):
        """What a sampled orthrus request with no cycle of its own runs after `context` positions: the 8-node
        tree, giving way to AR where its own acceptance does not pay for its cycles on this CPU (`cycles.sampling_choice`,
        from costs kept per kernels and thread count)."""
        from . import cycles

        key = (cycles.costs_key(self), os.environ.get(cycles.CYCLE_ENV), str(self.device))
        if remeasure or self._sampling_costs is None or self._sampling_costs[0] != key:
            self._sampling_costs = (key, cycles.sampling_inputs(self, remeasure))
        return cycles.sampling_choice(self._sampling_costs[1], self.k, context=context)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over draft rows: hidden [m, d] -> logits [m, V]."""
        return self.backbone.lm_head(hidden)

    # ------------------------------------------------------------------------------------------ generate
    def resolve_cycle(self, mode: str, cycle: str, greedy: bool, tree: int | None, lookup: int | None,
                      k: int | None, context: int):
        """(mode, tree, lookup, choice) that `generate` runs for these settings after a prompt of `context` tokens:
        left at None, from this CPU's measured costs (`choice_for`, with a trained head) or the fixed defaults."""
        choice = None
        if (mode == "orthrus" and cycle == "two-pass" and tree is None and lookup is None and k is None
                and self.head_digest != headfile.UNTRAINED):  # from this CPU's measured costs (`cycles`)
            choice = self.choice_for(greedy, context=context)
            mode, tree, lookup = choice.mode, choice.tree, choice.lookup
        tree, lookup = auto_cycle(mode, cycle, greedy, self.head_digest != headfile.UNTRAINED, tree, lookup)
        return mode, tree, lookup, choice

    def draws_ar_tokens(self, settings: dict, context: int) -> bool:
        """Whether `generate` with these settings commits the tokens `--mode ar` commits for them on exact kernels:
        greedy; or sampled, in AR or a two-pass tree (with or without lookup beside it), where every committed token
        is the one AR's draw at its position chooses. A sampled chain or fused cycle draws its drafts from q and
        accepts them by rejection sampling: a draw from the same distribution, not the same draw."""
        if settings.get("temperature", 0.0) == 0:
            return True
        cycle = settings.get("cycle", "two-pass")
        mode, tree, _, _ = self.resolve_cycle(settings.get("mode", "orthrus"), cycle, False, settings.get("tree"),
                                              settings.get("lookup"), settings.get("k"), context)
        return versus_ar(mode, cycle, tree, greedy=False, exact=True) == "tokens"

    def generate(self, prompt: str | list[int], mode: str = "orthrus", *, max_new_tokens: int = 128,
                 k: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 chat_template: bool = True, cycle: str = "two-pass", groups: int | None = None,
                 tree: int | None = None, lookup: int | None = None, on_text=None,
                 on_tokens=None, stop=None, keep_cache: bool = False) -> GenerationOutput:
        """Decode `prompt` (text, or token ids used as-is) with `mode` ("ar" | "orthrus"); orthrus runs the
        `cycle` "two-pass" (draft, then verify) or "fused" (one forward per cycle, `groups` draft groups);
        `tree` > 0 (two-pass) verifies a tree of that many draft candidates instead of one chain; `lookup` > 0
        adds prompt lookup: up to that many tokens copied from earlier context (both greedy or sampled). Left at
        None (with `k`) a greedy two-pass request with a trained head runs what this CPU's measured costs predict
        fastest after its prompt (`default_choice`: a tree and lookup, or AR where no cycle pays, as after a
        long prompt; `config["choice"]` says which and why); a sampled one the 8-node tree, going on as AR where its
        own acceptance does not pay on this CPU's costs (`sampling_choice`); otherwise None takes the fixed
        defaults (`loop.auto_cycle`). 0 turns either off.

        on_text(str) receives text as tokens are committed; on_tokens(list[int]) the committed ids; stop(), asked
        after every cycle, ends decoding early when it returns True (finish reason "stop"). `keep_cache` returns
        the decode's cache in `cache` (the keys of every token but the last), for a decode that goes on elsewhere.
        Returns a GenerationOutput(text, token_ids, stats, prompt_ids, finish_reason).
        """
        from .sampling import SamplingConfig
        from ..text import StreamDecoder, encode_prompt

        prompt_ids = list(prompt) if isinstance(prompt, (list, tuple)) else encode_prompt(self.tokenizer, prompt,
                                                                                          chat_template)
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        mode, tree, lookup, choice = self.resolve_cycle(mode, cycle, sampling.greedy, tree, lookup, k, len(prompt_ids))
        cfg = DecodeConfig(max_new_tokens=max_new_tokens, k=k, cycle=cycle, groups=groups, tree=tree, lookup=lookup,
                           sampling=sampling, ar_below=choice.ar_below if choice is not None else 0.0)
        stream = StreamDecoder(self.tokenizer) if (on_text and self.tokenizer is not None) else None

        def _on_tokens(ids):
            if on_tokens:
                on_tokens(ids)
            if stream is not None:
                delta = stream.push(ids)
                if delta:
                    on_text(delta)

        state = decode(self, prompt_ids, mode, cfg, on_tokens=_on_tokens,
                       stop=(lambda _state: stop()) if stop is not None else None)
        text = self.tokenizer.decode(state.generated, skip_special_tokens=True) if self.tokenizer is not None else ""
        speculative = mode == "orthrus"
        config = {"dtype": self.dtype_name, "attn": self.attn, "exact": self.attn == EXACT, "mode": mode,
                  "cycle": cycle if speculative else None, "k": block_size(self.k, cfg) if speculative else None,
                  "tree": tree if speculative else 0, "lookup": lookup if speculative else 0,
                  "choice": choice.to_dict() if choice is not None else None,
                  "versus_ar": versus_ar(mode, cycle, tree, sampling.greedy, self.attn == EXACT),
                  "kernels": kernels.build_name() if self.attn == EXACT else None}
        return GenerationOutput(text=text, token_ids=state.generated, stats=state.stats.to_dict(),
                                prompt_ids=prompt_ids, finish_reason=state.finished, config=config,
                                cache=state.cache if keep_cache else None)


def generate(model: OrthrusLM, prompt: str | list[int], mode: str = "orthrus", **kwargs) -> GenerationOutput:
    """`model.generate(prompt, mode, ...)` as a function."""
    return model.generate(prompt, mode, **kwargs)
