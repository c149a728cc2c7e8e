"""Continuous batching on exact kernels: a sequence decoded beside any others, joining and leaving at any step,
gets bitwise the logits (so the tokens, margins and top tokens) it gets decoded alone; a finished sequence's rows
are compacted away without changing anyone's bits."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import NO_EOS, tiny_backbone
from lossless.decoding import batch as batching
from lossless.decoding.batch import BatchDecoder
from lossless.decoding.loop import DecodeConfig, decode
from lossless.decoding.model import OrthrusLM
from lossless.decoding.sampling import Draws, SamplingConfig
from lossless.errors import LosslessError

SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
_MODELS: dict = {}


def exact_model(family: str, dtype: torch.dtype) -> OrthrusLM:
    if (family, dtype) not in _MODELS:
        model = OrthrusLM(tiny_backbone(family).to(dtype), k=8)
        model.set_attn("exact")
        _MODELS[(family, dtype)] = model
    return _MODELS[(family, dtype)]


def alone(model, prompt, cfg):
    """The single-sequence AR decode (the reference every batched sequence must equal)."""
    return decode(model, prompt, "ar", dataclasses.replace(cfg, record_margins=True))


def run_batch(model, requests, joins, compact_at=None, prefill_chunk=batching.PREFILL_CHUNK):
    """Decode `requests` [(prompt, cfg)] in one batch, request i joining before step joins[i]; returns their
    finished sequences in request order."""
    dec = BatchDecoder(model, prefill_chunk=prefill_chunk)
    seqs, step = [None] * len(requests), 0
    order = sorted(range(len(requests)), key=lambda i: joins[i])
    while any(s is None or s.finished is None for s in seqs):
        for i in order:
            if seqs[i] is None and joins[i] <= step:
                prompt, cfg = requests[i]
                seqs[i] = dec.add(prompt, dataclasses.replace(cfg, record_margins=True))
        if compact_at is not None and step == compact_at:
            dec.compact()
        dec.step()
        step += 1
    return seqs, dec


def assert_same(seq, ref):
    assert seq.state.generated == ref.generated
    assert seq.state.finished == ref.finished
    assert seq.state.margins == ref.margins and seq.state.tops == ref.tops  # the logits, to the bit


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@settings(max_examples=6, **SLOW)
@given(data=st.data())
def test_each_sequence_of_a_batch_equals_its_decode_alone(family, dtype, data):
    model = exact_model(family, dtype)
    n = data.draw(st.integers(1, 5), label="sequences")
    requests, joins = [], []
    for i in range(n):
        prompt = data.draw(st.lists(st.integers(0, 62), min_size=1, max_size=40), label=f"prompt{i}")
        temperature = data.draw(st.sampled_from([0.0, 0.0, 0.9]), label=f"temperature{i}")
        lookup = data.draw(st.sampled_from([0, 4]), label=f"lookup{i}")  # sampled: copies kept by AR's draws
        cfg = DecodeConfig(max_new_tokens=data.draw(st.integers(1, 24), label=f"new{i}"), eos_ids=NO_EOS,
                           lookup=lookup, sampling=SamplingConfig(temperature=temperature, seed=i))
        requests.append((prompt, cfg))
        joins.append(data.draw(st.integers(0, 12), label=f"join{i}"))
    compact_at = data.draw(st.one_of(st.none(), st.integers(0, 12)), label="compact at")
    prefill_chunk = data.draw(st.sampled_from([batching.PREFILL_CHUNK, 1, 3, 16]), label="prefill rows")  # chunks
    seqs, _ = run_batch(model, requests, joins, compact_at, prefill_chunk)
    for seq, (prompt, cfg) in zip(seqs, requests):
        assert_same(seq, alone(model, prompt, cfg))


def test_a_long_prompt_joins_in_chunks_while_the_others_go_on_decoding():
    """A step runs at most prefill_chunk prompt rows: the decoding sequence gets a token at every step of the long
    prompt's prefill, two joining prompts share each step's rows in the order they came, and every sequence still
    gets its tokens alone."""
    model = exact_model("llama", torch.bfloat16)
    cfg = DecodeConfig(max_new_tokens=30, eos_ids=NO_EOS, record_margins=True)
    dec = BatchDecoder(model, prefill_chunk=16)
    running = dec.add([5, 3, 8], cfg)
    dec.step()
    long, short = list(range(1, 51)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8]  # 50 and 20 rows
    first, second = dec.add(long, cfg), dec.add(short, cfg)
    seen = []
    for _ in range(5):  # 16 rows a step: the long one's 50 rows take 4 steps, the short one's 20 start in its 4th
        before = len(running.state.generated)
        dec.step()
        assert len(running.state.generated) == before + 1
        seen.append((len(first.state.generated), len(second.state.generated), len(first.pending), len(second.pending)))
    assert seen == [(0, 0, 34, 20), (0, 0, 18, 20), (0, 0, 2, 20), (1, 0, 1, 6), (2, 1, 1, 1)]
    while dec.active:
        dec.step()
    for seq, prompt in ((running, [5, 3, 8]), (first, long), (second, short)):
        assert_same(seq, alone(model, prompt, cfg))
    with pytest.raises(LosslessError, match="prefill_chunk"):
        BatchDecoder(model, prefill_chunk=0)


def test_a_batch_stops_each_sequence_at_its_eos_and_its_length():
    model = exact_model("llama", torch.bfloat16)
    prompt = [1, 5, 9, 3]
    free = alone(model, prompt, DecodeConfig(max_new_tokens=20, eos_ids=NO_EOS)).generated
    eos = free[6]
    requests = [(prompt, DecodeConfig(max_new_tokens=20, eos_ids=(eos,))), (prompt, DecodeConfig(max_new_tokens=3)),
                ([7, 7, 7], DecodeConfig(max_new_tokens=20, eos_ids=NO_EOS))]
    seqs, dec = run_batch(model, requests, [0, 1, 2])
    assert seqs[0].state.generated == free[: free.index(eos) + 1] and seqs[0].finished == "eos"
    assert len(seqs[1].state.generated) == 3 and seqs[1].finished in ("length", "eos")
    assert seqs[2].finished == "length" and len(seqs[2].state.generated) == 20
    assert dec.sequences == []


def test_finished_rows_are_compacted_away_and_the_rest_decode_on_unchanged(monkeypatch):
    monkeypatch.setattr(batching, "COMPACT_AT", 8)
    model = exact_model("qwen3", torch.bfloat16)
    long = ([3, 1, 4, 1, 5, 9, 2, 6], DecodeConfig(max_new_tokens=40, eos_ids=NO_EOS))
    shorts = [([i, i + 1, i + 2] * 4, DecodeConfig(max_new_tokens=4, eos_ids=NO_EOS)) for i in range(5)]
    seqs, dec = run_batch(model, [long, *shorts], [0, 0, 2, 4, 6, 8])
    assert dec.compactions >= 1
    for seq, (prompt, cfg) in zip(seqs, [long, *shorts]):
        assert_same(seq, alone(model, prompt, cfg))


def test_interleaved_steps_are_compacted_so_each_sequence_keys_lie_together(monkeypatch):
    """Nobody finishes (no dead rows), yet once the steps of several sequences have interleaved COMPACT_AT rows, the
    cache is compacted: each sequence's keys lie together again, in order; and every sequence still gets its
    bits alone."""
    monkeypatch.setattr(batching, "COMPACT_AT", 12)
    model = exact_model("llama", torch.bfloat16)
    requests = [([i + 1, i + 2, i + 3, i + 4] * 5, DecodeConfig(max_new_tokens=20, eos_ids=NO_EOS)) for i in range(3)]
    dec = BatchDecoder(model)
    seqs = [dec.add(p, dataclasses.replace(cfg, record_margins=True)) for p, cfg in requests]
    dec.step()  # the prompts, one block of 20 rows each: not interleaved
    assert dec.mixed == 0 and dec.compactions == 0
    laid_out = []
    for _ in range(6):
        dec.step()
        if dec.compactions:
            laid_out.append([s.state.cache.at for s in seqs])
            break
    assert dec.compactions == 1 and dec.mixed == 0
    at = 0
    for positions in laid_out[0]:  # together, one sequence after another
        assert positions == list(range(at, at + len(positions)))
        at += len(positions)
    while any(s.finished is None for s in seqs):
        dec.step()
    for seq, (prompt, cfg) in zip(seqs, requests):
        assert_same(seq, alone(model, prompt, cfg))


def test_a_sequence_ended_early_leaves_and_the_others_finish():
    model = exact_model("llama", torch.float32)
    dec = BatchDecoder(model)
    a = dec.add([1, 2, 3], DecodeConfig(max_new_tokens=30, eos_ids=NO_EOS))
    b = dec.add([4, 5, 6], DecodeConfig(max_new_tokens=6, eos_ids=NO_EOS, record_margins=True))
    dec.step()
    a.finish("stop")
    ended = dec.step()
    assert a in ended and a.finished == "stop" and len(a.state.generated) == 1
    while b.finished is None:
        dec.step()
    assert_same(b, alone(model, [4, 5, 6], DecodeConfig(max_new_tokens=6, eos_ids=NO_EOS)))


def test_batching_refuses_stock_kernels_and_what_a_batch_cannot_run():
    stock = OrthrusLM(tiny_backbone("llama"), k=8)
    with pytest.raises(LosslessError, match="exact kernels"):
        BatchDecoder(stock)
    dec = BatchDecoder(exact_model("llama", torch.float32))
    with pytest.raises(LosslessError, match="candidate trees"):
        dec.add([1, 2], DecodeConfig(tree=8))
    with pytest.raises(LosslessError, match="context"):
        dec.add([1] * 250, DecodeConfig(max_new_tokens=10))
    from lossless.serving.engine import Engine

    for bad in (0, -3, 2.5):  # refused before the engine's decoding thread starts (it would die on it)
        with pytest.raises(LosslessError, match="prefill_chunk"):
            Engine(exact_model("llama", torch.float32), batch=2, prefill_chunk=bad)


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_greedy_decode_begun_alone_goes_on_in_a_batch_with_the_same_tokens(cut):
    """A request's first tokens decoded alone in the speculative cycle, the rest in a batch beside another: the
    tokens (and the logits of the batched ones) of AR alone."""
    model = exact_model("qwen3", torch.bfloat16)
    prompt, cfg = [3, 1, 4, 1, 5, 9, 2, 6], DecodeConfig(max_new_tokens=20, eos_ids=NO_EOS, lookup=4)
    ref = alone(model, prompt, cfg)
    begun = decode(model, prompt, "orthrus", dataclasses.replace(cfg, stop_after=cut))
    assert begun.generated == ref.generated[: len(begun.generated)] and len(begun.generated) >= cut
    forwards = begun.stats.forwards
    dec = BatchDecoder(model, prefill_chunk=5)  # its prompt and first tokens run in chunks
    other = dec.add([7, 7, 2], DecodeConfig(max_new_tokens=20, eos_ids=NO_EOS))
    seq = dec.add(prompt, dataclasses.replace(cfg, record_margins=True), generated=begun.generated,
                  stats=begun.stats)
    while seq.finished is None or other.finished is None:
        dec.step()
    assert seq.state.generated == ref.generated and seq.finished == "length"
    assert seq.state.margins == ref.margins[len(begun.generated):]
    assert seq.state.stats.forwards > forwards and seq.state.stats.new_tokens == 20  # counting on


@pytest.mark.parametrize("hand_cache", [False, True])
@pytest.mark.parametrize("cut", [3, 6])
def test_a_sampled_decode_begun_alone_in_a_tree_goes_on_in_a_batch_with_ar_sampling_tokens(cut, hand_cache):
    """Sampled, a request's first tokens decoded alone with a candidate tree and the rest in a batch (with prompt
    lookup) beside another: each token is the one AR's draw at its position chooses, so the whole is `--mode
    ar`'s with the same seed, whenever the batch took it over (its cache handed over or not)."""
    model = exact_model("llama", torch.bfloat16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5]
    cfg = DecodeConfig(max_new_tokens=24, eos_ids=NO_EOS, lookup=4, sampling=SamplingConfig(temperature=0.8, seed=5))
    ref = alone(model, prompt, cfg)
    begun = decode(model, prompt, "orthrus", dataclasses.replace(cfg, tree=6, lookup=0, stop_after=cut))
    assert begun.generated == ref.generated[: len(begun.generated)] and len(begun.generated) >= cut
    assert begun.stats.steps >= 1  # (tree cycles ran)
    dec = BatchDecoder(model, prefill_chunk=5)
    other = dec.add([7, 7, 2], DecodeConfig(max_new_tokens=20, eos_ids=NO_EOS))
    seq = dec.add(prompt, dataclasses.replace(cfg, record_margins=True), generated=begun.generated, stats=begun.stats,
                  cache=begun.cache if hand_cache else None)
    while seq.finished is None or other.finished is None:
        dec.step()
    assert seq.state.generated == ref.generated and seq.state.margins == ref.margins[len(begun.generated):]


@pytest.mark.parametrize("neighbour", [False, True])
@pytest.mark.parametrize("cut", [1, 7])
def test_a_decode_begun_alone_hands_its_cache_over_and_goes_on_with_the_same_bits(cut, neighbour):
    """The cache of a decode begun alone moves into the batch (becoming its cache where no sequence has keys in
    it, appended after a neighbour's otherwise): the prompt and the first tokens are not run again, and the
    tokens and logits are AR's alone."""
    model = exact_model("llama", torch.bfloat16)
    prompt, cfg = [3, 1, 4, 1, 5, 9, 2, 6], DecodeConfig(max_new_tokens=16, eos_ids=NO_EOS, lookup=4)
    ref = alone(model, prompt, cfg)
    begun = decode(model, prompt, "orthrus", dataclasses.replace(cfg, stop_after=cut))
    dec, other = BatchDecoder(model), None
    if neighbour:  # a sequence with keys in the shared cache already
        other = dec.add([7, 7, 2], DecodeConfig(max_new_tokens=12, eos_ids=NO_EOS, record_margins=True))
        dec.step()
    held = dec.cache.get_seq_length()
    seq = dec.add(prompt, dataclasses.replace(cfg, record_margins=True), generated=begun.generated,
                  stats=begun.stats, cache=begun.cache)
    assert (dec.cache is begun.cache) != neighbour  # moved, not copied, where nobody else had keys
    assert seq.pending == [begun.tokens[-1]]
    assert seq.state.cache.at == list(range(held if neighbour else 0,
                                            (held if neighbour else 0) + len(begun.tokens) - 1))
    forwards = begun.stats.forwards
    dec.step()
    assert seq.state.stats.forwards == forwards + 1  # one row, not the prompt again
    while seq.finished is None or (other is not None and other.finished is None):
        dec.step()
    assert seq.state.generated == ref.generated and seq.finished == "length"
    assert seq.state.margins == ref.margins[len(begun.generated):]
    if other is not None:
        assert_same(other, alone(model, [7, 7, 2], DecodeConfig(max_new_tokens=12, eos_ids=NO_EOS)))
    with pytest.raises(LosslessError, match="every token but the last"):
        BatchDecoder(model).add(prompt, cfg, generated=begun.generated, cache=model.new_cache())


def test_a_handed_over_cache_that_fails_to_move_in_leaves_the_shared_one_as_it_was(monkeypatch):
    """Moving a decode's cache into the batch's fails part way (out of memory, say): the error comes out as it
    was, and no layer of the shared cache keeps rows the others lack."""
    model = exact_model("llama", torch.bfloat16)
    prompt, cfg = [3, 1, 4, 1, 5, 9, 2, 6], DecodeConfig(max_new_tokens=8, eos_ids=NO_EOS)
    begun = decode(model, prompt, "ar", dataclasses.replace(cfg, stop_after=2))
    dec = BatchDecoder(model)
    dec.add([7, 7, 2], DecodeConfig(max_new_tokens=8, eos_ids=NO_EOS))
    dec.step()
    held = [layer.get_seq_length() for layer in dec.cache.layers]
    update = type(dec.cache).update

    def failing(cache, keys, values, i, *args, **kwargs):
        if i == len(cache.layers) - 1:
            raise MemoryError("no room")
        return update(cache, keys, values, i, *args, **kwargs)

    monkeypatch.setattr(type(dec.cache), "update", failing)
    with pytest.raises(MemoryError, match="no room"):
        dec.add(prompt, cfg, generated=begun.generated, stats=begun.stats, cache=begun.cache)
    assert [layer.get_seq_length() for layer in dec.cache.layers] == held


def test_a_sequence_whose_own_step_fails_ends_alone_and_the_others_finish():
    """A sampled sequence whose distribution cannot be sampled (a temperature past the validation floor, set after
    it, as a request that slipped through would) and one whose token callback raises end with their own error;
    the greedy one beside them gets the tokens it gets alone."""
    model = exact_model("llama", torch.float32)
    dec = BatchDecoder(model)
    broken = SamplingConfig(temperature=0.5, seed=1)
    broken.temperature = 1e-40  # logits / 1e-40 overflow: NaN probabilities, and torch.multinomial raises
    bad_sample = dec.add([1, 2, 3], DecodeConfig(max_new_tokens=12, eos_ids=NO_EOS, sampling=broken))
    calls = []

    def failing(ids):
        calls.append(ids)
        if len(calls) == 3:
            raise ValueError("the client's text callback failed")
    bad_callback = dec.add([7, 8], DecodeConfig(max_new_tokens=12, eos_ids=NO_EOS), on_tokens=failing)
    good = dec.add([4, 5, 6], DecodeConfig(max_new_tokens=10, eos_ids=NO_EOS, record_margins=True))
    ended = []
    while good.finished is None:
        ended += dec.step()
    assert bad_sample in ended and bad_sample.finished == "error" and isinstance(bad_sample.error, RuntimeError)
    assert bad_callback in ended and bad_callback.finished == "error"
    assert str(bad_callback.error) == "the client's text callback failed" and len(calls) == 3
    assert good.error is None
    assert_same(good, alone(model, [4, 5, 6], DecodeConfig(max_new_tokens=10, eos_ids=NO_EOS)))


def test_an_engine_fails_only_the_job_whose_own_step_failed(monkeypatch):
    import asyncio

    from lossless.decoding import sampling as sampling_module
    from lossless.serving.engine import Engine, Job

    real = sampling_module.sample
    doomed = {Draws(13).at(i) for i in range(12)}  # the seed-13 request's draws

    def sample(probs, u):  # the seed-13 request's sampling fails, as an unsampleable one did
        if u in doomed:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(probs, u)
    monkeypatch.setattr(sampling_module, "sample", sample)
    model = exact_model("llama", torch.float32)
    engine = Engine(model, batch=4)

    async def run():
        loop = asyncio.get_running_loop()
        settings = dict(mode="ar", max_new_tokens=10, temperature=0.0, top_k=0, top_p=1.0, seed=0)
        jobs = [Job([1, 5, 9, 3], {**settings, "temperature": 0.7, "seed": 13}, [], loop),
                Job([1, 5, 9, 3], {**settings, "temperature": 0.7, "seed": 2}, [], loop),
                Job([4, 5, 6], settings, [], loop)]
        for job in jobs:
            engine.submit(job)
        out = []
        for job in jobs:
            while (event := await asyncio.wait_for(job.events.get(), 60))[0] == "text":
                pass
            out.append(event)
        return out
    try:
        results = asyncio.run(run())
    finally:
        engine.close()
    assert results[0][0] == "error" and "probability tensor" in str(results[0][1])
    assert [kind for kind, _ in results[1:]] == ["done", "done"]
    sampled = decode(model, [1, 5, 9, 3], "ar", DecodeConfig(max_new_tokens=10, sampling=SamplingConfig(0.7, seed=2)))
    assert results[1][1].token_ids == sampled.generated
    assert results[2][1].token_ids == decode(model, [4, 5, 6], "ar", DecodeConfig(max_new_tokens=10)).generated


def test_temperatures_that_overflow_the_logits_are_refused():
    for t in (1e-40, 1e-320, 9e-6, float("nan"), float("inf")):
        with pytest.raises(LosslessError, match="--temperature"):
            SamplingConfig(temperature=t)
    assert SamplingConfig(temperature=1e-5).probs(torch.tensor([[3.0, 1.0, -2.0]])).isfinite().all()
