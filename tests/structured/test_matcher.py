"""GrammarState against an oracle: a fresh xgrammar matcher advanced token by token from the
start for every row (no rollback, no shared state)."""
import random

import pytest
import torch

xgr = pytest.importorskip("xgrammar", reason="structured output is the optional 'structured' extra")

from eagle_fx.structured.grammar import GrammarCompiler, GrammarError  # noqa: E402
from eagle_fx.structured.matcher import GrammarState  # noqa: E402
from eagle_fx.structured.response_format import GrammarSpec, grammar_spec  # noqa: E402

from .conftest import EOS, digits_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "kind": {"enum": ["cat", "dog"]}, "weight": {"type": "number"},
    "owner": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "kind", "weight", "owner", "tags"]}
DOCUMENT = '{"name": "Rex the dog", "kind": "dog", "weight": 12.5, "owner": {"city": "Oslo"}, "tags": ["a", "bc"]}'


def oracle_row(compiled, tokens) -> torch.Tensor | None:
    """The mask after `tokens` from a fresh matcher; None where a token is rejected or ends the grammar."""
    matcher = xgr.GrammarMatcher(compiled)
    for t in tokens:
        if not matcher.accept_token(t):
            return None
    if matcher.is_terminated():
        return None
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bitmask[0]


def check_chain(state, compiled, committed, drafts):
    rows, valid = state.masks_for_chain(drafts)
    assert rows.shape == (len(drafts) + 1, state.width) and rows.dtype == torch.int32
    expected = [oracle_row(compiled, committed + drafts[:j]) for j in range(len(drafts) + 1)]
    real = next((j for j, row in enumerate(expected) if row is None), len(expected))
    assert valid == real
    for j in range(valid):
        assert torch.equal(rows[j], expected[j]), f"row {j} of {drafts} after {len(committed)} committed tokens"
    assert bool((rows[valid:] == -1).all())  # filler: every token allowed
    assert torch.equal(state.allowed_now(), expected[0])  # rolled back to the committed state


@pytest.fixture
def schema_case(compiler, tokenizer):
    compiled = compiler.compile(grammar_spec(guided_json=SCHEMA))
    return compiled, tokenizer.encode(DOCUMENT, add_special_tokens=False) + [EOS]


def test_masks_for_chain_match_a_fresh_matcher_along_a_document(schema_case):
    """Walk a valid document: at each committed length, chains of 0..4 drafts, some exact, some
    with one token replaced by a random id (specials, eos and out-of-grammar ids included)."""
    compiled, document = schema_case
    state, rng = GrammarState(compiled), random.Random(0)
    for p in range(len(document)):
        for k in (0, 1, 3, 4):
            drafts = document[p:p + k]
            if drafts and rng.random() < 0.5:
                drafts[rng.randrange(len(drafts))] = rng.choice([EOS, 0, 3, rng.randrange(2048), rng.randrange(2048)])
            check_chain(state, compiled, document[:p], drafts)
        assert state.commit(document[p:p + 1]) == 1
    assert state.terminated and state.completed


def test_rollback_leaves_the_state_as_before(schema_case):
    compiled, document = schema_case
    state = GrammarState(compiled)
    state.commit(document[:10])
    before = state.allowed_now().clone()
    rows, valid = state.masks_for_chain(document[10:14])
    assert valid == 5 and not state.terminated
    assert torch.equal(state.allowed_now(), before)
    assert state.commit(document[10:]) == len(document) - 10 and state.terminated  # goes on from token 10


def test_a_chain_through_eos_ends_there_and_rolls_back(schema_case):
    compiled, document = schema_case
    state = GrammarState(compiled)
    state.commit(document[:-3])
    rows, valid = state.masks_for_chain(document[-3:] + [5, 6])  # ..., '}', eos, then two drafts past the end
    assert valid == 3  # rows after '}' ... the row that allows eos; none after eos
    assert int(rows[2].count_nonzero()) == 1 and (int(rows[2][EOS // 32]) >> (EOS % 32)) & 1  # only eos there
    assert not state.terminated and not state.completed


def test_commit_stops_at_a_rejected_token_and_at_eos(schema_case):
    compiled, document = schema_case
    state = GrammarState(compiled)
    assert state.commit(document[:5] + [EOS] + document[5:]) == 5  # eos before the grammar is complete
    assert torch.equal(state.allowed_now(), oracle_row(compiled, document[:5]))
    assert state.commit(document[5:-1]) == len(document) - 6 and state.completed and not state.terminated
    assert state.commit([EOS, EOS]) == 1 and state.terminated  # eos ends it; nothing after
    assert state.commit([5]) == 0
    with pytest.raises(RuntimeError, match="terminated"):
        state.allowed_now()
    with pytest.raises(RuntimeError, match="terminated"):
        state.masks_for_chain([5])


def test_out_receives_the_rows(schema_case):
    compiled, document = schema_case
    state = GrammarState(compiled)
    out = torch.zeros(4, state.width, dtype=torch.int32)
    rows, valid = state.masks_for_chain(document[:3], out=out)
    assert rows is out and valid == 4
    row = torch.zeros(state.width, dtype=torch.int32)
    assert state.allowed_now(out=row).data_ptr() == row.data_ptr() and torch.equal(row, out[0])
    with pytest.raises(ValueError, match=r"out must be a CPU int32 tensor of shape \(3, 64\)"):
        state.masks_for_chain(document[:2], out=out)
    with pytest.raises(ValueError, match="out must be a CPU int32 tensor"):
        state.masks_for_chain(document[:3], out=out.to(torch.int64))


def test_ids_past_the_vocabulary_are_rejected_drafts():
    """12 tokens: the last word's bits 12..31 carry nothing, and xgrammar sets some of them."""
    compiled = GrammarCompiler(digits_tokenizer(), 12).compile(GrammarSpec("regex", "[0-9]+"))
    state = GrammarState(compiled)
    assert state.width == 1 and int(state.allowed_now()[0]) >> 12 != 0  # padding bits set
    rows, valid = state.masks_for_chain([3, 13, 4])
    assert valid == 2  # draft 3 ('1') taken, id 13 (no such token) rejected
    assert state.commit([3, 13]) == 1


def test_a_dead_end_after_a_token_is_a_grammar_error():
    """'1' can start `1[a-z]`, but the digits vocabulary cannot go on: the row after it allows
    nothing (a real row), and once it is committed allowed_now / masks_for_chain raise."""
    state = GrammarState(GrammarCompiler(digits_tokenizer(), 12).compile(GrammarSpec("regex", "1[a-z]")))
    rows, valid = state.masks_for_chain([3])
    assert valid == 2 and int(rows[1].count_nonzero()) == 0
    assert state.commit([3]) == 1
    with pytest.raises(GrammarError, match="no token of the vocabulary can continue"):
        state.allowed_now()
    with pytest.raises(GrammarError, match="no token of the vocabulary can continue"):
        state.masks_for_chain([4])
