"""Request handling that needs no decoding: what reaches the log (bounded, escaped), and prompts refused by their
length before the chat template and the tokenizer run (which run off the event loop)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

import lossless
from conftest import save_tiny_model_dir
from lossless.serving import app as app_module
from lossless.serving import create_app
from lossless.serving.protocol import ChatRequest, loggable, parse


def test_loggable_text_cannot_forge_a_line_and_is_bounded():
    forged = '/x\n2026-12-06 10:00:00 lossless.serve 1.2.3.4 "POST /v1/chat/completions" 200 5 ms'
    out = loggable(forged, 200)
    assert "\n" not in out and "\r" not in out and '\\"POST' in out and out.startswith("/x\\n")
    assert loggable("a" * 500, 40) == "a" * 40 + "..."
    assert loggable("\x1b[31mred\u2028", 40) == "\\x1b[31mred\\u2028"


def test_unknown_fields_make_one_bounded_escaped_log_line(caplog):
    body = {"messages": [{"role": "user", "content": "w1"}]}
    body.update({f"k{i}\nforged line {i}": i for i in range(40000)})
    with caplog.at_level(logging.INFO, logger="lossless.serve"):
        parse(ChatRequest, json.dumps(body).encode())
    lines = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and len(lines[0]) < 400
    assert lines[0].startswith("ignored 40000 unknown request fields: ") and lines[0].endswith("and 39995 more")


def _post(app, path: str, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    sent, chunks = [], [{"type": "http.request", "body": data, "more_body": False}]

    async def receive():
        if chunks:
            return chunks.pop(0)
        await asyncio.Event().wait()  # the client stays until the answer is sent

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "scheme": "http", "root_path": ""}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = lossless.load_model(str(save_tiny_model_dir(tmp_path_factory.mktemp("p") / "tiny")), "fp32",
                                attn="exact", head="none")
    app = create_app(model, max_body=1 << 22)
    yield model, app
    app.state.engine.close()


def test_a_prompt_too_long_by_its_characters_is_refused_before_it_is_tokenized(served, monkeypatch):
    model, app = served
    calls = []
    real = app_module.encode_prompt
    monkeypatch.setattr(app_module, "encode_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(app_module, "encode_messages", lambda *a, **k: calls.append(1))
    bound = model.max_positions * app_module.max_token_chars(model.tokenizer)
    long = "w1 " * (bound // 3 + 1)
    for path, body, param in (("/v1/completions", {"prompt": long}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages")):
        status, answer = _post(app, path, body)
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
        assert answer["error"]["param"] == param
    assert calls == []  # neither the template nor the tokenizer ran
    status, answer = _post(app, "/v1/completions", {"prompt": "w1 w2", "max_tokens": 2})
    assert status == 200 and calls == [1] and answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": "w1", "logprobs": 0}, "logprobs", "unsupported"),  # 0 asks for the chosen tokens' log-probabilities
    ({"prompt": "w1", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"prompt": "w1", "stream": False, "stream_options": {"include_usage": False}}, "stream_options", "invalid_value"),
])
def test_fields_openai_refuses_are_refused_in_its_shape(body, param, code):
    from lossless.serving.protocol import ApiError, CompletionRequest

    with pytest.raises(ApiError) as refused:
        parse(CompletionRequest, json.dumps(body).encode())
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, code)
    parse(CompletionRequest, json.dumps({"prompt": "w1", "logprobs": None, "stream": True,
                                         "stream_options": {"include_usage": True}}).encode())  # these are fine
    too_many = parse(CompletionRequest, json.dumps({"prompt": "w1", "stop": list("abcde")}).encode())
    with pytest.raises(ApiError) as refused:
        too_many.stops()
    assert (refused.value.param, refused.value.code) == ("stop", "invalid_value")


def test_time_to_first_token_counts_from_the_requests_arrival(served, monkeypatch):
    import time

    model, app = served
    real = app_module.encode_prompt

    def slow(*args, **kwargs):  # a tokenizer that takes its time
        time.sleep(0.3)
        return real(*args, **kwargs)
    monkeypatch.setattr(app_module, "encode_prompt", slow)
    registry = app.state.engine.metrics.registry
    before = registry.get_sample_value("lossless_time_to_first_token_seconds_sum") or 0.0
    assert _post(app, "/v1/completions", {"prompt": "w3 w4", "max_tokens": 2})[0] == 200
    assert registry.get_sample_value("lossless_time_to_first_token_seconds_sum") - before >= 0.3


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_a_whole_one_is_read():
    from starlette.requests import Request

    from lossless.serving.app import read_body
    from lossless.serving.protocol import ApiError

    def request(parts):
        async def receive():
            if parts:
                return parts.pop(0)
            await asyncio.Event().wait()  # a client that stopped sending
        return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)

    async def read(parts, seconds):
        return await read_body(request(parts), 1 << 20, seconds)
    slow = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}]
    with pytest.raises(ApiError) as late:
        asyncio.run(read(slow, 0.2))
    assert late.value.status == 408 and late.value.code == "request_timeout"
    whole = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True},
             {"type": "http.request", "body": b'"w1"}', "more_body": False}]
    assert asyncio.run(read(whole, 0.2)) == b'{"prompt": "w1"}'
