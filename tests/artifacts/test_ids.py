"""Property tests of content ids: canonical JSON, stable under key order, distinct for distinct content."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from artifacts.ids import canonical_json, content_id

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=25,
)
OBJECTS = st.dictionaries(st.text(max_size=8), JSON, max_size=6)


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every dict's keys in a random insertion order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


class Inner(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    weight: float


class Outer(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tag: str
    count: int
    items: tuple[Inner, ...]
    extra: dict[str, int]


MODELS = st.builds(
    Outer,
    tag=st.text(max_size=10),
    count=st.integers(),
    items=st.lists(
        st.builds(Inner, name=st.text(max_size=5), weight=st.floats(allow_nan=False, allow_infinity=False)),
        max_size=3,
    ).map(tuple),
    extra=st.dictionaries(st.text(max_size=5), st.integers(), max_size=4),
)


@given(OBJECTS, st.randoms(use_true_random=False))
def test_id_is_stable_under_key_order(obj: dict[str, Any], rng: random.Random) -> None:
    shuffled = _shuffled(obj, rng)
    assert content_id(shuffled) == content_id(obj)
    assert canonical_json(shuffled) == canonical_json(obj)


@given(JSON, JSON)
def test_distinct_content_gets_distinct_ids(a: Any, b: Any) -> None:
    if canonical_json(a) == canonical_json(b):
        assert content_id(a) == content_id(b)
    else:
        assert content_id(a) != content_id(b)


@given(JSON)
def test_json_round_trip_keeps_the_id(value: Any) -> None:
    text = canonical_json(value)
    back = json.loads(text)
    assert canonical_json(back) == text
    assert content_id(back) == content_id(value)


@given(JSON)
def test_id_is_64_hex_chars(value: Any) -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", content_id(value))


@settings(max_examples=50)
@given(MODELS, st.randoms(use_true_random=False))
def test_model_and_its_dict_have_one_id(model: Outer, rng: random.Random) -> None:
    as_dict = model.model_dump(mode="json")
    assert content_id(model) == content_id(as_dict) == content_id(_shuffled(as_dict, rng))
    assert content_id(Outer.model_validate(json.loads(canonical_json(model)))) == content_id(model)


def test_tuples_are_lists_and_sets_are_sorted() -> None:
    assert content_id((1, 2)) == content_id([1, 2])
    assert content_id({"b", "a"}) == content_id(["a", "b"])
    assert content_id([1, 2]) != content_id([2, 1])


def test_types_are_not_conflated() -> None:
    assert len({content_id(v) for v in (1, 1.0, True, "1", [1], {"1": 1}, None)}) == 7


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {"x": [float("-inf")]}])
def test_non_finite_floats_are_rejected(bad: Any) -> None:
    with pytest.raises(ValueError):
        content_id(bad)


@pytest.mark.parametrize("bad", [{1: "a"}, {"x": object()}, b"bytes"])
def test_values_without_json_form_are_rejected(bad: Any) -> None:
    with pytest.raises(TypeError):
        content_id(bad)
