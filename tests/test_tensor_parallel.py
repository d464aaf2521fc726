"""tensor_parallel=2 on CPU: two processes (gloo) run examples/tensor_parallel.py under torchrun;
their output equals the single-process output and HF greedy, fp32, and each rank's base KV pool
is half the single one. The pass on its own: shard counts and refusals."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.heavy
def test_two_ranks_equal_single_process_and_hf_greedy():
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous (torchrun's --master-port 0 waits forever)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                          str(ROOT / "examples" / "tensor_parallel.py"), "--num-prompts", "3", "--max-new-tokens", "24"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for line in ("every rank decoded the same tokens: True", "tp greedy == single: True", "tp greedy == HF greedy: True",
                 "(single process:", "0.50x)"):
        assert line in text, text


def test_refused_without_torch_distributed_and_for_fused_projections():
    import eagle_fx
    from conftest import tiny_base, tiny_draft

    with pytest.raises(ValueError, match=r"tensor_parallel=2 needs torch.distributed: run under `torchrun "
                                         r"--nproc-per-node 2`"):
        eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), tensor_parallel=2)
    with pytest.raises(ValueError, match="tensor_parallel=2 runs with backend 'eager' or 'inductor', not 'triton'"):
        eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), tensor_parallel=2, backend="triton")


def test_pass_shards_every_projection_and_refuses_fused_ones():
    """The pass on a captured base graph, as rank 1 of 2: 7 projections per layer rewritten, a
    reduction after each row-parallel one, weights halved; a fused-qkv family is an error."""
    from conftest import tiny_base, tiny_draft
    from eagle_fx.capture import capture
    from eagle_fx.passes import PassContext, shard_tensor_parallel
    from eagle_fx.passes.fx_graph import copy_graph_module
    from eagle_fx.pipeline import CapturePlan

    graphs = capture(tiny_base("llama"), tiny_draft("llama", "eagle"), CapturePlan())
    gm = copy_graph_module(graphs.base)
    res = shard_tensor_parallel.run(gm, PassContext(tensor_parallel=(1, 2), tensor_parallel_group="0"))
    assert res.num_matches == 7 * 4
    reductions = [n for n in gm.graph.nodes if n.target == torch.ops._c10d_functional.all_reduce.default]
    assert len(reductions) == 2 * 4
    q = tiny_base("llama").model.layers[0].self_attn.q_proj.weight
    shard = next(getattr(gm, n) for n, _ in gm.named_buffers() if "layers_0_self_attn_q_proj" in n)
    assert torch.equal(shard, q[q.shape[0] // 2:])
    falcon = capture(tiny_base("falcon_new"), tiny_draft("falcon_new", "eagle"), CapturePlan())
    with pytest.raises(ValueError, match=r"needs Llama-style projections .* this base's linear layers are"):
        shard_tensor_parallel.run(copy_graph_module(falcon.base), PassContext(tensor_parallel=(0, 2)))
