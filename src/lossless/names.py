"""The names users pick from: decoding modes, Orthrus cycles, attention kernels, compute precisions.

Every command, the library and the lm-eval adapter check these names here, so a new kernel or mode is
added in one place. This module knows names only; what a kernel does lives in `decoding/model.py`/`decoding/exact.py`,
what a dtype maps to in `dtypes.py`.
"""

from __future__ import annotations

from .errors import LosslessError

MODES = ("ar", "orthrus")
CYCLES = ("two-pass", "fused")  # how orthrus spends forwards: draft then verify, or both in one forward
EXACT = "exact"
AUTO = "auto"  # dtype/attn: the fastest lossless configuration of the device (decoding/models.py: resolve_auto)
ATTN_KERNELS = ("sdpa", "eager", EXACT)
LLAMA_CPP = "llama.cpp"  # the audit's other engine: llama.cpp decodes, our model only tokenizes (llamacpp.py)
AUDIT_KERNELS = ATTN_KERNELS + (LLAMA_CPP,)  # what an audit configuration may name after its dtype
DTYPE_NAMES = ("fp32", "bf16", "fp16")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise LosslessError(f"unknown mode '{mode}': choose one of {', '.join(MODES)}")
    return mode


def check_cycle(cycle: str) -> str:
    if cycle not in CYCLES:
        raise LosslessError(f"unknown cycle '{cycle}': choose one of {', '.join(CYCLES)}")
    return cycle


# nodes of the candidate tree that `--tree` without a number and the `orthrus-tree` candidate use: the fastest
# of 4, 6, 8, 12, 16 and 24 nodes with the step-1500 head (results/speed/speed_bf16_tree_step1500.txt)
DEFAULT_TREE = 8
# tokens of the lookup branch that `--lookup` without a number and the `orthrus-lookup` candidate use
DEFAULT_LOOKUP = 16
# the cycles the default is chosen from on each CPU (decoding/cycles.py): trees of these node budgets (0: the chain
# of top drafts), each with prompt lookup of these lengths
CYCLE_TREES = (0, 4, 8, 16, 32)
CYCLE_LOOKUPS = (0, 16, 32)
# requests `lossless serve` decodes together on exact kernels: with 8 clients, 2.76x the tokens/s of one at a
# time, and 2.11x at --batch 4 (machine A, results/serving/serve_load_bf16_exact_batch_machine_a.txt)
DEFAULT_BATCH = 8
# prompt rows one batched step runs beside the decoding sequences (`lossless serve --prefill-chunk`): a joining
# prompt runs in chunks of this many, so that a long one does not stall the others' tokens for its whole prefill
# (the rows of a chunk see the keys the earlier chunks wrote: the same keys, so the same bits, as one forward).
# A 1,500-token prompt joining 7 decoding requests: their longest gap 0.23 s instead of 1.99 s, its own first
# token 1.05x later; 64 rows: 0.16 s and 1.25x (machine A, results/serving/batch_prefill_bf16_exact_machine_a.txt)
PREFILL_CHUNK = 128
# The rows of one exact-mode prefill forward: a longer prompt runs in chunks of this many (the same bits), so its
# activations stay bounded (a 6,000-token prompt in one pass held about 110 MB more at its peak than stock's)
EXACT_PREFILL_CHUNK = 256


def check_tree(tree: int, cycle: str, lookup: int = 0) -> None:
    """A candidate tree (`tree` nodes, 0 = none) runs in the two-pass cycle, prompt lookup (`lookup` tokens,
    0 = none) in either cycle, greedy or sampled; both on any kernel, exact mode included."""
    for flag, value in (("--tree", tree), ("--lookup", lookup)):
        if not value:
            continue
        if value < 0:
            raise LosslessError(f"{flag} must be >= 0 (0 = none), got {value}")
        if cycle != "two-pass" and flag == "--tree":
            raise LosslessError(f"{flag} works with the two-pass cycle; drop {flag} or --cycle fused")


def check_attn(attn: str) -> str:
    if attn not in ATTN_KERNELS:
        raise LosslessError(f"unknown attention kernel '{attn}': choose one of {', '.join(ATTN_KERNELS)}")
    return attn


def positive_int(text: str, error: str) -> int:
    """`text` as an integer >= 1, else LosslessError(`error`)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise LosslessError(error)
    return value


def split_list(text: str, what: str) -> list[str]:
    """"a,b,a" -> ["a", "b"]: comma-separated values, blanks dropped, duplicates removed, order kept."""
    items = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not items:
        raise LosslessError(f"{what} needs at least one value")
    return items
