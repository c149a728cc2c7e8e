"""The server fuzzed from its own OpenAPI schema (schemathesis): valid and invalid bodies for every route, against a
live `lossless serve` on a tiny model. No answer is a 5xx, every 4xx is in OpenAI's error shape, and the server
still answers a normal request afterwards. Bounded: a few dozen examples per route, short decodes."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the schema fuzzer: pip install '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from test_server import live_server, model_dir  # noqa: E402,F401

import lossless  # noqa: E402
from lossless.serving import create_app  # noqa: E402

EXAMPLES = 120  # per route with a body and generation mode (10 for the others)


@pytest.fixture(scope="module")
def fuzzed(model_dir):  # noqa: F811
    with live_server(model_dir, "--max-tokens", "4", "--max-body", "65536", "--batch", "2") as s:
        yield s


@pytest.fixture(scope="module")
def operations(model_dir):  # noqa: F811
    """The server's routes as its OpenAPI document describes them (the app built in-process, for its schema)."""
    model = lossless.load_model(str(model_dir), "fp32", attn="exact", head="none")
    app = create_app(model)
    try:
        document = app.openapi()
    finally:
        app.state.engine.close()
    for path in ("/v1/chat/completions", "/v1/completions"):  # the served model's name, or none: a request that
        # names another model is a 404 before anything else is read, and would leave the rest of its body untried
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        body["properties"]["model"] = {"anyOf": [{"type": "string", "enum": [str(model_dir)]}, {"type": "null"}]}
        # the API's own fields (unknown ones are ignored by the server, and only dilute the search; the invalid
        # mode adds them back as violations)
        body["additionalProperties"] = False
    return [result.ok() for result in schemathesis.openapi.from_dict(document).get_all_operations()]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_request_makes_the_server_fail(operations, fuzzed, mode):
    """Bodies, paths and parameters drawn from the schema (valid ones, and ones that break it) for every route."""
    seen = {}
    for operation in operations:
        strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

        @settings(max_examples=EXAMPLES if operation.body else 10, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def call(case):
            response = case.call(base_url=fuzzed.url, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:300])
            if 400 <= response.status_code < 500 and response.status_code != 405:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text[:300]
        try:
            call()
        except Unsatisfiable:  # a route with nothing to break (no body; any string is a valid path parameter)
            assert mode == "negative" and not operation.body
    assert sum(seen.values()) >= len(operations) * 5 and any(400 <= s < 500 for s in seen), seen


def test_the_server_still_answers_after_the_fuzzing(fuzzed):
    assert fuzzed.get("/health")[0] == 200
    got, answer = fuzzed.post("/v1/completions", {"prompt": "w1 w5 w9 w3", "max_tokens": 3})
    assert got == 200 and answer["usage"]["completion_tokens"] == 3
    assert fuzzed.metric('lossless_requests_total{route="/v1/completions",status="500"}') == 0
    assert fuzzed.metric('lossless_requests_total{route="/v1/chat/completions",status="500"}') == 0
