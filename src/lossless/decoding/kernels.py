"""The compiled batch-invariant kernels of exact mode (`exact_kernels.cpp`): build, cache, choose a variant, call.

`linear`, `attention`, `rms_norm` and `silu` compute every output element by one fixed sequence of IEEE
operations that depends only on the inputs it reads (see the C++ file's header), so a row's result cannot
depend on how many rows share a call, where it sits among them, the thread count, the CPU's vector width or
the instruction-set variant that runs it.

The extension holds every variant (`ISAS`: amx, avx512bf16, avx512, avx2, scalar) side by side. Each call runs
the variant `isa()` names: `LOSSLESS_EXACT_ISA`, else the best this CPU can execute; `use_isa(name)` switches it
for a block (how the tests compare variants in one process). A variant the CPU cannot run is refused in one line.
bf16 products follow AMX's own order in every variant (`pack_weight`), so AMX tiles, where a CPU has them, give
the bits every other CPU gives.

The extension is compiled on first use with the machine's C++ compiler (torch's JIT extension builder) and
cached under `$LOSSLESS_CACHE/kernels/<hash>`: the hash covers the sources, the flags and the torch version
(the build is the same on every x86-64 CPU: the variants choose their instructions themselves). This module
knows tensors only; which modules call these kernels is `exact.py`'s business.
"""

from __future__ import annotations

import decimal
import hashlib
import logging
import math
import os
import platform
import sys
import tempfile
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ..errors import LosslessError
from ..paths import cache_dir

# The module (bindings), one translation unit per variant (built in parallel), and the headers they share
VARIANT_SOURCES = ("exact_amx.cpp", "exact_avx512bf16.cpp", "exact_avx512.cpp", "exact_avx2.cpp", "exact_scalar.cpp")
SOURCES = tuple(Path(__file__).with_name(name) for name in ("exact_kernels.cpp", *VARIANT_SOURCES, "exact_common.h", "exact_api.h",
                                                             "exact_isa.h"))
# -ffp-contract=off: no multiply-add is fused behind our back (only the explicit ones); no -ffast-math, so
# nothing is reassociated. No -march: each variant names its instructions with `#pragma GCC target`.
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]

# Variants, fastest first, and the CPU flags (/proc/cpuinfo names) each needs.
ISAS = ("amx", "avx512bf16", "avx512", "avx2", "scalar")
_NEEDS = {"amx": {"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx2", "fma",
                  "f16c", "bmi2"},
          "avx512bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx2", "fma", "f16c", "bmi2"},
          "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c", "bmi2"},
          "avx2": {"avx2", "fma", "f16c", "bmi2"},
          "scalar": {"fma"}}
ISA_ENV = "LOSSLESS_EXACT_ISA"


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (from /proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo; the platform's processor or machine where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def runnable_isas() -> list[str]:
    """The variants this CPU can execute, fastest first (outside x86-64: the scalar one). `amx` needs the CPU's
    tiles and the operating system's leave to use them (asked for once per process)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["scalar"]
    flags = cpu_flags()
    return [name for name in ISAS if _NEEDS[name] <= flags and (name != "amx" or not amx_refusal())]


@lru_cache(maxsize=1)
def amx_refusal() -> str:
    """Why this process may not use AMX tiles ('' when it may): the CPU lacks them, or Linux refused the tile
    state (asked for once, before any thread uses a tile)."""
    if platform.machine() not in ("x86_64", "AMD64") or not _NEEDS["amx"] <= cpu_flags():
        return "this CPU has no AMX tiles (amx_tile, amx_bf16)"
    return str(_compiled().request_amx())


_ISA: ContextVar[str | None] = ContextVar("lossless_exact_isa", default=None)


def isa() -> str:
    """The variant calls run now: `use_isa`'s, else $LOSSLESS_EXACT_ISA, else the best this CPU has."""
    return _resolve(_ISA.get() or os.environ.get(ISA_ENV, "").strip() or None)


@lru_cache(maxsize=None)
def _resolve(name: str | None) -> str:
    runnable = runnable_isas()
    if name is None:
        if not runnable:
            raise LosslessError("exact mode needs a CPU with fma (x86-64) or AArch64; use --attn sdpa")
        usable = usable_isas()
        if not usable:
            failed = ", ".join(f"{k} {v}" for k, v in self_check_failures().items())
            raise LosslessError("exact mode's kernels compute other bits on this CPU than on every other machine "
                                f"(every variant failed its self-check: {failed}; expected {SELF_CHECK}); use --attn sdpa")
        return usable[0]
    if name not in ISAS:
        raise LosslessError(f"{ISA_ENV}={name} is not a kernel variant: choose one of {', '.join(ISAS)}")
    if name not in runnable:
        why = f"{amx_refusal()}; " if name == "amx" and _NEEDS["amx"] <= cpu_flags() else ""
        raise LosslessError(f"{ISA_ENV}={name}: this CPU cannot run that variant ({why}it can run "
                            f"{', '.join(runnable) or 'none'})")
    failed = self_check_failures()
    if name in failed:
        raise LosslessError(f"{ISA_ENV}={name}: that variant computes other bits on this CPU than every other machine "
                            f"(self-check {failed[name]}, expected {SELF_CHECK}); unset it to use "
                            f"{', '.join(usable_isas()) or 'stock kernels (--attn sdpa)'}")
    return name


@contextmanager
def use_isa(name: str):
    """Run the kernels of variant `name` within this block (refused if the CPU cannot run it)."""
    token = _ISA.set(name)
    try:
        isa()
        yield name
    finally:
        _ISA.reset(token)


def _build_key(cflags: list[str]) -> str:
    digest = hashlib.sha256(source_digest().encode())
    for part in (" ".join(cflags), torch.__version__, platform.machine()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 (16 hex digits) of the kernel sources: what decoded a record, together with `isa()`."""
    digest = hashlib.sha256()
    for source in SOURCES:  # each file's name and length, then its bytes: text moved between files is a change
        data = source.read_bytes()
        digest.update(f"{source.name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def build_name() -> str:
    """What decodes in exact mode now: "<source digest>/<variant>" (the variant passed its self-check here, so the
    bits are every machine's for these sources)."""
    return f"{source_digest()}/{isa()}"


def build_dir(cflags: list[str] = CFLAGS) -> Path:
    return cache_dir() / "kernels" / _build_key(cflags)


@lru_cache(maxsize=1)
def extension():
    """The compiled extension, every variant in it (built once per machine and source, then loaded). Each
    variant that can compute bf16 products two ways (the dot-product instruction, or widened fp32 fmas: the same
    bits) times both once here and takes the faster. Each variant this CPU runs passes `self_check` here, or is
    not used (a one-line warning says so; naming it is refused)."""
    ext = _compiled()
    _FAILED.clear()
    for name in runnable_isas():
        variant = getattr(ext, name)
        variant.choose_bf16_path()
        try:
            got = self_check(variant)
        except Exception as exc:  # (a variant that cannot run its calls here is not used either)
            got = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if got != SELF_CHECK:
            _FAILED[name] = got
            logging.getLogger("lossless").warning(
                f"exact kernels: the {name} variant computes other bits on this CPU than every other machine (self-check "
                f"{got}, expected {SELF_CHECK}); it is not used, the next variant decodes the same tokens (a report "
                f"naming this CPU and compiler helps)")
    return ext


# What every kernel variant computes from the self-check's fixed inputs (`self_check`), on every machine, AMX's
# tiles included. A kernel that changes its order of operations changes it: tests/decoding/test_self_check.py
# then prints the new value to record here.
SELF_CHECK = "6f7fcd048e20cc59"
_FAILED: dict[str, str] = {}  # the variants whose self-check gave another value here: name -> that value


def self_check_failures() -> dict[str, str]:
    """The variants this CPU runs whose self-check failed (builds the kernels): name -> the value they gave."""
    extension()
    return dict(_FAILED)


def usable_isas() -> list[str]:
    """`runnable_isas()` less the variants whose self-check failed here: the ones exact mode may use."""
    failed = self_check_failures()
    return [name for name in runnable_isas() if name not in failed]


def _check_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int, top: int = 0) -> torch.Tensor:
    """Fixed values for the self-check, made from integers (no random generator, no conversion of a rounding
    kind, so the same bits on every machine): both signs, up to 7 significant bits, magnitudes 2^(top-14) to
    2^(top+1), one in 61 a subnormal of the dtype and one in 53 a zero."""
    count = math.prod(shape)
    i = np.arange(count, dtype=np.int64) + 7919 * seed
    mantissa = (i * 40503 + 12345) % 255 - 127  # -127..127: exact in bf16, fp16 and fp32
    value = np.ldexp(mantissa.astype(np.float64), (i * 2971) % 9 - 8 + top - 6)  # (ldexp: exact, no library's exp)
    tiny = {torch.bfloat16: -133, torch.float16: -24, torch.float32: -140}[dtype]
    value = np.where(i % 61 == 7, np.ldexp(mantissa.astype(np.float64), tiny), np.where(i % 53 == 3, 0.0, value))
    if dtype == torch.float16:
        out = torch.from_numpy(value.astype(np.float16))
    else:
        words = value.astype(np.float32).view(np.uint32)  # (exact: bf16's are the upper halves)
        out = torch.from_numpy(words.astype(np.int32)).view(torch.float32) if dtype == torch.float32 else \
            torch.from_numpy((words >> 16).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    return out.reshape(shape)


def _check_digest(variant, tile_weights: bool = False) -> str:
    """sha256 (16 hex digits) of what `variant` computes from the self-check's inputs, in fp32, bf16 and fp16:
    linear layers of 1 to 32 rows (every block shape), bf16's product-sums from a start, attention, RMSNorm,
    SiLU, a tree's choices, and a layer stack of one decoder layer (q/k norms, biases, key tiles made from the
    keys) over a cache of 20 positions and one of 1,100 (whose attention splits over the threads), one row and a
    causal block of 9 each, with the final norm. `tile_weights`: bf16 weights packed in AMX's tile layout."""
    digest = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())

    hidden, d, heads, kv, inter = 37, 10, 4, 2, 45
    for code, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        seed = iter(range(100 * code, 100 * code + 100))
        make = lambda shape, top=0: _check_values(shape, dtype, next(seed), top)  # noqa: E731
        w, bias = make((70, 301), -3), make((70,))
        packed = pack_weight(w, tiles=tile_weights)
        for rows in (1, 3, 4, 5, 9, 13, 16, 17, 29, 32):
            add(variant.linear(make((rows, 301)), packed, 70, bias if rows % 2 else None))
        if dtype == torch.bfloat16:
            add(variant.linear_sums(make((9, 301)), packed, 70, make((9, 70)).float()))
        q, k, v = make((9, 6, 40), -2), make((2, 70, 40)), make((2, 70, 40))
        visible = torch.from_numpy((np.arange(9 * 70) * 37 % 10 < 7).reshape(9, 70))
        add(variant.attention(q, k, v, visible, 0.2))
        add(variant.rms_norm(make((9, 301)), make((301,)), 1e-5))
        add(variant.silu(make((301,), 3)))
        top, probs = variant.choices(make((7, 300), 3), 8, True)
        add(top)
        add(probs)
        shapes_in, shapes_out = [(heads * d, hidden), (kv * d, hidden), (kv * d, hidden)], \
            [(hidden, heads * d), (inter, hidden), (inter, hidden), (hidden, inter)]
        stack = variant.Stack()
        stack.add(make((hidden,)), 1e-5, [pack_weight(make(s, -3), tiles=tile_weights) for s in shapes_in], [make((s[0],)) for s in shapes_in],
                  [s[0] for s in shapes_in], make((d,)), make((d,)), 1e-6, d, d ** -0.5,
                  [pack_weight(make(s, -3), tiles=tile_weights) for s in shapes_out], [make((s[0],)) for s in shapes_out],
                  [s[0] for s in shapes_out], make((hidden,)), 1e-5)
        for n, rows in ((20, 1), (20, 9), (1100, 1), (1100, 9)):  # (a long cache: attention split over the threads)
            cap = n + rows + 3
            keys, values = make((1, kv, cap, d)), make((1, kv, cap, d))
            tiles = torch.zeros(kv, -(-cap // 16), d if dtype == torch.float32 else (d + 1) // 2, 16, dtype=torch.int32)
            causal = torch.ones(rows, n + rows, dtype=torch.bool).tril(n)
            add(stack.forward(make((rows, hidden)), make((rows, d), -8), make((rows, d), -8), causal, [keys], [values],
                              [tiles], [0], n, make((hidden,)), 1e-5))
            add(keys[:, :, n:n + rows])
            add(values[:, :, n:n + rows])
    return digest.hexdigest()[:16]


def self_check(variant) -> str:
    """`_check_digest` of `variant` (a variant's kernels, e.g. `extension().avx2`) under every setting that
    changes its speed and not its bits (bf16 by the dot-product instruction and widened, tall blocks and blocks
    of 4 rows, AMX tiles from one row and never, bf16 weights in pair steps and in AMX's tile layout): that value
    where all agree, else the values joined by '/'."""
    widened = variant.bf16_widened()
    tiles = variant.amx_min_rows()
    values, ran = [], set()
    settings = ((False, True, 0, False), (True, True, 0, False), (False, False, 0, False), (False, True, 1, False),
                (False, True, 0, True), (False, True, 1, True))
    try:
        for wide, tall, amx, layout in settings:
            in_force = (variant.set_widen_bf16(wide), variant.set_tall_blocks(tall), variant.set_amx_rows(amx), layout)
            if in_force not in ran:  # (a variant without such a setting computes the same calls again)
                ran.add(in_force)
                values.append(_check_digest(variant, layout))
    finally:
        variant.set_widen_bf16(widened)
        variant.set_tall_blocks(True)
        variant.set_amx_rows(tiles)
    return "/".join(dict.fromkeys(values))


def amx_min_rows() -> int | None:
    """The fewest rows from which the current variant runs bf16 products on AMX tiles (measured when the kernels
    load), None where it never does."""
    rows = int(ops().amx_min_rows())
    return rows if rows > 0 else None


@contextmanager
def amx_rows(rows: int | None):
    """Within this block the amx variant runs bf16 calls of at least `rows` rows on tiles (None: never; tests and
    benchmarks: the bits are the same either way)."""
    variant = extension().amx if "amx" in runnable_isas() else None
    before = variant.amx_min_rows() if variant else 0
    if variant:
        variant.set_amx_rows(rows or 0)
    try:
        yield
    finally:
        if variant:
            variant.set_amx_rows(before)


def product_rates() -> dict[str, float] | None:
    """This core's 16-lane dot-product (AVX-512 BF16) and fp32 fma instructions a second at one thread, over 24
    independent chains of each: the compute a forward's products can reach. None where the current variant has no
    dot-product instruction."""
    rates = list(ops().product_rates())
    return {"dot": rates[0], "fma": rates[1]} if rates else None


def bf16_widened() -> bool:
    """Whether the current variant computes bf16 products as widened fp32 fmas (else the dot-product
    instruction, or plain fmas without AVX-512): speed only, the bits are the same."""
    return bool(ops().bf16_widened())


@contextmanager
def bf16_path(widened: bool):
    """Within this block the current variant computes bf16 products widened (True) or with the dot-product
    instruction (False) where it has the choice (tests: both must give the same bits)."""
    variant = ops()
    before = variant.bf16_widened()
    variant.set_widen_bf16(widened)
    try:
        yield
    finally:
        variant.set_widen_bf16(before)


@contextmanager
def tall_blocks(on: bool):
    """Within this block the current variant runs bf16 calls of more than 4 rows in tall blocks through one panel
    (True, the default) or in blocks of at most 4 rows (False), where it has the dot-product instruction; each
    reads x in its own layout (tests: both must give the same bits)."""
    variant = ops()
    variant.set_tall_blocks(on)
    try:
        yield
    finally:
        variant.set_tall_blocks(True)


def ops():
    """The kernels of the variant `isa()` names (built on first use)."""
    return getattr(extension(), isa())


@lru_cache(maxsize=1)
def _compiled():
    """The extension as built, before any variant has measured its paths."""
    return build(CFLAGS)


def build(cflags: list[str]):
    """The extension built with `cflags`."""
    from torch.utils import cpp_extension

    # the build runs ninja; the one pip installed (a dependency) counts even if its folder is not on PATH
    bin_dir = _ninja_dir()
    path = os.environ.get("PATH", "").split(os.pathsep)
    if bin_dir and path[:1] != [bin_dir]:  # first, ahead of any other ninja
        os.environ["PATH"] = os.pathsep.join([bin_dir, *(p for p in path if p != bin_dir)])
    where = build_dir(cflags)
    try:
        where.mkdir(parents=True, exist_ok=True)
        sources = _sources_in(where)
        units = [str(copy) for copy in sources if copy.suffix == ".cpp"]
        with _environ(MAX_JOBS=os.environ.get("MAX_JOBS") or str(build_jobs())):
            return cpp_extension.load(name=f"lossless_exact_{where.name}", sources=units, extra_cflags=cflags,
                                      extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LosslessError(f"exact mode could not build its CPU kernels in {where} ({first[:160]}); it needs "
                            f"g++ and a writable $LOSSLESS_CACHE, or use --attn sdpa") from None


BUILD_GB = 2.5  # about what g++ needs to compile one variant's file at -O3


def build_jobs(cores: int | None = None, available_gb: float | None = None) -> int:
    """How many of the kernels' files the build compiles at once: one per core, as many as the available memory
    holds at BUILD_GB each (a container's limits included), at least one ($MAX_JOBS, where set, decides instead)."""
    if cores is None:
        cores = _cores()
    if available_gb is None:
        available_gb = _available_gb()
    by_memory = 1 + len(VARIANT_SOURCES) if available_gb is None else int(available_gb // BUILD_GB)
    return max(1, min(cores, by_memory))


def _available_gb() -> float | None:
    """The memory this process can have without swapping: the system's (/proc/meminfo's MemAvailable) or, in a
    container with a memory limit (cgroup v2), what is left under the limit, the smaller. None where unknown."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) / 2**30 if found else None


def _cores() -> int:
    """The cores this process may use: its CPU affinity, within a container's CPU quota (cgroup v2 cpu.max)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


@contextmanager
def _environ(**values: str):
    """These environment variables within the block, then as they were."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _ninja_dir() -> str | None:
    """The folder of the ninja binary pip installed (a dependency; its package's own record says where), so that
    every install builds with the same ninja: another version keeps another log and would build the same
    extension again. None without it (then PATH's ninja)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("ninja")
    except PackageNotFoundError:
        return None
    for file in dist.files or ():
        path = Path(dist.locate_file(file))
        if file.name == "ninja" and path.is_file() and os.access(path, os.X_OK):
            return str(path.resolve().parent)
    return None


def _sources_in(where: Path) -> list[Path]:
    """The kernel sources, copied into the build folder (named by their digest, so a copy there is never stale)
    and built from there: every install of the same sources (a checkout, a wheel) finds the same build instead
    of compiling again because the files sit elsewhere. A copy is written whole and renamed into place, and only
    when missing or different, so a build's inputs never change under it."""
    folder = where / "src"
    folder.mkdir(exist_ok=True)
    copies = []
    for source in SOURCES:
        copy, data = folder / source.name, source.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            handle, part = tempfile.mkstemp(dir=folder, prefix=f".{copy.name}.", suffix=".tmp")
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.replace(part, copy)
        copies.append(copy)
    return copies


PANEL = 16  # outputs per weight panel: the kernels' lane count
CHUNK = 32  # bf16 inputs per chunk of AMX's order (one tile dot product)
# bf16: each group of four inputs 4q..4q+3 as two 32-bit pairs of one parity, (4q+2 low, 4q high) then (4q+3 low,
# 4q+1 high): the memory order of a group, and back
_PARITY = [2, 0, 3, 1]
_NATURAL = [1, 3, 0, 2]


def pack_weight(weight: torch.Tensor, consumed=None, tiles: bool = False) -> torch.Tensor:
    """weight [n, k] -> panels of 16 outputs (outputs past n are zeros), the layout `linear` reads: fp32 and fp16
    [ceil(n/16), k, 16], one input's 16 weights side by side, so each output is one fma chain over its inputs in
    order; bf16 [ceil(n/16), kp/2, 32] with k padded to kp, a multiple of 32, by zero inputs: 32-bit pairs of inputs
    of one parity (see exact_isa.h), the layout of the order AMX computes, an even and an odd chain per chunk of 32.
    With `tiles` (bf16 only; `tile_layout()` says when it pays), AMX's tile layout [ceil(n/16), kp/32, 16, 32]
    instead: chunk c of a panel is one B tile of the tile dot product (row i holds inputs 32c + 2i and 32c + 2i + 1
    of the 16 outputs), which AMX reads in place; every variant computes the same bits from either layout.
    `consumed(r0, r1)`, where given, is called once rows r0..r1-1 of `weight` are no longer read (its caller may
    then drop their pages)."""
    n, k = weight.shape
    pairs = weight.dtype == torch.bfloat16
    kp = -(-k // CHUNK) * CHUNK if pairs else k
    if n % PANEL == 0 and kp == k:  # nothing to pad: no copy beside the panels (an LM head is a large matrix)
        padded = weight.detach().contiguous()
    else:
        padded = torch.zeros((n + PANEL - 1) // PANEL * PANEL, kp, dtype=weight.dtype, device=weight.device)
        padded[:n, :k] = weight.detach()
        if consumed is not None:
            consumed(0, n)
            consumed = None
    panels = padded.view(-1, PANEL, kp)  # [p, 16, kp]
    count = panels.shape[0]

    def done(c: int) -> None:
        if consumed is not None:
            consumed(c * PANEL, min(n, (c + PACK_PANELS) * PANEL))
    # written PACK_PANELS panels at a time into the result, so packing holds the weight, the panels and one
    # chunk's temporaries (not two whole copies beside them: an LM head of 150,000 tokens is 300 MB in bf16)
    if not pairs:
        out = torch.empty(count, kp, PANEL, dtype=weight.dtype, device=weight.device)  # [p, k, 16]
        for c in range(0, count, PACK_PANELS):
            out[c:c + PACK_PANELS] = panels[c:c + PACK_PANELS].transpose(1, 2)
            done(c)
        return out
    if tiles:
        out = torch.empty(count, kp // CHUNK, PANEL, 2 * PANEL, dtype=weight.dtype, device=weight.device)
        for c in range(0, count, PACK_PANELS):  # [p, 16 outputs, chunks, 16 rows, 2] -> [p, chunks, rows, outputs, 2]
            chunk = panels[c:c + PACK_PANELS].reshape(-1, PANEL, kp // CHUNK, PANEL, 2).permute(0, 2, 3, 1, 4)
            out[c:c + PACK_PANELS] = chunk.reshape(-1, kp // CHUNK, PANEL, 2 * PANEL)
            done(c)
        return out
    out = torch.empty(count, kp // 2, 2 * PANEL, dtype=weight.dtype, device=weight.device)
    for c in range(0, count, PACK_PANELS):
        groups = panels[c:c + PACK_PANELS].reshape(-1, PANEL, kp // 4, 4)[..., _PARITY]  # [p, 16, groups, 4]
        out[c:c + PACK_PANELS] = groups.view(-1, PANEL, kp // 4, 2, 2).permute(0, 2, 3, 1, 4).reshape(-1, kp // 2, 2 * PANEL)
        done(c)
    return out


PACK_PANELS = 256  # panels `pack_weight` lays out at a time (4,096 outputs)


def _bf16_inputs(pairs: torch.Tensor) -> torch.Tensor:
    """[..., steps, 2] pair steps of one output (its 32-bit pairs as two bf16, low first) -> [..., 2 * steps]
    inputs in their own order."""
    steps = pairs.shape[-2]
    return pairs.reshape(*pairs.shape[:-2], steps // 2, 4)[..., _NATURAL].flatten(-2)


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_weight`: panels -> the weight [n, k], bit for bit (a copy)."""
    panels = packed.shape[0]
    if packed.dim() == 4:  # [p, chunks, 16, 32]: the tile layout
        weight = packed.view(panels, packed.shape[1], PANEL, PANEL, 2).permute(0, 3, 1, 2, 4).reshape(panels * PANEL, -1)
    elif packed.dtype == torch.bfloat16:  # [p, kp/2, 32]: pair steps
        steps = packed.view(panels, packed.shape[1], PANEL, 2).transpose(1, 2)  # [p, 16, steps, 2]
        weight = _bf16_inputs(steps).reshape(panels * PANEL, -1)
    else:  # [p, k, 16]
        weight = packed.transpose(1, 2).reshape(panels * PANEL, packed.shape[1])
    return weight[:n, :k].contiguous()


def tile_layout() -> bool:
    """Whether bf16 weights are best packed in AMX's tile layout here (`pack_weight(tiles=True)`): where the
    variant that runs is `amx` and takes tiles from some number of rows (its tiles then read the weights in place,
    not rebuilt call by call). The bits are the same either way."""
    return isa() == "amx" and amx_min_rows() is not None


def loaded() -> bool:
    """Whether the extension is loaded in this process already (an exact model loaded it). Helpers whose kernels
    only compute faster what torch computes too (`choices`) take them then, and never build them for themselves."""
    return extension.cache_info().currsize > 0


def choices(logits: torch.Tensor, n: int, probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of logits [..., V] (fp32, bf16 or fp16, on the CPU): the ids of its n largest values [..., n], the
    largest first, the earlier id first among equal values, a NaN above every number (so id 0 of a row is
    `torch.max`'s index), and with `probs` their softmax probabilities [..., n] (fp32; the sum over the row in a
    fixed order, the same bits on every variant), else None. 1 <= n <= min(8, V)."""
    rows = logits.reshape(-1, logits.shape[-1]).contiguous()
    out = ops().choices(rows, int(n), bool(probs))
    shape = (*logits.shape[:-1], int(n))
    return out[0].reshape(shape), out[1].reshape(shape) if probs else None


def move_rows(tensors: list[torch.Tensor], start: int, rows: list[int]) -> None:
    """In each contiguous CPU tensor [b, h, cap, d], the entries at positions start + rows[j] copied to start + j
    (rows rising, rows[j] >= j): a tree's accepted path moved into place in cache buffers, in one call."""
    extension().move_rows(tensors, int(start), [int(r) for r in rows])


def embedding_rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Rows `ids` (any shape) of the weight [n, k] that `pack_weight` packed, gathered from the panels: bit for
    bit `unpack_weight(packed, n, k)[ids]`, without unpacking the rest -> [*ids.shape, k]. An id outside 0..n-1
    raises IndexError, as an embedding's lookup does."""
    return extension().embedding_rows(packed, ids, int(n), int(k)).reshape(*ids.shape, k)


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] times the weight [n, k] that `pack_weight` packed, transposed (+ bias [n]) -> [..., n]."""
    out = ops().linear(x.reshape(-1, x.shape[-1]).contiguous(), packed, int(n),
                       None if bias is None else bias.contiguous())
    return out.reshape(*x.shape[:-1], n)


def linear_sums(x: torch.Tensor, packed: torch.Tensor, n: int, init: torch.Tensor | None = None) -> torch.Tensor:
    """`linear`'s fp32 product-sums before rounding to x's dtype, each output's chain started from init [m, n] (fp32;
    default +0) instead of +0: the order itself (the tests check it against AMX's recorded outputs)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    start = torch.zeros(x2.shape[0], n) if init is None else init.reshape(x2.shape[0], n).float().contiguous()
    return ops().linear_sums(x2, packed, int(n), start).reshape(*x.shape[:-1], n)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
              scaling: float) -> torch.Tensor:
    """query [q, h, d], key/value [kv, n, d] (rows contiguous, any stride between kv heads), visible [q, n] bool ->
    [q, h, d]: each row's softmax attention over the keys it may see, in key order (a row that sees nothing gets
    zeros)."""
    return ops().attention(query.contiguous(), _rows(key), _rows(value), visible.contiguous(), float(scaling))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [kv, n, d] with each row of d contiguous and rows one after another (any stride between kv heads, as in
    a cache that grows in place); a copy only if not."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the Llama/Qwen kind over the last dim: weight * (x / sqrt(mean(x^2) + eps)) cast to x's dtype."""
    out = ops().rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), float(eps))
    return out.reshape(x.shape)


def layer_in(*args) -> list[torch.Tensor]:
    """A decoder layer up to the cache update (`exact.FusedLayerMixin` passes the arguments; see exact_isa.h)."""
    return ops().layer_in(*args)


def layer_out(*args) -> torch.Tensor:
    """A decoder layer from attention on (`exact.FusedLayerMixin` passes the arguments; see exact_isa.h)."""
    return ops().layer_out(*args)


def stack():
    """An empty layer stack of the current variant (`exact.FusedStackMixin` adds its layers; see exact_isa.h)."""
    return ops().Stack()


def stream(tensors: list[torch.Tensor]) -> int:
    """Read every byte of `tensors` once, as fast as the threads can (the memory floor a forward is measured
    against); returns the OR of all their 32-bit words (so the reads cannot be skipped). Each tensor's bytes must
    be a whole number of 32-bit words (a trailing half word is not read)."""
    return int(ops().stream([t.contiguous() for t in tensors]))


def silu(x: torch.Tensor) -> torch.Tensor:
    return ops().silu(x.contiguous())



# ------------------------------------------------------------------------------------------ rotary table
# The rotary embedding's cos/sin come from libm-like kernels that round differently with the instruction set
# and a tensor's length. Exact mode computes them here instead, from float64 additions and multiplications
# only (each correctly rounded, the same on every machine: numpy fuses nothing), then rounds once to fp32.
_PIO2 = (1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624871116645580e-21)  # pi/2 in 33-bit parts
_SIN = [(-1.0) ** i / math.factorial(2 * i + 1) for i in range(9)]  # x, x^3/3!, .., x^17/17!: < 1e-19 on |x| <= pi/4
_COS = [(-1.0) ** i / math.factorial(2 * i) for i in range(10)]


def _horner(coefficients: list[float], x2: np.ndarray) -> np.ndarray:
    out = np.full_like(x2, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        out = out * x2 + c  # two roundings: numpy never fuses them
    return out


def sincos64(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sin, cos) of float64 angles 0 <= theta < 2^20 from fixed float64 operations: theta = k pi/2 + r (Cody-Waite,
    each k * part exact), Taylor polynomials on |r| <= pi/4, the quadrant from k mod 4. About 1e-16 from the
    true values; the same bits on every machine."""
    if np.any(theta < 0) or np.any(theta >= 2.0 ** 20):
        raise LosslessError("rotary angles must lie in [0, 2^20): positions this far are not supported in exact mode")
    k = np.rint(theta * (2.0 / math.pi))
    r = ((theta - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]
    r2 = r * r
    s, c = r * _horner(_SIN, r2), _horner(_COS, r2)
    quadrant = k.astype(np.int64) % 4
    sin = np.choose(quadrant, [s, c, -s, -c])
    cos = np.choose(quadrant, [c, -s, -c, s])
    return sin, cos


def default_inv_freq(base: float, dim: int) -> np.ndarray:
    """RoPE's inverse frequencies 1 / base^e_i with e_i = fp32(2i / dim), i < dim/2, as Hugging Face defines them
    (the exponent rounded to fp32 first), but the power correctly rounded to fp32 (decimal arithmetic at 40 digits,
    then float64, then fp32): torch's fp32 pow, which Hugging Face uses, may round by the CPU."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)  # fp32 divisions, as torch makes them
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        ln_base = decimal.Decimal(float(np.float32(base))).ln()
        values = [float((-decimal.Decimal(float(e)) * ln_base).exp()) for e in exponents]
    return np.asarray(values, dtype=np.float64).astype(np.float32)


def rotary_table(inv_freq: np.ndarray, positions: int, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, 2 * len(inv_freq)] fp32 in Hugging Face's layout (the half-table twice). The angle is
    fp32(position * inv_freq), as the stock rotary computes it; cos and sin then come from `sincos64`, times
    `scaling` in float64, rounded once to fp32."""
    freq = np.asarray(inv_freq, dtype=np.float32)
    theta = (np.arange(positions, dtype=np.float32)[:, None] * freq[None, :]).astype(np.float64)  # fp32 products
    sin, cos = sincos64(theta)
    cos, sin = ((t * float(scaling)).astype(np.float32) for t in (cos, sin))
    return tuple(torch.from_numpy(np.concatenate([t, t], axis=1)) for t in (cos, sin))
