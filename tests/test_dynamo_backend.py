"""torch.compile(backend="eagle_fx"): registered by entry point, eagle_fx passes + inductor."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_base


def test_entry_point_works_without_importing_eagle_fx():
    code = ("import sys, torch\n"
            "assert 'eagle_fx' not in sys.modules\n"
            "f = torch.compile(lambda x: torch.sin(x) * 2, backend='eagle_fx', options={'inductor': False})\n"
            "x = torch.randn(5)\n"
            "assert torch.allclose(f(x), torch.sin(x) * 2)\n"
            "assert 'eagle_fx.dynamo_backend' in sys.modules  # torch found it through the entry point\n"
            "print('ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_hf_llama_forward_matches_eager_and_logs_matches():
    base = tiny_base("llama")
    log = []
    fn = torch.compile(lambda ids: base(input_ids=ids, use_cache=False).logits, backend="eagle_fx",
                       options={"pass_log": log})
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = base(input_ids=ids, use_cache=False).logits
        got = fn(ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    lowered = next(line for line in log if line.startswith("lower_to_triton"))
    assert "add_rmsnorm 8" in lowered and "swiglu 4" in lowered  # 4 layers: 2 residual norms each, 4 MLPs
    assert any(line.startswith("canonicalize_attention") for line in log)


class CausalAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_unmasked_causal_sdpa_is_canonicalised():
    m = CausalAttention()
    log = []
    fn = torch.compile(m, backend="eagle_fx", options={"pass_log": log, "passes": ("canonicalize_attention",)})
    x = torch.randn(1, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), m(x), rtol=1e-5, atol=1e-5)
    assert log == ["canonicalize_attention: 1 match(es) (windows [0])"]


def test_unknown_options_are_errors():
    from eagle_fx.dynamo_backend import eagle_fx_backend

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['fuse_everything'\]; the options are"):
        eagle_fx_backend(gm, [torch.randn(1, 2)], {"fuse_everything": True})
    with pytest.raises(ValueError, match=r"unknown pass\(es\) \['magic'\]"):
        eagle_fx_backend(gm, [torch.randn(1, 2)], {"passes": ["magic"]})


# (family, training?, padded batch?): every family in train and eval mode, masked and unmasked
BACKEND_CASES = [("llama", True, False), ("llama", False, True), ("qwen3", True, True), ("qwen3", False, False),
                 ("gpt2", True, True), ("gpt2", False, False), ("falcon_new", True, False), ("phi", False, True)]


@pytest.mark.parametrize("arch,training,padded", BACKEND_CASES)
def test_backend_never_breaks_a_hf_model(arch, training, padded):
    """torch.compile(model, backend="eagle_fx") on HF families, in training mode with a backward
    (grad mode, the default) and in eval mode, with and without a padding mask: logits and every
    parameter's gradient as in eager, and no pass error (a pass that cannot rewrite logs and leaves)."""
    import copy

    from conftest import tiny_base

    model = copy.deepcopy(tiny_base(arch)).train(training)
    if training:
        for m in model.modules():  # dropout off: eager and compiled must see the same function
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0  # left padding on the second row
    log = []
    fn = torch.compile(lambda i, m: model(input_ids=i, attention_mask=m, use_cache=False).logits, backend="eagle_fx",
                       options={"pass_log": log, "inductor": False})
    ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    got = fn(ids, mask)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    got.float().pow(2).mean().backward()
    assert grads and set(grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-5, msg=n)
    assert log and not any("left as is" in line for line in log), log


def test_a_pass_that_fails_leaves_the_graph_and_logs(caplog):
    """A pass error inside the backend is a log line and an unchanged graph, never an exception."""
    from eagle_fx.passes import lower_to_triton

    def broken(gm, ctx=None):
        raise RuntimeError("no pattern for this")

    log = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lower_to_triton, "run", broken)
        fn = torch.compile(lambda x: torch.sin(x) * 2, backend="eagle_fx", options={"pass_log": log, "inductor": False})
        x = torch.randn(5)
        assert torch.allclose(fn(x), torch.sin(x) * 2)
    assert "lower_to_triton: left as is (RuntimeError: no pattern for this)" in log
