"""Lossless sampling: speculative rejection sampling gives the base's own distribution.

Oracle: the exact joint distribution of the first 3 generated tokens under the base alone,
computed with Hugging Face's logits warpers (temperature, top-k, top-p) over every prefix; the
20k seeded samples eagle_fx draws (draft proposals, accept/reject, residual and bonus tokens)
must fit it (chi-square over cells with expected count >= 5, rare cells pooled; p > 0.001)."""
import pytest
import torch

import eagle_fx
from eagle_fx.drafts import new_draft

V, N = 16, 20000
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # peaked distributions, so drafts are accepted and rejected
    return model


def exact_joint(base, temperature, top_p):
    """p(t1, t2, t3 | PROMPT) under the base alone, warped as HF generate warps."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    def dist(seqs):
        with torch.no_grad():
            logits = base(input_ids=torch.tensor(seqs)).logits[:, -1].float()
        logits = TemperatureLogitsWarper(temperature)(None, logits)
        if top_p < 1.0:
            logits = TopPLogitsWarper(top_p)(None, logits)
        return logits.softmax(-1)

    p1 = dist([PROMPT])[0]
    p2 = dist([PROMPT + [a] for a in range(V)])  # [V, V]
    p3 = dist([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    exp, obs = exp[exp > 0], obs[exp > 0]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2.double() / 2))


TREE = dict(top_k=3, depth=2, total_tokens=5)


@pytest.mark.heavy
# pairwise over method x chain/tree, each warping setting with a chain (the fifth case of the full
# set, EAGLE-1 chain at temperature 1, adds no new pair and was dropped)
@pytest.mark.parametrize("method,temperature,top_p,tree", [("eagle", 0.5, 1.0, None), ("eagle3", 1.0, 0.9, None),
                                                           ("eagle", 1.0, 1.0, TREE), ("eagle3", 1.0, 0.9, TREE)])
def test_first_three_tokens_follow_the_base(base, method, temperature, top_p, tree):
    """Chains (draft tokens sampled from q, accepted with min(1, p/q)) and EAGLE-2 trees (top-k
    children, each accepted with probability p(x) over the mass left, zeroed when rejected)."""
    draft = new_draft(base, method, seed=11, aux_layer_ids=(0, 1, 2) if method == "eagle3" else None)
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, max_batch_size=1000, max_seq_len=8, draft_tree=tree)
    out = model.generate([PROMPT] * N, max_new_tokens=3, eos_token_id=None, temperature=temperature, top_p=top_p,
                         seed=1234)
    seqs = torch.tensor(out.sequences)
    assert seqs.shape == (N, 3)
    counts = torch.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V ** 3).double()
    expected = exact_joint(base, temperature, top_p).reshape(-1).double() * N
    st = out.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # both the accept and the reject paths ran
    p_value = chi_square_p(counts, expected)
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}"


def test_without_speculation_follows_the_base(base):
    """num_spec_tokens=0 (the base alone on eagle_fx's graphs, the bench's plain-decode baseline)
    samples from the same warped distribution; no draft token is ever proposed."""
    model = eagle_fx.compile(base, new_draft(base, "eagle", seed=11), num_spec_tokens=0, max_batch_size=1000,
                             max_seq_len=8)
    out = model.generate([PROMPT] * N, max_new_tokens=3, eos_token_id=None, temperature=0.7, top_p=0.9, seed=99)
    seqs = torch.tensor(out.sequences)
    counts = torch.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V ** 3).double()
    assert out.stats.num_draft_tokens == 0 and out.stats.mean_acceptance_length == 1.0
    p_value = chi_square_p(counts, exact_joint(base, 0.7, 0.9).reshape(-1).double() * N)
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}"
