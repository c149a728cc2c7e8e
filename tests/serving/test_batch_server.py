"""`lossless serve --batch N`, live: concurrent requests decode together, one forward per step, and each gets the
answer it gets alone (greedy: `lossless generate`'s in any mode, exact kernels; sampled: `--mode ar`'s with the same
seed), streamed or not, its prompt joining in chunks, cut at its stop strings; a client that goes away leaves the
batch and the others finish; a request that finds the server idle decodes alone (greedy in the default cycle,
sampled in a tree, whose tokens are AR's draws) and goes on in the batch when another comes."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from test_server import CONTEXT, PROMPT, SERVER_ARGS, _generate, _idle, _stream_chat, live_server, model_dir  # noqa: F401
from lossless.cli import main
from lossless.names import DEFAULT_LOOKUP

PROMPTS = [PROMPT, "w2 w7 w7 w1 w30", "w11 w12 w13 w11 w12 w13 w11 w12", "w40"]


@pytest.fixture(scope="module")
def batched(model_dir):  # noqa: F811
    # prompts join in chunks of 8 rows (each chat-templated prompt is longer), beside the others' steps
    with live_server(model_dir, "--batch", "4", "--prefill-chunk", "8", "--max-tokens", str(CONTEXT)) as s:
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
        assert info["exact"] is True and info["versus_ar"] == "tokens"  # (batched, or greedy alone)
        if info.get("batched"):  # in the batch: AR steps, with prompt lookup
            assert info["mode"] == "ar" and info["tree"] == 0 and info["lookup"] == DEFAULT_LOOKUP
        else:  # a greedy request that found the server idle decodes alone, in the default cycle (a sampled one's,
            # with this untrained head, is the chain, whose draws are not AR's: it decodes in the batch)
            assert kind == "greedy" and info["mode"] == "orthrus"
    assert len(got) == 16 and sum(bool(info.get("batched")) for info in ran.values()) >= 8  # every sampled one
    _, text = batched.get("/metrics")
    alone = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith('lossless_batch_size_bucket{le="1.0"}'))
    assert batched.metric("lossless_batch_size_count") > alone, "some steps decoded several requests together"


def _stream(server, body: dict):
    """A streamed completion over raw HTTP, returned once its first chunk arrived."""
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=120)
    first = resp.readline()
    assert first.startswith(b"data: ")
    return resp, first


def _events(resp, first: bytes) -> list[dict]:
    lines = [first.decode(), *resp.read().decode().splitlines()]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_stop_strings_and_a_client_that_leaves_in_a_batch(batched, model_dir):  # noqa: F811
    client = batched.client()
    messages = [{"role": "user", "content": PROMPT}]
    full = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16).choices[0]
    stop = " " + full.message.content.split()[5]
    want = full.message.content.split(stop)[0]
    # a long sampled decode (in the batch: with this untrained head its own cycle is the chain) that its client
    # abandons
    # (a low temperature: the model never ends it with EOS, whose logit is 0)
    before = batched.metric("lossless_generated_tokens_total")
    long, _ = _stream(batched, {"prompt": PROMPT, "max_tokens": CONTEXT - 16, "temperature": 0.05, "seed": 3})
    cut = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16, stop=stop)
    assert cut.choices[0].message.content == want and cut.model_extra["lossless"]["finish"] == "stop_string"
    assert cut.model_extra["lossless"]["batched"] is True  # beside the long decode
    assert cut.usage.completion_tokens < 16  # its sequence left the batch at the stop string
    text, chunks = _stream_chat(client, model=str(model_dir), messages=messages, max_tokens=16, stop=stop)
    assert text == want and chunks[-1].model_extra["lossless"]["batched"] is True
    long.close()  # leaves the batch mid-decode
    _idle(batched)
    assert batched.metric("lossless_generated_tokens_total") - before < CONTEXT - 16 - 100  # the long one stopped
    again = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16).choices[0]
    assert again.message.content == full.message.content


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled tree"])
def test_a_request_decoding_alone_joins_the_batch_when_another_comes(batched, model_dir, capsys, sampled):  # noqa: F811
    """A request alone decodes in its own cycle (greedy: the default; sampled: a tree of 4, whose tokens are AR's
    draws), goes on in the batch when another comes, and its text is what it gets alone (sampled: `lossless generate
    --mode ar`'s with the same seed)."""
    n = 1500
    draws = ("--mode", "ar", "--temperature", "0.05", "--seed", "4") if sampled else ()
    want = _generate(capsys, model_dir, "--max-new-tokens", str(n), "--no-chat-template", *draws, PROMPT)
    _idle(batched)
    body = {"prompt": PROMPT, "max_tokens": n}
    if sampled:
        body.update(temperature=0.05, seed=4, lossless={"tree": 4})
    resp, first = _stream(batched, body)  # alone
    other = batched.client().completions.create(model=str(model_dir), prompt=PROMPTS[1], max_tokens=8)
    assert other.model_extra["lossless"]["batched"] is True
    events = _events(resp, first)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    ran = [e["lossless"] for e in events if e.get("lossless")][-1]
    assert text == want["text"] and ran["finish"] == "length"
    assert ran["batched"] is True and ran["alone_first"]["mode"] == "orthrus"
    assert 0 < ran["alone_first"]["tokens"] < n and (not sampled or ran["alone_first"]["tree"] == 4)


def test_batch_needs_exact_kernels_and_a_prefill_chunk_of_a_row_or_more(model_dir, capsys):  # noqa: F811
    for argv, says in ((["--attn", "sdpa", "--batch", "2"], "--batch 2 needs exact kernels"),
                       (["--prefill-chunk", "0"], "--prefill-chunk")):
        rc = main(["serve", "--model", str(model_dir), *argv])
        captured = capsys.readouterr()
        assert rc == 2 and says in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
