"""`lossless serve` under hostile traffic, on a real model: how long a large body stalls the streams of others, and
how soon SIGTERM ends a server with requests in flight.

1. Stall: one client streams a long greedy answer while, `--bodies` times, another client sends a body of about
   1 MB, within the default `--max-body` (a prompt of `--body-chars` characters: refused, 400, past the context). Each body's stall is
   the longest gap between the stream's chunks that overlaps the body's request, less the stream's median gap
   away from any body (what a chunk costs anyway). `--rounds` rounds, each on a fresh stream.
2. SIGTERM: `--inflight` streams decoding (each has its first chunk), then SIGTERM: the seconds until the process
   exits, its exit code, and for each stream how it ended (an error chunk and [DONE], [DONE] alone, or the
   connection cut) and when.

Prints a table and, last, one JSON line.

    python benchmarks/serve_faults.py --dtype bf16 --attn exact --serve-args '--batch 8' --threads 2
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_port, start_server  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the storm that changed her life."


def post(url: str, body: dict, timeout: float = 600):
    """A JSON POST over raw HTTP: the response, left open (an error status is returned, not raised)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        return exc


class Stream(threading.Thread):
    """A streamed chat completion over raw HTTP: the arrival time of every chunk and how the stream ended."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.chunks: list[float] = []
        self.ended, self.ended_at, self.first = None, None, threading.Event()

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": self.max_tokens, "stream": True}
        saw_error = False
        try:
            with post(self.url + "/v1/chat/completions", body) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        saw_error |= '"error"' in line[:20]
                        self.chunks.append(time.perf_counter())
                        self.first.set()
                    elif line == "data: [DONE]":
                        self.ended = "error chunk, [DONE]" if saw_error else "[DONE]"
            self.ended = self.ended or "closed without [DONE]"
        except OSError as exc:  # the connection cut (http.client's errors are OSErrors or ValueErrors)
            self.ended = f"cut ({type(exc).__name__})"
        except ValueError as exc:
            self.ended = f"cut ({type(exc).__name__})"
        self.ended_at = time.perf_counter()
        self.first.set()


def stall_round(url: str, args) -> list[dict]:
    stream = Stream(url, args.max_tokens)
    stream.start()
    stream.first.wait(600)
    time.sleep(0.5)
    prompt = "x " * (args.body_chars // 2)
    windows = []
    for _ in range(args.bodies):
        t0 = time.perf_counter()
        with post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                 "max_tokens": 4}) as resp:
            resp.read()
        windows.append((t0, time.perf_counter(), resp.status))
        time.sleep(0.5)
    stream.join(600)
    gaps = [(a, b) for a, b in zip(stream.chunks, stream.chunks[1:])]
    quiet = [b - a for a, b in gaps if not any(a < w1 and b > w0 for w0, w1, _ in windows)]
    if not quiet:
        raise SystemExit("every gap of the stream overlapped a large body: use a longer --max-tokens or fewer --bodies")
    base = statistics.median(quiet)
    rows = []
    for w0, w1, status in windows:
        over = [b - a for a, b in gaps if a < w1 and b > w0]
        rows.append({"status": status, "request_seconds": round(w1 - w0, 4), "median_gap": round(base, 4),
                     "longest_gap": round(max(over, default=0.0), 4),
                     "stall": round(max(0.0, max(over, default=0.0) - base), 4)})
    return rows


def sigterm_round(proc, url: str, args) -> dict:
    streams = [Stream(url, args.max_tokens) for _ in range(args.inflight)]
    for s in streams:
        s.start()
    for s in streams:
        s.first.wait(600)
    time.sleep(0.3)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(60)
    except Exception:
        proc.kill()
        code = "killed after 60 s"
    exited = time.perf_counter() - t0
    for s in streams:
        s.join(30)
    return {"exit_code": code, "exit_seconds": round(exited, 3),
            "streams": [{"ended": s.ended, "seconds": round(s.ended_at - t0, 3) if s.ended_at else None,
                         "chunks": len(s.chunks)} for s in streams]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--attn", default="exact")
    parser.add_argument("--serve-args", default="--batch 8", help="options of lossless serve")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--body-chars", type=int, default=1_047_000, help="the large prompt's characters")
    parser.add_argument("--bodies", type=int, default=4, help="large bodies per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inflight", type=int, default=8, help="streams decoding when SIGTERM comes")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    if args.bodies < 1 or args.rounds < 1 or args.inflight < 1:
        raise SystemExit("--bodies, --rounds and --inflight must be at least 1")
    from lossless.decoding import kernels

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w", prefix="serve-faults-", suffix=".log", delete=False) as log:
        proc = start_server(args, port, log, args.serve_args)
    try:
        with post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                 "max_tokens": 16}) as resp:  # warm-up
            resp.read()
        stalls = [row for _ in range(args.rounds) for row in stall_round(url, args)]
        term = sigterm_round(proc, url, args)
    finally:
        if proc.poll() is None:
            proc.kill()
    cpu = f"{kernels.cpu_model()}, {kernels.isa()} kernels"
    print(f"lossless serve {args.serve_args}, {args.model} ({args.dtype} {args.attn}), {args.threads} threads, {cpu}")
    print(f"{'chars':>9} {'status':>6} {'request s':>9} {'median gap':>10} {'longest gap':>11} {'stall':>7}")
    for r in stalls:
        print(f"{args.body_chars:>9} {r['status']:>6} {r['request_seconds']:>9.3f} {r['median_gap']:>10.4f} "
              f"{r['longest_gap']:>11.4f} {r['stall']:>7.4f}")
    print(f"largest stall: {max(r['stall'] for r in stalls) * 1e3:.1f} ms over {len(stalls)} bodies")
    ends = [s["seconds"] for s in term["streams"] if s["seconds"] is not None]
    print(f"SIGTERM with {args.inflight} streams in flight: exit code {term['exit_code']} after "
          f"{term['exit_seconds']:.2f} s; streams ended: "
          f"{', '.join(sorted({s['ended'] or 'hanging' for s in term['streams']}))}; the last after "
          f"{max(ends, default=float('nan')):.2f} s")
    print(json.dumps({"benchmark": "serve_faults", "model": args.model, "dtype": args.dtype, "attn": args.attn,
                      "serve_args": args.serve_args, "threads": args.threads, "cpu": cpu, "body_chars": args.body_chars,
                      "stalls": stalls, "largest_stall": max(r["stall"] for r in stalls), "sigterm": term}))


if __name__ == "__main__":
    main()
