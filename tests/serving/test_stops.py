"""Stop strings over a stream: what is released never holds a stop string, and the answer does not depend on
how the text was chunked."""

from hypothesis import given, settings, strategies as st

from lossless.text import StopCutter, cut_at_stops

ALPHABET = "ab\n "


def _released(text: str, cuts: list[int], stops: list[str]) -> tuple[str, bool]:
    cutter = StopCutter(stops)
    pieces, last = [], 0
    for at in sorted(set(c % (len(text) + 1) for c in cuts)) + [len(text)]:
        pieces.append(cutter.push(text[last:at]))
        last = at
        assert stops == [] or not any(s in "".join(pieces) for s in stops)
    pieces.append(cutter.flush())
    assert "".join(pieces) == cutter.text
    return cutter.text, cutter.stopped


@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=12),
       stop=st.text(ALPHABET, min_size=1, max_size=4))
def test_one_stop_string_cuts_where_the_whole_text_is_cut_whatever_the_chunks(text, cuts, stop):
    released, stopped = _released(text, cuts, [stop])
    assert released == cut_at_stops(text, [stop])
    assert stopped == (stop in text)


@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=12),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3))
def test_released_text_is_a_prefix_without_any_stop_string(text, cuts, stops):
    released, stopped = _released(text, cuts, stops)
    assert text.startswith(released)
    assert not any(s in released for s in stops)
    if not stopped:
        assert released == text


def test_no_stop_strings_release_everything_at_once():
    cutter = StopCutter([])
    assert cutter.push("abc") == "abc" and cutter.push("d") == "d" and cutter.flush() == ""
