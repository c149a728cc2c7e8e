"""One model, one decoding thread, a FIFO queue in front of it.

Owns the order of work and its lifetime: a `Job` (prompt ids and generate settings) waits in a bounded
queue (`QueueFull` at once when it is full) and decodes alone on the engine's thread, which owns the model;
its text reaches the request's event loop as it is committed, already cut at the stop strings. A job is
cancelled by its request (a client that went away) or by shutdown, between two cycles. It does not know
HTTP; `app.py` turns jobs into responses.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..errors import LosslessError
from ..text import StopCutter

log = logging.getLogger("lossless.serve")


class QueueFull(Exception):
    """Every place in the queue is taken."""


class ShuttingDown(Exception):
    """The server is stopping: no new work, and work in progress is cancelled."""


@dataclass
class Result:
    text: str  # the answer: cut at the first stop string, exactly what a stream sent
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # OpenAI's: "stop" (EOS or a stop string) | "length"
    stopped_by: str  # "eos" | "stop_string" | "length" | "cancelled"
    stats: dict
    config: dict


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    settings: dict  # keyword arguments of OrthrusLM.generate
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("text", str) | ("done", Result) | ("error", exc)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    on_cancel: object = None  # set by the engine: frees the job's place in the queue

    def emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the request's loop is gone (shutdown)
            pass

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel(self)


class Engine:
    """Decodes jobs one at a time, in the order they came, on one thread that owns `model`. A place in the queue
    is held by a job that waits and whose client is still there: a cancelled job gives its place back at once."""

    def __init__(self, model, max_queue: int = 16, metrics=None):
        self.model, self.metrics, self.max_queue = model, metrics, max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: set[Job] = set()
        self._closing = False
        self.current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="lossless-decode", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"all {self.max_queue} places in the queue are taken")
            job.on_cancel = self._forget
            self._waiting.add(job)
            self._gauge()
        self._queue.put(job)

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._waiting.discard(job)
            self._gauge()

    def depth(self) -> int:
        with self._lock:
            return self._depth()

    def _depth(self) -> int:
        return len(self._waiting) + (self.current is not None)

    def stop(self) -> None:
        """Take no more work; cancel what runs and what waits (each gets ShuttingDown). Returns at once."""
        with self._lock:
            self._closing = True
            doomed = [*self._waiting, *([self.current] if self.current is not None else [])]
        for job in doomed:
            job.cancel()
            job.emit("error", ShuttingDown("the server is shutting down"))
        self._queue.put(None)

    def close(self, timeout: float = 2.0) -> None:
        """stop(), then wait for the decoding thread (it ends within a cycle)."""
        self.stop()
        self._thread.join(timeout)

    def _gauge(self) -> None:  # under the lock
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._depth())

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                break
            with self._lock:
                self._waiting.discard(job)
                if self._closing or job.cancelled.is_set():
                    self._gauge()
                    continue
                self.current = job
                self._gauge()
            try:
                result = self._decode(job)
            except Exception as exc:  # a request's failure is its own; the next one decodes
                if not isinstance(exc, LosslessError):
                    log.exception("decoding failed")
                result = exc
            with self._lock:
                self.current = None
                self._gauge()
            if isinstance(result, Exception):
                job.emit("error", result)
            elif not (self._closing and job.cancelled.is_set()):  # stop() has told it already
                job.emit("done", result)

    def _decode(self, job: Job) -> Result:
        cutter = StopCutter(job.stops)
        last = [job.arrived, 0]  # time and count of the latest committed tokens

        def on_tokens(ids):
            if ids:
                now = time.perf_counter()
                if job.first_token_at is None:
                    job.first_token_at = now
                last[0], last[1] = now, last[1] + len(ids)

        def on_text(delta):
            piece = cutter.push(delta)
            if piece:
                job.emit("text", piece)

        out = self.model.generate(job.prompt_ids, on_text=on_text, on_tokens=on_tokens,
                                  stop=lambda: cutter.stopped or job.cancelled.is_set(), **job.settings)
        if not cutter.stopped:
            if out.text.startswith(cutter.text):  # the stream held back a trailing incomplete character
                piece = cutter.push(out.text[len(cutter.text):])
                if piece:
                    job.emit("text", piece)
            else:  # a tokenizer whose pieces do not add up to its whole decode: the answer is what was streamed
                log.warning("the streamed text is not a prefix of the decoded text; answering with the streamed text")
        piece = cutter.flush()
        if piece:
            job.emit("text", piece)
        stopped_by = ("cancelled" if job.cancelled.is_set() else "stop_string" if cutter.stopped
                      else out.finish_reason)
        self._observe(job, out, last)
        return Result(text=cutter.text, token_ids=out.token_ids, prompt_tokens=len(out.prompt_ids),
                      finish_reason="length" if out.finish_reason == "length" and not cutter.stopped else "stop",
                      stopped_by=stopped_by,
                      stats=out.stats, config=out.config)

    def _observe(self, job: Job, out, last) -> None:
        m = self.metrics
        if m is None:
            return
        n = len(out.token_ids)
        m.tokens.inc(n)
        if job.first_token_at is not None:
            m.time_to_first_token.observe(job.first_token_at - job.arrived)
            if last[1] > 1:
                m.time_per_token.observe((last[0] - job.first_token_at) / (last[1] - 1))
        if out.config.get("mode") == "orthrus" and out.stats.get("steps"):
            m.tokens_per_cycle.observe(out.stats["tokens_per_step"])
