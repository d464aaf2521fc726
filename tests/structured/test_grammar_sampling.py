"""Lossless sampling under a grammar: with the drafts and the verify masked, speculative rejection
sampling gives the base's masked distribution. Oracle: the exact joint distribution of the first 3
tokens under the base alone, each step's logits masked by the grammar first and then warped
(temperature, top-p: vLLM's order, mask before sampling settings); 6000 seeded samples must fit it
(chi-square over cells with expected count >= 5, rare cells pooled; p > 0.001)."""
import pytest
import torch

pytest.importorskip("xgrammar", reason="structured output is the optional 'structured' extra")

import eagle_fx  # noqa: E402
from eagle_fx.drafts import new_draft  # noqa: E402
from eagle_fx.structured.response_format import GrammarSpec  # noqa: E402

from .conftest import digits_tokenizer  # noqa: E402

V, N = 12, 6000  # the digits tokenizer: <pad>, <eos>, "0".."9" (id = digit + 2)
PROMPT = [3, 4, 5]
GRAMMAR = GrammarSpec("regex", "[1-3][4-7][0-9]+")
ALLOWED = [[d + 2 for d in (1, 2, 3)], [d + 2 for d in (4, 5, 6, 7)], [d + 2 for d in range(10)]]


@pytest.fixture(scope="module")
def base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
                      eos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions, so drafts are accepted and rejected
    return model


def exact_masked_joint(base, temperature: float, top_p: float) -> torch.Tensor:
    """p(t1, t2, t3 | PROMPT): at each step the logits masked to what the grammar allows there,
    then temperature and top-p as HF's warpers apply them."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    def dist(seqs, allowed):
        with torch.no_grad():
            logits = base(input_ids=torch.tensor(seqs)).logits[:, -1].float()
        mask = torch.zeros(V, dtype=torch.bool)
        mask[allowed] = True
        logits = TemperatureLogitsWarper(temperature)(None, logits.masked_fill(~mask, float("-inf")))
        if top_p < 1.0:
            logits = TopPLogitsWarper(top_p)(None, logits)
        return logits.softmax(-1)

    p1 = dist([PROMPT], ALLOWED[0])[0]
    p2 = dist([PROMPT + [a] for a in range(V)], ALLOWED[1])
    p3 = dist([PROMPT + [a, b] for a in range(V) for b in range(V)], ALLOWED[2]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


# a pruned draft vocabulary (eagle_fx.draft_vocab) without the first token's allowed digits "1".."3" (ids 3-5)
# and with only two of the second's: its draft rows there are masked whole, or nearly
PRUNED = [0, 1, 2, 6, 8, 9, 10, 11]


@pytest.mark.heavy
@pytest.mark.parametrize("keep", [None, PRUNED], ids=["full_vocab", "pruned_vocab"])
def test_first_three_tokens_under_a_grammar_follow_the_masked_base(base, keep, temperature=0.7, top_p=0.9):
    from test_sampling_distribution import chi_square_p  # (tests/ is on the path: no __init__.py there)

    draft = new_draft(base, "eagle", seed=11)
    if keep is not None:
        from eagle_fx.draft_vocab import prune_draft_vocab

        draft = prune_draft_vocab(draft, base, torch.tensor(keep))
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, backend="eager", max_batch_size=1000, max_seq_len=8)
    out = model.generate([PROMPT] * N, max_new_tokens=3, eos_token_id=1, temperature=temperature, top_p=top_p,
                         seed=4321, response_format=GRAMMAR, tokenizer=digits_tokenizer())
    seqs = torch.tensor(out.sequences)
    assert seqs.shape == (N, 3)
    for position, allowed in enumerate(ALLOWED):  # every token where the grammar allows it
        assert bool(torch.isin(seqs[:, position], torch.tensor(allowed)).all())
    counts = torch.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V ** 3).double()
    st = out.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.grammar_cycles > 0
    p_value = chi_square_p(counts, exact_masked_joint(base, temperature, top_p).reshape(-1).double() * N)
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}"
