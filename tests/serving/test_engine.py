"""The serving engine without HTTP: a stop requested from a signal handler cannot deadlock, a cancelled job
leaves the queue at once, and a decoding thread that dies fails the jobs it held, refuses new ones and turns
/health to 503 instead of leaving every request hanging."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from conftest import tiny_backbone
from lossless.decoding.model import OrthrusLM
from lossless.serving import engine as engine_module
from lossless.serving.engine import Engine, Job, ShuttingDown

GREEDY = dict(mode="orthrus", max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0, seed=0)


@pytest.fixture(scope="module")
def model():
    m = OrthrusLM(tiny_backbone("llama").to(torch.float32), k=4)
    m.set_attn("exact")
    return m


async def _outcome(job: Job, seconds: float = 60) -> tuple[str, object]:
    """The job's last event: ("done", Result) or ("error", exception); a timeout is a hang."""
    while True:
        kind, value = await asyncio.wait_for(job.events.get(), seconds)
        if kind != "text":
            return kind, value


def test_a_stop_from_a_signal_handler_on_the_lock_holders_thread_does_not_deadlock(model):
    engine = Engine(model, batch=2)
    try:
        with engine._lock:  # as when SIGTERM lands while the event loop's thread is inside `submit`
            stopper = engine.stop_soon()  # returns at once, though this thread holds the engine's lock
            time.sleep(0.05)
            assert stopper.is_alive() and not engine._closing  # it waits for the lock, on its own thread
        stopper.join(5)
        assert not stopper.is_alive() and engine._closing
    finally:
        engine.close()


def test_a_cancelled_job_leaves_the_queue_at_once_and_is_never_decoded(model):
    engine = Engine(model, batch=2)

    async def run():
        loop = asyncio.get_running_loop()
        lone = Job([7], {**GREEDY, "max_new_tokens": 200}, [], loop)  # 200 tokens before any EOS
        engine.submit(lone)
        while not engine.running:  # decoding alone now
            await asyncio.sleep(0.001)
        gone = Job([4, 5, 6], GREEDY, [], loop)
        engine.submit(gone)
        assert engine.depth() == 2
        gone.cancel()  # its client left while it waited
        assert engine.depth() == 1 and not engine._waiting and lone in engine.running
        kind, result = await _outcome(lone)
        await asyncio.sleep(0.05)
        return kind, result, gone.events.qsize()
    try:
        kind, result, gone_events = asyncio.run(run())
    finally:
        engine.close()
    # nobody else waits: the lone greedy job decodes alone to its end (a dead job in the queue would have moved it
    # into batched AR steps), and the cancelled one was never decoded
    assert kind == "done" and "batched" not in result.config and result.config["mode"] == "orthrus"
    assert len(result.token_ids) == 200 and gone_events == 0


def test_a_decoding_thread_that_dies_fails_its_jobs_and_refuses_new_ones(model, monkeypatch):
    def broken(*args, **kwargs):  # a fault outside any job's own decode: the batched loop's admission itself
        raise RuntimeError("the decoding loop broke")
    monkeypatch.setattr(engine_module, "_Live", broken)
    failures = []
    engine = Engine(model, batch=2, on_failure=failures.append)

    async def run():
        loop = asyncio.get_running_loop()
        first, second = Job([1, 5, 9], GREEDY, [], loop), Job([2, 3], GREEDY, [], loop)
        engine.submit(first)
        engine.submit(second)
        return await _outcome(first, 10), await _outcome(second, 10)
    try:
        outcomes = asyncio.run(run())
    finally:
        engine.close()
    assert [kind for kind, _ in outcomes] == ["error", "error"]  # told, not left hanging
    assert all("the decoding loop broke" in str(exc) for _, exc in outcomes)
    assert isinstance(engine.failure, RuntimeError) and failures == [engine.failure]
    with pytest.raises(ShuttingDown, match="engine failed"):
        engine.submit(Job([1], GREEDY, [], asyncio.new_event_loop()))
    assert engine.depth() == 0


def _get(app, path: str) -> tuple[int, dict]:
    """GET `path` from an ASGI app, in-process."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": [], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80), "scheme": "http", "root_path": ""}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def test_health_says_503_once_the_engine_has_failed(model):
    from lossless.serving import create_app

    app = create_app(model, batch=2)
    engine = app.state.engine
    try:
        assert _get(app, "/health") == (200, {"status": "ok", "model": model.name, "queue": 0})
        engine.failure = RuntimeError("the decoding loop broke")
        status, body = _get(app, "/health")
        assert status == 503 and body["status"] == "engine failed" and body["error"] == "RuntimeError"
    finally:
        engine.close()


def test_one_client_cannot_take_every_place(model):
    from lossless.serving.engine import ClientBusy, QueueFull

    engine = Engine(model, batch=1, max_queue=8, max_per_client=2)

    async def run():
        loop = asyncio.get_running_loop()
        long = dict(GREEDY, mode="ar", max_new_tokens=150)
        mine = [Job([7], long, [], loop, client="key:a") for _ in range(2)]
        for job in mine:
            engine.submit(job)
        with pytest.raises(ClientBusy, match="already has 2 requests"):
            engine.submit(Job([7], long, [], loop, client="key:a"))
        other = Job([1, 2, 3], GREEDY, [], loop, client="address:10.0.0.2")
        engine.submit(other)  # another client still gets a place
        mine[1].cancel()  # a place of its own given back: the client may queue again
        again = Job([4, 5, 6], GREEDY, [], loop, client="key:a")
        engine.submit(again)
        outcomes = [await _outcome(j) for j in (mine[0], other, again)]
        return outcomes
    try:
        outcomes = asyncio.run(run())
    finally:
        engine.close()
    assert [kind for kind, _ in outcomes] == ["done", "done", "done"]
    assert issubclass(ClientBusy, QueueFull)  # a 429 like a full queue, with its own code
