"""llama.cpp, the engine most CPU users run, as a peer: the embedded model's own GGUF file requantized by llama.cpp
to a dtype (so both engines read the same weights), and llama.cpp's own server (`llama-server`) decoding token ids
greedily, plainly or with one of its speculative modes. The audit's llama.cpp candidates (`candidates.py`)
and the benchmarks (`benchmarks/peers.py`, `serve_load.py`) build on this.

The server binary is the one `$LLAMA_SERVER` names, else this CPU's build of the pinned release that `build()`
makes (`make llama-server`, or `python -m lossless.study.llamacpp`), else `llama-server` on PATH. Its
`llama-quantize` (beside it) requantizes the GGUF.

Each decode is one `/completion` request: the prompt as token ids (the same chat template as ours), greedy
(temperature 0), no prompt reuse between requests, the top two log-probabilities of every generated token (their
difference is the logit margin: a softmax shifts every logit alike). llama.cpp stops at its end-of-generation
tokens and returns the last one, as our decode loop keeps its EOS.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import net
from ..errors import LosslessError
from ..paths import cache_dir

SERVER_ENV = "LLAMA_SERVER"
CONTEXT = 4096  # the server's context: a suite prompt and its 128-token answer fit many times over
START_SECONDS = 300.0  # a server that does not answer /health by then is stuck
# greedy: temperature 0 (llama.cpp then takes the most probable token), every sampler that could change that off
GREEDY_SAMPLING = {"temperature": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "dry_multiplier": 0.0}

# the dtype -> (llama-cpp-python's file type constant, file suffix, llama-quantize's type name)
FILE_TYPES = {"bf16": ("LLAMA_FTYPE_MOSTLY_BF16", "bf16", "BF16"), "fp16": ("LLAMA_FTYPE_MOSTLY_F16", "f16", "F16"),
              "fp32": ("LLAMA_FTYPE_ALL_F32", "f32", "F32")}

# The speculative modes of the pinned llama.cpp that need no second model file, and one draft model made from the
# embedded model's own file: candidate suffix -> llama-server options. The n-gram modes draft from n-grams of the
# context as prompt lookup does (a 2-token match, up to 10 drafted tokens: Hugging Face's prompt lookup settings);
# their defaults (a 12-token match) draft so rarely that nothing would be verified. `draft` drafts with the
# embedded file itself (4-bit weights) for its bf16/fp16/fp32 requantization: the same model, other kernels.
NGRAM = ("2", "10")  # lookup n-gram, drafted m-gram
MODES: dict[str, list[str]] = {
    "ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", NGRAM[0],
                     "--spec-ngram-simple-size-m", NGRAM[1]],
    "ngram-map-k": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", NGRAM[0],
                    "--spec-ngram-map-k-size-m", NGRAM[1]],
    "ngram-map-k4v": ["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", NGRAM[0],
                      "--spec-ngram-map-k4v-size-m", NGRAM[1]],
    "ngram-mod": ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", NGRAM[0], "--spec-ngram-mod-n-min", "1",
                  "--spec-ngram-mod-n-max", NGRAM[1]],
    "ngram-cache": ["--spec-type", "ngram-cache"],
    "draft": ["--spec-type", "draft-simple", "--spec-draft-n-max", "8"],  # + "-md <the embedded GGUF>"
}
GREEDY = "greedy"  # plain decoding, no speculation


def source_gguf(spec: str) -> Path:
    """The GGUF file the embedded model `spec` is converted from."""
    from ..decoding.models import EMBEDDED

    if spec not in EMBEDDED:
        raise LosslessError(f"llama.cpp runs the embedded models' GGUF files only ({', '.join(EMBEDDED)}), not {spec}")
    package, name, pip_spec = EMBEDDED[spec]
    found = importlib.util.find_spec(package)
    path = Path(list(found.submodule_search_locations)[0]) / name if found else None
    if path is None or not path.exists():
        raise LosslessError(f"the embedded model '{spec}' needs its wheel: pip install --no-deps {pip_spec}")
    return path


def requantized(spec: str, dtype: str, quantize: str | Path | None = None) -> Path:
    """The embedded GGUF requantized by llama.cpp to `dtype`, made once and cached (written aside, then renamed, so
    an interrupted run leaves nothing half-written): through llama-cpp-python, or where `quantize` names a
    `llama-quantize` binary (a llama.cpp build of its own, as `llama-server`'s), through that."""
    if dtype not in FILE_TYPES:
        raise LosslessError(f"llama.cpp: no GGUF file type for dtype {dtype}; use one of {', '.join(FILE_TYPES)}")
    constant, suffix, type_name = FILE_TYPES[dtype]
    source = source_gguf(spec)
    maker = "" if quantize is None else ".llama-quantize"  # each requantizer's own file
    target = cache_dir() / "peers" / f"{source.stem}.{suffix}{maker}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    if quantize is not None:
        done = subprocess.run([str(quantize), "--allow-requantize", str(source), str(partial), type_name],
                              capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise LosslessError(f"{quantize} could not requantize {source} to {dtype}: "
                                f"{' '.join((done.stderr or done.stdout).strip().splitlines()[-1:])}")
        partial.replace(target)
        return target
    if importlib.util.find_spec("llama_cpp") is None:
        raise LosslessError(f"requantizing {source.name} to {dtype} needs llama.cpp's llama-quantize beside its "
                            "llama-server (make llama-server builds both) or llama-cpp-python (pip install .[peers])")
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, constant)
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
        partial.unlink(missing_ok=True)
        raise LosslessError(f"llama.cpp could not requantize {source} to {dtype}")
    partial.replace(target)
    return target


RELEASE = "0.3.36"  # the llama-cpp-python release (pyproject's `peers` extra) whose llama.cpp sources are built
BUILD_ENV = "LOSSLESS_LLAMA_BUILD"  # where builds are kept (default: $LOSSLESS_CACHE/llama.cpp)
BUILT = ".built"  # written last: a build directory without it is unfinished and is built again
CMAKE_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF"]
# llama.cpp's own AMX kernels (quantized models on Intel CPUs with AMX) are left out on x86-64: built by GCC 12 they
# fault on their tile configuration (`ldtilecfg`, the first quantized matrix product: llama-server dies by SIGSEGV or
# SIGILL on an Intel Xeon with AMX); its AVX-512 kernels serve those models instead. bf16 models never took them.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_options() -> list[str]:
    """The configure options of this machine's build (`CMAKE_OPTIONS`, and on x86-64 without llama.cpp's AMX kernels)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return list(CMAKE_OPTIONS)
    return [*CMAKE_OPTIONS, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


TARGETS = ["llama-server", "llama-quantize", "llama-bench"]  # the benchmarks time llama.cpp with llama-bench


def build_dir() -> Path:
    """This CPU's build of the pinned release: native code, so one directory per release, instruction set and
    configure options."""
    import hashlib

    from ..decoding.kernels import cpu_flags

    root = Path(os.environ.get(BUILD_ENV) or cache_dir() / "llama.cpp").expanduser()
    isa = hashlib.sha256((" ".join(sorted(cpu_flags())) + "\0" + " ".join(cmake_options())).encode()).hexdigest()[:10]
    return root / f"{RELEASE}-{isa}"


def cached_build() -> Path:
    """llama-server of `build()`'s build for this CPU (it may not exist yet)."""
    return build_dir() / "build" / "bin" / "llama-server"


def build(jobs: int | None = None) -> Path:
    """Build llama.cpp's llama-server, llama-quantize and llama-bench from the pinned release's sources (PyPI's
    sdist of llama-cpp-python), for this CPU, once: about 7 minutes on 2 cores. Needs cmake, ninja and a C++ compiler.
    Returns the server binary. An interrupted build is started again from scratch; a second process waits."""
    from ..decoding.kernels import _ninja_dir
    from ..paths import exclusive_lock

    here = build_dir()
    if all((here / BUILT).is_file() and cached_build().with_name(t).is_file() for t in TARGETS):
        return cached_build()
    ninja = _ninja_dir()  # pip's ninja (a dependency) where the system has none
    env = {**os.environ, "PATH": os.pathsep.join(filter(None, [ninja, os.environ.get("PATH", "")]))}
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool, path=env["PATH"]) is None:
            raise LosslessError(f"building llama.cpp needs {tool}: apt-get install {'g++' if tool == 'c++' else tool}")
    here.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(here.parent / f".lock-{here.name}", "another process is building llama.cpp here (pid {pid}): "
                                                             "wait for it"):
        if (here / BUILT).is_file() and cached_build().is_file():
            if not all(cached_build().with_name(t).is_file() for t in TARGETS):
                _build_targets(here, jobs, env)  # a build from before llama-bench was a target: seconds
            return cached_build()
        if here.exists():
            shutil.rmtree(here)
        here.mkdir(parents=True)
        _build_in(here, jobs, env)
    return cached_build()


def _run_build(cmd: list, cwd: Path, env: dict) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise LosslessError(f"building llama.cpp failed at `{' '.join(map(str, cmd[:3]))} ...`: {' | '.join(tail)}")


def _build_targets(here: Path, jobs: int | None, env: dict) -> None:
    """(Re)build TARGETS in the configured build at `here` (incremental: seconds where only one is missing)."""
    _run_build(["cmake", "--build", str(here / "build"), "-j", str(jobs or os.cpu_count() or 1), "--target", *TARGETS],
               here, env)


def _build_in(here: Path, jobs: int | None, env: dict) -> None:
    import sys

    def run(cmd, cwd=here):
        _run_build(cmd, cwd, env)

    run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={RELEASE}", "--no-deps", "--no-binary", ":all:",
         "-d", str(here), "-q"])
    run(["tar", "xzf", f"llama_cpp_python-{RELEASE}.tar.gz"])
    source = here / f"llama_cpp_python-{RELEASE}" / "vendor" / "llama.cpp"
    run(["cmake", "-S", str(source), "-B", str(here / "build"), "-G", "Ninja", *cmake_options()])
    _build_targets(here, jobs, env)
    (here / BUILT).write_text(server_version(here / "build" / "bin" / "llama-server") + "\n")


def find_server(path: str | Path | None = None) -> Path | None:
    """The llama-server binary: `path`, else $LLAMA_SERVER, else this CPU's build of the pinned release
    (`make llama-server`), else one on PATH; None if none."""
    named = path or os.environ.get(SERVER_ENV)
    if named:
        p = Path(named).expanduser()
        return p.resolve() if p.is_file() else None
    if cached_build().is_file() and (build_dir() / BUILT).is_file():
        return cached_build()
    found = shutil.which("llama-server")
    return Path(found).resolve() if found else None


def find_bench(server: str | Path | None = None) -> Path | None:
    """llama.cpp's llama-bench: beside the llama-server `find_server` finds (`make llama-server` builds both), else
    one on PATH; None if none."""
    found = find_server(server)
    if found is not None and found.with_name("llama-bench").is_file():
        return found.with_name("llama-bench")
    on_path = shutil.which("llama-bench")
    return Path(on_path).resolve() if on_path else None


def require_bench() -> Path:
    found = find_bench()
    if found is None:
        raise LosslessError("no llama-bench binary found: `make llama-server` builds it beside llama-server")
    return found


def bench(gguf: str | Path, threads: int, *, depths: Sequence[int] = (0,), n_prompt: int = 0, n_gen: int = 0,
          repeats: int = 1, binary: str | Path | None = None) -> list[dict]:
    """One run of llama-bench on `gguf` with `threads` threads (llama.cpp's own timing, warm-up included): for each
    context depth, a prompt of `n_prompt` tokens and/or `n_gen` generated tokens after `depth` tokens already in
    the cache. Returns one dict a test: depth, n_prompt, n_gen and ms (the prompt's whole time, or a generated
    token's), the mean of `repeats`."""
    found = Path(binary) if binary else require_bench()
    if not found.is_file():
        raise LosslessError(f"no llama-bench binary at {found}")
    cmd = [str(found), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-d", ",".join(str(d) for d in depths), "-r", str(repeats), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-1:])
        raise LosslessError(f"llama-bench failed on {Path(gguf).name}: {tail}")
    try:
        tests = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        raise LosslessError(f"llama-bench printed no JSON ({exc}); is {found} llama.cpp's llama-bench?") from None
    if any(depths) and any("n_depth" not in t for t in tests):
        raise LosslessError(f"{found} reports no context depths (an older llama-bench): build the pinned one with "
                            "`make llama-server`")
    out = []
    for t in tests:
        tokens = t["n_gen"] if t["n_gen"] else 1
        out.append({"depth": int(t.get("n_depth", 0)), "n_prompt": int(t["n_prompt"]), "n_gen": int(t["n_gen"]),
                    "ms": float(t["avg_ns"]) / 1e6 / tokens})
    return out


def require_server(path: str | Path | None = None) -> Path:
    found = find_server(path)
    if found is None:
        named = path or os.environ.get(SERVER_ENV)
        where = f"no llama-server binary at {named}" if named else "no llama-server binary found"
        raise LosslessError(f"{where}: build one with `make llama-server` (docs/study.md), or set {SERVER_ENV} to yours")
    return found


def _prctl():
    """The C library's prctl, looked up in the parent (nothing may load a library between fork and exec)."""
    try:
        import ctypes

        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _die_with_parent(parent: int) -> None:
    """In the child before exec: an audit that dies takes its servers with it (Linux's parent-death signal; a
    parent already gone by then is caught by the pid check). SIGKILL, not SIGTERM: a llama-server stopping on
    SIGTERM can hang in its shutdown, and with its audit gone nothing would ever kill it."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


@dataclass
class Decoded:
    """One greedy decode by llama.cpp: the generated ids (its last end-of-generation token kept), per token the
    top two [[id, log-probability], ...] and top-1 minus top-2, and llama.cpp's own time (prefill + decode)."""
    ids: list[int]
    tops: list[list[list]]
    margins: list[float | None]
    seconds: float
    drafted: int | None = None
    accepted: int | None = None
    decode_seconds: float = 0.0  # the tokens after the first, prefill excluded (llama.cpp's "predicted" time)

    def log_ppl(self) -> float | None:
        """Mean negative log-probability of the chosen tokens (the response's log perplexity under llama.cpp)."""
        chosen = [next((lp for t, lp in top or () if t == i), None) for i, top in zip(self.ids, self.tops)]
        if not chosen or any(c is None for c in chosen):
            return None
        return -sum(chosen) / len(chosen)


@dataclass
class Server:
    """One llama-server process on one GGUF file with one set of options, started on a free local port."""
    binary: Path
    gguf: Path
    threads: int
    options: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    port: int = 0
    log: Path | None = None

    def start(self, attempts: int = 3) -> "Server":
        """Start the server and wait until it answers; a port taken meanwhile by another process (the free port
        is found before the server binds it) is tried again with another, `attempts` times in all."""
        for attempt in range(attempts):
            try:
                return self._start()
            except LosslessError as exc:
                if attempt + 1 == attempts or "bind" not in str(exc).lower():
                    raise
        raise AssertionError("unreachable")

    def _start(self) -> "Server":
        self.port = net.free_port()
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log = Path(name)
        cmd = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(self.threads), "-tb", str(self.threads), "-c", str(CONTEXT), "-np", "1", "--no-webui",
               *self.options]
        parent = os.getpid()
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=lambda: _die_with_parent(parent))
        try:
            deadline = time.monotonic() + START_SECONDS
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    bind = any("bind" in x.lower() for x in self._log_lines()[-5:])
                    raise LosslessError(f"llama-server exited with {self.proc.returncode} "
                                        f"({' '.join(self.options) or 'plain'}): {self._log_tail()}"
                                        + (" (could not bind its port)" if bind else ""))
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                        return self
                except OSError:
                    time.sleep(0.2)
            raise LosslessError(f"llama-server did not answer /health within {START_SECONDS:.0f} s: {self._log_tail()}")
        except BaseException:  # a failed start, or Ctrl-C while waiting: no server and no log left behind
            self.close()
            raise

    def _log_lines(self) -> list[str]:
        try:
            return [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        except (OSError, AttributeError):
            return []

    def _log_tail(self) -> str:
        lines = self._log_lines()
        return lines[-1] if lines else "no output"

    def decode(self, ids: list[int], max_new_tokens: int, ignore_eos: bool = False, probs: bool = True) -> Decoded:
        """Greedy decoding of `max_new_tokens` after the prompt `ids` (fewer where an end-of-generation token comes
        first, unless `ignore_eos`); without `probs` no top tokens (nor their cost: a sort of the vocabulary)."""
        if self.proc is None:
            self.start()
        body = {"prompt": list(ids), "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
                "n_probs": 2 if probs else 0, "stream": False, "ignore_eos": ignore_eos, **GREEDY_SAMPLING}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as response:
                out = json.load(response)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise LosslessError(f"llama-server refused a {len(ids)}-token prompt: {detail}") from None
        except OSError as exc:
            raise LosslessError(f"llama-server stopped answering ({exc}): {self._log_tail()}") from None
        if not isinstance(out, dict) or not isinstance(out.get("tokens"), list):
            raise LosslessError(f"{self.binary} answered without token ids: build llama.cpp's server with "
                                "`make llama-server` (the pinned release)")
        tokens = [int(t) for t in out["tokens"]]
        probs = out.get("completion_probabilities") or []
        # the top two log-probabilities of a token; None where the server gave none (it computes none for the
        # drafted tokens it accepts)
        tops = [[[int(t["id"]), float(t["logprob"])] for t in p.get("top_logprobs", [])] or None for p in probs]
        margins = [top[0][1] - top[1][1] if top and len(top) > 1 else None for top in tops]
        timings = out.get("timings", {})
        seconds = (timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000.0
        return Decoded(tokens, tops, margins, seconds, timings.get("draft_n"), timings.get("draft_n_accepted"),
                       timings.get("predicted_ms", 0.0) / 1000.0)

    def peak_mib(self) -> float | None:
        """The server's peak resident memory so far (MiB; None where /proc cannot tell)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM"):
                    return int(line.split()[1]) / 1024
        except (OSError, AttributeError):
            pass
        return None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.log is not None:
            self.log.unlink(missing_ok=True)


_SERVERS: dict[tuple, Server] = {}


def server_gguf(spec: str, dtype: str, binary: str | Path | None = None) -> Path:
    """The GGUF file the server decodes: the embedded model `spec` requantized to `dtype` by the server's own
    llama-quantize where it has one beside it."""
    quantize = require_server(binary).with_name("llama-quantize")
    return requantized(spec, dtype, quantize if quantize.is_file() else None)


def server(spec: str, dtype: str, mode: str, threads: int, binary: str | Path | None = None) -> Server:
    """The running server decoding the embedded model `spec` requantized to `dtype`, plainly (`greedy`) or with a
    speculative mode of MODES; started once per process and stopped when it exits."""
    if mode != GREEDY and mode not in MODES:
        raise LosslessError(f"unknown llama.cpp mode '{mode}': choose from {GREEDY}, {', '.join(MODES)}")
    exe = require_server(binary)
    key = (spec, dtype, mode, threads, str(exe))
    if key not in _SERVERS:
        gguf = server_gguf(spec, dtype, exe)
        options = list(MODES.get(mode, []))
        if mode == "draft":
            options += ["-md", str(source_gguf(spec)), "-tbd", str(threads), "-td", str(threads)]
        _SERVERS[key] = Server(exe, gguf, threads, options).start()
    return _SERVERS[key]


def close(dtype: str | None = None) -> None:
    """Stop the running servers of `dtype` (every server when None): an audit stops a configuration's servers once
    its last item is done, so finished configurations hold no memory."""
    for key in [k for k in _SERVERS if dtype is None or k[1] == dtype]:
        _SERVERS.pop(key).close()


@atexit.register
def close_all() -> None:
    close()


def server_version(binary: str | Path | None = None) -> str:
    """What `llama-server --version` says of its build ("version: ... (build N, commit ...)", compiler)."""
    done = subprocess.run([str(require_server(binary)), "--version"], capture_output=True, text=True, timeout=60)
    return "; ".join(x.strip() for x in (done.stdout + done.stderr).splitlines() if x.strip().startswith(("version", "built")))


class Engine:
    """llama.cpp in the place of a model under the audit's `llama.cpp` kernel: our model's tokenizer (so the prompt
    ids are the same), llama.cpp's decodes of the embedded GGUF requantized to `dtype`, with this process's torch
    threads."""

    def __init__(self, model, spec: str, dtype: str, threads: int | None = None):
        import torch

        self.model, self.spec, self.dtype = model, spec, dtype
        self.tokenizer = model.tokenizer
        self.head_digest = getattr(model, "head_digest", "")
        self.threads = threads or torch.get_num_threads()

    def decode(self, mode: str, ids: list[int], max_new_tokens: int) -> Decoded:
        return server(self.spec, self.dtype, mode, self.threads).decode(ids, max_new_tokens)


def engine_loader(load, spec: str):
    """`load(dtype, kernel)` of the audit, where the kernel `llama.cpp` gives an Engine over the stock model."""
    from ..names import LLAMA_CPP

    def loaded(dtype: str, kernel: str):
        if kernel == LLAMA_CPP:
            return Engine(load(dtype, "sdpa"), spec, dtype)
        return load(dtype, kernel)
    return loaded


# ------------------------------------------------------------------------------------ a model as GGUF
# Hugging Face parameter names of a Llama or Qwen3 decoder layer -> llama.cpp's tensor names
LAYER_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3"}  # config.model_type -> llama.cpp's architecture


def _rope_rows(w, heads: int):
    """llama.cpp's row order of a Llama q or k projection: its rotary pairs (i, i + d/2) of each head as
    neighbours (2i, 2i + 1), the order Meta's checkpoints had (Qwen3's rotary takes the halves, as HF does)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(backbone, path: str | Path) -> Path:
    """A Hugging Face Llama or Qwen3 causal LM `backbone` (without rope scaling or biases: refused) as a GGUF file
    llama.cpp loads, with the same weights bit for bit in the backbone's dtype (norms in fp32, as llama.cpp keeps
    them) and a placeholder vocabulary of the model's size (token i is `<i>`: callers give token ids, and the
    end-of-generation token is id 1). Written aside, then renamed."""
    import gguf
    import numpy as np
    import torch

    cfg = backbone.config
    arch = ARCHITECTURES.get(cfg.model_type)
    if arch is None:
        raise LosslessError(f"write_gguf: no llama.cpp layout for {cfg.model_type}; choose from {', '.join(ARCHITECTURES)}")
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise LosslessError(f"write_gguf: rope scaling {rope.get('rope_type', rope.get('type'))} is not written; "
                            "give a model without it")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise LosslessError("write_gguf: biases of attention or MLP are not written; give a model without them")
    if backbone.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise LosslessError(f"write_gguf: no GGUF type for {backbone.dtype}; use bf16, fp16 or fp32")
    kinds = {torch.bfloat16: (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
             torch.float16: (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
             torch.float32: (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32)}
    qtype, ftype = kinds[backbone.dtype]
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(partial), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(ftype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<{i}>" for i in range(cfg.vocab_size)])
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    w.add_token_merges(["<0> <1>"])  # llama.cpp needs the key; no text is ever tokenized
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    params = dict(backbone.named_parameters())  # a tied LM head is the embedding's parameter: named once
    written: set[str] = set()

    def add(name: str, source: str, norm: bool = False, rows: int = 0):
        written.add(source)
        t = params[source].detach().cpu()
        if rows:  # Llama's q or k projection: llama.cpp's rotary row order
            t = _rope_rows(t, rows)
        if norm or t.dim() == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t.float().numpy())
        else:  # the two-byte values as they are, as bytes
            w.add_tensor(name, t.contiguous().view(torch.int16).numpy().view(np.uint8), raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight")
    add("output_norm.weight", "model.norm.weight", norm=True)
    if "lm_head.weight" in params:
        add("output.weight", "lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        for hf, name in LAYER_TENSORS.items():
            source = f"model.layers.{i}.{hf}.weight"
            if source in params:
                rope = arch == "llama" and name in ("attn_q", "attn_k")
                add(f"blk.{i}.{name}.weight", source, rows=(heads if name == "attn_q" else kv) if rope else 0)
    missing = [n for n in params if n not in written]
    if missing:
        raise LosslessError(f"write_gguf: {len(missing)} parameters have no place in llama.cpp's {arch} layout "
                            f"({', '.join(missing[:3])}); give a plain {arch} model")
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


if __name__ == "__main__":  # `make llama-server`: build (or find) this CPU's llama-server, print its path
    import sys

    try:
        print(build())
    except LosslessError as exc:
        print(f"lossless: error: {exc}", file=sys.stderr)
        sys.exit(2)
