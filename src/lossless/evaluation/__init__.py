"""Evaluation through lm-evaluation-harness: the harness model (`harness`), `lossless eval` (`run`), the
local tasks (`tasks`) and the AR-vs-Orthrus summary and page (`report`).

Uses decoding and the shared modules; decoding does not use it.
"""
