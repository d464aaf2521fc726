"""On an accelerator (run by bench/gpu_check.sh with TRITON_INTERPRET=0): the Triton kernels
compiled for the device, and backend="triton" with CUDA graphs, against the same oracles.
Skipped, with the reason, on machines without one (and under the CPU interpreter); what these
tests read of a model is checked on every machine (test_what_the_device_tests_read_exists_here)."""
import os

import pytest
import torch

import eagle_fx
from conftest import hf_greedy, make_prompts, tiny_base, tiny_draft

ACCEL = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
needs_accelerator = pytest.mark.skipif(ACCEL is None, reason="no accelerator on this machine (bench/gpu_check.sh "
                                                                "runs these on a GPU)")
needs_compiled_kernels = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                            reason="TRITON_INTERPRET=1: kernels would run in the CPU interpreter; run "
                                                   "with TRITON_INTERPRET=0")


def replays_cuda_graphs(model) -> bool:
    """Whether `model` replays its static steps as CUDA graphs (the device tests read it here only)."""
    return model.executor.cuda_graphs


def test_what_the_device_tests_read_exists_here():
    """On any machine: the attribute the device tests read exists and says False off CUDA (read as
    `model.cuda_graphs`, gone since the runtime split, the device test failed only on a GPU)."""
    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), static_steps=True, max_batch_size=2,
                             max_seq_len=64)
    assert replays_cuda_graphs(model) is (model.device.type == "cuda")
    assert replays_cuda_graphs(model) is False  # the tiny pair is on the CPU here


@needs_accelerator
@needs_compiled_kernels
def test_kernels_bf16_on_device():
    from eagle_fx.ops.canonical import cached_attention_ref
    from eagle_fx.ops.triton import load_kernels

    load_kernels()
    from eagle_fx.ops.triton import norms, paged_attention, swiglu

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(7, 100, generator=g).to(ACCEL, torch.bfloat16) for _ in range(2))
    w = torch.randn(100, generator=g).to(ACCEL, torch.bfloat16)
    y, s = norms.add_rmsnorm(x, r, w, 1e-6)
    y_ref, s_ref = norms.add_rmsnorm_ref(x, r, w, 1e-6)
    assert torch.equal(s, s_ref)  # rounded to nearest on the device, like eager
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(swiglu.swiglu(x, r), swiglu.swiglu_ref(x, r), rtol=2e-2, atol=2e-2)
    pool = torch.randn(1, 2, 9, 16, 2, 64, generator=g).to(ACCEL, torch.bfloat16)
    pool_ref = pool.clone()
    T = 20
    q = torch.randn(1, 8, T, 64, generator=g).to(ACCEL, torch.bfloat16)
    k, v = (torch.randn(1, 2, T, 64, generator=g).to(ACCEL, torch.bfloat16) for _ in range(2))
    qsl = torch.tensor([0, 17, 20], device=ACCEL)
    pos = torch.cat([torch.arange(17), torch.arange(30, 33)]).to(ACCEL)[None]
    bt = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], device=ACCEL)
    seq = torch.repeat_interleave(torch.arange(2, device=ACCEL), torch.tensor([17, 3], device=ACCEL))
    slots = bt[seq, pos[0] // 16] * 16 + pos[0] % 16
    for window in (0, 5):
        ref = cached_attention_ref(q, k, v, pool_ref, 0, slots, bt, qsl, pos, 0.125, window)
        got = paged_attention.cached_attention(q, k, v, pool, 0, slots, bt, qsl, pos, 0.125, window)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(pool, pool_ref)


@needs_accelerator
@needs_compiled_kernels
@pytest.mark.parametrize("arch,method", [("llama", "eagle"), ("qwen3", "eagle3")])
def test_triton_backend_with_cuda_graphs_matches_hf(arch, method):
    base, draft = tiny_base(arch).to(ACCEL), tiny_draft(arch, method).to(ACCEL)
    try:
        model = eagle_fx.compile(base, draft, backend="triton", max_batch_size=3, max_seq_len=64)
        assert replays_cuda_graphs(model) == (ACCEL.type == "cuda")
        prompts = make_prompts(3)
        out = model.generate(prompts, max_new_tokens=16)
    finally:
        base.to("cpu"), draft.to("cpu")
    assert out.sequences == hf_greedy(arch, prompts, 16)


@needs_accelerator
@needs_compiled_kernels
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_one_function_cycle_on_device_has_no_host_syncs(backend):
    """The chain cycle as one function (compiled as one graph with inductor) on the device: HF
    greedy's tokens, torch.profiler finds no host sync op inside any cycle, and on CUDA every
    cycle runs with torch.cuda.set_sync_debug_mode("error"), under which any synchronising call
    (a .tolist(), .item(), a copy to the host) raises."""
    from test_chain_cycle import Labelled, _syncs_inside

    base, draft = tiny_base("llama").to(ACCEL), tiny_draft("llama", "eagle").to(ACCEL)
    try:
        model = eagle_fx.compile(base, draft, backend=backend, max_batch_size=3, max_seq_len=64)
        assert model.chain_cycle is not None
        cycle = model.chain_cycle
        if ACCEL.type == "cuda":
            cycle = SyncsRaise(cycle)
        model.chain_cycle = Labelled("eagle_fx_chain_cycle", cycle)
        prompts = make_prompts(3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = model.generate(prompts, max_new_tokens=16)
    finally:
        base.to("cpu"), draft.to("cpu")
    assert _syncs_inside(prof, "eagle_fx_chain_cycle") == []
    assert out.sequences == hf_greedy("llama", prompts, 16)


class SyncsRaise:
    """Runs a callable with CUDA's sync debug mode set to "error" (a synchronising call raises)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self.fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
