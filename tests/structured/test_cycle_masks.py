"""CycleMasks (a cycle's grammar masks, drafts filled one at a time as the draft proposes them)
against GrammarState.masks_for_chain (itself checked against a fresh matcher per prefix): the same
rows for every request with a grammar, all-allowed rows for one without, the matchers back at
their committed output afterwards, and the cycle's count and host time in the stats."""
import random

import pytest
import torch

pytest.importorskip("xgrammar", reason="structured output is the optional 'structured' extra")

from eagle_fx.runtime.stats import SpecDecodeStats  # noqa: E402
from eagle_fx.structured.bitmask import unpack_bitmask  # noqa: E402
from eagle_fx.structured.cycle_masks import CycleMasks  # noqa: E402
from eagle_fx.structured.matcher import GrammarState  # noqa: E402
from eagle_fx.structured.response_format import grammar_spec  # noqa: E402

from .conftest import EOS  # noqa: E402
from .test_matcher import DOCUMENT, SCHEMA  # noqa: E402

V = 2048


@pytest.mark.parametrize("k", [0, 1, 3])
def test_cycle_masks_equal_masks_for_chain_along_a_document(compiler, tokenizer, k):
    compiled = compiler.compile(grammar_spec(guided_json=SCHEMA))
    document = tokenizer.encode(DOCUMENT, add_special_tokens=False) + [EOS]
    state, rng, stats = GrammarState(compiled), random.Random(k), SpecDecodeStats(3)
    for p in range(len(document) - 1):
        drafts = document[p:p + k]  # the document goes on with these
        drafts += [EOS] * (k - len(drafts))
        if drafts and rng.random() < 0.5:  # a draft the grammar may not allow
            drafts[rng.randrange(k)] = rng.randrange(V)
        expected, valid = state.masks_for_chain(drafts)
        masks = CycleMasks([state, None], V, k, stats)
        rows = [unpack_bitmask(masks.draft_row(0, None), V)]
        for j in range(1, k):
            rows.append(unpack_bitmask(masks.draft_row(j, torch.tensor([drafts[j - 1], 7])), V))
        allowed = unpack_bitmask(masks.verify_rows(torch.tensor([drafts, [7] * k]).view(2, k)), V)
        assert allowed.shape == (2, k + 1, V) and allowed.dtype == torch.bool
        for j in range(k):  # the draft rows are the verify's
            assert torch.equal(rows[j], allowed[:, j])
        assert torch.equal(allowed[0], unpack_bitmask(expected, V)), (p, drafts, valid)
        assert bool(allowed[1].all())  # no grammar: everything allowed
        assert torch.equal(state.allowed_now(), expected[0])  # rolled back
        assert state.commit([document[p]]) == 1
    assert stats.grammar_cycles == len(document) - 1 and stats.grammar_mask_s > 0


def test_rows_are_filled_in_order(compiler):
    state = GrammarState(compiler.compile(grammar_spec(guided_json=SCHEMA)))
    masks = CycleMasks([state], V, 3)
    with pytest.raises(ValueError, match="in order"):
        masks.draft_row(1, torch.tensor([5]))
