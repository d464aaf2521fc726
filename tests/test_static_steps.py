"""backend="triton" end to end (interpreter) and the static-buffer discipline of the fixed-shape
steps (draft step, verify), which on a GPU are replayed as CUDA graphs."""
import pytest
import torch

import eagle_fx
from conftest import hf_greedy, make_prompts, tiny_base, tiny_draft
from eagle_fx.runtime.static_buffers import buckets


@pytest.mark.heavy
@pytest.mark.parametrize("arch,method,num_prompts,new_tokens", [("llama", "eagle", 2, 4), ("qwen3", "eagle3", 1, 4)])
def test_triton_backend_matches_hf(arch, method, num_prompts, new_tokens):
    model = eagle_fx.compile(tiny_base(arch), tiny_draft(arch, method), backend="triton", max_batch_size=3,
                             max_seq_len=48)
    assert model.static_steps and not model.executor.cuda_graphs  # CPU: static buffers, no capture
    lowered = [line for line in model.graphs.pass_log if "lower_to_triton" in line]
    assert len(lowered) == 5 and all("attention 1" in line or "attention 4" in line for line in lowered)
    prompts = make_prompts(num_prompts)  # the Triton interpreter is slow: a ragged pair (llama), a few tokens
    assert model.generate(prompts, max_new_tokens=new_tokens).sequences == hf_greedy(arch, prompts, new_tokens)


def test_triton_backend_refused_without_a_way_to_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' cannot run here: .*CUDA device, or TRITON_INTERPRET=1"):
        eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), backend="triton")


class BufferLog:
    """Records the data pointers of the static inputs each call of one step uses (an executor observer)."""

    def __init__(self, model, name):
        self.name, self.step, self.seen = name, model.executor.static[name], []
        model.executor.add_observer(self)

    def __call__(self, graph, inputs, out):
        if graph != self.name:
            return
        bucket = self.step.bucket_for(inputs["block_table"].shape[0])
        self.seen.append((bucket, {k: v.data_ptr() for k, v in self.step.static[bucket].items() if k != "_pad"}))


@pytest.mark.parametrize("kw", [{}, {"prefill_shift": True}, {"kv_share": -1}])
def test_static_buffers_stable_and_padding_inert(kw):
    """Across every step of a ragged batch (sequences finish at different times, so the batch
    shrinks through buckets 5 -> 4 -> 2 -> 1): one buffer set per bucket, reused at the same
    addresses; padding sequences write only the scratch block; output == HF greedy."""
    from eagle_fx.drafts import new_draft

    base = tiny_base("llama")
    draft = new_draft(base, "eagle", seed=7, kv_share=kw.pop("kv_share", None))
    model = eagle_fx.compile(base, draft, max_batch_size=5, max_seq_len=64, static_steps=True, **kw)
    assert buckets(5) == [1, 2, 4, 5]
    logs = {}
    for name in ("draft_step", "verify"):
        logs[name] = BufferLog(model, name)
    handed_out = set()
    allocate = model.kv_cache.allocator.allocate
    model.kv_cache.allocator.allocate = lambda n: handed_out.update(b := allocate(n)) or b
    prompts = make_prompts(5, seed=2, lengths=(3, 9, 5, 14, 2))
    eos = hf_greedy("llama", prompts, 16)[0][4]
    out = model.generate(prompts, max_new_tokens=16, eos_token_id=eos)
    assert out.sequences == hf_greedy("llama", prompts, 16, eos)
    for name, log in logs.items():
        used = sorted({b for b, _ in log.seen})
        assert len(used) >= 2, used  # the batch shrank through buckets
        for b in used:
            ptrs = [p for bb, p in log.seen if bb == b]
            assert all(p == ptrs[0] for p in ptrs), f"{name}: bucket {b} reallocated its buffers"
        assert set(log.step.static) == set(used)
    scratch = model.kv_cache.allocator.num_blocks  # one block past the allocator's
    pool = model.kv_cache.base_pool
    assert pool.shape[2] == scratch + 1
    never = sorted(set(range(scratch)) - handed_out)
    assert never and pool[:, :, never].abs().sum() == 0  # padding wrote no real block
    assert pool[:, :, scratch].abs().sum() > 0  # it wrote the scratch block


@pytest.mark.parametrize("kw", [{}, {"prefill_chunk_size": 5, "prefix_caching": True}, {"prefill_shift": True},
                                {"kv_share": 1, "prefill_chunk_size": 7}])
def test_static_prefill_buckets(kw):
    """Prefill over (batch, token) buckets: same output as HF, same KV as the unbucketed run
    (padding rows change only GEMM row counts), one buffer set per bucket used."""
    from eagle_fx.drafts import new_draft

    base = tiny_base("llama")
    draft = new_draft(base, "eagle", seed=7, kv_share=kw.pop("kv_share", None))
    prompts = make_prompts(4, seed=6, lengths=(3, 21, 9, 17))
    prompts = prompts + [p + [1, 2] for p in prompts]  # wave 2 re-uses wave 1's blocks with prefix caching
    runs = {}
    for static in (False, True):
        model = eagle_fx.compile(base, draft, max_batch_size=4, max_seq_len=64, static_steps=static, **kw)
        runs[static] = (model, model.generate(prompts, max_new_tokens=10))
    model, out = runs[True]
    assert out.sequences == hf_greedy("llama", prompts, 10) == runs[False][1].sequences
    n = model.kv_cache.allocator.num_blocks
    torch.testing.assert_close(model.kv_cache.base_pool[:, :, :n], runs[False][0].kv_cache.base_pool[:, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.kv_cache.draft_pool[:, :, :n], runs[False][0].kv_cache.draft_pool[:, :, :n], rtol=1e-5, atol=1e-5)
    used = {name: set(step.static) for name, step in model.executor.static.items()}
    assert used["base"] and all(tb >= 16 and (tb & (tb - 1)) == 0 for _, tb in used["base"])


def test_static_prefill_padding_longer_than_a_block_table_row():
    """4 x 40 prompt tokens pad to a 256-token bucket: the padding sequence is longer than a
    sequence's block-table span (5 blocks of 16) and must wrap inside its scratch row."""
    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), max_batch_size=4, max_seq_len=64,
                             static_steps=True)
    prompts = make_prompts(4, seed=8, lengths=(40,))
    assert model.generate(prompts, max_new_tokens=4).sequences == hf_greedy("llama", prompts, 4)
    assert (4, 256) in model.executor.static["base"].static
