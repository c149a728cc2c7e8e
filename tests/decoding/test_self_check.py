"""Exact mode's self-check: when the kernels load, every variant this CPU runs computes a fixed set of kernel calls
(linear layers of every block shape, bf16's product-sums, attention, RMSNorm, SiLU, a tree's choices, a layer stack
over a cache) in fp32, bf16 and fp16, under each of its speed settings, and hashes the bits. A variant whose hash
is not the one every machine gives (`kernels.SELF_CHECK`) is not used: a CPU or compiler that computes other bits
cannot quietly decode other tokens than every other machine."""

import logging

import pytest
import torch

from lossless.decoding import kernels
from lossless.errors import LosslessError

VARIANTS = kernels.runnable_isas()


def test_every_variant_gives_the_value_every_machine_gives_at_any_thread_count():
    ext = kernels.extension()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):  # (one thread: a long cache's attention unsplit; more: split over the threads)
            torch.set_num_threads(threads)
            for name in VARIANTS if threads < 3 else VARIANTS[:1]:
                got = kernels.self_check(getattr(ext, name))
                assert got == kernels.SELF_CHECK, (
                    f"the {name} variant's self-check gives {got} at {threads} threads: where a kernel's order of "
                    f"operations changed on purpose (the golden file recorded again), set kernels.SELF_CHECK to it")
    finally:
        torch.set_num_threads(before)
    assert kernels.self_check_failures() == {} and kernels.usable_isas() == VARIANTS


@pytest.mark.skipif("avx512bf16" not in VARIANTS, reason="the amx variant's code needs AVX-512 BF16 around its tiles")
def test_the_amx_variant_with_its_tile_instructions_written_out_gives_it_too():
    """On a CPU without AMX, the amx variant's whole path with only TDPBF16PS written out (its tiles from one row
    on, as the self-check runs it): so on a CPU with AMX only the tile instructions themselves are checked new."""
    amx = kernels.extension().amx
    amx.set_tile_emulation(True)
    try:
        assert kernels.self_check(amx) == kernels.SELF_CHECK
    finally:
        amx.set_tile_emulation(False)


class Perturbed:
    """A variant's kernels, with one kernel's output (`name`; "Stack" for the layer stack's) changed by one unit
    in the last place of one element."""

    def __init__(self, variant, name: str):
        self.variant, self.name = variant, name

    @staticmethod
    def nudge(out):
        if isinstance(out, (list, tuple)):
            return type(out)([Perturbed.nudge(out[0]), *out[1:]])
        out = out.clone()
        words = out.view(torch.int32 if out.element_size() == 4 else torch.int16 if out.element_size() == 2 else torch.int64)
        words.view(-1)[out.numel() // 2] += 1
        return out

    def __getattr__(self, attr):
        real = getattr(self.variant, attr)
        if attr != self.name:
            return real
        if attr == "Stack":
            class Stack:
                def __init__(self):
                    self.inner = real()

                def add(self, *args):
                    self.inner.add(*args)

                def forward(self, *args):
                    return Perturbed.nudge(self.inner.forward(*args))

            return Stack
        return lambda *args: Perturbed.nudge(real(*args))


@pytest.mark.parametrize("kernel", ["linear", "linear_sums", "attention", "rms_norm", "silu", "choices", "Stack"])
def test_one_wrong_bit_in_any_kernel_changes_the_value(kernel):
    variant = kernels.extension().scalar
    assert kernels.self_check(Perturbed(variant, kernel)) != kernels.SELF_CHECK


def test_a_variant_that_fails_it_is_not_used_and_naming_it_is_refused_in_one_line(monkeypatch, caplog):
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    best = VARIANTS[0]
    real = kernels.self_check
    monkeypatch.setattr(kernels, "self_check", lambda v: "0123456789abcdef" if v is getattr(kernels._compiled(), best)
                        else real(v))
    kernels.extension.cache_clear()
    kernels._resolve.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="lossless"):
            assert kernels.self_check_failures() == {best: "0123456789abcdef"}
        assert [r.getMessage().count("\n") for r in caplog.records] == [0]
        assert f"the {best} variant computes other bits on this CPU" in caplog.records[0].getMessage()
        assert kernels.usable_isas() == VARIANTS[1:]
        if len(VARIANTS) > 1:
            assert kernels.isa() == VARIANTS[1]  # the default goes on with the next variant
        monkeypatch.setenv(kernels.ISA_ENV, best)
        with pytest.raises(LosslessError, match=rf"^LOSSLESS_EXACT_ISA={best}: that variant computes other bits on "
                                                rf"this CPU .*self-check 0123456789abcdef, expected .*unset it to use"):
            kernels.isa()
        monkeypatch.delenv(kernels.ISA_ENV)
        monkeypatch.setattr(kernels, "self_check", lambda v: "0123456789abcdef")  # every variant fails
        kernels.extension.cache_clear()
        kernels._resolve.cache_clear()
        with pytest.raises(LosslessError, match="every variant failed its self-check.*use --attn sdpa$"):
            kernels.isa()
        # a variant whose calls raise here is not used either, and the others load
        monkeypatch.setattr(kernels, "self_check", lambda v: 1 / 0 if v is getattr(kernels._compiled(), best) else real(v))
        kernels.extension.cache_clear()
        assert kernels.self_check_failures() == {best: "ZeroDivisionError: division by zero"}
    finally:
        monkeypatch.undo()
        kernels.extension.cache_clear()
        kernels._resolve.cache_clear()
    assert kernels.self_check_failures() == {}  # (the kernels as they were, for the tests after this one)
