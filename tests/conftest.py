"""Tiny random backbones (2 layers) shared by the unit tests, and small helpers built on them."""

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lossless.decoding.loop import DecodeConfig, decode
from lossless.decoding.model import OrthrusLM
from lossless.net import free_port  # noqa: F401  (the tests' rendezvous and servers take their ports from it)

# The tiny models are dominated by per-op overhead; with several intra-op threads on a busy machine the
# OpenMP barriers can make a single forward 100x slower. One thread keeps the suite fast and steady.
torch.set_num_threads(1)
# The default cycle follows this machine's measured costs (decoding/cycles.py): tests that use the default get the
# fixed one (tree 8 + lookup 16 with a trained head), so that what they check does not depend on the CPU's timings;
# tests of the choice itself unset this.
os.environ["LOSSLESS_CYCLE"] = "fixed"

VOCAB = 64
NO_EOS = (-1,)  # an eos_ids value no token matches: decoding runs to max_new_tokens
PROMPTS = ([1, 5, 9, 3], [7], [2, 2, 2, 2, 2, 2, 2, 2], [0, 10, 20, 30, 40, 50])


def tiny_backbone(family: str = "llama", seed: int = 0, vocab: int = VOCAB, attn: str = "sdpa"):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=vocab - 1, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    model.set_attn_implementation(attn)
    # sharpen the random LM head so greedy trajectories are not ruled by near-ties
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def tiny_orthrus(family: str = "llama", k: int = 8, seed: int = 0, **kw) -> OrthrusLM:
    return OrthrusLM(tiny_backbone(family, seed, **kw), k=k, name=f"tiny-{family}")


@pytest.fixture(params=["llama", "qwen3"])
def family(request):
    return request.param


def ar_reference(model: OrthrusLM, prompt: list[int], max_new_tokens: int, eos_ids=NO_EOS) -> list[int]:
    """Greedy AR continuation of `prompt` (by default ignoring EOS, so exactly max_new_tokens ids)."""
    state = decode(model, prompt, "ar", DecodeConfig(max_new_tokens=max_new_tokens, eos_ids=tuple(eos_ids)))
    return state.generated


def assert_stops_at_length_and_at_eos(model: OrthrusLM, prompts, max_new: int, n_ref: int, eos_at: int, **cfg) -> None:
    """Orthrus with the DecodeConfig fields `cfg` stops exactly at `max_new` tokens, and right after an EOS
    (the reference's token at `eos_at`) that falls inside a multi-token cycle; both times with AR's tokens."""
    for prompt in prompts:
        ref = ar_reference(model, prompt, n_ref)
        state = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=max_new, eos_ids=NO_EOS, **cfg))
        assert state.generated == ref[:max_new] and state.finished == "length"
        eos = ref[eos_at]
        state = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=n_ref, eos_ids=(eos,), **cfg))
        assert state.generated == ref[: ref.index(eos) + 1] and state.finished == "eos"


def plain_and_noisy_models(noise: float = 0.3) -> dict[str, tuple[OrthrusLM, OrthrusLM]]:
    """Per family, two tiny k=8 models: one with its untrained head and one whose head is perturbed (so its
    drafts are partly wrong)."""
    out = {}
    for fam in ("llama", "qwen3"):
        plain, noisy = tiny_orthrus(fam, k=8), tiny_orthrus(fam, k=8)
        perturb_head(noisy, noise)
        out[fam] = (plain, noisy)
    return out


def perturb_head(model: OrthrusLM, scale: float = 1.0, seed: int = 1234) -> None:
    """Add Gaussian noise (scale x each tensor's std) to every head parameter, so q differs from p."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.head_parameters().values():
            std = float(p.float().std()) if p.numel() > 1 else 1.0
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale * (std or 1.0))


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer over "<s> w1 .. w{vocab-3} <unk> </s>" (ids 0 .. vocab-1, EOS = vocab-1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<s>": 0, **{f"w{i}": i for i in range(1, vocab - 2)}, "<unk>": vocab - 2, "</s>": vocab - 1}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<s>")


def save_tiny_model_dir(path: Path, family: str = "llama", seed: int = 0, tokenizer: bool = True) -> Path:
    """Write a tiny random causal LM (and a word-level tokenizer) as a local Hugging Face directory."""
    path = Path(path)
    tiny_backbone(family, seed).save_pretrained(path)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return path


class StackCalls(list):
    """The forwards of one model that ran as one layer-stack kernel call (exact mode's `FusedStackMixin`): each
    entry the rows of one call. Use as a context manager; the model's stacks are made afresh inside it."""

    def __init__(self, model: OrthrusLM):
        super().__init__()
        self.model = model

    def __enter__(self):
        from unittest import mock

        from lossless.decoding import kernels

        calls, real = self, kernels.stack

        class Counting:
            def __init__(self):
                self.inner = real()

            def add(self, *args):
                self.inner.add(*args)

            def forward(self, x, *args):
                calls.append(x.shape[0])
                return self.inner.forward(x, *args)

            def forward_views(self, draft, verify, x, *args):  # a fused forward: (verify rows, draft rows)
                calls.append((verify, x.shape[0] - verify))
                return self.inner.forward_views(draft.inner, verify, x, *args)

        self.model.backbone.model.__dict__.pop("_lossless_stacks", None)
        self.patch = mock.patch.object(kernels, "stack", Counting)
        self.patch.start()
        return self

    def __exit__(self, *exc):
        self.patch.stop()
        self.model.backbone.model.__dict__.pop("_lossless_stacks", None)
        return False
