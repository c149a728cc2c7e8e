"""Names of compute precisions and their torch dtypes, and a check that a device supports one."""

from __future__ import annotations

import torch

from .errors import LosslessError
from .names import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


def dtype_name(name: str) -> str:
    """Canonical short name (`fp32`, `bf16`, `fp16`) for a user-given precision name."""
    key = _ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else name
    if key not in DTYPES:
        raise LosslessError(f"unknown dtype '{name}': choose one of {', '.join(DTYPES)}")
    return key


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[dtype_name(name)]


def check_dtype_supported(name: str, device: torch.device) -> None:
    """Run a tiny matmul + softmax in `name` on `device`; refuse the precision if the device cannot."""
    dt = torch_dtype(name)
    try:
        a = torch.ones(4, 4, dtype=dt, device=device)
        torch.softmax(a @ a, dim=-1).sum().item()
    except (RuntimeError, TypeError, AssertionError) as exc:
        raise LosslessError(
            f"dtype {dtype_name(name)} is not supported on device {device}: use --dtype fp32 ({exc.__class__.__name__})"
        ) from None
