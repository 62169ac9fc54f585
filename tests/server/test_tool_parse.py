"""Tool-call parsers on model-style text: whole, and streamed in pieces split anywhere (same result)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from server.tools.formats import FORMATS, Hermes, Llama3, detect_format
from server.tools.parse import CallParser, ParsedCall, Piece

QWEN_TWO_CALLS = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}'
                  '\n</tool_call>')
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def run(parser: CallParser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    out: list[Piece] = []
    for p in pieces:
        out += parser.feed(p)
    out += parser.finish()
    return "".join(p.text for p in out if p.kind == "content"), [p.call for p in out if p.call is not None]


def test_hermes_content_then_parallel_calls() -> None:
    content, calls = run(Hermes().parser(), [QWEN_TWO_CALLS])
    assert content == "Let me check both.\n"
    assert calls == [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                     ParsedCall("get_time", '{"zone": "utc"}')]


def test_hermes_streams_content_before_a_call_and_holds_a_partial_tag() -> None:
    p = Hermes().parser()
    assert p.feed("Hello <tool") == [Piece("content", "Hello ")]
    assert p.feed("_ca") == []
    assert p.feed("lx> and more") == [Piece("content", "<tool_calx> and more")]
    assert p.finish() == []


def test_hermes_arguments_as_a_json_string_and_an_unclosed_final_call() -> None:
    body = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n'
    content, calls = run(Hermes().parser(), [body])
    assert calls == [ParsedCall("f", '{"a": 1}')] and content == ""


def test_hermes_broken_call_is_content_as_written() -> None:
    text = "<tool_call>\n{not json}\n</tool_call> tail"
    content, calls = run(Hermes().parser(), [text])
    assert calls == [] and content == text


def test_llama3_whole_reply_call_and_plain_text() -> None:
    assert run(Llama3().parser(), ["  ", LLAMA_CALL]) == ("", [ParsedCall("get_weather", '{"city": "Paris"}')])
    assert run(Llama3().parser(), ["<|python_tag|>", LLAMA_CALL])[1][0].name == "get_weather"
    assert run(Llama3().parser(), ["The answer", " is 4."]) == ("The answer is 4.", [])
    assert run(Llama3().parser(), ['{"not": "a call"}']) == ('{"not": "a call"}', [])


@given(cuts=st.lists(st.integers(0, len(QWEN_TWO_CALLS)), max_size=12), fmt=st.sampled_from(["hermes", "llama3"]))
@settings(max_examples=150, deadline=None)
def test_split_anywhere_gives_the_same_result(cuts: list[int], fmt: str) -> None:
    text = QWEN_TWO_CALLS if fmt == "hermes" else LLAMA_CALL
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert run(FORMATS[fmt]().parser(), pieces) == run(FORMATS[fmt]().parser(), [text])


def test_formats_are_detected_from_the_template(tiny_moe_template: str, llama3_template: str) -> None:
    assert detect_format(tiny_moe_template).name == "hermes"
    assert detect_format(llama3_template).name == "llama3"
    assert detect_format("{{ messages }}").name == "hermes", "no known syntax: Hermes"
    assert detect_format("<tool_call>\n<function=f>\n<parameter=x>").name == "hermes"  # Qwen3-Coder XML: not Hermes
    # but the XML form is not taken for Hermes' JSON either
    assert not Hermes.detect("<tool_call>\n<function=f>\n<parameter=x>")


def test_call_text_round_trips_through_the_parser() -> None:
    for fmt in (Hermes(), Llama3()):
        text = fmt.call_text("f", json.dumps({"x": [1, "é"]}, ensure_ascii=False))
        assert run(fmt.parser(), [text])[1] == [ParsedCall("f", '{"x": [1, "é"]}')]


# -- replies a grammar makes all calls: streamed as written ---------------------------------------------
NAMES = ["get_weather", "get_time", "get"]
FORCED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"{[", "n": [1, {"x": null}]}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>')


def forced(parser: CallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) with each call's arguments joined from its pieces."""
    out: list[Piece] = []
    for p in pieces:
        out += parser.feed(p)
    out += parser.finish()
    calls: list[tuple[str, str]] = []
    for p in out:
        if p.kind == "call_open" and p.call is not None:
            calls.append((p.call.name, ""))
        elif p.kind == "call_args":
            calls[-1] = (calls[-1][0], calls[-1][1] + p.text)
    return "".join(p.text for p in out if p.kind == "content"), calls


WHOLE = [("get_weather", '{"city": "Pa}ris \\"{[", "n": [1, {"x": null}]}'), ("get", "{}")]


@given(cuts=st.lists(st.integers(0, len(FORCED)), max_size=12))
@settings(max_examples=150, deadline=None)
def test_forced_calls_split_anywhere_give_the_calls_and_no_markup(cuts: list[int]) -> None:
    bounds = sorted({0, len(FORCED), *cuts})
    pieces = [FORCED[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert forced(Hermes().forced_parser(NAMES), pieces) == ("", WHOLE)


def test_a_forced_call_opens_as_soon_as_its_name_is_known_and_a_cut_one_stays() -> None:
    p = Hermes().forced_parser(NAMES)
    assert p.feed('<tool_call>\n{"name": "get') == []  # get, get_time or get_weather
    assert p.feed("_w") == [Piece("call_open", call=ParsedCall("get_weather", ""))]
    assert p.feed('eather", "arguments": {"ci') == [Piece("call_args", '{"ci')]
    assert p.finish() == []
    one = Llama3().forced_parser(["get_time"])
    assert one.feed('{"name": ') == [Piece("call_open", call=ParsedCall("get_time", ""))], "a named function"
    for cut in range(1, len(FORCED)):  # cut anywhere: every call begun is there, arguments as far as they got
        content, calls = forced(Hermes().forced_parser(NAMES), [FORCED[:cut]])
        assert content == "" and all(WHOLE[i][1].startswith(args) for i, (_, args) in enumerate(calls))
    assert forced(Hermes().forced_parser(["f"]), ["<tool_"]) == ("", [("f", "")])
    assert forced(Hermes().forced_parser(NAMES), ['<tool_call>\n{"name": "ge']) == ("", []), "no name yet"


def test_a_reply_that_leaves_the_grammar_is_content_from_there() -> None:
    assert forced(Hermes().forced_parser(NAMES), ["Sure: ", "<tool_call>"]) == ("Sure: <tool_call>", [])
    assert forced(Llama3().forced_parser(["f"]), ['{"name": "f", "parameters": 7}']) == ("", [("f", "7")])
