"""EAGLE-2 dynamic draft trees: the tree bookkeeping against hand-built trees and formulas, and
greedy output == Hugging Face greedy generate with trees (accepted paths off the first branch,
compacted in the pool)."""
import functools

import pytest
import torch

import eagle_fx
from conftest import compiled, hf_greedy, make_prompts, tiny_base, tiny_draft
from eagle_fx.draft_tree import DraftTree, rerank, tree_mask
from eagle_fx.runtime import TreeProposer
from eagle_fx.runtime.verifier import greedy_walk, sampled_walk
from test_sampling_distribution import chi_square_p

TREE = dict(top_k=2, depth=3, total_tokens=5)


def test_tree_mask_of_a_hand_built_tree():
    #        root
    #       /    \
    #      n1     n2
    #     /  \      \
    #    n3   n4     n6
    #    |
    #    n5
    parents = torch.tensor([[-1, -1, 0, 0, 2, 1]])
    expected = torch.tensor([
        # root n1 n2 n3 n4 n5 n6
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # n1
        [1, 0, 1, 0, 0, 0, 0],  # n2
        [1, 1, 0, 1, 0, 0, 0],  # n3
        [1, 1, 0, 0, 1, 0, 0],  # n4
        [1, 1, 0, 1, 0, 1, 0],  # n5
        [1, 0, 1, 0, 0, 0, 1],  # n6
    ], dtype=torch.bool)
    assert torch.equal(tree_mask(parents)[0], expected)
    assert (tree_mask(parents)[0].sum(-1) - 1).tolist() == [0, 1, 1, 2, 2, 3, 2]  # depths


def test_rerank_keeps_the_best_closed_under_parents():
    # candidates: 0,1 children of the root; 2,3 of cand 0; 4,5 of cand 1 (scores: parent + log p)
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    scores = torch.tensor([[-0.1, -1.0, -0.3, -2.0, -1.0, -1.5]])
    parent_cand = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    toks, parents = rerank(tokens, scores, parent_cand, 4)
    # best four: cand 0 (-0.1), 2 (-0.3), then the tie at -1.0: cands 1 and 4 -> 1 and 4 (4 is 1's child)
    assert toks.tolist() == [[10, 11, 12, 14]]
    assert parents.tolist() == [[-1, -1, 0, 1]]
    # a tie between a parent and its child keeps the parent first
    toks, parents = rerank(tokens, torch.tensor([[-1.0, -3.0, -1.0, -3.0, -3.0, -3.0]]), parent_cand, 2)
    assert toks.tolist() == [[10, 12]] and parents.tolist() == [[-1, 0]]


def _grown_candidates(batch, top_k, depth, seed):
    """Candidates as the proposer grows them (parent score + log-probability, parents expanded from
    the best of the layer before), from random draft distributions with exact ties sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    scores, parents = [], []
    logp = torch.log_softmax(torch.randn(batch, top_k, generator=g), -1).sort(-1, descending=True).values
    scores.append(logp)
    parents.append(torch.full((batch, top_k), -1))
    layer_scores, layer_first = logp, 0
    for _ in range(depth - 1):
        expand = layer_scores.topk(top_k, dim=1).indices  # [B, top_k] within the layer
        logp = torch.log_softmax(torch.randn(batch, top_k, top_k, generator=g), -1).sort(-1, descending=True).values
        logp[:, :, 0] = torch.where(torch.rand(batch, top_k, generator=g) < 0.3, 0.0, logp[:, :, 0])  # ties
        child = (layer_scores.gather(1, expand)[:, :, None] + logp).flatten(1)
        scores.append(child)
        parents.append((layer_first + expand)[:, :, None].expand(-1, -1, top_k).flatten(1))
        layer_first += layer_scores.shape[1]
        layer_scores = child
    return torch.cat(scores, 1), torch.cat(parents, 1)


@pytest.mark.parametrize("seed", range(5))
def test_rerank_against_a_brute_force_oracle(seed):
    """The kept nodes are the total_tokens best candidates (ties: the earlier), in candidate order,
    and each node's parent index points at its parent candidate's node: checked row by row in Python."""
    B, top_k, depth, total = 3, 3, 4, 9
    scores, parent_cand = _grown_candidates(B, top_k, depth, seed)
    tokens = torch.arange(scores.shape[1]).expand(B, -1) + 100
    toks, parents = rerank(tokens, scores, parent_cand, total)
    for b in range(B):
        ranked = sorted(range(scores.shape[1]), key=lambda c: (-scores[b, c].item(), c))
        keep = sorted(ranked[:total])
        assert toks[b].tolist() == [100 + c for c in keep]
        want = [-1 if parent_cand[b, c] < 0 else keep.index(int(parent_cand[b, c])) for c in keep]
        assert parents[b].tolist() == want


def test_rerank_reads_nothing_on_the_host():
    """rerank runs on meta tensors, which have no values: any host read (.item(), bool(tensor),
    .tolist()) raises there. (It once checked its own result with bool(...any()): a device sync
    per tree step.)"""
    scores, parent_cand = _grown_candidates(2, 2, 3, 0)
    tokens = torch.arange(scores.shape[1]).expand(2, -1)
    toks, parents = rerank(tokens.to("meta"), scores.to("meta"), parent_cand.to("meta"), 5)
    assert toks.shape == parents.shape == (2, 5)


def test_greedy_walk_follows_the_argmax():
    parents = torch.tensor([[-1, -1, 0, 0, 2, 1], [-1, -1, 0, 0, 2, 1]])
    tokens = torch.tensor([[5, 6, 7, 8, 9, 4], [5, 6, 7, 8, 9, 4]])
    # row 0: root argmax 6 -> n2; n2's argmax 4 -> n6 (a leaf); n6's argmax 3 is the bonus
    # row 1: root argmax 5 -> n1; n1's argmax 8 -> n4; n4 has no child: bonus = n4's argmax 2
    target = torch.tensor([[6, 0, 4, 0, 0, 0, 3], [5, 8, 0, 0, 2, 0, 0]])
    accepted, bonus, path = greedy_walk(parents, tokens, target, depth=3)
    assert accepted.tolist() == [2, 2] and bonus.tolist() == [3, 2]
    assert path.tolist() == [[0, 2, 6, 6], [0, 1, 4, 4]]
    # nothing matches: no draft accepted, the root's argmax is the next token
    accepted, bonus, path = greedy_walk(parents, tokens, torch.full((2, 7), 1), depth=3)
    assert accepted.tolist() == [0, 0] and bonus.tolist() == [1, 1] and path.tolist() == [[0] * 4] * 2


def test_sampled_walk_is_distributed_as_the_base():
    """Formula oracle: the first token ~ p(root), and the second, given the first was a tree child,
    ~ p(that child); 20k draws, chi-square."""
    V, n = 6, 20000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)  # at [root, n1, n2]
    parents = torch.tensor([[-1, -1]]).expand(n, 2)
    tokens = torch.tensor([[2, 0]]).expand(n, 2)  # n1 = token 2, n2 = token 0 (both leaves)
    accepted, nxt, path = sampled_walk(parents, tokens, p.expand(n, 3, V), depth=1, generator=g)
    first = torch.where(accepted == 1, torch.tensor([2, 0])[(path[:, 1] - 1).clamp_min(0)], nxt)
    counts = torch.bincount(first, minlength=V).double()
    assert chi_square_p(counts, p[0].double() * n) > 1e-3
    for child, token in ((1, 2), (2, 0)):
        sel = path[:, 1] == child
        assert bool((accepted[sel] == 1).all())
        counts = torch.bincount(nxt[sel], minlength=V).double()
        assert chi_square_p(counts, p[child].double() * int(sel.sum())) > 1e-3


def test_options_are_checked():
    base, draft = tiny_base("llama"), tiny_draft("llama", "eagle")
    with pytest.raises(ValueError, match="score_temperature"):
        eagle_fx.compile(base, draft, draft_tree=dict(TREE, score_temperature=0))
    with pytest.raises(ValueError, match="takes the keys"):
        eagle_fx.compile(base, draft, draft_tree=dict(top_k=2, depth=3))
    with pytest.raises(ValueError, match="positive int"):
        eagle_fx.compile(base, draft, draft_tree=dict(top_k=0, depth=3, total_tokens=4))
    with pytest.raises(ValueError, match="candidates"):
        eagle_fx.compile(base, draft, draft_tree=dict(top_k=2, depth=2, total_tokens=7))
    with pytest.raises(TypeError, match="draft_tree must be"):
        eagle_fx.compile(base, draft, draft_tree=[2, 3, 4])
    with pytest.raises(ValueError, match="kv_share=LAYER"):
        eagle_fx.compile(base, draft, draft_tree=TREE, kv_share=1)
    from eagle_fx.drafts import new_draft

    sharing = new_draft(base, "eagle", seed=3, kv_share=1)  # trained to read base layer 1: kv_share="auto" takes it
    with pytest.raises(ValueError, match=r"draft_tree does not run with kv_share=LAYER \(here 1"):
        eagle_fx.compile(base, sharing, draft_tree=TREE)
    with pytest.raises(ValueError, match="pass draft_tree= to eagle_fx.compile"):
        compiled("llama", "eagle").replace(draft_tree=TREE)
    assert DraftTree.of(TREE).num_candidates == 2 + 2 * 4


class TruthOnALastBranch:
    """Test-only tree hook: put the base's own greedy continuation on the path to the deepest,
    last node (so acceptance leaves the first branch and the accepted K/V must be moved), and
    make every other node wrong; every `every`th step the path's last token is wrong too."""

    def __init__(self, prompts, refs, vocab, every=0):
        self.full = {tuple(p): p + r for p, r in zip(prompts, refs)}
        self.vocab, self.every, self.steps = vocab, every, 0

    def __call__(self, contexts, tokens, parents):
        out = tokens.clone()
        depth = tree_mask(parents).sum(-1)[:, 1:] - 1  # [A, N]
        for a, ctx in enumerate(contexts):
            full = next(f for p, f in self.full.items() if list(ctx[:len(p)]) == list(p) and len(f) >= len(ctx))
            nxt = full[len(ctx):] + [0] * int(depth[a].max())
            node = int((depth[a] * 1000 + torch.arange(depth.shape[1])).argmax())
            path = []
            while node >= 0:
                path.append(node)
                node = int(parents[a, node])
            for i in range(out.shape[1]):
                out[a, i] = (nxt[int(depth[a, i]) - 1] + 1) % self.vocab
            self.steps += 1
            for i in path:
                out[a, i] = nxt[int(depth[a, i]) - 1]
            if self.every and self.steps % self.every == 0:
                out[a, path[0]] = (out[a, path[0]] + 1) % self.vocab
        return out


DEEP = dict(top_k=2, depth=10, total_tokens=38)  # every candidate kept: paths deeper than the window (8)


@functools.lru_cache(maxsize=None)
def tree_model(arch, method, shift=False, deep=False):
    return eagle_fx.compile(tiny_base(arch), tiny_draft(arch, method), draft_tree=DEEP if deep else TREE,
                            prefill_shift=shift)


@pytest.mark.parametrize("every", [0, 3])
@pytest.mark.parametrize("arch,method,shift,deep", [("llama", "eagle", False, False), ("qwen3", "eagle3", False, False),
                                                    ("mistral_swa", "eagle", True, False),
                                                    ("gemma3", "eagle3", False, False), ("mistral_swa", "eagle", False, True),
                                                    ("gemma3", "eagle", True, True)])
def test_greedy_matches_hf_with_trees(arch, method, shift, deep, every):
    prompts = make_prompts(3)
    refs = hf_greedy(arch, prompts, 24)
    model = tree_model(arch, method, shift, deep)
    tree = DEEP if deep else TREE
    moved = []

    def record(path, accepted):
        depth = torch.arange(1, path.shape[1])
        moved.append(bool(((path[:, 1:] != depth) & (depth <= accepted[:, None])).any()))

    model = model.replace(proposer=TreeProposer(TruthOnALastBranch(prompts, refs, 96, every), on_path=record))
    out = model.generate(prompts, max_new_tokens=24)
    assert out.sequences == refs
    st = out.stats
    assert len(st.accepted_per_pos) == tree["depth"]
    assert any(moved)  # accepted paths left the first branch: their K/V were moved
    if every == 0:
        assert st.mean_acceptance_length > 1 + tree["depth"] * 0.5
    if deep:  # some accepted paths were longer than the sliding window
        assert st.accepted_per_pos[8] > 0
    else:
        assert 0 < st.num_accepted_tokens


def test_trees_with_random_drafts_chunking_and_prefix_caching():
    prompts = make_prompts(4, seed=9, lengths=(21, 7, 21, 33))
    prompts[2] = prompts[0][:16] + prompts[2][16:]  # a shared first block
    model = tree_model("llama", "eagle").replace(prefill_chunk_size=5, prefix_caching=True, block_size=8,
                                                 max_batch_size=2)
    out = model.generate(prompts, max_new_tokens=12)
    assert out.sequences == hf_greedy("llama", prompts, 12)
    assert out.stats.prefix_hit_tokens_base > 0
    chain = model.replace(draft_tree=None, num_spec_tokens=2)  # the chain over the same graphs
    assert chain.generate(prompts, max_new_tokens=12).sequences == out.sequences
