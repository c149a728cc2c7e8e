"""`lossless serve`, live: a real server process on 127.0.0.1, driven by the official `openai` client and by
raw HTTP. Answers equal `lossless generate`'s, streamed equals non-streamed, bad requests get OpenAI's error
shape (never a 500), the API key guards every route but /health, a full queue answers 429, a client that goes
away cancels its decode, and SIGINT/SIGTERM stop the server cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch

from conftest import free_port, tiny_backbone, tiny_tokenizer
from lossless.cli import main
from lossless.names import DEFAULT_LOOKUP

CONTEXT = 2048  # long enough that a decode runs for seconds (the disconnect test), short enough for one request
PROMPT = "w1 w5 w9 w3"
SERVER_ARGS = ("--dtype", "fp32", "--attn", "exact", "--head", "none")
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w2 {% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random llama with a word-level tokenizer and a chat template, whose EOS logit is always 0 (below the
    best of the other 63 sharpened logits), so a decode runs to max_tokens: long decodes last seconds."""
    path = tmp_path_factory.mktemp("serve") / "tiny"
    backbone = tiny_backbone("llama")
    backbone.config.max_position_embeddings = CONTEXT
    with torch.no_grad():
        backbone.lm_head.weight[-1].zero_()
    backbone.save_pretrained(path)
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        return _send(req)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict | str]:
        return _send(urllib.request.Request(self.url + path, headers=headers or {}))

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                   or line.startswith(name + "{"))


def _send(req) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


@contextmanager
def live_server(model_dir: Path, *args: str, env: dict | None = None, stop=signal.SIGINT):
    """`lossless serve` on a free port, ready (its /health answers); stopped by `stop`, which must end it
    cleanly (exit 0) within 30 s."""
    port = free_port()
    log = model_dir.parent / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "lossless", "serve", "--model", str(model_dir), *SERVER_ARGS, "--port", str(port),
           *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, port, log)
    try:
        deadline = time.monotonic() + 300  # the first exact-mode load may build the kernels
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if server.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(stop)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"the server did not stop on {stop.name}:\n{log.read_text()}")
    assert rc == 0, log.read_text()
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def server(model_dir):
    with live_server(model_dir, "--max-tokens", str(CONTEXT), "--max-body", "65536") as s:
        yield s


def _generate(capsys, model_dir, *args) -> dict:
    rc = main(["generate", "--model", str(model_dir), *SERVER_ARGS, "--json", *args])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def _stream_chat(client, **kw) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_chat_and_completions_answer_what_lossless_generate_answers(server, model_dir, capsys):
    client = server.client()
    want = _generate(capsys, model_dir, "--max-new-tokens", "12", PROMPT)
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=12)
    assert chat.choices[0].message.content == want["text"] and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length" == want["finish_reason"]
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (want["prompt_tokens"], 12)
    assert chat.usage.total_tokens == want["prompt_tokens"] + 12
    ran = chat.model_extra["lossless"]
    assert {k: ran[k] for k in want["config"]} == want["config"]
    assert ran["exact"] is True and ran["attn"] == "exact" and ran["mode"] == "orthrus" and ran["finish"] == "length"
    assert ran["tokens_per_cycle"] >= 1 and ran["cycles"] >= 1
    # streamed: the same text, a role chunk first, the finish reason and the usage at the end
    text, chunks = _stream_chat(client, model=str(model_dir), messages=messages, max_tokens=12,
                                stream_options={"include_usage": True})
    assert text == want["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # AR, chosen per request, gives the same tokens in exact mode
    ar = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=12,
                                        extra_body={"lossless": {"mode": "ar"}})
    assert ar.choices[0].message.content == want["text"] and ar.model_extra["lossless"]["mode"] == "ar"
    # completions: the raw prompt, as `generate --no-chat-template`
    raw = _generate(capsys, model_dir, "--max-new-tokens", "10", "--no-chat-template", PROMPT)
    done = client.completions.create(model=str(model_dir), prompt=PROMPT, max_tokens=10)
    assert done.choices[0].text == raw["text"] and done.usage.prompt_tokens == raw["prompt_tokens"] == 4
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=str(model_dir), prompt=PROMPT,
                                                                           max_tokens=10, stream=True) if c.choices)
    assert streamed == raw["text"]
    assert [m.id for m in client.models.list().data] == [str(model_dir)]


def test_stop_strings_cut_the_answer_the_same_way_streamed_or_not(server, model_dir):
    client = server.client()
    messages = [{"role": "user", "content": PROMPT}]
    full = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16)
    words = full.choices[0].message.content.split()
    stop = " " + words[5]
    want = full.choices[0].message.content.split(stop)[0]
    for stops in (stop, [stop, "no such text"]):
        cut = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=16, stop=stops)
        assert cut.choices[0].message.content == want and cut.choices[0].finish_reason == "stop"
        assert cut.model_extra["lossless"]["finish"] == "stop_string"
        text, chunks = _stream_chat(client, model=str(model_dir), messages=messages, max_tokens=16, stop=stops)
        assert text == want and stop not in "".join(c.choices[0].delta.content or "" for c in chunks)


def test_a_stop_string_in_the_last_cycle_still_finishes_as_stop(server, model_dir):
    client = server.client()
    kw = dict(model=str(model_dir), messages=[{"role": "user", "content": PROMPT}],
              extra_body={"lossless": {"mode": "ar"}})
    words = client.chat.completions.create(max_tokens=8, **kw).choices[0].message.content.split()
    cut = client.chat.completions.create(max_tokens=6, stop=" " + words[5], **kw)
    assert cut.choices[0].message.content == " ".join(words[:5]) and cut.choices[0].finish_reason == "stop"
    # null where the API takes a default, as some clients send it
    status, answer = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": None, "stream": None,
                                                     "echo": None, "temperature": None})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


def test_sampling_with_a_seed_is_reproducible_and_says_its_seed(server, model_dir):
    client = server.client()
    kw = dict(model=str(model_dir), prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    assert a.choices[0].text == b.choices[0].text and a.model_extra["lossless"]["seed"] == 7
    # (this untrained head's sampled cycle is the chain, whose draws are not AR's: batched AR steps with lookup)
    assert a.model_extra["lossless"]["batched"] is True and a.model_extra["lossless"]["tree"] == 0
    assert a.model_extra["lossless"]["lookup"] == DEFAULT_LOOKUP
    fresh = [client.completions.create(**kw).model_extra["lossless"]["seed"] for _ in range(2)]
    assert fresh[0] != fresh[1]
    # a tree and prompt lookup may be asked for when sampling: a request alone decodes in them, and its tokens are
    # AR's draws, the batched request's with the same seed
    treed = [client.completions.create(seed=7, extra_body={"lossless": {"tree": 4, "lookup": 8}}, **kw) for _ in range(2)]
    assert treed[0].choices[0].text == treed[1].choices[0].text == a.choices[0].text
    ran = treed[0].model_extra["lossless"]
    assert (ran["mode"], ran["tree"], ran["lookup"]) == ("orthrus", 4, 8) and not ran.get("batched")


LONG = " ".join(["w7"] * (CONTEXT + 10))
BAD_REQUESTS = {
    # name: (route, body, status, param)
    "malformed json": ("/v1/chat/completions", b'{"messages": [', 400, None),
    "not an object": ("/v1/completions", b"[1, 2]", 400, None),
    "no messages": ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    "message without a role": ("/v1/chat/completions", {"messages": [{"content": "w1"}]}, 400, "messages.0.role"),
    "messages of the wrong type": ("/v1/chat/completions", {"messages": "w1 w2"}, 400, "messages"),
    "image content": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content"),
    "negative max_tokens": ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, 400, "max_tokens"),
    "zero max_tokens": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    "fractional max_tokens": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2.5}, 400, "max_tokens"),
    "max_tokens as text": ("/v1/completions", {"prompt": PROMPT, "max_tokens": "8"}, 400, "max_tokens"),
    "max_tokens past the cap": ("/v1/completions", {"prompt": PROMPT, "max_tokens": CONTEXT + 1}, 400, "max_tokens"),
    "n above 1": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "n": 2}, 400, "n"),
    "temperature out of range": ("/v1/completions", {"prompt": PROMPT, "temperature": 3}, 400, "temperature"),
    "top_p zero": ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    "temperature that overflows the logits": ("/v1/completions", {"prompt": PROMPT, "temperature": 1e-40}, 400,
                                              "temperature"),
    "denormal temperature": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                      "temperature": 1e-320}, 400, "temperature"),
    "stream as text": ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, 400, "stream"),
    "too many stops": ("/v1/completions", {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    "logprobs": ("/v1/completions", {"prompt": PROMPT, "logprobs": 2}, 400, "logprobs"),
    "tools": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    "empty prompt": ("/v1/completions", {"prompt": "  "}, 400, "prompt"),
    "token ids out of the vocabulary": ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    "prompt past the context": ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, 400, "prompt"),
    "prompt + max_tokens past the context": ("/v1/completions", {"prompt": " ".join(["w7"] * (CONTEXT - 8)),
                                                                 "max_tokens": 16}, 400, "max_tokens"),
    "unknown model": ("/v1/completions", {"prompt": PROMPT, "model": "gpt-9"}, 404, "model"),
    "unknown extension field": ("/v1/completions", {"prompt": PROMPT, "lossless": {"speed": "max"}}, 400,
                                "lossless.speed"),
    "k above the head's": ("/v1/completions", {"prompt": PROMPT, "lossless": {"k": 99}}, 400, "lossless.k"),
    "body past the cap": ("/v1/completions", {"prompt": " ".join(["w7"] * 30000)}, 413, None),
    "no such route": ("/v1/embeddings", {"input": "w1"}, 404, None),
    "arrays nested deeply": ("/v1/completions", b"[" * 60000, 400, None),
    "a number of 5000 digits": ("/v1/completions", b'{"prompt": "w1", "max_tokens": 1' + b"0" * 5000 + b"}", 400,
                                None),
    "a lone surrogate in the prompt": ("/v1/completions", b'{"prompt": "w1 \\ud800"}', 400, None),
    "a lone surrogate in the model name": ("/v1/completions", b'{"prompt": "w1", "model": "\\ud800"}', 400, None),
    "temperature as true": ("/v1/completions", {"prompt": PROMPT, "temperature": True}, 400, "temperature"),
    "temperature as text": ("/v1/completions", {"prompt": PROMPT, "temperature": "0.5"}, 400, "temperature"),
}


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    for name, (route, body, status, param) in BAD_REQUESTS.items():
        got, answer = server.post(route, body)
        assert got == status, (name, answer)
        assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, name
        assert answer["error"]["message"] and answer["error"]["param"] == param, (name, answer)
    assert server.get("/v1/chat/completions")[0] == 405
    # the official client raises its typed errors from these answers
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="'n'"):
        client.completions.create(model=server_model(server), prompt=PROMPT, n=2)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    assert server.get("/health")[0] == 200
    assert client.completions.create(model=server_model(server), prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    assert "Traceback" not in server.log.read_text()
    assert server.metric('lossless_requests_total{route="/v1/completions",status="500"}') == 0


def server_model(server) -> str:
    return server.get("/v1/models")[1]["data"][0]["id"]


def _idle(server) -> None:
    _until(lambda: server.get("/health")[1]["queue"] == 0)


LONG_DECODE = CONTEXT - 16  # seconds of AR decoding on the tiny model


def test_a_client_that_goes_away_cancels_its_decode(server):
    # mid-stream: read the first chunk, hang up
    before = server.metric("lossless_generated_tokens_total")
    body = {"prompt": PROMPT, "max_tokens": LONG_DECODE, "stream": True, "lossless": {"mode": "ar"}}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    assert resp.readline().startswith(b"data: ")  # decoding has started
    resp.close()
    _idle(server)
    assert 0 < server.metric("lossless_generated_tokens_total") - before < LONG_DECODE // 2  # stopped early
    # waiting for a whole answer: send the request, hang up before it is done
    before = server.metric("lossless_generated_tokens_total")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        data = json.dumps({**body, "stream": False}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        deadline = time.monotonic() + 30
        while server.get("/health")[1]["queue"] == 0:  # until it decodes
            assert time.monotonic() < deadline
            time.sleep(0.01)
    _idle(server)
    assert server.metric("lossless_generated_tokens_total") - before < LONG_DECODE  # cancelled queued or decoding
    # the next request starts and completes
    assert server.client().completions.create(model=server_model(server), prompt=PROMPT,
                                              max_tokens=4).usage.completion_tokens == 4


def test_metrics_and_the_access_log(server):
    client = server.client()
    client.chat.completions.create(model=server_model(server), messages=[{"role": "user", "content": PROMPT}],
                                   max_tokens=8)
    _, text = server.get("/metrics")
    for series in ('lossless_requests_total{route="/v1/chat/completions",status="200"}',
                   "lossless_generated_tokens_total", "lossless_tokens_per_cycle_count", "lossless_queue_depth",
                   "lossless_time_to_first_token_seconds_bucket", "lossless_time_per_output_token_seconds_count"):
        assert series in text, series
    assert server.metric("lossless_tokens_per_cycle_count") >= 1
    assert '"POST /v1/chat/completions" 200' in server.log.read_text()


def test_the_api_key_guards_every_route_but_health_and_a_full_queue_answers_429(model_dir):
    # one request at a time, so the queue holds what the test puts there (test_batch_server.py covers batches)
    with live_server(model_dir, "--max-queue", "2", "--batch", "1", env={"LOSSLESS_API_KEY": "sesame"},
                     stop=signal.SIGTERM) as s:
        assert s.get("/health")[0] == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            status, answer = s.get("/v1/models", headers)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key"
            assert s.post("/v1/completions", {"prompt": PROMPT}, headers)[0] == 401
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        client = s.client(api_key="sesame")
        name = client.models.list().data[0].id

        # load: 8 clients x 3 requests of 32 tokens; each completes or gets a clean 429, nothing is lost
        outcomes, latencies = [], []

        def one_client():
            for _ in range(3):
                start = time.perf_counter()
                try:
                    out = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}],
                                                         max_tokens=32)
                    outcomes.append(out.usage.completion_tokens)
                    latencies.append(time.perf_counter() - start)
                except openai.RateLimitError as exc:
                    assert exc.status_code == 429 and "busy" in str(exc)
                    outcomes.append(429)

        threads = [threading.Thread(target=one_client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(outcomes) == 24 and set(outcomes) <= {32, 429} and 32 in outcomes
        print(f"\n{outcomes.count(32)} completed, {outcomes.count(429)} refused (429); latency s: "
              f"median {sorted(latencies)[len(latencies) // 2]:.3f}, max {max(latencies):.3f}")
        _idle(s)

        # clients that hang up while queued give their places back at once: a long decode runs, two requests
        # queue and go away, and the next request is admitted (not 429)
        auth = {"Authorization": "Bearer sesame", "Content-Type": "application/json"}
        long = _open_stream(s, auth)
        hung_up = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", s.port))
            data = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            hung_up.append(sock)
        _until(lambda: s.get("/health")[1]["queue"] == 3)
        for sock in hung_up:
            sock.close()
        _until(lambda: s.get("/health")[1]["queue"] == 1)
        admitted = []
        waiter = threading.Thread(target=lambda: admitted.append(
            client.completions.create(model=name, prompt=PROMPT, max_tokens=4).usage.completion_tokens))
        waiter.start()
        _until(lambda: s.get("/health")[1]["queue"] == 2)
        long.close()  # cancels the long decode; the admitted request runs
        waiter.join(60)
        assert admitted == [4]

        # SIGTERM while a stream runs: the stream ends with an error chunk and [DONE], the server exits 0
        last = _open_stream(s, auth)
    rest = last.read().decode()
    assert "shutting_down" in rest and rest.rstrip().endswith("data: [DONE]")


def _until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _open_stream(server, headers: dict):
    """A long AR decode, streamed over raw HTTP; returned once its first chunk arrived."""
    body = {"prompt": PROMPT, "max_tokens": LONG_DECODE, "stream": True, "lossless": {"mode": "ar"}}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers=headers)
    resp = urllib.request.urlopen(req, timeout=60)
    assert resp.readline().startswith(b"data: ")
    return resp


def test_an_address_it_cannot_listen_on_is_a_one_line_error_before_the_model_loads(model_dir, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv in (["--port", str(port)], ["--host", "no-such-host.invalid"]):
            rc = main(["serve", "--model", str(model_dir / "missing"), *argv])
            err = capsys.readouterr().err
            assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
            assert "--port" in err or "--host" in err


def test_connections_past_the_limit_get_a_503_and_the_server_serves_on(model_dir):
    with live_server(model_dir, "--max-connections", "3", "--batch", "1") as s:
        held = []
        # a request's head without its body holds its connection; one that arrives while an earlier connection is
        # still counted (the readiness check's, closing) gets a 503 itself and is closed: hold more until the
        # limit is reached, so a fourth connection is refused at once
        while s.get("/health")[0] != 503:
            assert len(held) < 12, "the connection limit was never reached"
            held.append(socket.create_connection(("127.0.0.1", s.port)))
            held[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{")
            time.sleep(0.05)
        assert len(held) >= 2  # the limit, not something else, refused it
        for sock in held:
            sock.close()
        _until(lambda: s.get("/health")[0] == 200)
        assert s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[0] == 200
        # one request at a time: a sampled one runs the tree and lookup it asks for
        status, answer = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.8, "seed": 1,
                                                    "lossless": {"tree": 4, "lookup": 8}})
        assert status == 200 and (answer["lossless"]["tree"], answer["lossless"]["lookup"]) == (4, 8)
