"""torch.library.opcheck on every eagle_fx op (torch.ops.eagle_fx.*): the schema's aliasing and
mutation annotations, the fake kernel against the real one (shapes, strides, dtypes), the
autograd registration, and the op under AOTAutograd with dynamic shapes. Small representative
inputs: each cached op in its ragged (prefill), device-side (uniform) and batch-invariant forms,
query layouts as a projection leaves them (transposed views), gradients where the op has a
formula. The Triton ops run under TRITON_INTERPRET=1 (conftest.py)."""
import contextlib

import pytest
import torch

import eagle_fx.ops  # noqa: F401  (defines torch.ops.eagle_fx.*)
import eagle_fx.structured.mask_op  # noqa: F401  (defines torch.ops.eagle_fx.grammar_*)
from eagle_fx.ops.triton import load_kernels, triton_status
from tests.ops.paged_case import paged_layout

if triton_status("cpu")[0]:
    load_kernels()

HEADS, KV_HEADS, D, BLOCK = 4, 2, 8, 4
WORDS = 3  # int32 words per grammar mask row (a 96-token vocabulary)


class _RowsFromTokens:
    """A stand-in for a cycle's CycleMasks under the grammar ops (eagle_fx.structured.mask_op): rows
    that depend only on their inputs, so opcheck may call the ops as often as it likes."""

    def draft_row(self, j, previous):
        seed = 0 if previous is None else previous.sum().item()
        return torch.arange(3 * WORDS, dtype=torch.int32).view(3, WORDS) * (j + 1) + seed

    def verify_rows(self, drafts):
        rows = torch.arange(drafts.shape[0] * (drafts.shape[1] + 1) * WORDS, dtype=torch.int32)
        return rows.view(drafts.shape[0], -1, WORDS) + drafts.sum().item()

    def rollback(self):
        pass


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _projected(total, heads, g, requires_grad=False):
    """[1, heads, total, D] in a projection's layout: a transposed view of [1, total, heads, D]."""
    x = torch.randn(1, total, heads, D, generator=g).transpose(1, 2)
    return x.requires_grad_(requires_grad)


def _paged(lens_before, per_seq, seed=0):
    """Sequences with lens_before cached tokens and per_seq new query rows each, in a pool of 2 layers."""
    g = _g(seed)
    pool, table, slots, pos, qsl, total = paged_layout(lens_before, per_seq, KV_HEADS, D, BLOCK, 5, g)
    q, k, v = _projected(total, HEADS, g), _projected(total, KV_HEADS, g), _projected(total, KV_HEADS, g)
    return q, k, v, pool, slots, table, qsl, pos


def _cases():
    cases = []
    g = _g(1)
    for window in (0, 3):
        q, k, v = _projected(7, HEADS, g, True), _projected(7, KV_HEADS, g, True), _projected(7, KV_HEADS, g, True)
        cases.append(pytest.param("attention", (q, k, v, 0.3, window), {}, id=f"attention-window{window}"))
    for name, kwargs in (("ragged", {}), ("uniform", {"uniform_queries": True}),
                         ("batch_invariant", {"batch_invariant": True})):
        q, k, v, pool, slots, table, qsl, pos = _paged([3, 9], 2)
        cases.append(pytest.param("cached_attention", (q, k, v, pool, 1, slots, table, qsl, pos, 0.3, 0), kwargs,
                                  id=f"cached_attention-{name}"))
    ring = 4
    for name, kwargs in (("ragged", {}), ("uniform", {"uniform_queries": True}),
                         ("batch_invariant", {"batch_invariant": True})):
        q, k, v, pool, _, table, qsl, pos = _paged([6, 9], 2, seed=2)
        spec_kv = torch.randn(2, 3, ring, KV_HEADS, D, generator=g)
        committed = torch.tensor([7, 9])  # the first sequence's second row is speculated: written to the ring
        cases.append(pytest.param("shared_cached_attention",
                                  (q, k, v, pool, 0, spec_kv, torch.tensor([2, 0]), committed, table, qsl, pos, 0.3, 0),
                                  kwargs, id=f"shared_cached_attention-{name}"))
    for batch_invariant in (False, True):
        width, tree_start = 3, torch.tensor([5, 2])
        q, k, v, pool, _, table, qsl, _ = _paged([5, 2], width, seed=3)
        depth = torch.tensor([0, 1, 1])  # node 0 and its two children
        pos = (tree_start[:, None] + depth).reshape(1, -1)
        logical = (tree_start[:, None] + torch.arange(width)).reshape(-1)
        seq = torch.arange(2).repeat_interleave(width)
        slots = table[seq, logical // BLOCK] * BLOCK + logical % BLOCK
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).repeat(2, 1)
        cases.append(pytest.param("tree_cached_attention",
                                  (q, k, v, pool, 0, slots, table, qsl, pos, mask, tree_start, 0.3, 2),
                                  {"batch_invariant": batch_invariant},
                                  id=f"tree_cached_attention-batch_invariant{batch_invariant}"))
    tokens, drafts = torch.tensor([4, 7, 1]), torch.tensor([[4, 9], [7, 7], [1, 0]])
    cases += [pytest.param("grammar_draft_row", (tokens, 0, WORDS), {}, id="grammar_draft_row-first"),
              pytest.param("grammar_draft_row", (tokens, 1, WORDS), {}, id="grammar_draft_row"),
              pytest.param("grammar_verify_rows", (drafts, WORDS), {}, id="grammar_verify_rows"),
              pytest.param("grammar_verify_rows", (drafts[:, :0], WORDS), {}, id="grammar_verify_rows-no-drafts")]
    x, w, b = torch.randn(3, 5, 16, generator=g), torch.randn(12, 16, generator=g), torch.randn(12, generator=g)
    cases += [pytest.param("rowwise_linear", (x, w, b), {}, id="rowwise_linear"),
              pytest.param("rowwise_linear", (x[:, :0], w), {}, id="rowwise_linear-no-rows")]
    if triton_status("cpu")[0]:
        x, r, w = (torch.randn(*s, generator=g) for s in ((3, 5, 48), (3, 5, 48), (48,)))
        gate, up = torch.randn(3, 7, 33, generator=g), torch.randn(3, 7, 33, generator=g)
        ids, embed = torch.randint(0, 11, (2, 3), generator=g), torch.randn(11, 16, generator=g)
        features, weight = torch.randn(2, 3, 24, generator=g), torch.randn(20, 40, generator=g)
        norms = torch.randn(16, generator=g), torch.randn(24, generator=g)
        q, k, v, pool, slots, table, qsl, pos = _paged([3, 9], 2, seed=4)
        cases += [
            pytest.param("triton_rmsnorm", (x, w, 1e-6), {}, id="triton_rmsnorm"),
            pytest.param("triton_add_rmsnorm", (x, r, w, 1e-6), {}, id="triton_add_rmsnorm"),
            pytest.param("triton_swiglu", (gate, up), {}, id="triton_swiglu"),
            pytest.param("triton_draft_input", (ids, embed, features, weight, None, None, None, 1e-6), {},
                         id="triton_draft_input"),
            pytest.param("triton_draft_input", (ids, embed, features, weight, weight[:, 0], *norms, 1e-6), {},
                         id="triton_draft_input-norms-bias"),
            pytest.param("triton_cached_attention", (q, k, v, pool, 1, slots, table, qsl, pos, 0.3, 0), {},
                         id="triton_cached_attention"),
        ]
    return cases


CASES = _cases()


def test_every_eagle_fx_op_is_checked():
    """A new op gets a case here: the cases name every op torch knows in the eagle_fx namespace."""
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("eagle_fx::")}
    assert registered and registered == {case.values[0] for case in CASES}


@pytest.mark.parametrize("op,args,kwargs", CASES)
def test_opcheck(op, args, kwargs):
    from eagle_fx.structured.mask_op import filling

    with filling(_RowsFromTokens()) if op.startswith("grammar_") else contextlib.nullcontext():
        torch.library.opcheck(getattr(torch.ops.eagle_fx, op).default, args, kwargs)
