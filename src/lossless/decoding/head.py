"""Draft-head files: the diff parameters (+ mask embedding) as safetensors, with a JSON config.

A head is a directory holding `head.safetensors` and `head.json`. The JSON records the block size `k`,
the mask token (or that a learned mask embedding is used), the format version, and a fingerprint
(architecture hash + sampled weight signature) of the backbone the head was made for; loading a head onto another backbone is refused. The head's
training recipe, when there is one, is kept in the JSON under `"training"`.

This module knows file layout and identity checks. It does not know how heads are trained or used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from ..errors import LosslessError
from ..paths import write_atomically

FORMAT_VERSION = 1
HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head.json"


@dataclass
class HeadConfig:
    """What a head file says about itself."""

    k: int
    backbone_fingerprint: str
    backbone_signature: list = field(default_factory=list)
    mask_token_id: int | None = None
    format_version: int = FORMAT_VERSION
    backbone: str = ""
    trained: bool = False
    training: dict = field(default_factory=dict)
    encoding: str = "full"  # "full": tensors as trained; "delta_int8": int8 deltas over the AR weights
    draft_adapter: int = 0  # rank of the draft view's MLP adapters (0: none; dualview.set_draft_adapter)


def backbone_fingerprint(backbone: nn.Module) -> str:
    """Hash of the backbone's architecture: config shape fields and every non-diff parameter's name and
    shape. Weights are identified separately by `backbone_signature`, compared with a tolerance."""
    cfg = backbone.config
    h = hashlib.sha256()
    fields = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "head_dim")
    h.update(json.dumps({f: getattr(cfg, f, None) for f in fields}, sort_keys=True).encode())
    for name, p in sorted(backbone.named_parameters()):
        if "_diff." not in name:
            h.update(f"{name}{tuple(p.shape)}".encode())
    return h.hexdigest()[:32]


SIGNATURE_SIZE = 64


def backbone_signature(backbone: nn.Module) -> list[float]:
    """SIGNATURE_SIZE weight values sampled across the backbone's parameters (fp32, 5 significant digits).

    Compared with a relative tolerance, so fp32, bf16 and fp16 copies of one model agree while another
    model's weights do not."""
    params = [p for n, p in sorted(backbone.named_parameters()) if "_diff." not in n and p.numel() >= 64]
    values: list[float] = []
    for j in range(SIGNATURE_SIZE):
        p = params[(j * len(params)) // SIGNATURE_SIZE].detach().reshape(-1)
        # a deterministic spread of positions inside the tensor; skip exact zeros (padding rows)
        idx = (j * 7919 + 13) % p.numel()
        values.append(float(f"{float(p[idx]):.5g}"))
    return values


def signatures_match(a: list[float], b: list[float], rtol: float = 2e-2, atol: float = 1e-3) -> bool:
    if len(a) != len(b) or not a:
        return False
    return all(abs(x - y) <= atol + rtol * max(abs(x), abs(y)) for x, y in zip(a, b))


ENCODINGS = ("full", "delta_int8")


def encode_delta_int8(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Store each 2-D weight with a reference as int8 (W - W_ref) with one fp32 scale per output row.

    Other tensors (norm weights, the mask embedding) are kept in fp32. About 4x smaller than fp32.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().float().cpu()
        ref = reference.get(name)
        if ref is None or t.dim() != 2:
            out[name] = t
            continue
        delta = t - ref.detach().float().cpu()
        scale = delta.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        out[name + ".delta_q"] = torch.round(delta / scale).clamp(-127, 127).to(torch.int8)
        out[name + ".delta_scale"] = scale.squeeze(1)
    return out


def decode_delta_int8(stored: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of encode_delta_int8: W = W_ref + int8 * scale (in fp32)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in stored.items():
        if name.endswith(".delta_scale"):
            continue
        if name.endswith(".delta_q"):
            base = name.removesuffix(".delta_q")
            if base not in reference:
                raise LosslessError(f"head stores a delta for {base}, which this backbone does not have")
            scale = stored[base + ".delta_scale"].float()[:, None]
            out[base] = reference[base].detach().float().cpu() + t.float() * scale
        else:
            out[name] = t
    return out


def save_head(path: str | Path, tensors: dict[str, torch.Tensor], config: HeadConfig) -> Path:
    """Write `tensors` and `config` to the head directory `path` (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    # atomically: a reader never sees a torn file, the file gets the usual permissions, and a full disk leaves
    # no temporary file behind
    write_atomically(path / HEAD_WEIGHTS, save(cpu, metadata={"format_version": str(config.format_version)}))
    write_atomically(path / HEAD_CONFIG, json.dumps(asdict(config), indent=2) + "\n")
    return path


def _invalid_field(c: HeadConfig) -> str | None:
    if not isinstance(c.k, int) or isinstance(c.k, bool) or c.k < 1:
        return f"k must be a positive integer, got {c.k!r}"
    if c.mask_token_id is not None and (not isinstance(c.mask_token_id, int) or c.mask_token_id < 0):
        return f"mask_token_id must be a non-negative integer or null, got {c.mask_token_id!r}"
    if not isinstance(c.backbone_fingerprint, str):
        return "backbone_fingerprint must be a string"
    if not isinstance(c.backbone_signature, list) or not all(isinstance(v, (int, float)) for v in c.backbone_signature):
        return "backbone_signature must be a list of numbers"
    if not isinstance(c.format_version, int):
        return "format_version must be an integer"
    if not isinstance(c.draft_adapter, int) or isinstance(c.draft_adapter, bool) or c.draft_adapter < 0:
        return f"draft_adapter must be a non-negative integer, got {c.draft_adapter!r}"
    if c.encoding not in ENCODINGS:
        return f"unknown encoding {c.encoding!r}"
    return None


def read_head_config(path: str | Path) -> tuple[Path, HeadConfig]:
    """The directory and validated config of a head (a directory or its safetensors file), without its
    weights: cheap enough to check a `--head` before any model loads. Raises LosslessError if unusable."""
    path = Path(path)
    if path.is_file():
        path = path.parent
    weights, cfg_file = path / HEAD_WEIGHTS, path / HEAD_CONFIG
    if not weights.exists() or not cfg_file.exists():
        raise LosslessError(f"no head at {path}: expected {HEAD_WEIGHTS} and {HEAD_CONFIG} in that directory")
    try:
        raw = json.loads(cfg_file.read_bytes().decode("utf-8"))
        config = HeadConfig(**raw)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
        raise LosslessError(f"corrupt head config {cfg_file}: {exc}; re-train or re-download the head") from None
    bad = _invalid_field(config)
    if bad:
        raise LosslessError(f"corrupt head config {cfg_file}: {bad}; re-train or re-download the head")
    if config.format_version != FORMAT_VERSION:
        raise LosslessError(
            f"head {path} has format version {config.format_version}; this lossless reads version {FORMAT_VERSION}"
        )
    return path, config


def load_head(path: str | Path) -> tuple[dict[str, torch.Tensor], HeadConfig]:
    """Read a head directory (or the path of its safetensors file); raise LosslessError if unusable."""
    path, config = read_head_config(path)
    weights = path / HEAD_WEIGHTS
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LosslessError(f"corrupt head file {weights}: {exc}; re-train or re-download the head") from None
    return tensors, config


UNTRAINED = "untrained"  # the digest of a head that was never loaded: copies of the AR projections


def head_digest(tensors: dict[str, torch.Tensor], config: HeadConfig) -> str:
    """Identity of a head as stored (dtype-independent: the file's tensors, k and the mask token), so a
    study can pin the head its records were made with."""
    h = hashlib.sha256(f"k={config.k};mask={config.mask_token_id};encoding={config.encoding}".encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def stored_head_digest(path: str | Path) -> str:
    """`head_digest` of the head directory at `path`."""
    return head_digest(*load_head(path))
