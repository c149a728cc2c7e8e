"""The engine a CPU user would otherwise pick, for `speed.py`: llama.cpp (through llama-cpp-python) greedy-decoding
the embedded model's own GGUF file, requantized by llama.cpp itself to the benchmark's dtype (so the weights are
the ones `lossless` loads), from the same prompt token ids (the same chat template), with the same threads.

Optional: `available()` is False where `llama_cpp` does not import. Install it with `pip install .[peers]`
(built from source; `CMAKE_ARGS="-DGGML_NATIVE=ON"` builds for this CPU, see docs/speed.md). The GGUF files
come from `lossless.study.llamacpp`, which the audit's llama.cpp candidates share.
"""

from __future__ import annotations

import importlib.util
import time

from lossless.study.llamacpp import requantized


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


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
