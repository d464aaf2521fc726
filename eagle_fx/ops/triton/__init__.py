"""Triton kernels for the canonical ops, lowered in by `passes/lower_to_triton.py`.

Each kernel module holds the `@triton.jit` kernel, its launcher registered as a
`torch.library.custom_op` (with a fake impl, so graphs with it export and compile) and a plain
torch reference the tests hold it to:

    norms.py          rmsnorm, add_rmsnorm (residual add fused)
    swiglu.py         silu(gate) * up
    draft_input.py    the draft's input projection: embedding gather + concat (+ EAGLE-3's two
                      norms) + linear, in one kernel
    paged_kv.py       the KV write by slot mapping (launched by the attention op, no op of its own)
    paged_attention.py  paged attention over the pool for ragged prefill, extend, decode and
                      verify (GQA, sliding window), and the op that writes then attends

The kernel modules import Triton and define kernels when first imported; Triton reads
TRITON_INTERPRET at that point, so on a CPU set TRITON_INTERPRET=1 before importing them.
`triton_status(device)` says whether they can run, without importing them.
"""
from __future__ import annotations

import importlib.util
import os


def triton_status(device) -> tuple[bool, str]:
    """(can the kernels run on `device`, why not)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton)"
    dev_type = getattr(device, "type", str(device))
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "Triton interpreter (TRITON_INTERPRET=1)"
    if dev_type != "cuda":
        return False, (f"the model is on {dev_type}: Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set "
                       "before eagle_fx is imported (the slow CPU interpreter)")
    return True, "CUDA"


def load_kernels():
    """Import the kernel modules (registers the eagle_fx::triton_* ops); returns the package."""
    from eagle_fx.ops.triton import draft_input, norms, paged_attention, paged_kv, swiglu  # noqa: F401

    return importlib.import_module("eagle_fx.ops.triton")
