"""Stop sequences across token boundaries: the emitted text is the text cut right before the stop that
completes first, however the text is split."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from server.stops import StopMatcher

ALPHABET = "ab\n<>|"


def _expected(text: str, stops: list[str]) -> tuple[str, bool]:
    """Grow the text a character at a time; the first stop found ends it (the longest of those ending there)."""
    for end in range(1, len(text) + 1):
        done = [end - len(s) for s in stops if text[:end].endswith(s)]
        if done:
            return text[: min(done)], True
    return text, False


@given(pieces=st.lists(st.text(ALPHABET, max_size=4), max_size=20),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4))
@settings(max_examples=150, deadline=None, database=None)
def test_any_split_gives_the_text_before_the_first_completed_stop(pieces: list[str], stops: list[str]) -> None:
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    want, stopped = _expected("".join(pieces), stops)
    assert out == want
    assert m.stopped == stopped


def test_partial_stop_is_held_back_then_released() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("hello </e") == "hello "
    assert m.feed("xtra") == "</extra"
    assert m.feed(" </en") == " "
    assert m.feed("d> tail") == ""
    assert m.stopped
    assert m.feed("more") == "" and m.flush() == ""


def test_no_stops_pass_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == "" and not m.stopped


def test_overlapping_stops_end_where_the_first_completes() -> None:
    for pieces in (["a|<"], ["a", "|", "<"], ["a|", "<"]):
        m = StopMatcher(["|", "a|<"])
        assert "".join(m.feed(p) for p in pieces) + m.flush() == "a", pieces
