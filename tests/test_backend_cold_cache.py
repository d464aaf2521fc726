"""torch.compile(backend="eagle_fx") from a cold inductor cache, in training mode with a backward.

A warm cache once hid a backward that failed on every fresh machine (the backend ran a second
AOTAutograd inside the first, which lost the forward's output strides the backward is compiled
for: "expected ... stride 8==72" in backward()). So these compile in a subprocess with its own
empty TORCHINDUCTOR_CACHE_DIR, the way a new user does: several small Hugging Face Llama models
(GQA and MHA, head dims 8, 16 and 64) called from one compiled function, so one cold inductor
compile of the forward and one of the backward cover them all. Oracle: eager Hugging Face, logits
and every parameter's gradient.
"""
import os
import subprocess
import sys
import tempfile

import pytest

# (name, query heads, kv heads, head dim); one hidden size, so the models' other kernels are the
# same source and compile once
CONFIGS = [("gqa_d8", 8, 2, 8), ("mha_d16", 4, 4, 16), ("gqa_d64", 2, 1, 64)]


def _compare_compiled_to_eager() -> None:
    """Run in the subprocess: eager forward + backward, then compiled, then compare."""
    import torch
    import transformers

    models = []
    for i, (_, heads, kv_heads, head_dim) in enumerate(CONFIGS):
        torch.manual_seed(i)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
        models.append(transformers.LlamaForCausalLM(config).train())  # train mode, as the snippet
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))

    def forward(ids):
        return [m(input_ids=ids).logits for m in models]

    def run(fn):
        for m in models:
            m.zero_grad(set_to_none=True)
        logits = fn(ids)
        sum(x.float().pow(2).mean() for x in logits).backward()
        grads = [{n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None} for m in models]
        return [x.detach() for x in logits], grads

    want_logits, want_grads = run(forward)
    log = []
    got_logits, got_grads = run(torch.compile(forward, backend="eagle_fx", options={"pass_log": log}))
    for (name, *_), got, want, got_g, want_g in zip(CONFIGS, got_logits, want_logits, got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} logits: {m}")
        assert want_g and set(got_g) == set(want_g), name
        for p in want_g:
            torch.testing.assert_close(got_g[p], want_g[p], rtol=1e-3, atol=1e-5, msg=lambda m: f"{name} {p}: {m}")
    assert log and not any("left as is" in line for line in log), log
    print("ok", len(CONFIGS))


@pytest.mark.heavy
def test_backend_trains_from_a_cold_inductor_cache():
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        env.pop("TRITON_INTERPRET", None)  # a new user on a CPU: the Triton lowering is skipped
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no compile-worker pool to start for a few kernels
        out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith(f"ok {len(CONFIGS)}"), out.stderr[-4000:]


if __name__ == "__main__":
    _compare_compiled_to_eager()
