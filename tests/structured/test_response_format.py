"""response_format / guided_* -> GrammarSpec: every accepted form, the canonical schema text, and
each bad input's error."""
import json

import pytest

from eagle_fx.structured.response_format import GrammarSpec, canonical_schema, grammar_spec

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}}, "required": ["b"]}
CANONICAL = json.dumps(SCHEMA, separators=(",", ":"))


def test_openai_json_schema():
    spec = grammar_spec({"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    assert spec == GrammarSpec("json_schema", CANONICAL)
    assert json.loads(spec.source) == SCHEMA


def test_openai_json_object_and_text():
    assert grammar_spec({"type": "json_object"}) == GrammarSpec("json_object", "")
    assert grammar_spec({"type": "text"}) is None
    assert grammar_spec() is None
    assert grammar_spec(None, guided_json=None) is None


def test_a_schema_dict_is_its_own_response_format():
    assert grammar_spec(SCHEMA) == GrammarSpec("json_schema", CANONICAL)


def test_guided_json_as_dict_or_text_gives_one_key():
    text_with_other_spacing = json.dumps(SCHEMA, indent=4)
    assert grammar_spec(guided_json=SCHEMA) == grammar_spec(guided_json=text_with_other_spacing) == grammar_spec(SCHEMA)
    assert hash(grammar_spec(guided_json=SCHEMA)) == hash(grammar_spec(guided_json=text_with_other_spacing))


def test_the_schema_keeps_the_declared_property_order():
    """xgrammar emits properties in the schema's order, so a reordered schema is another grammar
    (tests/structured/test_grammar.py shows the compiled difference): not sorted into one key."""
    reordered = {**SCHEMA, "properties": {"a": SCHEMA["properties"]["a"], "b": SCHEMA["properties"]["b"]}}
    assert reordered == SCHEMA  # python's dict equality ignores order ...
    assert grammar_spec(reordered) != grammar_spec(SCHEMA)  # ... the grammar does not
    assert canonical_schema(reordered).index('"a"') < canonical_schema(reordered).index('"b"')


def test_guided_regex_and_grammar():
    assert grammar_spec(guided_regex=r"\d{3}") == GrammarSpec("regex", r"\d{3}")
    assert grammar_spec(guided_grammar='root ::= "yes" | "no"') == GrammarSpec("ebnf", 'root ::= "yes" | "no"')


def test_a_grammar_spec_passes_through():
    spec = GrammarSpec("regex", "a+")
    assert grammar_spec(spec) is spec


@pytest.mark.parametrize("kwargs, names", [
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "response_format and guided_regex"),
    (dict(guided_json=SCHEMA, guided_grammar='root ::= "a"'), "guided_json and guided_grammar"),
    (dict(guided_regex="a", guided_grammar='root ::= "a"', guided_json="{}"), "guided_json and guided_regex and "
                                                                              "guided_grammar"),
])
def test_more_than_one_is_an_error(kwargs, names):
    with pytest.raises(ValueError, match=f"give one of .*, not {names}$"):
        grammar_spec(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(response_format="json"), "response_format must be a dict"),
    (dict(response_format={"type": "json_schema"}), "needs 'json_schema'"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "needs 'json_schema'"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}),
     "response_format.json_schema.schema: a JSON schema must be an object"),
    (dict(response_format={"type": "structural_tag"}), "'structural_tag' is not supported"),
    (dict(guided_json="{not json"), "guided_json: not valid JSON"),
    (dict(guided_json="[1, 2]"), "guided_json: a JSON schema must be an object"),
    (dict(guided_json={"const": float("nan")}), "guided_json: the schema does not serialise to JSON"),
    (dict(guided_json={"default": object()}), "guided_json: the schema does not serialise to JSON"),
    (dict(guided_regex=""), "guided_regex must be a non-empty str"),
    (dict(guided_regex=3), "guided_regex must be a non-empty str"),
    (dict(guided_grammar=b"root ::= x"), "guided_grammar must be a non-empty str"),
])
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        grammar_spec(**kwargs)


@pytest.mark.parametrize("kind, source, error", [
    ("yaml", "a: 1", ValueError), ("regex", b"a", TypeError), ("json_object", "{}", ValueError),
    ("regex", "", ValueError),
])
def test_bad_grammar_spec(kind, source, error):
    with pytest.raises(error):
        GrammarSpec(kind, source)
