"""What a user asks the output to follow, normalised into one `GrammarSpec` (or None: free text).

The forms accepted (exactly one per request):

- OpenAI `response_format`: `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`,
  `{"type": "json_object"}` (any JSON object), `{"type": "text"}` (no grammar: None);
- the python convenience: `response_format=` a JSON schema dict itself (`{"type": "object", ...}`);
- vLLM's fields: `guided_json` (a schema dict or its JSON text), `guided_regex` (a regex),
  `guided_grammar` (an EBNF grammar in xgrammar's GBNF dialect, llama.cpp's, with a `root` rule).

A schema is kept as compact JSON text with its keys in the order the user wrote them, not sorted:
xgrammar emits an object's properties in the schema's declared order, so `{"a", "b"}` and
`{"b", "a"}` are different grammars and must be different cache keys. The same dict, or its JSON
text with other whitespace, gives the same key. Nothing here needs xgrammar (the server parses
requests without it); compiling, and the errors only a compiler can find, are in grammar.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "ebnf")
OPENAI_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar the output must follow; hashable, the compile cache's key.

    kind: "json_schema" (source: the schema as compact JSON text), "json_object" (any JSON object;
    source ""), "regex" (source: the pattern, matched in full) or "ebnf" (source: the grammar text).
    """

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"GrammarSpec kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise TypeError(f"GrammarSpec source must be a str, got {type(self.source).__name__}")
        if self.kind == "json_object" and self.source:
            raise ValueError("a json_object GrammarSpec has no source (it means any JSON object); for a schema use "
                             "kind='json_schema'")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"a {self.kind} GrammarSpec needs a non-empty source")


def canonical_schema(schema: Any, field: str = "schema") -> str:
    """The schema as compact JSON text (a dict, or JSON text of one), keys in the user's order.

    `field` names where the schema came from, for the error message."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: not valid JSON ({e}); pass a JSON schema object or its JSON text") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON schema must be an object (a dict), got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}: the schema does not serialise to JSON ({e})") from None


def _from_response_format(response_format: Any) -> GrammarSpec | None:
    if isinstance(response_format, GrammarSpec):
        return response_format
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be a dict: OpenAI's {'type': 'json_schema' | 'json_object' | 'text', "
                         f"...}} or a JSON schema; got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "structural_tag":
        raise ValueError("response_format type 'structural_tag' is not supported; use 'json_schema', 'json_object', "
                         "'text', guided_regex or guided_grammar")
    if kind not in OPENAI_TYPES:
        # not OpenAI's wrapper: the dict is the schema itself (no JSON schema has one of those types)
        return GrammarSpec("json_schema", canonical_schema(response_format, "response_format"))
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    wrapper = response_format.get("json_schema")
    if not isinstance(wrapper, dict) or "schema" not in wrapper:
        raise ValueError("response_format type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}; "
                         f"got json_schema={wrapper!r}")
    return GrammarSpec("json_schema", canonical_schema(wrapper["schema"], "response_format.json_schema.schema"))


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty str, got {value!r}")
    return value


def grammar_spec(response_format: Any = None, *, guided_json: Any = None, guided_regex: str | None = None,
                 guided_grammar: str | None = None) -> GrammarSpec | None:
    """The one GrammarSpec a request asks for, or None for free text.

    At most one of the four may be given (None means not given); two or more is a ValueError naming
    them. A GrammarSpec passed as response_format is returned as is.
    """
    given = {name: value for name, value in (("response_format", response_format), ("guided_json", guided_json),
                                             ("guided_regex", guided_regex), ("guided_grammar", guided_grammar))
             if value is not None}
    if len(given) > 1:
        raise ValueError(f"give one of response_format, guided_json, guided_regex, guided_grammar, not "
                         f"{' and '.join(given)}")
    if not given:
        return None
    (name, value), = given.items()
    if name == "response_format":
        return _from_response_format(value)
    if name == "guided_json":
        return GrammarSpec("json_schema", canonical_schema(value, "guided_json"))
    if name == "guided_regex":
        return GrammarSpec("regex", _text(value, "guided_regex"))
    return GrammarSpec("ebnf", _text(value, "guided_grammar"))
