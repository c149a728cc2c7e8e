"""`lossless serve --batch N`, live: concurrent requests decode together, one forward per step, and each gets the
answer it gets alone (greedy: `lossless generate`'s in any mode, exact kernels; sampled: `--mode ar`'s with the same
seed), streamed or not, cut at its stop strings; a client that goes away leaves the batch and the others finish; a
greedy request that finds the server idle decodes alone in the default cycle."""

from __future__ import annotations

import threading

import pytest

from test_server import CONTEXT, PROMPT, SERVER_ARGS, _generate, _idle, _open_stream, _stream_chat, live_server, model_dir  # noqa: F401
from lossless.cli import main
from lossless.names import DEFAULT_LOOKUP

PROMPTS = [PROMPT, "w2 w7 w7 w1 w30", "w11 w12 w13 w11 w12 w13 w11 w12", "w40"]


@pytest.fixture(scope="module")
def batched(model_dir):  # noqa: F811
    with live_server(model_dir, "--batch", "4", "--max-tokens", str(CONTEXT)) as s:
        yield s


def test_concurrent_requests_decode_together_and_each_gets_its_answer_alone(batched, model_dir, capsys):  # noqa: F811
    # what each request gets alone, from `lossless generate` (greedy: the default orthrus cycle; sampled: AR)
    want = {}
    for i, prompt in enumerate(PROMPTS):
        want[(i, "greedy")] = _generate(capsys, model_dir, "--max-new-tokens", str(20 + i), prompt)["text"]
        want[(i, "sampled")] = _generate(capsys, model_dir, "--max-new-tokens", str(20 + i), "--mode", "ar",
                                         "--temperature", "0.8", "--seed", str(i), prompt)["text"]
    client = batched.client()
    got, ran, errors = {}, {}, []

    def ask(i, kind, stream):
        try:
            kw = dict(model=str(model_dir), messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=20 + i)
            if kind == "sampled":
                kw.update(temperature=0.8, seed=i)
            if stream:
                text, chunks = _stream_chat(client, **kw)
                info = [c.model_extra.get("lossless") for c in chunks if c.model_extra.get("lossless")][-1]
            else:
                out = client.chat.completions.create(**kw)
                text, info = out.choices[0].message.content, out.model_extra["lossless"]
            got[(i, kind, stream)], ran[(i, kind, stream)] = text, info
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i, kind, stream)) for i in range(len(PROMPTS))
               for kind in ("greedy", "sampled") for stream in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for (i, kind, stream), text in got.items():
        assert text == want[(i, kind)], (i, kind, stream)
        info = ran[(i, kind, stream)]
        assert info["exact"] is True
        if info.get("batched"):  # in the batch: AR steps, with prompt lookup when greedy
            assert info["mode"] == "ar" and info["tree"] == 0
            assert info["lookup"] == (DEFAULT_LOOKUP if kind == "greedy" else 0)
        else:  # a greedy request that found the server idle decodes alone, in the default cycle
            assert kind == "greedy" and info["mode"] == "orthrus"
    assert len(got) == 16 and sum(bool(info.get("batched")) for info in ran.values()) >= 8  # every sampled one
    _, text = batched.get("/metrics")
    alone = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith('lossless_batch_size_bucket{le="1.0"}'))
    assert batched.metric("lossless_batch_size_count") > alone, "some steps decoded several requests together"


def test_stop_strings_and_a_client_that_leaves_in_a_batch(batched, model_dir):  # noqa: F811
    client = batched.client()
    messages = [{"role": "user", "content": PROMPT}]
    full = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16).choices[0]
    stop = " " + full.message.content.split()[5]
    want = full.message.content.split(stop)[0]
    long = _open_stream(batched, {"Content-Type": "application/json"})  # a long decode that its client abandons
    cut = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16, stop=stop)
    assert cut.choices[0].message.content == want and cut.model_extra["lossless"]["finish"] == "stop_string"
    text, _ = _stream_chat(client, model=str(model_dir), messages=messages, max_tokens=16, stop=stop)
    assert text == want
    long.close()
    _idle(batched)
    again = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16).choices[0]
    assert again.message.content == full.message.content


def test_batch_needs_exact_kernels(model_dir, capsys):  # noqa: F811
    rc = main(["serve", "--model", str(model_dir), "--attn", "sdpa", "--batch", "2"])
    captured = capsys.readouterr()
    assert rc == 2 and "--batch 2 needs exact kernels" in captured.err and len(captured.err.strip().splitlines()) == 1
