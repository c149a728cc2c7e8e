"""A bounded fault and load test on 127.0.0.1: 64 clients at once against a live `--batch 4` server, mixing
streamed and whole answers, greedy and sampled requests, clients that leave mid-stream, bodies past the cap,
parameters no sampler takes and a prompt far past the context. Every valid request gets its tokens (greedy:
`lossless generate`'s; sampled: `--mode ar`'s with its seed), every bad one a 4xx, nobody hangs; the server's
resident memory ends within 10% of where it was after warm-up; then SIGTERM with 8 streams in flight: each ends
within 10 s (an error chunk, then [DONE]) and the server exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

from test_server import PROMPT, _generate, live_server, model_dir  # noqa: F401

PROMPTS = [PROMPT, "w2 w7 w7 w1 w30", "w11 w12 w13 w11 w12 w13", "w40", "w3 w3 w9"]
TOKENS = 12


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _completion(server, body: dict, timeout: float = 120) -> tuple[int, str, bool]:
    """(status, text, ended with [DONE]) of a completion, streamed or not, over raw HTTP."""
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if not body.get("stream"):
                return resp.status, json.loads(resp.read())["choices"][0]["text"], True
            raw = resp.read().decode().splitlines()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]["message"], True
    events = [json.loads(line[6:]) for line in raw if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    return 200, text, raw[-1:] == ["data: [DONE]"] or "data: [DONE]" in raw


def test_64_clients_with_faults_then_sigterm(model_dir, capsys):  # noqa: F811
    want = {}
    for i, prompt in enumerate(PROMPTS):
        args = ("--max-new-tokens", str(TOKENS), "--no-chat-template", prompt)
        want[(i, "greedy")] = _generate(capsys, model_dir, *args)["text"]
        want[(i, "sampled")] = _generate(capsys, model_dir, "--mode", "ar", "--temperature", "0.8", "--seed", str(i),
                                         *args)["text"]
    with live_server(model_dir, "--batch", "4", "--max-queue", "64", "--max-body", "65536",
                     stop=signal.SIGTERM) as server:
        for i in range(3):  # warm-up
            assert _completion(server, {"prompt": PROMPTS[i], "max_tokens": TOKENS})[0] == 200
        rss_warm = _rss_kb(server.proc.pid)
        jobs, results, errors = [], {}, []
        for c in range(64):
            i, kind = c % len(PROMPTS), c % 8
            if kind < 4:  # valid: greedy or sampled, streamed or whole
                body = {"prompt": PROMPTS[i], "max_tokens": TOKENS, "stream": kind % 2 == 1}
                if kind >= 2:
                    body.update(temperature=0.8, seed=i)
                jobs.append((c, "valid", (i, "sampled" if kind >= 2 else "greedy"), body))
            elif kind == 4:  # leaves after the first chunk
                jobs.append((c, "leaves", None, {"prompt": PROMPTS[i], "max_tokens": 1500, "stream": True}))
            elif kind == 5:
                jobs.append((c, "bad", 413, {"prompt": " ".join(["w7"] * 30000)}))
            elif kind == 6:
                jobs.append((c, "bad", 400, {"prompt": PROMPTS[i], "temperature": 1e-40}))
            else:
                jobs.append((c, "bad", 400, {"prompt": " ".join(["w5"] * 100_000)[:60000], "max_tokens": 4}))

        def run(c, what, expect, body):
            try:
                if what == "leaves":
                    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                                 method="POST", headers={"Content-Type": "application/json"})
                    resp = urllib.request.urlopen(req, timeout=120)
                    assert resp.readline().startswith(b"data: ")
                    resp.close()
                    results[c] = "left"
                else:
                    results[c] = _completion(server, body)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append((c, repr(exc)))

        threads = [threading.Thread(target=run, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors and not any(t.is_alive() for t in threads), errors
        for c, what, expect, body in jobs:
            if what == "valid":
                status, text, done = results[c]
                assert status == 200 and done and text == want[expect], (c, body, text)
            elif what == "bad":
                assert results[c][0] == expect, (c, results[c])
        rss_end = _rss_kb(server.proc.pid)
        assert rss_end <= 1.10 * rss_warm, (rss_warm, rss_end)

        # SIGTERM with 8 streams in flight: each ends within 10 s, with an error chunk and [DONE]
        streams = []
        for i in range(8):  # sampled: batched AR steps, 1,500 tokens each (seconds), still running at the signal
            req = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": PROMPTS[i % 5], "max_tokens": 1500, "seed": i,
                                                          "temperature": 0.8, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"})
            resp = urllib.request.urlopen(req, timeout=60)
            assert resp.readline().startswith(b"data: ")
            streams.append(resp)
        server.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        cut = 0
        for resp in streams:  # each finishes or is told, and the stream ends properly
            rest = resp.read().decode()
            assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
            cut += "shutting_down" in rest
        assert time.monotonic() - start < 10 and cut >= 1
        assert server.proc.wait(timeout=10) == 0
