"""The compiled batch-invariant kernels of exact mode (`exact_kernels.cpp`): build, cache, call.

`linear`, `attention`, `rms_norm` and `silu` compute every output element by one fixed sequence of IEEE
operations that depends only on the inputs it reads (see the C++ file's header), so a row's result cannot
depend on how many rows share a call, where it sits among them, the thread count or the CPU's vector width.

The extension is compiled on first use with the machine's C++ compiler (torch's JIT extension builder)
and cached under `$LOSSLESS_CACHE/kernels/<hash>`: the hash covers the source, the flags, the CPU and the
torch version, so a cache never serves a build made for something else. This module knows tensors only;
which modules call these kernels is `exact.py`'s business.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import LosslessError

SOURCE = Path(__file__).with_name("exact_kernels.cpp")
# -ffp-contract=off: no multiply-add is fused behind our back (only the explicit ones); no -ffast-math, so
# nothing is reassociated. -march=native only changes how wide the lanes run, never a result.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags (from /proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_key(cflags: list[str]) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join(cflags), torch.__version__, platform.machine(), " ".join(sorted(cpu_flags()))):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def build_dir(cflags: list[str] = CFLAGS) -> Path:
    from .models import cache_dir

    return cache_dir() / "kernels" / _build_key(cflags)


@lru_cache(maxsize=1)
def ops():
    """The compiled extension (built once per machine and source, then loaded from the cache)."""
    return build(CFLAGS)


def build(cflags: list[str]):
    """The extension built with `cflags` (`ops()` is the native build; a test builds one for AVX2 only, to check
    that another instruction set gives the same bits)."""
    from torch.utils import cpp_extension

    # the build runs ninja; the one pip installed (a dependency) counts even if its folder is not on PATH
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except ImportError:
        bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    where = build_dir(cflags)
    try:
        where.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(name=f"lossless_exact_{where.name}", sources=[str(SOURCE)], extra_cflags=cflags,
                                  extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LosslessError(f"exact mode could not build its CPU kernels in {where} ({first[:160]}); it needs "
                            f"g++ and a writable $LOSSLESS_CACHE, or use --attn sdpa") from None


PANEL = 16  # outputs per weight panel: the kernels' lane count


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] -> panels of 16 outputs (outputs past n are zeros), the layout `linear` reads: [ceil(n/16),
    k, 16], one input's 16 weights side by side, so each output is one fma chain over its inputs in order; in
    bf16 [ceil(n/16), ceil(k/2), 32], two inputs at a time (k padded with a zero input), the layout of the
    AVX-512 BF16 dot-product instruction."""
    n, k = weight.shape
    pairs = weight.dtype == torch.bfloat16
    kp = k + (k % 2 if pairs else 0)
    padded = torch.zeros((n + PANEL - 1) // PANEL * PANEL, kp, dtype=weight.dtype, device=weight.device)
    padded[:n, :k] = weight.detach()
    panels = padded.view(-1, PANEL, kp)  # [p, 16, kp]
    if not pairs:
        return panels.transpose(1, 2).contiguous()  # [p, k, 16]
    return panels.view(-1, PANEL, kp // 2, 2).permute(0, 2, 1, 3).reshape(-1, kp // 2, 2 * PANEL).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] times the weight [n, k] that `pack_weight` packed, transposed (+ bias [n]) -> [..., n]."""
    out = ops().linear(x.reshape(-1, x.shape[-1]).contiguous(), packed, int(n),
                       None if bias is None else bias.contiguous())
    return out.reshape(*x.shape[:-1], n)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
              scaling: float) -> torch.Tensor:
    """query [q, h, d], key/value [kv, n, d], visible [q, n] bool -> [q, h, d]: each row's softmax attention
    over the keys it may see, in key order (a row that sees nothing gets zeros)."""
    return ops().attention(query.contiguous(), key.contiguous(), value.contiguous(), visible.contiguous(),
                           float(scaling))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the Llama/Qwen kind over the last dim: weight * (x / sqrt(mean(x^2) + eps)) cast to x's dtype."""
    out = ops().rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), float(eps))
    return out.reshape(x.shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    return ops().silu(x.contiguous())

