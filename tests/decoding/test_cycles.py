"""The default cycle from the CPU's measured costs (decoding/cycles.py): the cost model, the choice, profiles,
the cached costs, and what `generate` runs and reports."""

import json

import pytest
import torch

from lossless.decoding import cycles
from lossless.decoding.loop import DecodeConfig, decode
from lossless.names import DEFAULT_LOOKUP, DEFAULT_TREE
from tests.conftest import tiny_orthrus

# forward costs in steps, as measured on two CPUs (the verify of 9, 13, 17 and 32 rows; the draft pass): Intel
# Xeon on VDPBF16PS (compute-bound from ~4 rows) and the same CPU with AMX tiles (about one step up to 32 rows)
INTEL = {"rows": {"1": 1.0, "9": 1.50, "13": 1.92, "17": 2.23, "32": 3.38}, "draft": 1.50}
AMX = {"rows": {"1": 1.0, "9": 1.02, "13": 1.03, "17": 1.05, "32": 1.10}, "draft": 1.02}


def entry(tree, lookup, tokens, drafts, verifies):
    return {"tree": tree, "lookup": lookup, "tokens": tokens, "drafts": drafts,
            "verifies": {str(r): n for r, n in verifies.items()}}


# 100 tokens: the chain in 40 cycles of 9 rows; the 32-node tree in 25 cycles of 33 rows (more tokens per cycle)
PROFILE = {"candidates": [entry(0, 0, 100, 40, {9: 40}), entry(32, 0, 100, 25, {33: 25})]}


def test_costs_between_measured_rows_are_linear_and_extend_past_the_last():
    costs = {"rows": {"1": 10.0, "9": 14.0, "17": 30.0}, "draft": 12.0}
    assert cycles.cost_at(costs, 1) == 10.0 and cycles.cost_at(costs, 9) == 14.0
    assert cycles.cost_at(costs, 5) == pytest.approx(12.0)
    assert cycles.cost_at(costs, 13) == pytest.approx(22.0)
    assert cycles.cost_at(costs, 25) == pytest.approx(46.0)  # the 9-17 slope, on
    assert cycles.cost_at(costs, 0) == 10.0


def test_the_prediction_is_ar_time_over_the_forwards_time():
    e = entry(8, 16, 60, 10, {9: 6, 17: 4, 13: 2})
    costs = {"rows": {"1": 10.0, "9": 14.0, "17": 30.0}, "draft": 12.0}
    spent = 10 * 12.0 + 6 * 14.0 + 4 * 30.0 + 2 * 22.0
    assert cycles.predict(e, costs) == pytest.approx(60 * 10.0 / spent)


def test_cheap_rows_choose_the_big_tree_and_dear_rows_choose_ar():
    amx = cycles.choose(PROFILE, AMX)
    assert (amx.mode, amx.tree, amx.lookup) == ("orthrus", 32, 0)
    assert amx.predicted["tree 32"] > amx.predicted["chain"] > 1.1
    assert amx.why.startswith("tree 32: predicts") and "17 rows 1.05" in amx.why
    intel = cycles.choose(PROFILE, INTEL)  # chain: 100 x 1 / (40 x 3.0) = 0.83; tree: 100 / (25 x 5.17) = 0.77
    assert (intel.mode, intel.tree, intel.lookup) == ("ar", 0, 0)
    assert intel.predicted["chain"] == pytest.approx(100 / (40 * 3.0), abs=1e-3)
    assert intel.why.startswith("AR:") and "below the 1.15x" in intel.why


def test_a_cycle_must_clear_the_margin_not_just_ar():
    costs = {"rows": {"1": 1.0, "9": 1.1}, "draft": 1.0}  # the chain predicts 100 / (40 x 2.1) = 1.19
    assert cycles.choose({"candidates": PROFILE["candidates"][:1]}, costs).mode == "orthrus"
    assert cycles.choose({"candidates": PROFILE["candidates"][:1]}, costs, margin=1.2).mode == "ar"


# the same CPU's costs after 100 positions (rows nearly a step, AMX-like) and after 4,100 (each row reads the whole
# cache: 9 rows 2.0 steps, 33 rows 5.0)
LONG = {**AMX, "cache_len": 100, "long": {"cache_len": 4100, "rows": {"1": 2.0, "9": 4.0, "13": 5.0, "17": 6.0,
                                                                        "32": 10.0}, "draft": 3.0}}


def test_costs_after_a_long_context_are_linear_in_it_between_and_past_the_two_measured():
    assert cycles.at_context(LONG, None) is LONG and cycles.at_context(LONG, 100) is LONG
    assert cycles.at_context(LONG, 40) is LONG and cycles.at_context(AMX, 9000) is AMX  # shorter; none measured
    half = cycles.at_context(LONG, 2100)  # halfway
    assert half["rows"]["1"] == pytest.approx(1.5) and half["rows"]["9"] == pytest.approx((1.02 + 4.0) / 2)
    assert half["draft"] == pytest.approx((1.02 + 3.0) / 2) and half["context"] == 2100
    past = cycles.at_context(LONG, 8100)  # on along the same line
    assert past["rows"]["1"] == pytest.approx(3.0) and past["rows"]["32"] == pytest.approx(1.10 + 2 * (10.0 - 1.10))
    cheap = {**LONG, "long": {**LONG["long"], "draft": 0.5}}  # measured cheaper after the long prompt (noise)
    assert cycles.at_context(cheap, 60000)["draft"] == LONG["draft"]  # never below the short context's
    at_long = cycles.at_context(LONG, 4100)
    assert all(at_long["rows"][r] == pytest.approx(LONG["long"]["rows"][r]) for r in LONG["rows"])
    assert set(at_long["rows"]) == set(LONG["rows"])  # the short table's row counts, the long one's interpolated


def test_a_long_prompt_chooses_ar_where_its_rows_cost_too_much():
    short = cycles.choose(PROFILE, LONG, context=50)
    assert (short.mode, short.tree) == ("orthrus", 32) and short.why == cycles.choose(PROFILE, AMX).why
    far = cycles.choose(PROFILE, LONG, context=4100)  # chain: 100 x 2 / (40 x (3 + 4)) = 0.71
    assert far.mode == "ar" and far.predicted["chain"] == pytest.approx(100 * 2.0 / (40 * 7.0), abs=1e-3)
    assert "after 4,100 tokens" in far.why
    assert cycles.valid_costs({"version": cycles.COSTS_VERSION, **LONG})


def test_bookkeeping_outside_the_forwards_counts_per_cycle_and_per_ar_step():
    keep = {"ar": 0.5, "chain": 1.0, "tree 32": 3.0}
    assert cycles.bookkeeping_at({"bookkeeping": keep}, 0) == 1.0
    assert cycles.bookkeeping_at({"bookkeeping": keep}, 16) == pytest.approx(2.0)
    assert cycles.bookkeeping_at({}, 16) == 0.0  # costs measured without it
    costs = {"rows": {"1": 10.0, "9": 14.0}, "draft": 12.0, "bookkeeping": keep}
    e = entry(16, 0, 30, 10, {9: 10})
    assert cycles.predict(e, costs) == pytest.approx(30 * 10.5 / (10 * 12.0 + 10 * 14.0 + 10 * 2.0))


# ------------------------------------------------------------------------------------------- on a model
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny exact-kernel model with a head loaded from disk (a head of its own: the default is chosen)."""
    root = tmp_path_factory.mktemp("cycles")
    source = tiny_orthrus("llama", k=4, seed=0)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in source.head_parameters().values():
            p.add_(0.05 * torch.randn_like(p))
    head = source.save_head(root / "head")
    model = tiny_orthrus("llama", k=4, seed=0)
    model.load_head(head)
    model.set_attn("exact")
    return model


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cycles, "cycles_dir", lambda: tmp_path / "cycles")
    monkeypatch.delenv(cycles.CYCLE_ENV, raising=False)
    return tmp_path


PROMPTS = [[1, 5, 9, 3, 1, 5, 9], [7, 2, 2, 2, 2, 2]]


def test_a_profile_counts_every_forward_of_every_candidate(trained):
    candidates = [(0, 0), (4, 0), (4, 16)]
    profile = cycles.record_profile(trained, PROMPTS, 12, candidates)
    assert "draft" not in trained.__dict__ and "verify" not in trained.__dict__  # the counters are gone
    assert profile["head"] == trained.head_digest and profile["prompts"] == 2
    ar_tokens = 0
    for ids in PROMPTS:
        state = decode(trained, ids, "ar", DecodeConfig(max_new_tokens=12))
        ar_tokens += len(state.generated) - 1
    for (tree, lookup), e in zip(candidates, profile["candidates"]):
        assert (e["tree"], e["lookup"]) == (tree, lookup)
        cycles_run = sum(e["verifies"].values())
        # the first token comes from the prefill; every later one from a verify (accepted drafts + AR's token)
        assert e["tokens"] == ar_tokens  # exact kernels: every cycle commits AR's tokens
        assert cycles_run <= e["tokens"] and e["drafts"] <= cycles_run
        rows = sum(int(r) * n for r, n in e["verifies"].items())
        assert rows >= e["tokens"]  # every committed token is one verify row at least
    chain = profile["candidates"][0]
    # the chain drafts before every verify but a last one of one row (one token left: nothing to draft)
    assert chain["drafts"] == sum(n for r, n in chain["verifies"].items() if r != "1") > 0
    assert max(int(r) for r in chain["verifies"]) <= 4  # block size k = 4


def test_the_tokens_of_every_profiled_cycle_agree_or_the_profile_is_refused(trained, monkeypatch):
    from lossless.decoding import loop
    from lossless.errors import LosslessError

    real = loop.decode

    def parting(model, ids, mode, cfg, **kw):  # a candidate whose tokens part from the first candidate's
        state = real(model, ids, mode, cfg, **kw)
        if cfg.tree:
            state.tokens[-1] = (state.tokens[-1] + 1) % 64
        return state
    monkeypatch.setattr(loop, "decode", parting)
    with pytest.raises(LosslessError, match="tree 4 decoded other tokens than chain"):
        cycles.record_profile(trained, PROMPTS[:1], 6, [(0, 0), (4, 0)])


def _write_profile(model, cache, candidates):
    (cache / "cycles").mkdir(exist_ok=True)
    profile = {"version": cycles.PROFILE_VERSION, "head": model.head_digest, "candidates": candidates}
    (cache / "cycles" / f"profile-{model.head_digest}.json").write_text(json.dumps(profile))


def test_costs_are_measured_once_then_read_from_the_cache(trained, cache, monkeypatch):
    measured = []
    real = cycles.measure_costs

    def counting(model, rounds=12, cache_len=100):
        measured.append(rounds)
        return real(model, rounds=1, cache_len=16)
    monkeypatch.setattr(cycles, "measure_costs", counting)
    first = cycles.cached_costs(trained)
    assert measured == [12] and set(first["rows"]) == {str(r) for r in cycles.COST_ROWS}
    assert all(ms > 0 for ms in first["rows"].values()) and first["draft"] > 0
    assert set(first["bookkeeping"]) == {"ar", "chain", "tree 32", "ar sampled", "chain sampled", "tree 8 sampled"}
    assert min(first["bookkeeping"].values()) >= 0
    assert first["variant"] != "stock" and first["key"] == cycles.costs_key(trained)
    long = first["long"]  # after the longest prompt the tiny model's 256 positions leave room for
    assert long["cache_len"] == 256 - max(cycles.COST_ROWS) - trained.k - 2 and set(long["rows"]) == set(first["rows"])
    assert all(ms > 0 for ms in long["rows"].values()) and long["draft"] > 0 and first["cache_len"] == 16
    assert cycles.cached_costs(trained) == first and measured == [12]  # from the cache
    cycles.cached_costs(trained, remeasure=True)
    assert measured == [12, 12]
    cycles.costs_path(trained).write_text("{truncated")
    cycles.cached_costs(trained)  # an unreadable cache file is measured again, not an error
    assert measured == [12, 12, 12] and json.loads(cycles.costs_path(trained).read_text())["key"] == first["key"]


def test_the_costs_key_follows_the_threads_the_kernels_and_the_heads_block(trained):
    from lossless.decoding import kernels

    key = cycles.costs_key(trained)
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        assert cycles.costs_key(trained) != key
    finally:
        torch.set_num_threads(before)
    assert cycles.costs_key(trained) == key
    with kernels.use_isa("scalar"):  # every x86-64 CPU here runs it
        assert cycles.costs_key(trained) != key
    other = tiny_orthrus("llama", k=3, seed=0)  # the same backbone, a head of another block size
    other.set_attn("exact")
    assert cycles.costs_key(other) != key


def test_a_watch_inside_a_watch_counts_in_both_and_leaves_the_model_as_it_was(trained):
    with cycles._Watching(trained) as outer:
        with cycles._Watching(trained) as inner:
            decode(trained, PROMPTS[0], "orthrus", DecodeConfig(max_new_tokens=6))
        assert "verify" in trained.__dict__  # the outer watch's wrapper is back
        decode(trained, PROMPTS[0], "orthrus", DecodeConfig(max_new_tokens=6))
    assert not {"prefill", "step", "draft", "verify", "verify_tree"} & set(trained.__dict__)
    assert outer.drafts == 2 * inner.drafts > 0 and outer.verifies == {r: 2 * n for r, n in inner.verifies.items()}
    assert 0 < inner.seconds < outer.seconds


@pytest.mark.parametrize("profile_text, costs_text", [
    ('{"version": 1, "candidates": []}', None),  # no candidates
    ('[1, 2]', None),  # JSON, not an object
    ('{"version": 1, "candidates": [{"tree": 0, "lookup": 0, "tokens": 0, "drafts": 0, "verifies": {}}]}', None),
    (None, '{"version": 4, "rows": {"1": 10.0}, "draft": 12.0}'),  # one row count: nothing to interpolate
    (None, '["not", "costs"]'),
    (None, '{"version": 4, "rows": {"1": 10.0, "9": -1}, "draft": 12.0}'),
    (None, '{"version": 2, "rows": {"1": 10.0, "9": 12.0}, "draft": 12.0}'),  # the version before long contexts
    (None, '{"version": 3, "rows": {"1": 10.0, "9": 12.0}, "draft": 12.0}'),  # before sampled bookkeeping
    (None, '{"version": 4, "cache_len": null, "rows": {"1": 10.0, "9": 12.0}, "draft": 12.0}'),
    (None, '{"version": 4, "cache_len": 100, "rows": {"1": 10.0, "9": 12.0}, "draft": 12.0, '
           '"long": {"cache_len": 50, "rows": {"1": 20.0, "9": 40.0}, "draft": 30.0}}'),  # a "long" one shorter
])
def test_a_bad_profile_or_costs_file_falls_back_instead_of_failing(trained, cache, profile_text, costs_text):
    (cache / "cycles").mkdir(exist_ok=True)
    _write_profile(trained, cache, PROFILE["candidates"])
    if profile_text is not None:
        text = profile_text.replace('"version": 1,', f'"version": 1, "head": "{trained.head_digest}",')
        cycles.recorded_profile_path(trained).write_text(text)
        _costs_file(trained, cache, AMX)
    if costs_text is not None:
        path = cycles.costs_path(trained)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(costs_text.replace('"rows"', f'"key": "{cycles.costs_key(trained)}", "rows"', 1))
    choice = trained.default_choice()  # no traceback: a fixed default, or costs measured again
    assert choice.mode in ("ar", "orthrus")
    if profile_text is not None:
        assert (choice.tree, choice.lookup) == (DEFAULT_TREE, DEFAULT_LOOKUP) and "fixed default" in choice.why
    else:
        assert cycles.valid_costs(json.loads(cycles.costs_path(trained).read_text()))  # measured again
    assert trained.generate(PROMPTS[0], max_new_tokens=4).token_ids


def test_a_profile_recorded_later_in_the_process_is_used(trained, cache):
    first = trained.default_choice()
    assert not first.predicted  # no profile yet: the fixed default
    _write_profile(trained, cache, PROFILE["candidates"])
    _costs_file(trained, cache, AMX)
    assert trained.default_choice().tree == 32


def _costs_file(model, cache, costs):
    path = cycles.costs_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": cycles.COSTS_VERSION, "key": cycles.costs_key(model), **costs}))


@pytest.mark.parametrize("costs, want", [(AMX, ("orthrus", 32, 0)), (INTEL, ("ar", 0, 0))])
def test_generate_runs_the_choice_and_says_why(trained, cache, costs, want):
    _write_profile(trained, cache, PROFILE["candidates"])
    _costs_file(trained, cache, costs)
    out = trained.generate(PROMPTS[0], max_new_tokens=8)
    config = out.config
    assert (config["mode"], config["tree"], config["lookup"]) == want
    assert config["choice"]["mode"] == want[0] and config["choice"]["why"] == cycles.choose(PROFILE, costs).why
    if want[0] == "ar":
        assert out.stats["forwards"] == len(out.token_ids)  # the prefill's token, then one step per token
    ar = trained.generate(PROMPTS[0], mode="ar", max_new_tokens=8)
    assert out.token_ids == ar.token_ids and ar.config["choice"] is None  # exact: the same tokens either way


def test_generate_chooses_for_its_prompts_length(trained, cache):
    _write_profile(trained, cache, PROFILE["candidates"])
    _costs_file(trained, cache, {**LONG, "cache_len": 16, "long": {**LONG["long"], "cache_len": 116}})
    short = trained.generate(PROMPTS[0], max_new_tokens=6).config  # 7 tokens: as measured after 16
    assert (short["mode"], short["tree"]) == ("orthrus", 32)
    prompt = (PROMPTS[0] * 20)[:110]  # 110 tokens, most of the way to the long costs
    long = trained.generate(prompt, max_new_tokens=6)
    assert long.config["mode"] == "ar" and "after 110 tokens" in long.config["choice"]["why"]
    assert long.token_ids == trained.generate(prompt, mode="ar", max_new_tokens=6).token_ids


def test_explicit_cycles_and_untrained_heads_keep_the_fixed_defaults(trained, cache, monkeypatch):
    _write_profile(trained, cache, PROFILE["candidates"])
    _costs_file(trained, cache, INTEL)
    explicit = trained.generate(PROMPTS[0], max_new_tokens=6, tree=4)
    assert explicit.config["choice"] is None and (explicit.config["tree"], explicit.config["lookup"]) == (4, DEFAULT_LOOKUP)
    assert trained.generate(PROMPTS[0], max_new_tokens=6, k=3).config["choice"] is None
    assert trained.generate(PROMPTS[0], max_new_tokens=6, k=3, temperature=0.7).config["choice"] is None
    untrained = tiny_orthrus("llama", k=4, seed=0)
    assert untrained.generate(PROMPTS[0], max_new_tokens=6).config["choice"] is None
    monkeypatch.setenv(cycles.CYCLE_ENV, "fixed")
    fixed = trained.generate(PROMPTS[0], max_new_tokens=6).config
    assert (fixed["mode"], fixed["tree"], fixed["lookup"]) == ("orthrus", DEFAULT_TREE, DEFAULT_LOOKUP)
    assert "fixed" in fixed["choice"]["why"]


def test_a_head_without_a_profile_takes_the_fixed_default_and_says_how_to_record_one(trained, cache):
    choice = trained.default_choice()
    assert (choice.mode, choice.tree, choice.lookup) == ("orthrus", DEFAULT_TREE, DEFAULT_LOOKUP)
    assert "lossless costs --profile" in choice.why and not choice.predicted
    assert not cycles.costs_path(trained).exists()  # nothing measured without a profile to use it


def test_the_shipped_head_brings_the_profile_of_its_own_digest():
    from lossless.decoding.head import stored_head_digest
    from lossless.paths import HEADS_DIR

    profile = json.loads((HEADS_DIR / "smollm2-135m" / cycles.PROFILE_FILE).read_text())
    assert profile["version"] == cycles.PROFILE_VERSION
    assert profile["head"] == stored_head_digest(HEADS_DIR / "smollm2-135m")  # a new head needs a new profile
    assert [(e["tree"], e["lookup"]) for e in profile["candidates"]] == list(cycles.CANDIDATES)
    assert len({e["tokens"] for e in profile["candidates"]}) == 1  # recorded on exact kernels: the same tokens


def test_a_sampled_requests_tree_gives_way_to_ar_where_its_cycles_do_not_pay(trained, cache):
    """A sampled request with no cycle of its own runs the tree of SAMPLED_TREE nodes, and after FALLBACK_CYCLES
    cycles goes on as AR if it commits fewer tokens a cycle than its cycle costs in steps on this CPU (times the
    margin): with Intel's costs and dear sampling (a cycle 5 steps, more than its block) it gives way, with costs
    where a cycle costs a fifth of a step it never does. The same seed gives the same tokens."""
    from lossless.decoding.sampling import SamplingConfig

    _costs_file(trained, cache, {**INTEL, "bookkeeping": {"ar sampled": 0.5, "chain sampled": 0.1,
                                                          f"tree {cycles.SAMPLED_TREE} sampled": 5.0}})
    trained._sampling_costs = None
    config = trained.generate(PROMPTS[0], max_new_tokens=4, temperature=0.8).config
    choice = trained.sampling_choice()
    even = (1.5 + cycles.cost_at(INTEL, cycles.SAMPLED_TREE + 1) + 5.0) / (1.0 + 0.5)  # draft, verify, bookkeeping
    assert config["choice"] == choice.to_dict() and config["mode"] == "orthrus" and "giving way to AR" in choice.why
    assert config["tree"] == choice.tree == cycles.SAMPLED_TREE and config["lookup"] == 0
    assert choice.ar_below == pytest.approx(even * cycles.SAMPLING_MARGIN, abs=1e-3)

    def run(ar_below):
        cfg = DecodeConfig(max_new_tokens=40, eos_ids=(-1,), sampling=SamplingConfig(temperature=0.8, seed=3),
                           tree=cycles.SAMPLED_TREE, ar_below=ar_below)
        return decode(trained, PROMPTS[0], "orthrus", cfg)

    state = run(choice.ar_below)
    accepted, ar_from = state.stats.accepted, state.stats.ar_from
    assert len(accepted) == cycles.FALLBACK_CYCLES and ar_from == 1 + sum(accepted) + len(accepted)
    assert state.stats.steps == len(accepted) + len(state.generated) - ar_from  # then one AR step a token
    assert run(choice.ar_below).generated == state.generated
    _costs_file(trained, cache, {"rows": {"1": 10.0, "2": 1.0, "40": 1.0}, "draft": 1.0})  # a fifth of a step
    trained._sampling_costs = None
    cheap = run(trained.sampling_choice().ar_below)
    assert cheap.stats.ar_from is None and len(cheap.stats.accepted) == cheap.stats.steps


def test_giving_way_to_ar_keeps_exact_ar_tokens_when_greedy(trained):
    """The loop's switch itself: an orthrus decode told to give way at any tokens per cycle runs
    FALLBACK_CYCLES cycles, then AR steps, and in exact mode commits AR's tokens throughout."""
    cfg = DecodeConfig(max_new_tokens=30, eos_ids=(-1,), ar_below=1e9)
    state = decode(trained, PROMPTS[1], "orthrus", cfg)
    assert len(state.stats.accepted) == cycles.FALLBACK_CYCLES and state.stats.ar_from is not None
    assert state.generated == decode(trained, PROMPTS[1], "ar", DecodeConfig(max_new_tokens=30, eos_ids=(-1,))).generated
    assert decode(trained, PROMPTS[1], "orthrus", DecodeConfig(max_new_tokens=30, eos_ids=(-1,))).stats.ar_from is None
