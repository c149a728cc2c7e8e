"""Draft heads: the frozen backbone stays bitwise unchanged, head files round-trip, foreign or corrupt
heads are refused, and checkpoints in the Orthrus authors' layout load."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

import lossless
from conftest import NO_EOS, PROMPTS, perturb_head, tiny_backbone, tiny_orthrus
from lossless.decoding.loop import DecodeConfig, decode
from lossless.errors import LosslessError
from lossless.decoding.head import HEAD_CONFIG, HEAD_WEIGHTS
from lossless.decoding.model import OrthrusLM
from lossless.decoding.sampling import SamplingConfig


def _snapshot(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in params.items()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


# ------------------------------------------------------------------------------------ frozen backbone
def test_backbone_weights_are_bitwise_unchanged_by_construction_and_decoding(family):
    backbone = tiny_backbone(family)
    before = copy.deepcopy(backbone)
    before_params = dict(before.named_parameters())
    before_buffers = dict(before.named_buffers())
    model = OrthrusLM(backbone, k=4)

    _assert_same(dict(model.backbone_parameters()), before_params)
    for temperature in (0.0, 1.0):
        for mode in ("ar", "orthrus"):
            cfg = DecodeConfig(max_new_tokens=12, eos_ids=NO_EOS, sampling=SamplingConfig(temperature=temperature))
            decode(model, PROMPTS[0], mode, cfg)
    # a head whose weights move must not move the backbone's (the diff weights are copies, not views)
    perturb_head(model, 1.0)
    decode(model, PROMPTS[0], "orthrus", DecodeConfig(max_new_tokens=12, eos_ids=NO_EOS))

    _assert_same(dict(model.backbone_parameters()), before_params)
    _assert_same(dict(model.backbone.named_buffers()), before_buffers)
    # and the AR view is still exactly the original model
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(model.backbone(input_ids=ids).logits, before(input_ids=ids).logits)


def test_backbone_parameters_are_frozen_and_head_parameters_train(family):
    model = tiny_orthrus(family, k=4)
    backbone, head = model.backbone_parameters(), model.head_parameters()
    assert backbone and head
    assert not any(p.requires_grad for p in backbone.values())
    assert all(p.requires_grad for p in head.values())
    # the two sets partition the module's parameters
    head_ids = {id(p) for p in head.values()}
    assert not head_ids & {id(p) for p in backbone.values()}
    assert {id(p) for p in model.parameters()} == head_ids | {id(p) for p in backbone.values()}
    diff = [n for n in head if "_diff." in n]
    expected = {"q_proj", "k_proj", "v_proj", "o_proj"} | ({"q_norm", "k_norm"} if family == "qwen3" else set())
    assert len(diff) == model.config.num_hidden_layers * len(expected)
    assert "mask_embedding" in head


# ------------------------------------------------------------------------------------------ head files
def test_head_save_load_round_trip_restores_tensors_k_and_fingerprint(tmp_path, family):
    model = tiny_orthrus(family, k=4)
    perturb_head(model, 1.0, seed=7)
    saved = _snapshot(model.head_parameters())
    path = model.save_head(tmp_path / "head")
    assert (path / HEAD_WEIGHTS).exists() and (path / HEAD_CONFIG).exists()

    perturb_head(model, 1.0, seed=8)
    assert not torch.equal(model.head_parameters()["layers.0.q_proj_diff.weight"],
                           saved["layers.0.q_proj_diff.weight"])
    model.load_head(path)
    _assert_same(_snapshot(model.head_parameters()), saved)

    # a fresh model of the same backbone (different k) takes the head's k and keeps the fingerprint
    other = tiny_orthrus(family, k=8)
    other.load_head(path / HEAD_WEIGHTS)  # the safetensors path works as well as the directory
    _assert_same(_snapshot(other.head_parameters()), saved)
    assert other.k == 4
    assert other.head_info.k == 4
    assert other.head_info.backbone_fingerprint == model.fingerprint == other.fingerprint
    info = json.loads((path / HEAD_CONFIG).read_text())
    assert info["k"] == 4 and info["backbone_fingerprint"] == model.fingerprint


def test_saving_a_trained_head_records_the_recipe(tmp_path):
    model = tiny_orthrus("llama", k=4)
    path = model.save_head(tmp_path / "head", training={"steps": 3})
    info = json.loads((path / HEAD_CONFIG).read_text())
    assert info["trained"] is True and info["training"] == {"steps": 3}
    assert model.head_info.trained is False  # saving does not relabel the model in memory


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fingerprint_ignores_compute_dtype_so_a_head_loads_across_precisions(tmp_path, dtype):
    model = tiny_orthrus("qwen3", k=4)
    path = model.save_head(tmp_path / "head")
    other = OrthrusLM(tiny_backbone("qwen3").to(dtype), k=8)
    assert other.fingerprint == model.fingerprint
    other.load_head(path)
    assert other.k == 4


def test_head_for_another_backbone_is_refused(tmp_path, family):
    foreign = tiny_orthrus(family, k=4, seed=1)
    path = foreign.save_head(tmp_path / "foreign")
    model = tiny_orthrus(family, k=8, seed=0)
    # same architecture, other weights: the structural hash agrees, the weight signature does not
    assert model.fingerprint == foreign.fingerprint and model.signature != foreign.signature
    before = _snapshot(model.head_parameters())
    with pytest.raises(LosslessError, match="another backbone"):
        model.load_head(path)
    _assert_same(_snapshot(model.head_parameters()), before)
    assert model.k == 8


def test_head_for_another_architecture_is_refused(tmp_path):
    path = tiny_orthrus("llama", k=4).save_head(tmp_path / "llama-head")
    with pytest.raises(LosslessError, match="another backbone"):
        tiny_orthrus("qwen3", k=4).load_head(path)


def _write_good_head(tmp_path):
    model = tiny_orthrus("llama", k=4)
    return model, model.save_head(tmp_path / "head")


@pytest.mark.parametrize("damage", [
    "truncated weights", "garbage weights", "empty weights", "missing weights",
    "invalid json", "json list", "json missing k", "json unknown field", "missing json",
    "format version", "missing tensor", "extra tensor", "wrong shape",
])
def test_corrupt_head_is_refused_with_lossless_error(tmp_path, damage):
    model, path = _write_good_head(tmp_path)
    weights, config = path / HEAD_WEIGHTS, path / HEAD_CONFIG
    info = json.loads(config.read_text())
    tensors = {n: p.detach().clone() for n, p in model.head_parameters().items()}
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage weights":
        weights.write_bytes(b"\x89this is not a safetensors file" * 10)
    elif damage == "empty weights":
        weights.write_bytes(b"")
    elif damage == "missing weights":
        weights.unlink()
    elif damage == "invalid json":
        config.write_text('{"k": 4, "backbone_fingerprint": ')
    elif damage == "json list":
        config.write_text("[4]")
    elif damage == "json missing k":
        del info["k"]
        config.write_text(json.dumps(info))
    elif damage == "json unknown field":
        config.write_text(json.dumps({**info, "surprise": 1}))
    elif damage == "missing json":
        config.unlink()
    elif damage == "format version":
        config.write_text(json.dumps({**info, "format_version": 99}))
    elif damage == "missing tensor":
        tensors.pop("layers.1.v_proj_diff.weight")
        save_file(tensors, str(weights))
    elif damage == "extra tensor":
        tensors["layers.9.q_proj_diff.weight"] = torch.zeros(2, 2)
        save_file(tensors, str(weights))
    elif damage == "wrong shape":
        tensors["layers.0.q_proj_diff.weight"] = torch.zeros(3, 3)
        save_file(tensors, str(weights))

    fresh = tiny_orthrus("llama", k=8)
    with pytest.raises(LosslessError):
        fresh.load_head(path)


def test_missing_head_directory_is_refused(tmp_path):
    with pytest.raises(LosslessError, match="no head"):
        tiny_orthrus("llama").load_head(tmp_path / "nowhere")


# ------------------------------------------------------------------------------ the authors' layout
MASK_ID = 5


def _write_authors_checkpoint(path, block_size: int = 4, mask_token_id: int = MASK_ID):
    """A tiny random Qwen3 in the Orthrus authors' layout; returns (backbone state, diff tensors)."""
    backbone = tiny_backbone("qwen3", seed=3)
    path.mkdir(parents=True, exist_ok=True)
    cfg = backbone.config.to_dict()
    cfg.update(model_type="orthrus", architectures=["OrthrusForCausalLM"], block_size=block_size,
               mask_token_id=mask_token_id,
               auto_map={"AutoModelForCausalLM": "modeling_orthrus.OrthrusForCausalLM"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {n: t.detach().clone().contiguous() for n, t in backbone.state_dict().items()}
    g = torch.Generator().manual_seed(99)
    diff = {}
    for i in range(backbone.config.num_hidden_layers):
        attn = backbone.model.layers[i].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            shape = getattr(attn, name).weight.shape
            diff[f"model.layers.{i}.self_attn.{name}_diff.weight"] = torch.randn(shape, generator=g) * 0.2
    save_file({**state, **diff}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return state, diff


def test_authors_layout_checkpoint_loads_with_its_draft_weights(tmp_path):
    state, diff = _write_authors_checkpoint(tmp_path / "orthrus-ckpt")
    model = lossless.load_model(str(tmp_path / "orthrus-ckpt"), "fp32", attn="sdpa")  # its tensors as loaded

    assert model.k == 4
    assert model.mask_token_id == MASK_ID
    assert model.mask_embedding is None and "mask_embedding" not in model.head_parameters()
    assert model.head_info.trained is True
    head = model.head_parameters()
    assert len(head) == len(diff)
    for key, tensor in diff.items():
        parts = key.split(".")
        name = ".".join(["layers", parts[2], *parts[4:]])
        assert torch.equal(head[name], tensor), key
        assert not torch.equal(head[name], state[key.replace("_diff", "")])  # random, not copied
    backbone = model.backbone_parameters()
    for name, tensor in state.items():
        if name in backbone:
            assert torch.equal(backbone[name], tensor), name
    assert set(backbone) <= set(state)

    for prompt in PROMPTS:
        for K in (2, 4):
            cfg = DecodeConfig(max_new_tokens=24, k=K, eos_ids=NO_EOS)
            assert decode(model, prompt, "orthrus", cfg).generated == decode(model, prompt, "ar", cfg).generated
    with pytest.raises(LosslessError, match="--k"):
        decode(model, PROMPTS[0], "orthrus", DecodeConfig(max_new_tokens=4, k=8))


def test_authors_layout_draft_view_uses_the_mask_token_embedding(tmp_path):
    _write_authors_checkpoint(tmp_path / "a", mask_token_id=5)
    _write_authors_checkpoint(tmp_path / "b", mask_token_id=6)
    a = lossless.load_model(str(tmp_path / "a"), "fp32")
    b = lossless.load_model(str(tmp_path / "b"), "fp32")
    cache_a, _ = a.prefill(PROMPTS[0])
    cache_b, _ = b.prefill(PROMPTS[0])
    assert not torch.allclose(a.draft(cache_a, 7, 4), b.draft(cache_b, 7, 4))


def test_authors_layout_without_draft_weights_is_refused(tmp_path):
    path = tmp_path / "incomplete"
    state, diff = _write_authors_checkpoint(path)
    diff.pop("model.layers.1.self_attn.k_norm_diff.weight")
    save_file({**state, **diff}, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LosslessError, match="lacks draft weights"):
        lossless.load_model(str(path), "fp32")


def test_a_refused_head_leaves_the_model_head_untouched(tmp_path):
    model, path = _write_good_head(tmp_path)
    tensors = {n: p.detach().clone() for n, p in model.head_parameters().items()}
    last = sorted(tensors)[-1]
    tensors[last] = torch.zeros(3, 3)  # the last tensor has the wrong shape; the others are valid
    save_file(tensors, str(path / HEAD_WEIGHTS))
    fresh = tiny_orthrus("llama", k=8)
    perturb_head(fresh, 1.0, seed=5)
    before = _snapshot(fresh.head_parameters())
    with pytest.raises(LosslessError):
        fresh.load_head(path)
    _assert_same(_snapshot(fresh.head_parameters()), before)


def test_head_json_with_a_non_integer_k_is_refused_with_lossless_error(tmp_path):
    _, path = _write_good_head(tmp_path)
    info = json.loads((path / HEAD_CONFIG).read_text())
    (path / HEAD_CONFIG).write_text(json.dumps({**info, "k": "eight"}))
    with pytest.raises(LosslessError):
        tiny_orthrus("llama", k=8).load_head(path)
