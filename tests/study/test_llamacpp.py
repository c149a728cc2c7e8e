"""llama.cpp in the audit: its speculative modes are candidates under the kernel `llama.cpp` only, compared with
llama.cpp's own greedy decoding of the same GGUF; a missing server is refused before anything is written.

The integration tests run llama.cpp's server on the embedded model. Without a llama-server binary ($LLAMA_SERVER,
PATH, or the cached build `make llama-server` makes) they skip, except where LOSSLESS_LLAMA_TESTS=required (CI
builds one): there they fail."""

import json
import math
import os

import pytest
import torch

from lossless import net
from lossless.study import llamacpp
from lossless.cli import main
from lossless.errors import LosslessError
from lossless.study.audit import run_audit
from lossless.study.candidates import BUILTIN, check_kernel
from lossless.study.report import load_run, write_report
from test_audit import config, tiny_loader, write_suite

SPEC = "smollm2-135m"
THREADS = torch.get_num_threads()  # as the audit's engine runs its servers
LLAMA = [n for n, c in BUILTIN.items() if c.engine]
# prompts whose answers repeat their own words: n-gram drafting finds matches in them
REPEATING = ["Repeat this list back to me three times: apple, banana, cherry, date, elderberry, fig, grape.",
             "Write the numbers from one to twenty in words, separated by commas."]


def test_every_speculative_mode_of_llama_cpp_is_a_candidate_of_its_kernel_only(tmp_path, capsys):
    assert sorted(LLAMA) == sorted(f"llama.cpp-{m}" for m in llamacpp.MODES)
    for name in LLAMA:
        check_kernel(name, "llama.cpp")
        with pytest.raises(LosslessError, match="audit it under the kernel llama.cpp"):
            check_kernel(name, "sdpa")
    for name in ("orthrus", "oracle", "prompt-lookup"):
        with pytest.raises(LosslessError, match="llama.cpp decodes"):
            check_kernel(name, "llama.cpp")
    for configs, candidates in (("bf16/sdpa", "llama.cpp-ngram-simple"), ("bf16/llama.cpp", "orthrus")):
        code = main(["audit", "--configs", configs, "--candidates", candidates, "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_missing_server_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(tmp_path / "no-such-llama-server"))
    suite = write_suite(tmp_path / "s.jsonl")
    out = tmp_path / "run"
    cfg = config(suite, configs=["bf16/llama.cpp"], candidates=["llama.cpp-ngram-simple"])
    with pytest.raises(LosslessError, match="docs/study.md"):
        run_audit(cfg, out, load=tiny_loader, progress=False)
    assert not out.exists()


def test_reference_trajectories_from_another_run(tmp_path):
    """`--reference-from`: one run's configurations against another run's AR (the full study's fp32 for llama.cpp)."""
    suite = write_suite(tmp_path / "s.jsonl")
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    run_audit(config(suite, dtypes=["fp32"]), fp32, load=tiny_loader, progress=False)
    run_audit(config(suite, dtypes=["bf16"]), bf16, load=tiny_loader, progress=False)
    with pytest.raises(LosslessError, match="no such AR reference"):
        write_report(bf16, tmp_path / "none", html=False, reference="fp32/sdpa")  # bf16's own run has no fp32
    summary = write_report(bf16, tmp_path / "r", html=False, reference="fp32/sdpa", reference_from=fp32)
    section = summary["reference_comparison"]
    assert section["reference"]["run"] == str(fp32) and section["reference"]["n_prompts"] == 6
    theirs = {r["prompt_id"]: r["ar_ids"] for r in load_run(fp32)[0]}
    ours = load_run(bf16)[0]
    equal = sum(r["ar_ids"] == theirs[r["prompt_id"]] for r in ours)
    (row,) = section["configs"]
    assert row["n"] == 6 and row["ar"]["n_equal"] == equal and not row["is_reference"]
    assert "fp32/sdpa AR of " in (tmp_path / "r" / "report.md").read_text()


# ----------------------------------------------------------------------------------------- with a server
@pytest.fixture(scope="module", autouse=True)
def no_server_outlives_the_module():
    yield
    llamacpp.close_all()


@pytest.fixture(scope="module")
def server_binary():
    found = llamacpp.find_server()
    if found is None:
        if os.environ.get("LOSSLESS_LLAMA_TESTS") == "required":
            pytest.fail("LOSSLESS_LLAMA_TESTS=required but no llama-server binary: run `make llama-server`")
        pytest.skip("no llama-server binary (make llama-server builds one)")
    return found


@pytest.fixture(scope="module")
def embedded():
    from lossless.decoding.models import load_model

    return load_model(SPEC, "bf16", "cpu", "sdpa")


def test_llama_cpp_greedy_takes_its_top_token_and_its_modes_draft(server_binary, embedded):
    from lossless.text import encode_prompt

    ids = encode_prompt(embedded.tokenizer, REPEATING[0])
    plain = llamacpp.server(SPEC, "bf16", llamacpp.GREEDY, THREADS).decode(ids, 40)
    assert 1 <= len(plain.ids) <= 40 and len(plain.tops) == len(plain.ids) == len(plain.margins)
    # greedy: every token is the most probable one, its margin over the runner-up >= 0
    assert all(top[0][0] == t and top[0][1] >= top[1][1] for t, top in zip(plain.ids, plain.tops))
    assert all(m >= 0 for m in plain.margins) and plain.log_ppl() > 0 and plain.seconds > 0
    assert embedded.tokenizer.decode(plain.ids[:3])  # real token ids of the model's vocabulary
    again = llamacpp.server(SPEC, "bf16", llamacpp.GREEDY, THREADS).decode(ids, 40)
    assert again.ids == plain.ids  # no prompt reuse: the same request decodes the same tokens
    lookup = llamacpp.server(SPEC, "bf16", "ngram-simple", THREADS).decode(ids, 40)
    assert lookup.drafted and lookup.drafted > 0  # the mode speculates: its drafts are verified in batches
    # the server gives no probabilities for tokens of a verified batch: those have no top two and no margin
    # (recorded as unknown, never as a made-up value), while plain decoding has them for every token
    assert [t is None for t in lookup.tops] == [m is None for m in lookup.margins]
    assert all(t is not None for t in plain.tops)


def test_audit_of_llama_cpp_against_its_own_greedy(server_binary, embedded, tmp_path):
    suite = tmp_path / "s.jsonl"
    suite.write_text("".join(json.dumps({"id": f"r{i}", "domain": "repeat", "prompt": p}) + "\n"
                             for i, p in enumerate(REPEATING)))
    out = tmp_path / "run"
    names = ["llama.cpp-ngram-simple", "llama.cpp-draft"]
    cfg = config(suite, configs=["bf16/llama.cpp"], candidates=names, max_new_tokens=24)
    cfg.model = SPEC
    plain = llamacpp.server(SPEC, "bf16", llamacpp.GREEDY, THREADS)  # the audit's reference server
    process = plain.proc
    result = run_audit(cfg, out, load=lambda d, a: embedded, progress=False)
    assert result["new_records"] == result["planned_records"] == 2 * len(names)
    # the configuration's last item done, its servers are stopped: a finished configuration holds no memory
    assert process.poll() is not None and llamacpp.server(SPEC, "bf16", llamacpp.GREEDY, THREADS) is not plain
    records, info = load_run(out)
    assert info["environment"]["llama_server"].startswith("version")
    from lossless.text import encode_prompt

    for r in records:
        ids = encode_prompt(embedded.tokenizer, REPEATING[int(r["prompt_id"][1:])])
        # the reference is llama.cpp's own greedy decoding of the same prompt ids
        assert r["ar_ids"] == llamacpp.server(SPEC, "bf16", llamacpp.GREEDY, THREADS).decode(ids, 24).ids
        assert r["attn"] == r["reference_attn"] == "llama.cpp" and r["candidate"] in names and r["orthrus_seconds"] > 0
        assert len(r["ar_margins"]) == len(r["ar_ids"]) and all(m >= 0 for m in r["ar_margins"])
        if not r["exact_match"]:  # where they part, the reference's own top two say how near a tie it was
            assert r["ref_margin_at_divergence"] is not None and len(r["ref_top_at_divergence"]) == 2
        assert r["orthrus_margin_at_divergence"] is None or math.isfinite(r["orthrus_margin_at_divergence"])
    summary = write_report(out, html=False)
    assert {c["candidate"] for c in summary["configs"]} == set(names)
    assert all(c["speed_vs_ar"]["n"] == 2 for c in summary["configs"])
    again = run_audit(cfg, out, load=lambda d, a: embedded, progress=False)
    assert again["new_records"] == 0  # resumes: nothing decoded twice


def test_llama_bench_beside_the_server_times_steps_at_each_depth_and_a_prompt(server_binary, tmp_path):
    """The benchmarks time llama.cpp with its own llama-bench, built beside llama-server: one record a test, a
    generated token's milliseconds at each depth or a prompt's whole; a file it cannot load is one clear error."""
    if llamacpp.find_bench() is None:  # a llama-server of its own ($LLAMA_SERVER, PATH) without llama-bench beside it
        if os.environ.get("LOSSLESS_LLAMA_TESTS") == "required":
            pytest.fail("LOSSLESS_LLAMA_TESTS=required but no llama-bench binary: run `make llama-server`")
        pytest.skip("no llama-bench beside llama-server (make llama-server builds both)")
    gguf = llamacpp.server_gguf(SPEC, "bf16")
    steps = llamacpp.bench(gguf, 1, depths=[0, 64], n_gen=2)
    assert [(t["depth"], t["n_gen"], t["n_prompt"]) for t in steps] == [(0, 2, 0), (64, 2, 0)]
    assert all(0 < t["ms"] < 10_000 for t in steps)
    prompt = llamacpp.bench(gguf, 1, n_prompt=32)
    assert [(t["depth"], t["n_gen"], t["n_prompt"]) for t in prompt] == [(0, 0, 32)] and prompt[0]["ms"] > 0
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    with pytest.raises(LosslessError, match="llama-bench failed on broken.gguf"):
        llamacpp.bench(broken, 1, n_gen=1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_model_written_as_gguf_decodes_in_llama_cpp_as_in_torch(server_binary, family, tmp_path):
    """write_gguf's layout (names, the Llama rotary row order, tied embeddings, Qwen3's q/k norms): llama.cpp's
    greedy tokens and log-probabilities of an fp32 model are torch's, up to llama.cpp's fp16 cache."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config, causal = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    torch.manual_seed(0)
    model = causal(config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
                          tie_word_embeddings=family == "qwen3")).float().eval()
    with torch.no_grad():  # weights far from init's scale, so the top tokens are well apart
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    path = llamacpp.write_gguf(model, tmp_path / f"{family}.gguf")
    server = llamacpp.Server(server_binary, path, 1).start()
    try:
        prompt = [5, 17, 99, 3, 42, 7]
        theirs = server.decode(prompt, 6, ignore_eos=True)
    finally:
        server.close()
    x = torch.tensor([prompt])
    with torch.no_grad():
        for i, token in enumerate(theirs.ids):
            logp = torch.log_softmax(model(x).logits[0, -1].double(), -1)
            top = torch.topk(logp, 2)
            assert abs(theirs.tops[i][0][1] - float(top.values[0])) < 0.02
            if int(top.indices[0]) != token:  # only where torch's top two are within the cache's rounding
                assert float(top.values[0] - top.values[1]) < 0.02
                break
            x = torch.cat([x, torch.tensor([[token]])], 1)
    assert len(theirs.ids) == 6 and i >= 2


def test_a_bf16_model_written_as_gguf_holds_its_weights_bit_for_bit(tmp_path):
    """The GGUF's tensors are the model's bf16 values as they are (read back with gguf's own reader), the Llama q/k
    rows in llama.cpp's rotary order; a model with something the layout has no place for is refused."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    reader = gguf.GGUFReader(llamacpp.write_gguf(model, tmp_path / "m.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    params = dict(model.named_parameters())

    def bits(name):
        return torch.from_numpy(tensors[name].data.copy()).view(torch.int16).reshape(-1)

    assert torch.equal(bits("token_embd.weight"), params["model.embed_tokens.weight"].view(torch.int16).reshape(-1))
    assert torch.equal(bits("output.weight"), params["lm_head.weight"].view(torch.int16).reshape(-1))
    assert torch.equal(bits("blk.1.ffn_down.weight"), params["model.layers.1.mlp.down_proj.weight"].view(torch.int16).reshape(-1))
    q = params["model.layers.0.self_attn.q_proj.weight"]
    rotated = q.reshape(4, 2, 8, 64).transpose(1, 2).reshape(64, 64)  # each head's halves (i, i + 8) as neighbours
    assert torch.equal(bits("blk.0.attn_q.weight"), rotated.contiguous().view(torch.int16).reshape(-1))
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert len(tensors) == len(params) and not list(tmp_path.glob(".*.tmp"))
    biased = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "attention_bias": True}))
    with pytest.raises(LosslessError, match="biases"):
        llamacpp.write_gguf(biased, tmp_path / "b.gguf")


def test_a_port_taken_before_the_server_binds_it_is_tried_again(server_binary, monkeypatch):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    free = net.free_port
    monkeypatch.setattr(net, "free_port", lambda: next(ports, None) or free())
    server = llamacpp.Server(server_binary, llamacpp.server_gguf(SPEC, "bf16", server_binary), 1)
    try:
        server.start()
        assert server.port != taken.getsockname()[1] and server.proc.poll() is None
    finally:
        server.close()
        taken.close()
    assert not server.log.exists()  # closing takes the log with the server


def test_a_server_that_would_not_stop_on_sigterm_dies_with_its_audit(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    # the audit: starts a "server" that ignores SIGTERM (as a hung llama-server does), prints its pid, then is killed
    audit = ("import os, subprocess, sys, time; from lossless.study import llamacpp; parent = os.getpid(); "
             "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
             "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)'], "
             "stdout=subprocess.PIPE, preexec_fn=lambda: llamacpp._die_with_parent(parent)); "
             "child.stdout.readline(); print(child.pid, flush=True); time.sleep(120)")  # once it ignores SIGTERM
    proc = subprocess.Popen([sys.executable, "-c", audit], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(100):
        try:  # gone, or a zombie its new parent has yet to reap
            if open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the server outlived its audit")
