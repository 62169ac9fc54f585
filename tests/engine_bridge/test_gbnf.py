"""JSON Schema to GBNF: schemas that cannot be enforced are refused with where and why; every grammar we
build compiles in llama.cpp and every constrained reply (random-weight twin, several seeds) validates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from artifacts.engine_params import EngineParams
from engine_bridge.errors import GrammarError
from engine_bridge.gbnf import GrammarBuilder, literal, rule_name, schema_grammar
from engine_bridge.worker.serving import ServeEngine
from tests.engine_bridge.sinks import WHOLE_VOCABULARY, gen_args

jsonschema = pytest.importorskip("jsonschema")

PARAMS = EngineParams(n_ctx=512, n_seq_max=1, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1)
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"enum": ["x", 3]}},
     "required": ["c"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "maxItems": 3},
    {"anyOf": [{"type": "string", "maxLength": 4}, {"const": {"k": [1, 2]}}]},
    {"type": ["integer", "boolean"]},
    {"allOf": [{"type": "object", "properties": {"p": {"type": "boolean"}}, "required": ["p"]},
               {"$ref": "#/$defs/q"}], "$defs": {"q": {"type": "object", "properties": {"q": {"const": 1}}}}},
    {"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"},
                                                               "maxItems": 1}}, "required": ["kids"]}},
     "$ref": "#/$defs/t"},
    {"type": "object", "properties": {}, "additionalProperties": False},
    {"type": "array", "prefixItems": [{"const": "head"}, {"type": "boolean"}]},
    {"type": "string", "minLength": 2, "maxLength": 3, "description": "annotations are ignored"},
]


def test_literals_and_rule_names() -> None:
    assert literal('a"b\\c\n') == '"a\\"b\\\\c\\n"'
    assert rule_name("get_weather.v2") == "get-weather-v2" and rule_name("__") == "r"


@pytest.mark.parametrize(("schema", "where"), [
    ({"$ref": "#/$defs/missing"}, "resolve"),
    ({"$ref": "https://example.com/s.json"}, "local"),
    ({"type": "thing"}, "unknown type"),
    ({"enum": []}, "non-empty"),
    ({"allOf": [{"type": "string"}]}, "object schemas only"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems"),
    (["not", "a", "schema"], "must be an object"),
    ({"$ref": "#"}, "left-recursive"),
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"}, "left-recursive"),
])
def test_schemas_that_cannot_be_enforced_are_refused(schema: Any, where: str) -> None:
    with pytest.raises(GrammarError, match=where) as exc:
        schema_grammar(schema, "response_format.json_schema.schema")
    assert exc.value.code == "bad_grammar" and exc.value.where.startswith("response_format")


def test_one_builder_holds_several_schemas() -> None:
    g = GrammarBuilder()
    a = g.schema("tool-a", {"type": "object", "properties": {"x": {"type": "string"}}})
    b = g.schema("tool-b", {"type": "object", "properties": {"x": {"type": "integer"}}})
    assert a != b
    text = g.build(f"{a} | {b}").gbnf
    assert text.count("root ::=") == 1 and f"{a} ::=" in text and f"{b} ::=" in text


def test_every_constrained_reply_validates(tiny_moe: Path) -> None:
    replies: dict[int, list[str]] = {}

    class Sink:
        def event(self, key: int, event: dict[str, Any]) -> None:
            replies.setdefault(key, []).append(event.get("text", ""))

        def done(self, key: int, result: dict[str, Any]) -> None:
            replies.setdefault(key, []).append(result.get("text_tail", ""))
            finished[key] = result["finish_reason"]

        def fail(self, key: int, code: str, message: str) -> None:
            raise AssertionError(f"{code}: {message}")

    finished: dict[int, str] = {}
    engine = ServeEngine(tiny_moe, PARAMS, 0, Sink())
    prompt = engine.vocab.tokenize("Answer in JSON:")
    key = 0
    for schema in SCHEMAS:
        spec = schema_grammar(schema).model_dump()
        for seed in range(3):
            key += 1
            engine.submit(key, gen_args(f"r{key}", prompt, 200, temperature=1.0, seed=seed, grammar=spec,
                                         **WHOLE_VOCABULARY))
            while engine.has_work():
                engine.step()
            if finished[key] == "stop":
                jsonschema.validate(json.loads("".join(replies[key])), schema)
    engine.close()
    assert sum(r == "stop" for r in finished.values()) >= len(finished) * 2 // 3, finished
