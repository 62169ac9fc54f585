"""Grammars for constrained decoding: JSON Schema to llama.cpp's GBNF, and the grammar the worker is sent.

Pure Python (no llama_cpp import), so the server builds a request's grammar and only the worker compiles
it (``llama_sampler_init_grammar``). The rules follow llama.cpp's ``json-schema-to-grammar``: the same
primitives (strings of JSON characters, 16-digit numbers) and the same bounded whitespace between tokens,
so a constrained reply is always valid JSON that a JSON parser accepts.

Enforced: ``type`` (one or a list), ``properties`` / ``required`` (declaration order, optional ones may be
left out; other keys are not generated, as llama.cpp does), ``additionalProperties`` of objects without
``properties``, ``items`` / ``prefixItems`` /
``minItems`` / ``maxItems``, ``enum``, ``const``, ``anyOf`` / ``oneOf``, ``allOf`` of objects, local
``$ref`` (``#/$defs/...``, ``#/definitions/...``, recursion included), ``minLength`` / ``maxLength``, and
``minimum >= 0`` on integers. Not enforced (the value is still valid JSON of the right type): numeric
ranges otherwise, ``pattern`` and ``format``. Annotations (``description``, ``title``, ``default``, ...)
are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from engine_bridge.errors import GrammarError
from engine_bridge.grammar_spec import GrammarSpec, Trigger

SPACE = '| " " | "\\n"{1,2} [ \\t]{0,20}'  # llama.cpp's bounded whitespace between tokens
PRIMITIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "boolean": ('("true" | "false")', ()),
    "decimal-part": ("[0-9]{1,16}", ()),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", ()),
    "number": ('("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
               ("integral-part", "decimal-part")),
    "integer": ('("-"? integral-part)', ("integral-part",)),
    "natural": ("integral-part", ("integral-part",)),
    "value": ("object | array | string | number | boolean | null",
              ("object", "array", "string", "number", "boolean", "null")),
    "object": ('"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"',
               ("string", "value")),
    "array": ('"[" space ( value ("," space value)* )? space "]"', ("value",)),
    "char": ('[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})', ()),
    "string": ('"\\"" char* "\\""', ("char",)),
    "null": ('"null"', ()),
}
_TYPE_RULES = {"boolean": "boolean", "number": "number", "integer": "integer", "string": "string",
               "null": "null", "array": "array", "object": "object"}
_RULE_NAME = re.compile(r"[^a-zA-Z0-9]+")
_LITERAL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
MAX_SCHEMA_DEPTH = 64
MAX_REPEAT = 4096


def literal(text: str) -> str:
    """A GBNF string literal matching ``text`` exactly."""
    return '"' + "".join(_LITERAL_ESCAPES.get(c, c) for c in text) + '"'


def rule_name(text: str) -> str:
    """A valid GBNF rule name made from ``text`` (letters, digits and dashes)."""
    return _RULE_NAME.sub("-", text).strip("-") or "r"


class GrammarBuilder:
    """Collects GBNF rules: JSON schemas by name, plus hand-written rules around them."""

    def __init__(self) -> None:
        """An empty grammar with llama.cpp's whitespace rule."""
        self._rules: dict[str, str] = {"space": SPACE}
        self._root_schema: Any = None
        self._refs: dict[str, str] = {}
        self._open: dict[str, bool] = {}  # $refs being expanded -> whether a '{' or '[' came since
        self._where = ""

    def rule(self, name: str, body: str) -> str:
        """Add ``name ::= body`` (a different body under a taken name gets a numbered name); returns the name."""
        name = rule_name(name)
        key, i = name, 0
        while key in self._rules and self._rules[key] != body:
            i += 1
            key = f"{name}{i}"
        self._rules[key] = body
        return key

    def _primitive(self, name: str) -> str:
        if name not in self._rules:  # set first: value, object and array refer to each other
            body, deps = PRIMITIVES[name]
            self._rules[name] = body
            for dep in deps:
                self._primitive(dep)
        return name

    def schema(self, name: str, schema: Any, where: str = "schema") -> str:
        """Add the rules for JSON ``schema`` under ``name``; returns the rule to reference.

        Raises:
            GrammarError: the schema is not an object/boolean schema, or uses a construct that cannot be
                enforced (an unresolvable ``$ref``, an ``allOf`` of non-objects, a negative repeat count).
        """
        self._root_schema, self._refs, self._where, self._open = schema, {}, where, {}
        return self._visit(schema, rule_name(name), where, 0)

    def build(self, root_body: str, trigger: Trigger | None = None) -> GrammarSpec:
        """The whole grammar with ``root ::= root_body`` (what follows the trigger word, if any)."""
        rules = {**self._rules, "root": root_body}
        text = "\n".join(f"{k} ::= {v}" for k, v in rules.items())
        return GrammarSpec(gbnf=text + "\n", root="root", trigger=trigger)

    # -- schema visitors ------------------------------------------------------------------------------
    def _visit(self, schema: Any, name: str, where: str, depth: int) -> str:
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(where, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if schema is True or schema == {}:
            return self._primitive("value")
        if not isinstance(schema, Mapping):
            raise GrammarError(where, f"a schema must be an object or a boolean, got {type(schema).__name__}")
        if "$ref" in schema:
            return self._ref(str(schema["$ref"]), where, depth)
        if "const" in schema:
            return self.rule(name, self._json_literal(schema["const"], where))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise GrammarError(f"{where}.enum", "enum must be a non-empty list")
            return self.rule(name, " | ".join(self._json_literal(v, where) for v in values))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._alternatives(schema[key], name, f"{where}.{key}", depth)
        if "allOf" in schema:
            return self._visit(self._merge_all_of(schema, where), name, where, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._alternatives([{**schema, "type": t} for t in kind], name, f"{where}.type", depth)
        return self._typed(schema, kind, name, where, depth)

    def _typed(self, schema: Mapping[str, Any], kind: Any, name: str, where: str, depth: int) -> str:
        if kind is None:
            if "properties" in schema or "additionalProperties" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                return self._primitive("value")
        if kind not in _TYPE_RULES:
            raise GrammarError(f"{where}.type", f"unknown type {kind!r}")
        if kind == "object":
            return self._object(schema, name, where, depth)
        if kind == "array":
            return self._array(schema, name, where, depth)
        if kind == "string" and ("minLength" in schema or "maxLength" in schema):
            lo, hi = self._bounds(schema, "minLength", "maxLength", where)
            return self.rule(name, f'"\\"" {self._repeat(self._primitive("char"), lo, hi)} "\\""')
        if kind == "integer" and _number(schema.get("minimum", schema.get("exclusiveMinimum"))) >= 0:
            return self._primitive("natural")
        return self._primitive(_TYPE_RULES[kind])

    def _alternatives(self, options: Any, name: str, where: str, depth: int) -> str:
        if not isinstance(options, list) or not options:
            raise GrammarError(where, "must be a non-empty list of schemas")
        alts = [self._visit(s, f"{name}-{i}", f"{where}[{i}]", depth + 1) for i, s in enumerate(options)]
        return self.rule(name, " | ".join(alts))

    def _ref(self, ref: str, where: str, depth: int) -> str:
        if self._open.get(ref) is False:
            raise GrammarError(where, f"$ref {ref!r} refers to itself with no object or array in between (a "
                                      "left-recursive grammar)")
        if ref in self._refs:
            return self._refs[ref]
        if ref == "#":
            target = self._root_schema
        elif ref.startswith("#/"):
            target = self._root_schema
            for part in ref[2:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, Mapping) or part not in target:
                    raise GrammarError(where, f"$ref {ref!r} does not resolve inside the schema")
                target = target[part]
        else:
            raise GrammarError(where, f"$ref {ref!r}: only local references (#/...) are supported")
        name = rule_name("ref-" + ref[2:]) if ref != "#" else "ref-root"
        name = self.rule(name, '"null"')  # reserve the name first: a recursive schema refers to itself
        self._refs[ref] = name
        self._open[ref] = False
        try:
            self._rules[name] = self._visit(target, name + "-def", where, depth + 1)
        finally:
            del self._open[ref]
        return name

    def _consuming(self) -> dict[str, bool]:
        """Mark every $ref being expanded as past a '{' or '['; returns the marks to restore afterwards."""
        saved = dict(self._open)
        self._open.update(dict.fromkeys(self._open, True))
        return saved

    def _merge_all_of(self, schema: Mapping[str, Any], where: str) -> dict[str, Any]:
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise GrammarError(f"{where}.allOf", "must be a non-empty list of schemas")
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        props: dict[str, Any] = dict(merged.get("properties") or {})
        required: list[str] = list(merged.get("required") or [])
        for i, part in enumerate(parts):
            if isinstance(part, Mapping) and "$ref" in part:
                part = self._resolve(str(part["$ref"]), f"{where}.allOf[{i}]")
            if not isinstance(part, Mapping) or part.get("type", "object") != "object":
                raise GrammarError(f"{where}.allOf[{i}]", "allOf is supported for object schemas only")
            props.update(part.get("properties") or {})
            required += [r for r in part.get("required") or [] if r not in required]
        return {**merged, "type": "object", "properties": props, "required": required}

    def _resolve(self, ref: str, where: str) -> Any:
        target = self._root_schema
        for part in ref.removeprefix("#/").split("/") if ref != "#" else []:
            if not isinstance(target, Mapping) or part not in target:
                raise GrammarError(where, f"$ref {ref!r} does not resolve inside the schema")
            target = target[part]
        return target

    def _object(self, schema: Mapping[str, Any], name: str, where: str, depth: int) -> str:
        saved = self._consuming()
        try:
            return self._object_rule(schema, name, where, depth)
        finally:
            self._open.update(saved)

    def _object_rule(self, schema: Mapping[str, Any], name: str, where: str, depth: int) -> str:
        props = schema.get("properties") or {}
        if not isinstance(props, Mapping):
            raise GrammarError(f"{where}.properties", "properties must be an object")
        required = schema.get("required") or []
        if not isinstance(required, list):
            raise GrammarError(f"{where}.required", "required must be a list of property names")
        extra = schema.get("additionalProperties")
        if not props:
            if extra is False:
                return self.rule(name, '"{" space "}"')
            value = self._primitive("value") if extra in (None, True) else \
                self._visit(extra, f"{name}-additional", f"{where}.additionalProperties", depth + 1)
            string = self._primitive("string")
            kv = f'{string} ":" space {value}'
            return self.rule(name, f'"{{" space ( {kv} ("," space {kv})* )? space "}}"')
        items = []
        for key, sub in props.items():
            value = self._visit(sub, f"{name}-{key}", f"{where}.properties.{key}", depth + 1)
            items.append((self.rule(f"{name}-{key}-kv", f'{literal(json.dumps(key))} space ":" space {value}'),
                          key in required))
        return self.rule(name, self._object_body(name, items))

    def _object_body(self, name: str, items: list[tuple[str, bool]]) -> str:
        """``{ ... }`` with the items in order, optional ones skippable, commas only between present ones."""
        n = len(items)
        # rest-i: items i.. after something was emitted (each present one is preceded by a comma)
        rest = [""] * (n + 1)
        for i in range(n - 1, 0, -1):
            kv, req = items[i]
            tail = f" {rest[i + 1]}" if rest[i + 1] else ""
            item = f'"," space {kv}'
            body = f"{item}{tail}" if req else f"({item})?{tail}"
            rest[i] = self.rule(f"{name}-rest-{i}", body)
        # first-i: items i.. with nothing emitted yet (never empty when a required item remains)
        first = [""] * (n + 1)
        for i in range(n - 1, -1, -1):
            kv, req = items[i]
            tail = f" {rest[i + 1]}" if rest[i + 1] else ""
            body = f"{kv}{tail}"
            if not req and first[i + 1]:
                body = f"{body} | {first[i + 1]}"
            first[i] = self.rule(f"{name}-first-{i}", body)
        any_required = any(req for _, req in items)
        inner = first[0] if any_required else f"({first[0]})?"
        return f'"{{" space {inner} space "}}"'

    def _array(self, schema: Mapping[str, Any], name: str, where: str, depth: int) -> str:
        saved = self._consuming()
        try:
            return self._array_rule(schema, name, where, depth)
        finally:
            self._open.update(saved)

    def _array_rule(self, schema: Mapping[str, Any], name: str, where: str, depth: int) -> str:
        prefix = schema.get("prefixItems")
        if isinstance(prefix, list) and prefix:
            parts = [self._visit(s, f"{name}-{i}", f"{where}.prefixItems[{i}]", depth + 1)
                     for i, s in enumerate(prefix)]
            return self.rule(name, '"[" space ' + ' "," space '.join(parts) + ' space "]"')
        items = schema.get("items", True)
        item = self._visit(items, f"{name}-item", f"{where}.items", depth + 1)
        lo, hi = self._bounds(schema, "minItems", "maxItems", where)
        if hi == 0:
            return self.rule(name, '"[" space "]"')
        seq = item
        if hi != 1:
            comma_item = f'"," space {item}'
            seq += " " + self._repeat(comma_item, max(lo - 1, 0), None if hi is None else hi - 1)
        return self.rule(name, f'"[" space {seq if lo > 0 else f"({seq})?"} space "]"')

    @staticmethod
    def _bounds(schema: Mapping[str, Any], lo_key: str, hi_key: str, where: str) -> tuple[int, int | None]:
        lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
        if not _count(lo) or (hi is not None and (not _count(hi) or hi < lo)):
            raise GrammarError(where, f"{lo_key}/{hi_key} must be counts with {lo_key} <= {hi_key}")
        return min(lo, MAX_REPEAT), None if hi is None or hi > MAX_REPEAT else hi

    @staticmethod
    def _repeat(item: str, lo: int, hi: int | None) -> str:
        if hi is None:
            return f"({item}){{{lo},}}" if lo else f"({item})*"
        return f"({item}){{{lo},{hi}}}"

    @staticmethod
    def _json_literal(value: Any, where: str) -> str:
        try:
            return literal(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
        except (TypeError, ValueError) as exc:
            raise GrammarError(where, f"not a JSON value: {exc}") from exc


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> float:
    """A schema bound as a number; -inf when absent or not a number."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else float("-inf")


def schema_grammar(schema: Any, where: str = "schema") -> GrammarSpec:
    """A grammar whose replies are JSON values valid for ``schema`` (surrounding whitespace allowed).

    Raises:
        GrammarError: see :meth:`GrammarBuilder.schema`.
    """
    g = GrammarBuilder()
    value = g.schema("schema", schema, where)
    return g.build(f"space {value} space")
