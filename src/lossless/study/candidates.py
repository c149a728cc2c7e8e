"""Candidates: the speculative decoders the audit compares with the AR greedy reference.

A candidate turns (model, prompt ids, the audit's decode settings, the AR reference of its own kernel) into
one greedy trajectory, a `CandidateRun`. Built in:

- `orthrus`: the two-pass Orthrus cycle with the model's draft head (the audit's original subject);
- `orthrus-fused`: the fused cycle (one forward verifies a block and drafts the next);
- `orthrus-tree`: the two-pass cycle verifying a tree of DEFAULT_TREE draft candidates (the top drafts and
  their runners-up) in one forward;
- `orthrus-lookup`: the two-pass cycle with prompt lookup beside the drafts (DEFAULT_LOOKUP tokens copied
  from earlier context; a match of two or more tokens is verified alone, without a draft pass);
- `orthrus-tree-lookup`: both, the library's fastest greedy cycle (`--tree --lookup`);
- `oracle`: our decode loop with the reference trajectory itself as the drafter, so every draft is right
  and any divergence comes from verifying several tokens in one forward (runs under every kernel, exact
  mode included);
- `prompt-lookup`: Hugging Face `generate(prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)`, greedy;
- `self-assisted`: Hugging Face assisted generation with the model as its own assistant: its drafts are
  the model's own greedy choices, so, as with `oracle`, a divergence is verification's alone;
- `hf-greedy`: plain Hugging Face `generate`, greedy: a control for the HF candidates (no speculation);
- `llama.cpp-<mode>`: llama.cpp's server decoding with one of its speculative modes (`llamacpp.MODES`: the
  n-gram modes `ngram-simple`, `ngram-map-k`, `ngram-map-k4v`, `ngram-mod`, `ngram-cache`, and `draft`, a draft
  model made of the embedded model's own 4-bit file), audited under the kernel `llama.cpp` only, against
  llama.cpp's own greedy decoding of the same file: its losslessness, on its own kernels.

and `module:function`: any importable callable `(model, prompt_ids, max_new_tokens) -> generated token
ids` (a list or a 1-D tensor; greedy; generated ids only, ending at EOS (kept) or max_new_tokens, like the
reference). `model` is the `OrthrusLM`: `model.backbone` is the Hugging Face model, `model.tokenizer`,
`model.eos_token_ids()`, `model.device`.

Candidates that run Hugging Face `generate` need the backbone's own kernels; under `attn=exact` they are
refused, never run on other kernels, and so is a user's decoder unless the function carries
`lossless_exact = True` (it says it decodes through the model's own passes, e.g. with `lossless.decode`). Only Orthrus and the oracle run the decode loop, so only they report
accepted drafts and tokens per cycle; the others leave those fields empty.

This module knows decoders and names. It does not know records, files or plans (that is `audit.py`).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..decoding.loop import DecodeConfig, block_size, decode
from ..errors import LosslessError
from .llamacpp import MODES
from ..names import DEFAULT_LOOKUP, DEFAULT_TREE, EXACT, LLAMA_CPP

PROMPT_LOOKUP_TOKENS = 10  # draft length of prompt lookup (the Hugging Face documentation's suggestion)
DEFAULT = "orthrus"


@dataclass
class CandidateRun:
    """One candidate trajectory and what it cost; fields a candidate cannot measure stay None."""
    ids: list[int]  # generated ids only
    seconds: float
    forwards: int | None = None  # model forwards, prefill included (self-assisted: target and assistant)
    margins: list[float] | None = None  # top-1 minus top-2 logit per generated token
    accepted: list[int] | None = None  # drafts accepted per cycle (decode-loop candidates only)
    tokens_per_step: float | None = None
    cycle: str | None = None  # "two-pass" | "fused" for Orthrus
    k: int | None = None  # block size of decode-loop candidates
    tops: list[list[list]] | None = None  # the top [[id, logit], ...] per generated token (decoding.top_tokens)


# (model, prompt_ids, cfg, reference ids of the candidate's own kernel) -> CandidateRun
Runner = Callable[[object, list[int], DecodeConfig, list[int]], CandidateRun]


@dataclass(frozen=True)
class Candidate:
    name: str
    run: Runner
    hf_generate: bool = False  # runs Hugging Face generate: stock kernels only
    exact_ok: bool = True  # may run under attn=exact (a user's decoder only if it says so)
    engine: str | None = None  # decodes in another engine (llama.cpp): audited under that kernel only


# ------------------------------------------------------------------------------------ decode-loop ones
def _from_state(state, cycle: str | None, k: int) -> CandidateRun:
    s = state.stats
    return CandidateRun(list(state.generated), s.seconds, s.forwards, list(state.margins), list(s.accepted),
                        round(s.tokens_per_step, 4), cycle, k, tops=list(state.tops))


def run_orthrus(model, ids, cfg, reference):
    cfg = dataclasses.replace(cfg, cycle="two-pass")
    return _from_state(decode(model, ids, "orthrus", cfg), "two-pass", block_size(model.k, cfg))


def run_orthrus_fused(model, ids, cfg, reference):
    cfg = dataclasses.replace(cfg, cycle="fused")
    return _from_state(decode(model, ids, "orthrus", cfg), "fused", block_size(model.k, cfg))


def run_orthrus_tree(model, ids, cfg, reference):
    cfg = dataclasses.replace(cfg, cycle="two-pass", tree=cfg.tree or DEFAULT_TREE)
    return _from_state(decode(model, ids, "orthrus", cfg), "two-pass", block_size(model.k, cfg))


def run_orthrus_lookup(model, ids, cfg, reference):
    cfg = dataclasses.replace(cfg, cycle="two-pass", lookup=cfg.lookup or DEFAULT_LOOKUP)
    return _from_state(decode(model, ids, "orthrus", cfg), "two-pass", block_size(model.k, cfg))


def run_orthrus_tree_lookup(model, ids, cfg, reference):
    cfg = dataclasses.replace(cfg, cycle="two-pass", tree=cfg.tree or DEFAULT_TREE, lookup=cfg.lookup or DEFAULT_LOOKUP)
    return _from_state(decode(model, ids, "orthrus", cfg), "two-pass", block_size(model.k, cfg))


def oracle_drafter(reference: list[int]):
    """A drafter proposing the reference's own next tokens: all drafts right while the trajectories agree."""
    def drafter(model, state, k, sampling, draws):
        n = len(state.generated)
        return list(reference[n: n + k - 1]), None
    return drafter


def run_oracle(model, ids, cfg, reference):
    cfg = dataclasses.replace(cfg, cycle="two-pass")
    state = decode(model, ids, "orthrus", cfg, drafter=oracle_drafter(reference))
    return _from_state(state, "two-pass", block_size(model.k, cfg))


# ------------------------------------------------------------------------------------------ HF generate
def hf_generate(model, ids: list[int], max_new_tokens: int, assistant=None, **kwargs) -> CandidateRun:
    """Greedy Hugging Face `generate` on the model's backbone (its dtype and kernel), stopping at the same
    EOS ids and length as the reference; `kwargs` are generation-config fields, `assistant` an assistant
    model. Forwards are counted by a hook on the backbone."""
    from transformers import GenerationConfig

    eos = list(model.eos_token_ids())
    x = torch.tensor([ids], device=model.device)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                           pad_token_id=eos[0] if eos else None, **kwargs)
    calls = [0]
    hook = model.backbone.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.backbone.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen,
                                          assistant_model=assistant)
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    return CandidateRun(out[0, len(ids):].tolist(), seconds, calls[0])


def run_prompt_lookup(model, ids, cfg, reference):
    return hf_generate(model, ids, cfg.max_new_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)


def run_self_assisted(model, ids, cfg, reference):
    from transformers import GenerationConfig

    # generate keeps the assistant's draft schedule on the assistant's own generation_config; this one is
    # the model's, so it is restored afterwards
    saved = model.backbone.generation_config
    model.backbone.generation_config = GenerationConfig.from_dict(saved.to_dict())
    try:
        return hf_generate(model, ids, cfg.max_new_tokens, assistant=model.backbone)
    finally:
        model.backbone.generation_config = saved


def run_hf_greedy(model, ids, cfg, reference):
    return hf_generate(model, ids, cfg.max_new_tokens)


# ------------------------------------------------------------------------------------------- llama.cpp
def llama_cpp_runner(mode: str) -> Runner:
    """A speculative mode of llama.cpp's server; `model` is the audit's `llamacpp.Engine`."""
    def run(model, ids, cfg, reference):
        d = model.decode(mode, ids, cfg.max_new_tokens)
        return CandidateRun(d.ids, d.seconds, margins=d.margins, tops=d.tops)
    return run


LLAMA_CPP_PREFIX = f"{LLAMA_CPP}-"

BUILTIN = {
    "orthrus": Candidate("orthrus", run_orthrus),
    "orthrus-fused": Candidate("orthrus-fused", run_orthrus_fused),
    "orthrus-tree": Candidate("orthrus-tree", run_orthrus_tree),
    "orthrus-lookup": Candidate("orthrus-lookup", run_orthrus_lookup),
    "orthrus-tree-lookup": Candidate("orthrus-tree-lookup", run_orthrus_tree_lookup),
    "oracle": Candidate("oracle", run_oracle),
    "prompt-lookup": Candidate("prompt-lookup", run_prompt_lookup, hf_generate=True),
    "self-assisted": Candidate("self-assisted", run_self_assisted, hf_generate=True),
    "hf-greedy": Candidate("hf-greedy", run_hf_greedy, hf_generate=True),
    **{LLAMA_CPP_PREFIX + mode: Candidate(LLAMA_CPP_PREFIX + mode, llama_cpp_runner(mode), engine=LLAMA_CPP)
       for mode in MODES},
}


# ---------------------------------------------------------------------------------------- your own
def _user_runner(fn: Callable, spec: str) -> Runner:
    def run(model, ids, cfg, reference):
        start = time.perf_counter()
        out = fn(model, list(ids), cfg.max_new_tokens)
        seconds = time.perf_counter() - start
        if isinstance(out, torch.Tensor):
            out = out.reshape(-1).tolist()
        try:
            tokens = [int(t) for t in out]
        except (TypeError, ValueError):
            raise LosslessError(f"candidate '{spec}' returned {type(out).__name__}, not a list of token ids") from None
        return CandidateRun(tokens, seconds)
    return run


def load_user_candidate(spec: str) -> Candidate:
    """`module:function` -> a Candidate calling it; the working directory is importable, as for scripts."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise LosslessError(f"candidate '{spec}': expected module:function, e.g. my_decoders:lookup_5")
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LosslessError(f"candidate '{spec}': cannot import module '{module_name}' ({exc})") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise LosslessError(f"candidate '{spec}': module '{module_name}' has no '{attr}'")
    if not callable(fn):
        raise LosslessError(f"candidate '{spec}': '{attr}' is not callable")
    return Candidate(spec, _user_runner(fn, spec), exact_ok=getattr(fn, EXACT_MARK, False) is True)


# ------------------------------------------------------------------------------------------------ names
def parse_candidates(text: str | list[str]) -> list[str]:
    """"orthrus,oracle" -> ["orthrus", "oracle"], each checked (user candidates imported) before any work."""
    names = text if isinstance(text, list) else list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not names:
        raise LosslessError("--candidates needs at least one value")
    for name in names:
        resolve(name)
    return names


def resolve(name: str) -> Candidate:
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" in name:
        return load_user_candidate(name)
    raise LosslessError(f"unknown candidate '{name}': choose from {', '.join(BUILTIN)}, or give module:function")


EXACT_MARK = "lossless_exact"  # a user's decoder sets fn.lossless_exact = True to run under attn=exact


def check_kernel(name: str, attn: str) -> None:
    """Refuse a candidate that cannot run under `attn` (HF generate cannot drive the exact kernels; a user's
    decoder runs there only if it declares that it decodes with the model's own exact-mode passes)."""
    candidate = resolve(name)
    if candidate.engine != (attn if attn == LLAMA_CPP else None):
        if candidate.engine:
            raise LosslessError(f"candidate '{name}' decodes in {candidate.engine}: audit it under the kernel "
                                f"{candidate.engine} (--configs bf16/{candidate.engine}), against {candidate.engine}'s own AR")
        raise LosslessError(f"under the kernel {attn} llama.cpp decodes: audit its speculative modes there "
                            f"({', '.join(n for n, c in BUILTIN.items() if c.engine)}), not '{name}'")
    if attn == EXACT and not candidate.exact_ok:
        fn = name.partition(":")[2]
        raise LosslessError(f"candidate '{name}' does not say it runs exact mode's kernels: set {fn}.{EXACT_MARK} = "
                            f"True if it decodes through the model it is given (lossless.decode), or audit it under sdpa")
    if attn == EXACT and candidate.hf_generate:
        raise LosslessError(f"candidate '{name}' runs Hugging Face generate, which cannot drive the exact kernels: "
                            f"audit it under sdpa or eager")
