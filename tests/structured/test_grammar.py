"""GrammarCompiler: each bad grammar a GrammarError before decoding, the cache, the tokenizer's
special tokens unspellable, padded logits ids never allowed. Oracles: xgrammar's own matcher."""
import pytest

xgr = pytest.importorskip("xgrammar", reason="structured output is the optional 'structured' extra")

from eagle_fx.structured.grammar import GrammarCompiler, GrammarError  # noqa: E402
from eagle_fx.structured.response_format import GrammarSpec, grammar_spec  # noqa: E402

from .conftest import EOS, bundled_compiler, bundled_tokenizer, digits_tokenizer  # noqa: E402


def allowed_ids(compiled, text: str = "") -> set[int]:
    """The ids a fresh xgrammar matcher allows after accepting `text`."""
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(text)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return {t for t in range(compiled.tokenizer_info.vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}


def matches(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("spec, message", [
    (grammar_spec(guided_json={"type": 3}), r"^invalid JSON schema: Type should be a string"),
    (grammar_spec(guided_json={"type": "banana"}), r'^invalid JSON schema: Unsupported type "banana"'),
    (grammar_spec(guided_regex="a["), r"^invalid regex: Regex parsing error at position 3: Unclosed '\['"),
    (grammar_spec(guided_grammar='root ::= "a" | '), r"^invalid EBNF grammar: EBNF parser error at line 1"),
    (grammar_spec(guided_grammar='start ::= "a"'), r'^invalid EBNF grammar: .*root rule with name "root" is not found'),
])
def test_an_invalid_grammar_is_a_grammar_error_naming_kind_and_cause(compiler, spec, message):
    with pytest.raises(GrammarError, match=message) as info:
        compiler.compile(spec)
    assert isinstance(info.value, ValueError)
    assert ".cc:" not in str(info.value)  # xgrammar's log prefix (time, C++ file) is cut off


def test_a_grammar_the_tokenizer_cannot_start_is_a_grammar_error():
    """The digits tokenizer spells no letter: a regex of letters cannot begin; one of digits can."""
    compiler = GrammarCompiler(digits_tokenizer(), 12)
    with pytest.raises(GrammarError, match="regex cannot be followed with this tokenizer: no token"):
        compiler.compile(GrammarSpec("regex", "[a-z]+"))
    with pytest.raises(GrammarError, match="JSON schema cannot be followed"):
        compiler.compile(grammar_spec(guided_json={"type": "string"}))  # a JSON string starts with '"'
    assert allowed_ids(compiler.compile(GrammarSpec("regex", "[0-9]+"))) == set(range(2, 12))
    assert compiler.stop_token_ids == (1,)  # the tokenizer's eos by default


def test_the_cache_hits_on_an_equal_spec_and_forgets_the_oldest(tokenizer):
    compiler = GrammarCompiler(tokenizer, 2048, stop_token_ids=[EOS], cache_size=2)
    first = compiler.compile(grammar_spec(guided_json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    again = compiler.compile(grammar_spec(guided_json='{"type": "object",  "properties": {"a": {"type": "integer"}}}'))
    assert again is first and (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(GrammarSpec("regex", "a+"))
    compiler.compile(GrammarSpec("regex", "b+"))  # the schema is now the least recently used: out
    assert compiler.compile(GrammarSpec("regex", "a+")) is not None and compiler.hits == 2
    assert compiler.compile(grammar_spec(guided_json={"type": "object", "properties": {"a": {"type": "integer"}}})) \
        is not first
    assert (compiler.hits, compiler.misses) == (2, 4)


def test_special_tokens_are_unspellable_and_eos_is_the_stop_token(tokenizer, compiler):
    """xgrammar alone spells <|user|> as its text, so `<.*>` would allow it; ours never allows
    the tokenizer's special added tokens, and eos only where the grammar is complete."""
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special} - {EOS}
    assert special == {0, 1, 3, 4}
    plain = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=2048, stop_token_ids=[EOS]))
    assert allowed_ids(plain.compile_regex("<.*>")) & special == {0, 1, 3, 4}  # what we avoid
    ours = compiler.compile(GrammarSpec("regex", "<.*>"))
    assert allowed_ids(ours) & special == set()
    assert EOS not in allowed_ids(ours)
    assert allowed_ids(ours, "<x>") & {EOS} == {EOS}  # complete here (and `.*` can go on)
    for i in special:
        assert not xgr.GrammarMatcher(ours).accept_token(i)


def test_padded_logits_ids_are_never_allowed(tokenizer):
    """vocab_size is the logits width: 40 ids past the tokenizer's 2048 are padding."""
    compiled = bundled_compiler(2088).compile(GrammarSpec("regex", "(.|\n)*"))
    allowed = allowed_ids(compiled)
    assert compiled.tokenizer_info.vocab_size == 2088
    assert max(allowed) < 2048 and len(allowed) > 1900


def test_json_object_is_any_object_and_nothing_else(compiler):
    compiled = compiler.compile(GrammarSpec("json_object", ""))
    assert matches(compiled, '{"x": [1, {"y": null}], "z": "w"}') and matches(compiled, "{}")
    assert not matches(compiled, "[1]") and not matches(compiled, '"text"')


def test_properties_come_in_the_declared_order(compiler):
    """Why the spec keeps the schema's key order (response_format.canonical_schema)."""
    ab = grammar_spec(guided_json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                   "required": ["a", "b"]})
    ba = grammar_spec(guided_json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
                                   "required": ["a", "b"]})
    assert matches(compiler.compile(ab), '{"a": 1, "b": 2}') and not matches(compiler.compile(ab), '{"b": 2, "a": 1}')
    assert matches(compiler.compile(ba), '{"b": 2, "a": 1}') and not matches(compiler.compile(ba), '{"a": 1, "b": 2}')


def test_any_whitespace_false_allows_only_the_default_separators():
    spec = grammar_spec(guided_json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    tight, loose = bundled_compiler(2048, any_whitespace=False).compile(spec), bundled_compiler().compile(spec)
    assert matches(tight, '{"a": 1}') and not matches(tight, '{\n  "a": 1\n}')
    assert matches(loose, '{"a": 1}') and matches(loose, '{\n  "a": 1\n}')


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=0), "vocab_size must be"), (dict(vocab_size=2048, cache_size=0), "cache_size must be"),
    (dict(vocab_size=2048, stop_token_ids=[]), "stop_token_ids must be non-empty"),
    (dict(vocab_size=2048, stop_token_ids=[4096]), "stop_token_ids must be non-empty ids below vocab_size=2048"),
])
def test_bad_compiler_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GrammarCompiler(bundled_tokenizer(), **kwargs)


def test_a_tokenizer_without_eos_needs_stop_token_ids():
    tokenizer = digits_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no eos_token_id: pass stop_token_ids="):
        GrammarCompiler(tokenizer, 12)
    assert GrammarCompiler(tokenizer, 12, stop_token_ids=[0]).stop_token_ids == (0,)


def test_compile_takes_a_spec(compiler):
    with pytest.raises(TypeError, match="compile takes a GrammarSpec"):
        compiler.compile({"type": "json_object"})
