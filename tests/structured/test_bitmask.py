"""unpack_bitmask / mask_logits against xgrammar's own apply_token_bitmask_inplace, and traced:
make_fx (symbolic shapes) and torch.compile(fullgraph=True).

Two xgrammar backends are the oracle: "torch_native" (its reference in torch) on every bitmask, and
its CPU kernel on bitmasks whose bits past vocab_size are all 1. xgrammar 0.2.8's CPU kernel, when
vocab_size % 32 != 0, the last token is allowed and a later bit of that word is 0, writes -inf one
element past the row (the next row's token 0, or past the tensor: a heap corruption).
"""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from eagle_fx.structured.bitmask import bitmask_width, mask_logits, unpack_bitmask

xgr = pytest.importorskip("xgrammar", reason="structured output is the optional 'structured' extra")

INT32_MIN = -2 ** 31  # only bit 31 (the sign bit) set


def random_bitmask(rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(INT32_MIN, 2 ** 31, (rows, bitmask_width(vocab_size)), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, 0], bitmask[-1, -1] = INT32_MIN, -1  # the sign bit alone; a full last word (bits past the vocab)
    bitmask[rows // 2] = 0
    return bitmask


def with_padding_bits_set(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask with its bits past vocab_size (in the last word) all 1."""
    tail = vocab_size % 32
    if tail == 0:
        return bitmask
    padded = bitmask.clone()
    padded[..., -1] |= torch.tensor(-(1 << tail), dtype=torch.int32)  # bits tail..31
    return padded


def xgrammar_masked(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
                    backend: str = "torch_native") -> torch.Tensor:
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab_size, backend=backend)
    return out


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 2048, 2088])
def test_mask_logits_matches_xgrammar(vocab_size):
    bitmask = random_bitmask(5, vocab_size, seed=vocab_size)
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(1))
    ours = mask_logits(logits, unpack_bitmask(bitmask, vocab_size))
    assert torch.equal(ours, xgrammar_masked(logits, bitmask, vocab_size))
    padded = with_padding_bits_set(bitmask, vocab_size)
    assert torch.equal(mask_logits(logits, unpack_bitmask(padded, vocab_size)), ours)  # padding bits carry nothing
    assert torch.equal(ours, xgrammar_masked(logits, padded, vocab_size, backend="cpu"))
    assert torch.isinf(ours[5 // 2]).all()  # the all-zero row


def test_bit_31_is_token_31_of_its_word():
    bitmask = torch.tensor([[INT32_MIN, 1]], dtype=torch.int32)
    assert unpack_bitmask(bitmask, 40).nonzero()[:, 1].tolist() == [31, 32]


def test_leading_dims_and_bool_output():
    """[batch, k+1, W] as a cycle graph would take it: each [k+1, W] slice as xgrammar masks it."""
    bitmask = random_bitmask(6, 70, seed=3).view(2, 3, 3)
    allowed = unpack_bitmask(bitmask, 70)
    assert allowed.shape == (2, 3, 70) and allowed.dtype == torch.bool
    logits = torch.randn(2, 3, 70)
    masked = mask_logits(logits, allowed)
    for b in range(2):
        assert torch.equal(masked[b], xgrammar_masked(logits[b], bitmask[b], 70))


def test_a_wider_bitmask_is_cut_to_the_vocabulary_and_a_narrow_one_refused():
    bitmask = torch.full((1, 4), -1, dtype=torch.int32)  # 128 bits
    assert unpack_bitmask(bitmask, 100).shape == (1, 100)
    with pytest.raises(ValueError, match="covers 128 tokens, fewer than vocab_size=129; allocate 5 words"):
        unpack_bitmask(bitmask, 129)
    with pytest.raises(TypeError, match="int32"):
        unpack_bitmask(bitmask.long(), 100)


def masked(logits, bitmask):
    return mask_logits(logits, unpack_bitmask(bitmask, logits.shape[-1]))


def test_traces_with_make_fx_symbolic():
    bitmask, logits = random_bitmask(4, 77, seed=5), torch.randn(4, 77)
    gm = make_fx(masked, tracing_mode="symbolic")(logits, bitmask)
    assert not any("_local_scalar_dense" in str(n.target) for n in gm.graph.nodes)  # no host reads (.item())
    assert torch.equal(gm(logits, bitmask), xgrammar_masked(logits, bitmask, 77))
    other_bitmask, other_logits = random_bitmask(3, 77, seed=6), torch.randn(3, 77)  # another batch size
    assert torch.equal(gm(other_logits, other_bitmask), xgrammar_masked(other_logits, other_bitmask, 77))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])  # (the grammar cycle runs it under inductor)
def test_compiles_in_one_graph(backend):
    torch._dynamo.reset()
    compiled = torch.compile(masked, fullgraph=True, backend=backend, dynamic=True)
    for rows, vocab_size in ((4, 77), (2, 77), (3, 100)):
        bitmask, logits = random_bitmask(rows, vocab_size, seed=rows), torch.randn(rows, vocab_size)
        assert torch.equal(compiled(logits, bitmask), xgrammar_masked(logits, bitmask, vocab_size))
