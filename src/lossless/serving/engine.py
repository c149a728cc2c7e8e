"""One model, one decoding thread, a FIFO queue in front of it.

Owns the order of work and its lifetime: a `Job` (prompt ids and generate settings) waits in a bounded
queue (`QueueFull` at once when it is full) and decodes on the engine's thread, which owns the model; its
text reaches the request's event loop as it is committed, already cut at the stop strings. A job is
cancelled by its request (a client that went away) or by shutdown, between two cycles.

With `batch` 1 jobs decode one at a time, each in the configuration it asked for (`OrthrusLM.generate`). With
`batch` > 1 (exact kernels) up to that many decode together, one forward per step (`decoding.batch`): a job joins
at the next step after it arrives (its prompt running in chunks of `prefill_chunk` rows beside the others' steps)
and leaves at the step it ends, and its tokens are bitwise AR's alone (sampled: its seed's). A batch runs AR steps with
prompt lookup (the draft view's passes decode one sequence at a time): greedy tokens are the same as any lossless
configuration's on exact kernels; sampled ones are `--mode ar`'s with the same seed (a copy is kept where AR's
draw at its position chooses it), and so those of a sampled tree's. A job that finds nothing else decoding or
waiting decodes alone in the configuration it asked for (the fastest lossless one by default: with one client a
batch's AR steps would be slower than speculation), where that configuration commits AR's tokens (greedy, or sampled
in a tree: `OrthrusLM.draws_ar_tokens`), until another job arrives; then it
goes on in the batch after the tokens it has, its cache moved into the batch's (its prompt and tokens are not run
again). Its tokens are the same either way. It does not know HTTP; `app.py`
turns jobs into responses.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import LosslessError
from ..names import DEFAULT_LOOKUP, EXACT, PREFILL_CHUNK
from ..text import StopCutter, StreamDecoder

log = logging.getLogger("lossless.serve")


class QueueFull(Exception):
    """Every place in the queue is taken."""


class ClientBusy(QueueFull):
    """This client already has as many requests waiting or decoding as one client may."""


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
    client: str = ""  # who sent it (an API key's digest, else an address): for the per-client limit
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
    """Decodes jobs in the order they came, on one thread that owns `model`: one at a time, or up to `batch`
    together (exact kernels). A place in the queue is held by a job that waits and whose client is still there:
    a cancelled job leaves the queue at once (it is not decoded, and it does not count as someone waiting).

    If the decoding thread itself fails (not a job's own decode: that fails the job alone), every job waiting or
    decoding gets the error, `failure` says why, `submit` refuses new work (ShuttingDown, a 503), and `on_failure`
    (the server's: exit with status 1, for a supervisor to restart it) is called."""

    def __init__(self, model, max_queue: int = 16, metrics=None, batch: int = 1, prefill_chunk: int | None = None,
                 on_failure=None, max_per_client: int | None = None):
        if batch > 1 and getattr(model, "attn", None) != EXACT:
            raise LosslessError(f"--batch {batch} needs exact kernels (a request's tokens must not depend on its "
                                f"neighbours): serve with --attn exact, or --batch 1")
        self.model, self.metrics, self.max_queue, self.batch = model, metrics, max_queue, batch
        self.max_per_client = max_per_client  # requests one client may have waiting or decoding (None: no limit)
        # the most prompt rows a batched step runs
        self.prefill_chunk = PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        if batch > 1:  # a bad value refused here, not by the decoding thread's first BatchDecoder (which would die)
            from ..decoding.batch import BatchDecoder

            BatchDecoder.check_prefill_chunk(self.prefill_chunk)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # a job arrived, or the engine is stopping
        self._waiting: deque[Job] = deque()  # jobs whose clients are still there, in arrival order
        self._closing = False
        self.failure: Exception | None = None
        self.on_failure = on_failure
        self.running: set[Job] = set()  # decoding now
        self._thread = threading.Thread(target=self._serve, name="lossless-decode", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.failure is not None:
                raise ShuttingDown(f"the decoding engine failed ({type(self.failure).__name__}): the server is "
                                   f"restarting")
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if self.max_per_client is not None and job.client and sum(
                    other.client == job.client for other in (*self._waiting, *self.running)) >= self.max_per_client:
                raise ClientBusy(f"this client already has {self.max_per_client} request"
                                 f"{'s' if self.max_per_client > 1 else ''} waiting or decoding")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"all {self.max_queue} places in the queue are taken")
            job.on_cancel = self._forget
            self._waiting.append(job)
            self._gauge()
            self._wake.notify()

    def _forget(self, job: Job) -> None:
        """A waiting job's client left: the job leaves the queue now."""
        with self._lock:
            try:
                self._waiting.remove(job)
            except ValueError:  # decoding already (it stops between two cycles) or done
                pass
            self._gauge()

    def depth(self) -> int:
        with self._lock:
            return self._depth()

    def _depth(self) -> int:
        return len(self._waiting) + len(self.running)

    def _someone_waits(self) -> bool:
        with self._lock:
            return bool(self._waiting)

    def stop(self) -> None:
        """Take no more work; cancel what runs and what waits (each gets ShuttingDown). Returns at once; it takes the
        engine's lock, so a signal handler must not call it on a thread that may hold that lock (`stop_soon`)."""
        with self._lock:
            self._closing = True
            doomed = [*self._waiting, *self.running]
            self._waiting.clear()
            self._gauge()
            self._wake.notify_all()
        for job in doomed:
            job.cancel()
            job.emit("error", ShuttingDown("the server is shutting down"))

    def stop_soon(self) -> threading.Thread:
        """`stop()` on a thread of its own: safe from a signal handler that interrupted this engine's own lock
        holder (the event loop's thread, in `submit` or a request's clean-up), which `stop()` there would deadlock."""
        thread = threading.Thread(target=self.stop, name="lossless-stop", daemon=True)
        thread.start()
        return thread

    def close(self, timeout: float = 2.0) -> None:
        """stop(), then wait for the decoding thread (it ends within a cycle)."""
        self.stop()
        self._thread.join(timeout)

    def _gauge(self) -> None:  # under the lock
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._depth())

    def _take(self, block: bool) -> Job | None | bool:
        """The next job to decode (marked running), None at shutdown, False when none is waiting (`block` False)."""
        with self._lock:
            while not self._closing and not self._waiting:
                if not block:
                    return False
                self._wake.wait()
            if self._closing:
                return None
            job = self._waiting.popleft()
            self.running.add(job)
            self._gauge()
            return job

    def _done(self, job: Job, result) -> None:
        """Hand a job its result (or its error) and free its place."""
        with self._lock:
            self.running.discard(job)
            self._gauge()
        if isinstance(result, Exception):
            job.emit("error", result)
        elif not (self._closing and job.cancelled.is_set()):  # stop() has told it already
            job.emit("done", result)

    def _serve(self) -> None:
        """The decoding thread: its loop, and if the loop itself fails, every job told so."""
        try:
            self._run() if self.batch == 1 else self._run_batched()
        except BaseException as exc:  # noqa: BLE001 - the thread's end: nothing else would notice
            log.exception("the decoding engine failed", exc_info=exc)
            with self._lock:
                self.failure = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
                self._closing = True
                doomed = [*self._waiting, *self.running]
                self._waiting.clear()
                self.running.clear()
                self._gauge()
            for job in doomed:
                job.emit("error", self.failure)
            if self.on_failure is not None:
                self.on_failure(self.failure)

    def _run(self) -> None:
        while (job := self._take(block=True)) is not None:
            self._done(job, self._guarded(self._decode, job))

    @staticmethod
    def _guarded(decode, job: Job):
        """decode(job)'s result, or its exception: a request's failure is its own; the next one decodes."""
        try:
            return decode(job)
        except Exception as exc:
            return _failed(exc)

    def _run_batched(self) -> None:
        from ..decoding.batch import BatchDecoder

        decoder = BatchDecoder(self.model, self.prefill_chunk)
        live: dict[object, _Live] = {}  # sequence -> its job's streaming state
        while True:
            # 1. admit: waiting jobs join while there is room (wait for one only when nothing decodes)
            while len(live) < self.batch:
                job = self._take(block=not live)
                if job is None:
                    return self._abandon(live)
                if job is False:
                    break
                entry = _Live(job, self.model.tokenizer)
                if not live and not self._someone_waits() and self._begins_alone(job):
                    # alone: a job decodes in its own fastest cycle until another job arrives, then goes on in the
                    # batch after the tokens it has (the same tokens either way, on exact kernels)
                    try:
                        entry.alone = self._alone(entry)
                    except Exception as exc:
                        self._done(job, _failed(exc))
                        continue
                    if entry.alone.finish_reason != "stop" or entry.cutter.stopped or job.cancelled.is_set():
                        self._done(job, self._guarded(lambda j: self._answer(j, entry.cutter, entry.alone,
                                                                             entry.last), job))
                        continue
                try:
                    seq = decoder.add(job.prompt_ids, batch_config(job.settings), on_tokens=entry.on_tokens,
                                      **entry.handed_over())
                except Exception as exc:
                    self._done(job, _failed(exc))
                    continue
                entry.lookup = seq.cfg.lookup
                live[seq] = entry
            # 2. a job stopped by its stop string or its client leaves before the step
            for seq, entry in live.items():
                if entry.cutter.stopped or entry.job.cancelled.is_set():
                    seq.finish("stop")
            # 3. one forward for all of them; the ones that ended get their results
            if self.metrics is not None and decoder.active:
                self.metrics.batch_size.observe(len(decoder.active))
            try:
                ended = decoder.step()
            except Exception as exc:  # fails the jobs of this batch; the next ones start on a fresh decoder
                for entry in live.values():
                    self._done(entry.job, _failed(exc))
                live, decoder = {}, BatchDecoder(self.model, self.prefill_chunk)
                continue
            for seq in ended:
                entry = live.pop(seq)
                if seq.error is not None:  # its own failure: the others decode on
                    self._done(entry.job, _failed(seq.error))
                    continue
                try:
                    result = self._result(entry, seq)
                except Exception as exc:
                    result = _failed(exc)
                self._done(entry.job, result)

    def _begins_alone(self, job: Job) -> bool:
        """Whether a job alone decodes in its own cycle: where that cycle commits `--mode ar`'s tokens (greedy, or
        sampled in AR or a tree: `draws_ar_tokens`), so the batch may take it over after any of them."""
        try:
            return self.model.draws_ar_tokens(job.settings, len(job.prompt_ids))
        except Exception as exc:  # noqa: BLE001 - a setting its decode refuses, or costs that could not be measured:
            # the job decodes in the batch (whose `add` refuses a bad setting for this job alone); the engine goes on
            if not isinstance(exc, LosslessError):
                log.warning("could not tell a request's own cycle (%s); it decodes in the batch", exc)
            return False

    def _alone(self, entry: "_Live", handing_over: bool = True):
        """A job's decode in the configuration it asked for, stopped after a cycle in which its stop string appeared
        or its client left, or (`handing_over`) another job arrived."""
        job = entry.job
        return self.model.generate(job.prompt_ids, on_tokens=entry.on_tokens, **job.settings, keep_cache=handing_over,
                                   stop=lambda: entry.cutter.stopped or job.cancelled.is_set()
                                   or (handing_over and self._someone_waits()))

    def _abandon(self, live: dict) -> None:
        """Shutdown: `stop` has cancelled and told every running job already."""
        with self._lock:
            for entry in live.values():
                self.running.discard(entry.job)
            self._gauge()

    def _result(self, entry: "_Live", seq) -> Result:
        from ..decoding import kernels
        from ..decoding.loop import GenerationOutput

        state, model = seq.state, self.model
        text = model.tokenizer.decode(state.generated, skip_special_tokens=True) if model.tokenizer is not None else ""
        config = {"dtype": model.dtype_name, "attn": model.attn, "exact": True, "mode": "ar", "cycle": None, "k": None,
                  "tree": 0, "lookup": entry.lookup, "batched": True, "kernels": kernels.build_name(),
                  "versus_ar": "tokens"}
        if entry.alone is not None:  # its first tokens decoded alone, before another request came
            config["alone_first"] = {"tokens": len(entry.alone.token_ids),
                                     **{k: entry.alone.config.get(k) for k in ("mode", "cycle", "k", "tree", "lookup")}}
        out = GenerationOutput(text=text, token_ids=state.generated, stats=state.stats.to_dict(),
                               prompt_ids=state.tokens[:state.n_prompt], finish_reason=state.finished, config=config)
        return self._answer(entry.job, entry.cutter, out, entry.last)

    def _decode(self, job: Job) -> Result:
        entry = _Live(job, self.model.tokenizer)
        return self._answer(job, entry.cutter, self._alone(entry, handing_over=False), entry.last)

    def _answer(self, job: Job, cutter: StopCutter, out, last) -> Result:
        """The job's result from its decode's output: the text cut at the stop strings, exactly what was streamed."""
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


def _failed(exc: Exception) -> Exception:
    if not isinstance(exc, LosslessError):
        log.exception("decoding failed", exc_info=exc)
    return exc


def _note_tokens(job: Job, last: list, ids: list[int]) -> None:
    """Time and count of a job's latest committed tokens (for its time to first token and time per token)."""
    if ids:
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
        last[0], last[1] = now, last[1] + len(ids)


class _Live:
    """A job decoding in the batch: its text stream, cut at its stop strings as tokens are committed."""

    def __init__(self, job: Job, tokenizer):
        self.job, self.cutter, self.last, self.lookup = job, StopCutter(job.stops), [job.arrived, 0], 0
        self.stream = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.alone = None  # the GenerationOutput of its decode alone, where it began so

    def handed_over(self) -> dict:
        """`BatchDecoder.add`'s arguments that continue its decode alone (none where it did not begin so)."""
        if self.alone is None:
            return {}
        from ..decoding.loop import DecodeStats

        s, cache = self.alone.stats, self.alone.cache
        self.alone.cache = None  # moved into the batch's cache (its prompt and tokens are not run again)
        return {"generated": list(self.alone.token_ids), "cache": cache,
                "stats": DecodeStats(steps=s["steps"], forwards=s["forwards"], new_tokens=s["new_tokens"],
                                     seconds=s["seconds"], accepted=list(s["accepted"]))}

    def on_tokens(self, ids: list[int]) -> None:
        _note_tokens(self.job, self.last, ids)
        if self.stream is not None:
            piece = self.cutter.push(self.stream.push(ids))
            if piece:
                self.job.emit("text", piece)


def batch_config(settings: dict):
    """A job's `generate` settings as a batch runs them: AR steps with prompt lookup (the request's, else
    DEFAULT_LOOKUP) unless the job asked for AR; trees, the fused cycle and the draft view are not run."""
    from ..decoding.loop import DecodeConfig
    from ..decoding.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=settings.get("temperature", 0.0), top_k=settings.get("top_k", 0),
                              top_p=settings.get("top_p", 1.0), seed=settings.get("seed", 0))
    lookup = settings.get("lookup")
    if settings.get("mode", "orthrus") == "ar":
        lookup = 0
    elif lookup is None:
        lookup = DEFAULT_LOOKUP
    return DecodeConfig(max_new_tokens=settings["max_new_tokens"], sampling=sampling, lookup=int(lookup))
