"""Decoding: the Orthrus model (a frozen backbone plus its diffusion view), the decode loop and its cycles
(chain, tree, lookup, fused), sampling, loading models and head files, and exact mode's kernels.

Uses only the package's shared modules (errors, names, paths, dtypes, text); nothing here knows the study,
training or evaluation. The loop's public names are re-exported here: `from lossless.decoding import decode`.
"""

from .loop import DecodeConfig, DecodeState, DecodeStats, GenerationOutput, decode

__all__ = ["DecodeConfig", "DecodeState", "DecodeStats", "GenerationOutput", "decode"]
