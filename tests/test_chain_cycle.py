"""The decode-step work without host syncs, and the chain cycle as one function.

Oracles: the device-side (uniform) attention equals the per-sequence (ragged) reference on the same
inputs; run on meta / fake tensors, the decode-step attention and the whole chain cycle read no
value on the host (a .tolist() / .item() / nonzero there raises); torch.profiler finds no
aten::_local_scalar_dense (nor nonzero) inside a cycle of a real generate; and the greedy tokens
stay Hugging Face's."""
import dataclasses
from functools import partial

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import eagle_fx
from conftest import hf_greedy, make_prompts, tiny_base, tiny_draft
from eagle_fx.ops.canonical import cached_attention_ref, shared_cached_attention_ref, tree_cached_attention_ref
from eagle_fx.runtime.chain_cycle import CycleNoise, call_graphs, chain_cycle
from eagle_fx.runtime.sampling import Sampler

H, KVH, D, BS = 4, 2, 8, 4
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::is_nonzero")


def _uniform_case(device="cpu", per_seq=3, lens=(6, 11), blocks=4, seed=0):
    """Two sequences whose last per_seq positions are queried, over a paged pool."""
    g = torch.Generator().manual_seed(seed)
    num_seqs, total = len(lens), len(lens) * per_seq
    pool = torch.randn(3, 2, 12, BS, KVH, D, generator=g)
    table = torch.tensor([[3, 7, 1, 9], [2, 5, 8, 0]])[:, :blocks]
    pos = torch.cat([torch.arange(n - per_seq, n) for n in lens])
    seq = torch.arange(total) // per_seq
    slots = table[seq, pos // BS] * BS + pos % BS
    q = torch.randn(1, H, total, D, generator=g)
    k, v = torch.randn(2, 1, KVH, total, D, generator=g)
    qsl = torch.arange(num_seqs + 1) * per_seq
    tensors = dict(q=q, k=k, v=v, kv_pool=pool, slot_mapping=slots, block_table=table, query_start_loc=qsl,
                   positions=pos[None])
    return {name: t.to(device) for name, t in tensors.items()}


@pytest.mark.parametrize("window", [0, 5])
def test_uniform_attention_equals_the_ragged_reference(window):
    case = _uniform_case()
    ragged_pool, uniform_pool = case["kv_pool"].clone(), case["kv_pool"].clone()
    ragged = cached_attention_ref(**{**case, "kv_pool": ragged_pool}, layer=1, scale=0.3, sliding_window=window)
    uniform = cached_attention_ref(**{**case, "kv_pool": uniform_pool}, layer=1, scale=0.3, sliding_window=window,
                                   uniform_queries=True)
    torch.testing.assert_close(uniform, ragged)
    assert torch.equal(uniform_pool, ragged_pool)  # the same K/V written


def test_uniform_shared_attention_equals_the_ragged_reference():
    case = _uniform_case(per_seq=1)
    spec_kv = torch.randn(2, 3, 3, KVH, D)
    committed = torch.tensor([5, 9])  # sequence 0's query (position 5) is its own; sequence 1 reads 9 committed + 1
    common = dict(q=case["q"], k=case["k"], v=case["v"], kv_pool=case["kv_pool"], base_layer=0,
                  spec_rows=torch.tensor([2, 0]), committed_len=committed, block_table=case["block_table"],
                  query_start_loc=case["query_start_loc"], positions=case["positions"], scale=0.3, sliding_window=0)
    ragged_ring, uniform_ring = spec_kv.clone(), spec_kv.clone()
    ragged = shared_cached_attention_ref(**common, spec_kv=ragged_ring)
    uniform = shared_cached_attention_ref(**common, spec_kv=uniform_ring, uniform_queries=True)
    torch.testing.assert_close(uniform, ragged)
    assert torch.equal(uniform_ring, ragged_ring)


def test_decode_step_attention_reads_nothing_on_the_host():
    """Meta tensors hold no values: a host read (tolist, item, nonzero, a data-dependent shape) raises."""
    case = _uniform_case(device="meta")
    out = cached_attention_ref(**case, layer=1, scale=0.3, sliding_window=5, uniform_queries=True)
    assert out.shape == case["q"].shape and out.device.type == "meta"
    with pytest.raises((RuntimeError, NotImplementedError)):  # the ragged (prefill) path does read: the test can fail
        cached_attention_ref(**case, layer=1, scale=0.3, sliding_window=0)
    single = _uniform_case(device="meta", per_seq=1)
    out = shared_cached_attention_ref(
        single["q"], single["k"], single["v"], single["kv_pool"], 0, torch.empty(2, 3, 3, KVH, D, device="meta"),
        torch.zeros(2, dtype=torch.long, device="meta"), torch.zeros(2, dtype=torch.long, device="meta"),
        single["block_table"], single["query_start_loc"], single["positions"], 0.3, 0, uniform_queries=True)
    assert out.shape == single["q"].shape
    tree_mask = torch.ones(6, 3, dtype=torch.bool, device="meta")
    out = tree_cached_attention_ref(case["q"], case["k"], case["v"], case["kv_pool"], 1, case["slot_mapping"],
                                    case["block_table"], case["query_start_loc"], case["positions"], tree_mask,
                                    torch.zeros(2, dtype=torch.long, device="meta"), 0.3, 4)
    assert out.shape == case["q"].shape


def _cycle_inputs(model, num_seqs=2):
    kv, spec = model.kv_cache, model.spec
    long = dict(dtype=torch.long)
    table = torch.arange(num_seqs * kv.blocks_per_seq, **long).view(num_seqs, -1)[:, :2]
    draft_vocab = spec.vocab_size if spec.d2t is None else spec.d2t.shape[0]
    return (kv.pools_by_side(), torch.tensor([3, 5])[:num_seqs],
            torch.tensor([4, 7])[:num_seqs], table, torch.arange(num_seqs, **long),
            torch.randn(num_seqs, draft_vocab), torch.randn(num_seqs, spec.draft_hidden_size))


@pytest.mark.parametrize("method,sampling", [("eagle", False), ("eagle3", True)])
def test_chain_cycle_reads_nothing_on_the_host(method, sampling):
    """The whole cycle (draft steps, verify, acceptance, extend) on fake tensors: any host read raises."""
    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", method), num_spec_tokens=3, max_batch_size=2,
                             max_seq_len=32)
    settings = model.chain_cycle.base_settings
    noise = CycleNoise()
    if sampling:
        settings = dataclasses.replace(settings, sampling=True)
        noise = CycleNoise(Sampler(0.8, 5, 0.9).warping(2, "cpu"), torch.rand(2, 3), torch.rand(2, 4, model.vocab_size))
    graphs = {name: getattr(model.graphs, name) for name in ("draft_step", "verify", "draft_extend")}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        pools, *inputs = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in _cycle_inputs(model)]
        run = partial(call_graphs, graphs, model.signatures, pools)
        out = chain_cycle(run, model.spec, settings, *inputs, noise)
    accepted, next_token, drafts = out[:3]
    assert accepted.shape == next_token.shape == (2,) and drafts.shape == (2, 3)


def _syncs_inside(prof, label: str) -> list[str]:
    events = prof.events()
    inside = []
    for e in events:
        if e.name not in SYNC_OPS:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name != label:
            parent = parent.cpu_parent
        if parent is not None:
            inside.append(e.name)
    return inside


class Labelled:
    """A callable run under a torch.profiler record_function label."""

    def __init__(self, label, fn):
        self.label, self.fn = label, fn

    def __call__(self, *args, **kwargs):
        with torch.profiler.record_function(self.label):
            return self.fn(*args, **kwargs)


def test_no_host_syncs_inside_a_generates_cycles():
    """torch.profiler over one greedy and one sampled generate: the host syncs that do happen are
    outside the chain cycles (the cycle's one read of its results, the prefill)."""
    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), num_spec_tokens=3, max_batch_size=3,
                             max_seq_len=64)
    model.chain_cycle = Labelled("eagle_fx_chain_cycle", model.chain_cycle)
    prompts = make_prompts(3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        greedy = model.generate(prompts, max_new_tokens=12)
        model.generate(prompts, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)
    names = [e.name for e in prof.events()]
    assert names.count("eagle_fx_chain_cycle") >= 8  # the cycles ran under the label
    assert "aten::_local_scalar_dense" in names  # syncs are seen (outside the cycles): the count can fail
    assert _syncs_inside(prof, "eagle_fx_chain_cycle") == []
    assert greedy.sequences == hf_greedy("llama", prompts, 12)


def test_synthetic_acceptance_follows_its_coin():
    """The bench's real-proportions mode: acceptance by a coin of probability P inside the real cycle.
    Oracles: P=0 accepts nothing, so every token is the base's own argmax (== HF greedy); P=1 accepts
    every draft (mean acceptance length k+1 exactly); P=0.5 gives 1 + P + P^2 + P^3 within 4 sigma."""
    prompts = make_prompts(3)
    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), num_spec_tokens=3)
    cycle = model.chain_cycle
    cycle.use_synthetic_acceptance(0.0)
    out = model.generate(prompts, max_new_tokens=12, eos_token_id=None)
    assert out.sequences == hf_greedy("llama", prompts, 12)
    assert out.stats.num_accepted_tokens == 0
    cycle.use_synthetic_acceptance(1.0)
    out = model.generate(prompts, max_new_tokens=33, eos_token_id=None)
    assert out.stats.mean_acceptance_length == 4.0
    cycle.use_synthetic_acceptance(0.5, seed=3)
    out = model.generate(prompts * 4, max_new_tokens=100, eos_token_id=None)
    drafts = out.stats.num_drafts
    expected = 1 + 0.5 + 0.25 + 0.125
    accepted_sd = (sum((i + 1) ** 2 * p for i, p in enumerate([0.25, 0.125, 0.125])) - (expected - 1) ** 2) ** 0.5
    assert abs(out.stats.mean_acceptance_length - expected) < 4 * accepted_sd / drafts ** 0.5
    with pytest.raises(ValueError, match="runs greedy only"):
        model.generate(prompts, max_new_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="a probability in"):
        cycle.use_synthetic_acceptance(1.5)


def traced_chain_cycle(model, k: int, traced: list | None = None):
    """A ChainCycle of the model's step graphs at k, compiled by dynamo under the runtime's settings
    (compile_dynamic: fullgraph, dynamic sizes, no duck shaping) with a backend that appends each
    graph it traced to `traced` and runs it as traced (cheap: no inductor). Returns (the cycle, traced)."""
    from eagle_fx.runtime.chain_cycle import ChainCycle
    from eagle_fx.runtime.compiled import compile_dynamic

    traced = [] if traced is None else traced

    def counting_backend(gm, example_inputs):
        traced.append(gm)
        return gm.forward

    graphs = {name: getattr(model.graphs, name) for name in ("draft_step", "verify", "draft_extend")}
    cycle = ChainCycle(graphs, model.signatures, model.spec, k, model.draft_offset, model.options.block_size,
                       compiler=lambda fn: compile_dynamic(fn, fullgraph=True, backend=counting_backend))
    return cycle, traced


def test_one_compiled_cycle_serves_every_sampling_setting():
    """Temperature, top-k and top-p are tensor inputs of the compiled cycle: after the first sampled
    generate, generates with other settings compile nothing new (dynamo traced with a counting
    backend, cheap); and the compiled cycle samples exactly what the same function run over the
    executor samples from the same seed (same noise, same tokens)."""
    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), num_spec_tokens=3, max_batch_size=2,
                             max_seq_len=64)
    cycle, compiles = traced_chain_cycle(model, 3)
    prompts = make_prompts(2, lengths=(6, 6))
    settings = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.3, top_k=5), dict(temperature=0.5, top_k=3,
                                                                                       top_p=0.7)]
    eager = [model.generate(prompts, max_new_tokens=10, eos_token_id=None, seed=5, **s).sequences for s in settings]
    model.chain_cycle = cycle
    torch._dynamo.reset()
    first = model.generate(prompts, max_new_tokens=10, eos_token_id=None, seed=5, **settings[0]).sequences
    after_first = len(compiles)
    rest = [model.generate(prompts, max_new_tokens=10, eos_token_id=None, seed=5, **s).sequences for s in settings[1:]]
    assert after_first >= 1 and len(compiles) == after_first  # the compiled cycle ran, and only once per shape
    assert [first] + rest == eager
    assert len({tuple(map(tuple, e)) for e in eager}) == 3  # the settings do change the samples: the test can fail


def test_compiled_cycles_of_every_k_and_setting_do_not_share_one_recompile_budget():
    """The serving engine runs several k on one model: compiled cycles for k = 0..3, one sequence and
    several, greedy and sampling, are more variants than dynamo's recompile limit (8) allows one
    code object; each variant has a code object of its own, so none is refused (it was:
    FailOnRecompileLimitHit)."""
    from eagle_fx.runtime.sampling import Sampler

    model = eagle_fx.compile(tiny_base("llama1"), tiny_draft("llama1", "eagle"), num_spec_tokens=3, max_batch_size=2,
                             max_seq_len=64)
    compiles = []
    torch._dynamo.reset()
    long = dict(dtype=torch.long)
    spec = model.spec
    for k in range(4):
        cycle, _ = traced_chain_cycle(model, k, compiles)
        for num_seqs, sampler in [(1, Sampler()), (2, Sampler()), (2, Sampler.for_call(0.8, 1.0, 0, 1, "cpu"))]:
            table = torch.arange(2 * num_seqs, **long).view(num_seqs, 2)
            cycle(model.executor, sampler, torch.zeros(num_seqs, **long), torch.full((num_seqs,), 5, **long), table,
                  torch.arange(num_seqs, **long), torch.zeros(num_seqs, spec.vocab_size),
                  torch.zeros(num_seqs, spec.draft_hidden_size))
    assert len(compiles) == 4 * 3  # every variant compiled once, none refused


def test_a_compiled_cycle_called_on_a_view_is_not_traced_again_for_a_tensor_that_is_not_one():
    """dynamo guards a view's base: the serving engine's cost probe passed a table made by .view()
    and serving passes cut-and-copied ones, so every k compiled at the probe was traced again inside
    the first requests (25-45 s of inductor each). Views get storage of their own before the call."""
    from eagle_fx.runtime.sampling import Sampler

    model = eagle_fx.compile(tiny_base("llama1"), tiny_draft("llama1", "eagle"), num_spec_tokens=2, max_batch_size=2,
                             max_seq_len=64)
    torch._dynamo.reset()
    long, spec = dict(dtype=torch.long), model.spec
    cycle, compiles = traced_chain_cycle(model, 2)
    logits, hidden = torch.zeros(4, spec.vocab_size), torch.zeros(4, spec.draft_hidden_size)
    tables = [torch.arange(6, **long).view(2, 3),  # a view of a longer tensor
              torch.arange(6, **long).view(2, 3)[:, :2],  # a cut of one
              torch.tensor([[0, 1], [2, 3]], **long)]  # and tensors of their own
    for table in tables:
        cycle(model.executor, Sampler(), torch.zeros(4, **long)[:2], torch.full((2,), 5, **long), table,
              torch.arange(2, **long), logits[:2], hidden[2:])
    assert len(compiles) == 1


@pytest.mark.parametrize("k", [0, 2])
def test_every_matmul_of_a_compiled_cycle_has_a_known_width(k):
    """Each input of a compiled cycle gets a size symbol of its own and a one-sequence cycle pins
    pending's to 1: the verify's positions (from committed_len) then had another row count than its
    tokens, an attention output reshaped by both a symbolic width (64*(4//s0)), and inductor refused
    its C++ GEMM template for those linears (o_proj + residual ran as oneDNN calls at 3-5x the
    template's time). Oracle: in the graph dynamo traces (counting backend, cheap), every linear's
    input width is a number (no free size symbol), at one sequence and at several."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    from eagle_fx.runtime.sampling import Sampler

    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), num_spec_tokens=2, max_batch_size=2,
                             max_seq_len=64)
    torch._dynamo.reset()
    long, spec = dict(dtype=torch.long), model.spec
    cycle, traced = traced_chain_cycle(model, k)
    for num_seqs in (1, 2):
        cycle(model.executor, Sampler(), torch.zeros(num_seqs, **long), torch.full((num_seqs,), 5, **long),
              torch.arange(2 * num_seqs, **long).view(num_seqs, 2).clone(), torch.arange(num_seqs, **long),
              torch.zeros(num_seqs, spec.vocab_size), torch.zeros(num_seqs, spec.draft_hidden_size))
    assert len(traced) == 2
    for gm in traced:
        linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (
            torch.ops.aten.linear.default, torch.nn.functional.linear, torch._C._nn.linear)]
        assert linears  # the test can fail: it finds the step graphs' linears
        widths = {n.name: n.args[0].meta["example_value"].shape[-1] for n in linears}
        assert not {name: str(w) for name, w in widths.items() if free_symbols(w)}
