"""Tiny random backbones (2 layers) shared by the unit tests."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lossless.model import OrthrusLM

VOCAB = 64


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
