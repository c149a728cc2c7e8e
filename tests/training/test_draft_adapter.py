"""Draft adapters (draft-only MLP capacity): a new one changes no draft, a trained one changes drafts and
never the AR view, heads carry them through save and load, training trains them, and decoding with them
still equals greedy AR."""

import pytest
import torch

from conftest import NO_EOS, PROMPTS, ar_reference, perturb_head, tiny_orthrus
from lossless.cli import main
from lossless.decoding.loop import DecodeConfig, decode
from lossless.errors import LosslessError
from lossless.decoding.head import stored_head_digest
from lossless.training.train import DistillLoss, TrainConfig, choose_anchors, step_rng, train
from test_training import synthetic_records

RANK = 8


def _draft(model, prompt=PROMPTS[0]):
    cache, _ = model.prefill(prompt)
    return model.draft(cache, prompt[-1], model.k)


def _adapted(family, seed=0):
    """A tiny model with a trained-looking head and adapter (noise on every head parameter)."""
    model = tiny_orthrus(family, k=4, seed=seed)
    model.set_draft_adapter(RANK)
    perturb_head(model, 0.5)
    return model


def test_a_new_adapter_leaves_the_drafts_as_they_were(family):
    model = tiny_orthrus(family, k=4)
    perturb_head(model, 0.5)
    before = _draft(model)
    model.set_draft_adapter(RANK)
    assert model.draft_adapter == RANK and any("mlp_diff" in n for n in model.head_parameters())
    assert torch.equal(_draft(model), before)
    model.set_draft_adapter(0)
    assert model.draft_adapter == 0 and not any("mlp_diff" in n for n in model.head_parameters())


def test_a_trained_adapter_changes_drafts_and_never_the_ar_view(family):
    plain = tiny_orthrus(family, k=4)
    model = _adapted(family)
    assert not torch.equal(_draft(model), _draft(plain))
    prompt = PROMPTS[1]
    for m in (plain, model):  # the AR view: prefill, verify and the fused forward's verify rows
        m.cache, m.last = m.prefill(prompt)
    assert torch.equal(plain.last, model.last)
    assert torch.equal(plain.verify(plain.cache, [3, 4, 5]), model.verify(model.cache, [3, 4, 5]))
    plain_fused, plain_groups = plain.verify_and_draft(plain.cache, [6, 7, 8], [0, 1, 2], 3)
    fused, groups = model.verify_and_draft(model.cache, [6, 7, 8], [0, 1, 2], 3)
    assert torch.equal(plain_fused, fused) and not torch.equal(plain_groups, groups)
    # the backbone's own weights are what they were
    for (n, p), (_, q) in zip(plain.backbone_parameters().items(), model.backbone_parameters().items()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("how", [dict(), dict(tree=6), dict(cycle="fused")])
def test_decoding_with_an_adapted_head_equals_greedy_ar(family, how):
    model = _adapted(family)
    for prompt in PROMPTS[:3]:
        state = decode(model, prompt, "orthrus", DecodeConfig(max_new_tokens=20, eos_ids=NO_EOS, **how))
        assert state.generated == ar_reference(model, prompt, 20)


@pytest.mark.parametrize("encoding", ["full", "delta_int8"])
def test_a_head_with_an_adapter_saves_and_loads_its_rank_and_weights(tmp_path, encoding):
    model = _adapted("llama")
    model.save_head(tmp_path / "h", encoding=encoding)
    fresh = tiny_orthrus("llama", k=4)
    fresh.load_head(tmp_path / "h")
    assert fresh.draft_adapter == RANK and fresh.head_info.draft_adapter == RANK
    if encoding == "full":
        assert torch.equal(_draft(fresh), _draft(model))
    else:  # int8 deltas: the adapter is stored over zero, about as exactly as the projections over the AR weights
        assert torch.allclose(_draft(fresh), _draft(model), atol=0.05, rtol=0.05)
    # a head without an adapter takes the adapter away again
    tiny_orthrus("llama", k=4).save_head(tmp_path / "plain")
    fresh.load_head(tmp_path / "plain")
    assert fresh.draft_adapter == 0 and torch.equal(_draft(fresh), _draft(tiny_orthrus("llama", k=4)))


def test_a_head_whose_adapter_tensors_are_damaged_is_refused_and_the_model_keeps_its_own(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _adapted("llama")
    model.save_head(tmp_path / "h")
    tensors = load_file(tmp_path / "h" / "head.safetensors")
    tensors["layers.0.mlp_diff.down.weight"] = tensors["layers.0.mlp_diff.down.weight"][:-1]
    save_file(tensors, tmp_path / "h" / "head.safetensors")
    plain = tiny_orthrus("llama", k=4)
    before = _draft(plain)
    with pytest.raises(LosslessError, match="mlp_diff.down.weight has shape"):
        plain.load_head(tmp_path / "h")
    assert plain.draft_adapter == 0 and torch.equal(_draft(plain), before)


def test_heads_without_an_adapter_keep_their_digest():
    """Pinned studies name their head by digest: the adapter field must not change an existing head's."""
    from lossless.paths import HEADS_DIR

    assert stored_head_digest(HEADS_DIR / "smollm2-135m-ab37ba07") == "ab37ba076f45e618"


def test_training_an_adapter_lowers_the_loss_and_trains_only_head_and_adapter():
    model = tiny_orthrus("qwen3", k=4)
    model.set_draft_adapter(RANK)
    backbone = {n: p.detach().clone() for n, p in model.backbone_parameters().items()}
    rec = synthetic_records(1)[0]
    ids, n_prompt = rec["prompt_ids"] + rec["response_ids"], len(rec["prompt_ids"])
    anchors = choose_anchors(step_rng(0, 0), n_prompt, len(ids), 8)
    loss_fn = DistillLoss(model, 4)
    head = model.head_parameters()
    # the adapter alone: its capacity is what lowers the loss here
    opt = torch.optim.Adam([p for n, p in head.items() if "mlp_diff" in n], lr=1e-3)
    loss0, _, _ = loss_fn(ids, n_prompt, anchors)
    loss0.backward()
    assert head["layers.0.mlp_diff.up.weight"].grad.abs().sum() > 0
    assert all(p.grad is None for p in model.backbone_parameters().values())
    for _ in range(5):
        opt.step()
        opt.zero_grad()
        loss, _, _ = loss_fn(ids, n_prompt, anchors)
        loss.backward()
    assert loss.item() < loss0.item()
    assert all(torch.equal(p, backbone[n]) for n, p in model.backbone_parameters().items())


def test_a_run_with_an_adapter_resumes_only_with_it(tmp_path):
    cfg = dict(out=str(tmp_path / "run"), k=4, steps=4, lr=1e-3, warmup=1, seqs_per_step=2, anchors=4, save_every=2,
               eval_every=0, autocast="off", draft_adapter=RANK)
    model = tiny_orthrus("llama", k=4)
    model.set_draft_adapter(RANK)
    train(model, synthetic_records(), TrainConfig(**cfg), progress=False, stop_at=2)
    with pytest.raises(LosslessError, match="--draft-adapter 8"):  # resumed without the adapter
        train(tiny_orthrus("llama", k=4), synthetic_records(), TrainConfig(**{**cfg, "draft_adapter": 0}),
              resume=True, progress=False)
    resumed = tiny_orthrus("llama", k=4)
    resumed.set_draft_adapter(RANK)
    assert train(resumed, synthetic_records(), TrainConfig(**cfg), resume=True, progress=False)["steps"] == 4


def test_cli_refuses_a_negative_rank(capsys):
    assert main(["train", "--model", "smollm2-135m", "--out", "unused", "--draft-adapter", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--draft-adapter" in err and "Traceback" not in err


def test_the_adapter_has_its_own_learning_rate(tmp_path):
    """--adapter-lr-mult 0 freezes the adapters while the rest of the head trains; a larger multiplier moves
    them further than the run's own rate."""
    moved = {}
    for mult in (0.0, 1.0, 10.0):
        model = tiny_orthrus("llama", k=4)
        model.set_draft_adapter(RANK)
        before = {n: p.detach().clone() for n, p in model.head_parameters().items()}
        cfg = TrainConfig(out=str(tmp_path / f"m{mult}"), k=4, steps=3, lr=1e-3, warmup=1, seqs_per_step=2, anchors=4,
                          save_every=0, eval_every=0, autocast="off", draft_adapter=RANK, adapter_lr_mult=mult)
        train(model, synthetic_records(), cfg, progress=False)
        after = model.head_parameters()
        moved[mult] = sum(float((after[n].detach() - before[n]).abs().sum()) for n in before if ".mlp_diff." in n)
        assert any(not torch.equal(before[n], after[n]) for n in before if ".mlp_diff." not in n)
    assert moved[0.0] == 0.0 and 0 < moved[1.0] < moved[10.0]
