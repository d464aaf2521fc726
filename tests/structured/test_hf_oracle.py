"""The HF oracle under a JSON schema (nested object, array, enum, integer, number, boolean) on the
bundled base: its output parses with json.loads and validates, and GrammarState follows it token
for token (every token allowed by its masks, the stop token ending the grammar)."""
import functools
import json

import pytest
import torch

pytest.importorskip("xgrammar", reason="structured output is the optional 'structured' extra")

from eagle_fx.bundled import BUNDLED  # noqa: E402
from eagle_fx.structured.matcher import GrammarState  # noqa: E402
from eagle_fx.structured.response_format import grammar_spec  # noqa: E402

from .conftest import EOS, bundled_compiler, bundled_tokenizer  # noqa: E402
from .hf_oracle import hf_grammar_greedy  # noqa: E402
from .schema_check import schema_errors  # noqa: E402

PET = {"type": "object", "additionalProperties": False,
       "properties": {"name": {"type": "string", "maxLength": 12},
                      "kind": {"enum": ["cat", "dog", "bird"]},
                      "age": {"type": "integer", "minimum": 0, "maximum": 30},
                      "weight": {"type": "number"},
                      "owner": {"type": "object", "additionalProperties": False,
                                "properties": {"city": {"type": "string", "maxLength": 10},
                                               "verified": {"type": "boolean"}},
                                "required": ["city", "verified"]},
                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
       "required": ["name", "kind", "age", "weight", "owner", "tags"]}


@functools.lru_cache(maxsize=None)
def bundled_base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(BUNDLED / "base", dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def test_schema_check_finds_each_kind_of_error():
    good = {"name": "Rex", "kind": "dog", "age": 3, "weight": 2.5, "owner": {"city": "Oslo", "verified": True},
            "tags": ["a"]}
    assert schema_errors(good, PET) == []
    bad = {**good, "kind": "cow", "age": 31, "weight": "2", "owner": {"city": "Oslo", "x": 1},
           "tags": ["a", "b", "a", "c"], "extra": None}
    del bad["name"]
    assert sorted(e.split(":")[0] for e in schema_errors(bad, PET)) == [
        "$", "$", "$.age", "$.kind", "$.owner", "$.owner", "$.tags", "$.tags[3]", "$.weight"]
    with pytest.raises(ValueError, match="does not check"):
        schema_errors(1, {"pattern": "x"})


@pytest.mark.parametrize("text", ["Describe a pet as JSON:", "Hello"])
def test_hf_oracle_output_parses_and_validates(text):
    """Compact whitespace (any_whitespace=False): with any whitespace allowed this tiny base writes
    newlines until max_new_tokens."""
    tokenizer, compiler = bundled_tokenizer(), bundled_compiler(2048, any_whitespace=False)
    compiled = compiler.compile(grammar_spec(guided_json=PET))
    prompt = tokenizer.encode(text, add_special_tokens=False)
    out = hf_grammar_greedy(bundled_base(), prompt, compiled, max_new_tokens=160, eos_token_id=EOS)
    assert out[-1] == EOS and EOS not in out[:-1], "the grammar ended before max_new_tokens"
    value = json.loads(tokenizer.decode(out[:-1]))
    assert schema_errors(value, PET) == []

    state = GrammarState(compiled)
    for token in out:
        row = state.allowed_now()
        assert (int(row[token // 32]) >> (token % 32)) & 1
        assert state.commit([token]) == 1
    assert state.terminated
