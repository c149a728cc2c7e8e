"""Token choice from logits: greedy, and the processed distributions used for sampling.

`SamplingConfig.probs` turns logits into the distribution actually sampled from (temperature, then
top-k, then top-p). Orthrus applies the same processing to the draft distribution q and the verify
distribution p, so rejection sampling is exact for the processed target.

A sampled decode's uniform draws are keyed by position (`Draws`): the draw that chooses generated token i is a
function of the seed and i alone. So a token verified in a block, a tree or a batch is chosen by the same draw
from the same p as an AR step would choose it: where the drafts are candidates chosen without a draw (a tree's,
looked-up copies), a candidate is kept exactly when it is the token AR's draw gives, and on exact kernels the
decode gives `--mode ar`'s tokens for the same seed, token for token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..errors import LosslessError


# the smallest temperature a sampled decode takes: logits over a temperature near the float32 range's end overflow
# to inf, and their softmax is NaN (1e-40 and 1e-320 did); below 1e-5 the samples are the argmax for any logits
# that are not ties to 5 decimals, which greedy decoding (temperature 0) gives outright
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingConfig:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN too
            raise LosslessError("--temperature must be >= 0 (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise LosslessError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}: logits divided by "
                                f"{self.temperature:g} overflow (use 0 for the most likely token)")
        if self.top_k < 0:
            raise LosslessError("--top-k must be >= 0 (0 = no top-k filter)")
        if not 0.0 < self.top_p <= 1.0:
            raise LosslessError("--top-p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def draws(self) -> "Draws":
        return Draws(self.seed)

    def token(self, logits: torch.Tensor, draws: "Draws", i: int) -> int:
        """The token AR's draw at generated position i chooses from a row of logits [V]: the one rule every sampled
        AR step, batched step and verification of candidates chosen without a draw takes."""
        return sample(self.probs(logits), draws.at(i))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed sampling distribution, float32: logits [..., V] -> probs [..., V]."""
        scores = logits.float() / self.temperature
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
            # drop a token when the tokens ranked above it already reach top_p; always keep the first
            drop_sorted = (cum - torch.softmax(sorted_scores, dim=-1)) >= self.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return torch.softmax(scores, dim=-1)


# what a decode's draw at a position is for: the token there (AR's own draw, which every verification of
# candidates chosen without a draw uses too), a draft drawn from the draft distribution q, rejection sampling's test
# of that draft, and its draw from the residual
TOKEN, DRAFT, TEST, RESIDUAL = range(4)


class Draws:
    """The uniform draws of one sampled decode, keyed by position: `at(i, what)` is a function of the seed, the
    generated token's index i and what the draw is for, alone (BLAKE2b of the three, 53 bits: a float64 in [0, 1)).
    Whichever forward verifies token i and whatever ran before it, the draw is the same."""

    def __init__(self, seed: int):
        self.prefix = f"{int(seed)}/".encode()

    def at(self, i: int, what: int = TOKEN) -> float:
        digest = hashlib.blake2b(self.prefix + f"{int(i)}/{what}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 11) * 2.0 ** -53


def sample(probs: torch.Tensor, u: float) -> int:
    """The token id that the uniform draw u in [0, 1) chooses from probs [V] (non-negative; their sum need not be
    1): where u times their sum falls in their cumulative sums, taken in float64, so over u every token's chance is
    its share of the sum to within float64's rounding, and a token of probability 0 is never chosen.
    torch.multinomial drew one token of a 49k vocabulary in 0.85 ms on 2 cores, this in 0.05 ms."""
    cdf = probs.double().cumsum(0)
    total = float(cdf[-1])
    if not 0 < total < float("inf") or bool((probs < 0).any()):  # NaN too: as torch.multinomial refuses them
        raise RuntimeError("cannot sample: the probabilities hold a NaN, an inf or a negative value, or sum to 0")
    at = torch.tensor(float(u) * total, dtype=torch.float64, device=probs.device)
    token = int(torch.searchsorted(cdf, at, right=True))
    if token >= cdf.shape[0]:  # the draw rounded up to the whole sum: the last token that has a chance
        token = int(torch.nonzero(probs)[-1, 0])
    return token


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice along the vocabulary axis (first index on exact ties, like torch.argmax).

    Where exact mode's kernels are loaded, their `choices` (one pass, rows spread over the threads: 26 against 290
    us for 10 rows of the 49k vocabulary, 2 threads, Zen 5); else `max(dim).indices`, which returns the same
    index as `argmax` (both documented to take the first maximal value) and on CPU is several times faster on bf16
    logits (0.4 against 1.8 ms for 8 rows, 1 thread, AVX-512 BF16)."""
    if _kernel_ready(logits):
        from . import kernels

        return kernels.choices(logits, 1)[0][..., 0]
    return logits.max(dim=-1).indices


def top_candidates(logits: torch.Tensor, n: int) -> tuple[list[list[float]], list[list[int]]]:
    """The n most probable tokens of each row of logits [m, V] under its softmax: (probabilities, ids), each [m][n],
    the most probable first (a tree's candidates). Exact mode's kernels where they are loaded: the earlier id first
    among equal logits and a fixed-order sum, so the same tree on every CPU (what a cycle profile records); else
    torch (the same ids where no two values tie, which torch.topk orders as it may; probabilities within float
    rounding)."""
    n = min(n, logits.shape[-1])
    if _kernel_ready(logits) and n <= 8:
        from . import kernels

        ids, probs = kernels.choices(logits, n, probs=True)
        return probs.tolist(), ids.tolist()
    top = torch.topk(torch.softmax(logits.float(), dim=-1), n, dim=-1)
    return top.values.tolist(), top.indices.tolist()


def _kernel_ready(logits: torch.Tensor) -> bool:
    from . import kernels

    return (kernels.loaded() and logits.device.type == "cpu" and logits.dim() >= 1 and logits.shape[-1] > 0
            and logits.numel() > 0 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16))
