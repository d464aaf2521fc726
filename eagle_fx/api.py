"""`eagle_fx.compile`: options -> capture -> passes -> backend -> SpeculativeModel."""
from __future__ import annotations

import dataclasses
import logging

import torch

from eagle_fx.capture import capture
from eagle_fx.draft_kv import DraftKV
from eagle_fx.drafts import load_draft
from eagle_fx.kv_share import base_kv_shape, check_pair, resolve_layer
from eagle_fx.multimodal import check_vision_language, image_inputs_for, is_vision_language
from eagle_fx.options import Options
from eagle_fx.pipeline import CapturePlan
from eagle_fx.runtime import PairSpec, SpeculativeModel
from eagle_fx.rope_support import pair_rope_limit
from eagle_fx.runtime.compiled import compile_dynamic
from eagle_fx.unsupported_bases import refuse_unsupported_base

log = logging.getLogger("eagle_fx")

__all__ = ["compile", "load_draft"]


def _check_pair(base, draft) -> None:
    if not isinstance(base, torch.nn.Module) or not hasattr(base, "config"):
        raise TypeError(f"base must be a Hugging Face causal LM (a torch.nn.Module with .config), got {type(base).__name__}")
    if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "body"):
        raise TypeError(f"draft must be an eagle_fx draft (use eagle_fx.load_draft(path, base)), got {type(draft).__name__}")
    refuse_unsupported_base(base)
    bp, dp = next(base.parameters()), next(draft.parameters())
    if bp.device != dp.device:
        raise ValueError(f"base is on {bp.device} but the draft is on {dp.device}; move both to one device (draft.to(base.device))")
    if bp.dtype != dp.dtype:
        raise ValueError(f"base is {bp.dtype} but the draft is {dp.dtype}; cast both to one dtype (draft.to(base.dtype))")
    bc = base.config.get_text_config()
    target = getattr(draft, "target_hidden_size", draft.config.hidden_size)
    if target != bc.hidden_size:
        raise ValueError(f"the draft was built for a base of hidden size {target} (draft hidden size "
                         f"{draft.config.hidden_size}); this base has hidden size {bc.hidden_size}")
    gc = getattr(base, "generation_config", None)
    ignored = [f"{k}={getattr(gc, k)}" for k, neutral in (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0))
               if gc is not None and getattr(gc, k, None) not in (None, neutral)]
    if ignored:
        log.warning("eagle_fx does not apply the base's generation_config %s (it decodes greedy, or samples with "
                    "generate's temperature / top_k / top_p)", ", ".join(ignored))
    if gc is not None and getattr(gc, "do_sample", False):
        log.warning("the base's generation_config samples (do_sample=True, temperature=%s, top_p=%s, top_k=%s); "
                    "eagle_fx's generate decodes greedy unless told: pass generation_config=base.generation_config "
                    "(or temperature=...) to generate to sample as HF generate does", gc.temperature, gc.top_p, gc.top_k)


def _kv_share_layer(base, draft, options: Options) -> int | None:
    """The base layer a KV-sharing draft reads (kv_share=LAYER, or "auto" with a draft trained to
    share), after eagle_fx.kv_share's checks; None when the draft does not share a base layer."""
    ks, trained = options.kv_share, draft.kv_share_layer
    if ks == "auto":
        ks = trained
    if not isinstance(ks, int):
        if trained is not None:
            log.warning("eagle_fx: this draft was trained to read base layer %d's K/V; kv_share=%r runs it on its own "
                        "K/V, which it was not trained for (acceptance drops)", trained, ks)
        return None
    layer = resolve_layer(base, ks)
    check_pair(base, draft, layer, options.prefill_shift)
    if trained != layer:
        log.warning("eagle_fx: kv_share=%d: this draft was trained %s; expect low acceptance", ks,
                    "without KV sharing" if trained is None else f"to read base layer {trained}")
    return layer


def _can_alias_kv(base, draft, options: Options) -> bool:
    """kv_share="pool" applies when the draft's cache slots line up with the base's (unshifted) and
    its K/V have the base's shape; otherwise the draft keeps a pool of its own (said in a log line)."""
    if options.kv_share not in ("pool", "auto"):
        return False
    if options.prefill_shift:
        log.info("eagle_fx: prefill_shift=True: the draft keeps a KV pool of its own (its slots are shifted)")
        return False
    dc, base_kv = draft.config, base_kv_shape(base)
    if (dc.num_key_value_heads, dc.head_dim) != base_kv:
        log.info("eagle_fx: draft kv heads/head dim %s differ from the base's %s: the draft keeps a KV pool of its own",
                 (dc.num_key_value_heads, dc.head_dim), base_kv)
        return False
    return True


def _tensor_parallel_rank(base, world: int) -> tuple[int, str]:
    """(this process's rank, the default group's name) for tensor_parallel=world, after checking
    torch.distributed runs with that many processes and the base's heads divide among them."""
    if world == 1:
        return 0, ""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"tensor_parallel={world} needs torch.distributed: run under `torchrun --nproc-per-node "
                         f"{world}` and call torch.distributed.init_process_group() before eagle_fx.compile")
    if dist.get_world_size() != world:
        raise ValueError(f"tensor_parallel={world} but torch.distributed runs {dist.get_world_size()} processes; "
                         "pass tensor_parallel=torch.distributed.get_world_size()")
    c = base.config.get_text_config()
    kv_heads, _ = base_kv_shape(base)
    for what, count in (("attention heads", c.num_attention_heads), ("kv heads", kv_heads)):
        if count % world:
            raise ValueError(f"tensor_parallel={world}: the base has {count} {what}, not divisible by {world}; "
                             f"use a tensor_parallel that divides {count}")
    return dist.get_rank(), dist.group.WORLD.group_name


def _backend(gm, backend: str):
    """The step graph as a callable for `backend`; always run without autograd (inference only).
    "triton": the lowered graph runs as is (its kernels are the Triton ops)."""
    return compile_dynamic(gm) if backend == "inductor" else torch.no_grad()(gm)


def compile(base, draft, num_spec_tokens: int = 3, prefill_shift: bool = False, backend: str = "eager",  # noqa: A001
            max_batch_size: int = 8, max_seq_len: int = 2048, block_size: int = 16,
            prefill_chunk_size: int | None = None, prefix_caching: bool = False, bootstrap=None,
            num_blocks: int | None = None, batch_invariant: bool = False, kv_share="auto",
            static_steps: bool | None = None, draft_tree: dict | None = None,
            tensor_parallel: int = 1, gemm_autotune: bool = True) -> SpeculativeModel:
    """Capture `base` + `draft` as step graphs, run the passes, and return a SpeculativeModel.

    prefill_shift=False (default): the draft prefill is unshifted (drop_prefill_shift), so draft
    KV is keyed like base KV; True gives the shifted reference scheme. prefill_chunk_size splits
    prefill into chunks; prefix_caching reuses full KV blocks across requests (LRU eviction);
    bootstrap is the unshifted scheme's feature before t_0 (zeros by default). batch_invariant
    makes every token's numerics independent of chunking and batching (bit-identical KV), slower.
    kv_share="pool" puts the draft's KV in one more layer of the base's pool when the scheme is
    unshifted and the draft's kv heads and head dim match the base's (else the draft keeps its own
    pool). kv_share=LAYER (int, negative counts from the end) makes the draft read base layer
    LAYER's K/V for every committed position and keep only its speculated positions' K/V; its
    prefill and extend compute one row per sequence (eagle_fx.kv_share has the rules and errors).
    kv_share="auto" (default): the draft's trained LAYER for a sharing draft, else "pool".
    kv_share=None: the draft keeps a pool of its own.
    backend: "eager" (the step graphs as GraphModules), "inductor" (torch.compile of each graph,
    warmed up here), "triton" (lower_to_triton swaps in the Triton kernels; needs CUDA, or
    TRITON_INTERPRET=1 set before eagle_fx is imported). static_steps runs the draft step and the
    verify over per-batch-bucket static buffers, captured as CUDA graphs on a GPU (default: on for
    backend="triton"). "tensorrt": each step graph exported and compiled by torch_tensorrt (CUDA).
    gemm_autotune (backend="inductor" on a CPU): the compiled chain cycle picks every matmul's
    kernel by benchmarking inductor's C++ GEMM template against ATen (the fast CPU decode; False
    compiles in about a third of the time, for tests and quick tries).
    draft_tree=dict(top_k=, depth=, total_tokens=): EAGLE-2 dynamic draft trees instead of a chain
    of num_spec_tokens (eagle_fx.draft_tree); the verify is total_tokens + 1 rows per sequence. The
    tree steps run as plain graph calls (no static buffers). model.replace(draft_tree=None,
    num_spec_tokens=k) gives the chain over the same graphs.
    A vision-language base (LLaVA or Qwen2-VL family: `get_image_features`, image placeholder
    tokens): the draft attaches to its language model, and generate(..., pixel_values=[...],
    image_grid_thw=[...]) takes each prompt's images (eagle_fx.multimodal).
    tensor_parallel=N (under torchrun with N processes, torch.distributed initialised): each rank
    runs its shard of the base (shard_tensor_parallel: column-parallel q/k/v and gate/up,
    row-parallel o/down with an all-reduce, a KV pool of KVH/N heads) and the whole draft, with a
    KV pool of its own; every rank computes the same logits, so every rank returns the same output.
    """
    options = Options(num_spec_tokens=num_spec_tokens, prefill_shift=prefill_shift, backend=backend,
                      max_batch_size=max_batch_size, max_seq_len=max_seq_len, block_size=block_size,
                      prefill_chunk_size=prefill_chunk_size, prefix_caching=prefix_caching, bootstrap=bootstrap,
                      num_blocks=num_blocks, batch_invariant=batch_invariant, kv_share=kv_share,
                      static_steps=static_steps, draft_tree=draft_tree, tensor_parallel=tensor_parallel,
                      gemm_autotune=gemm_autotune)
    _check_pair(base, draft)
    tp_rank, tp_group = _tensor_parallel_rank(base, options.tensor_parallel)
    rope_limit = pair_rope_limit(base, draft)
    base.eval()
    draft.eval()
    images = image_inputs_for(base) if is_vision_language(base) else None  # the vision-language handling, if any
    if images is not None:  # before the capture: fail fast
        check_vision_language(base)
    options.check_for_pair(images is not None, rope_limit)  # before the capture: fail fast
    if images is not None and options.tensor_parallel > 1:
        raise ValueError("tensor_parallel does not run vision-language bases yet; use tensor_parallel=1")
    # a sharded base pool holds KVH/N heads per rank, the replicated draft all of its own: its own pool
    layer = _kv_share_layer(base, draft, options) if images is None and options.tensor_parallel == 1 else None
    if layer is not None and options.kv_share != layer:  # "auto" as the layer it resolved to: Options checks it
        options = dataclasses.replace(options, kv_share=layer)
    device = next(base.parameters()).device
    if options.backend == "triton":
        from eagle_fx.ops.triton import triton_status

        ok, why = triton_status(device)
        if not ok:
            raise ValueError(f"backend='triton' cannot run here: {why}")
    if options.backend == "tensorrt":
        from eagle_fx.export import ExportError, _torch_tensorrt

        try:
            _torch_tensorrt()
        except ExportError as e:
            raise ValueError(f"backend='tensorrt' cannot run here: {e}") from None
        if device.type != "cuda":
            raise ValueError(f"backend='tensorrt' cannot run here: the model is on {device.type}; TensorRT engines need CUDA")
    draft_kv = (DraftKV.LAYER if layer is not None else DraftKV.POOL
                if options.tensor_parallel == 1 and _can_alias_kv(base, draft, options) else DraftKV.OWN)
    plan = CapturePlan(prefill_shift=options.prefill_shift, batch_invariant=options.batch_invariant, draft_kv=draft_kv,
                       kv_share_layer=layer, lower_to_triton=options.backend == "triton",
                       tree=options.draft_tree is not None, vision_language=images is not None,
                       mrope=images is not None and images.mrope,
                       tensor_parallel=(tp_rank, options.tensor_parallel), tensor_parallel_group=tp_group)
    graphs = capture(base, draft, plan)
    callables = {name: _backend(getattr(graphs, name), options.backend) for name in graphs.names()}
    spec = PairSpec.from_pair(base, draft, draft_kv=draft_kv, kv_share_layer=layer, mrope=plan.mrope,
                              rope_limit=rope_limit, tensor_parallel=options.tensor_parallel)
    model = SpeculativeModel(graphs, callables, options, spec, image_encoder=images)
    if options.backend == "tensorrt":  # the same graphs, exported and built into TensorRT engines
        from eagle_fx.export import tensorrt_callables

        model = SpeculativeModel(graphs, tensorrt_callables(model), options, model.spec, image_encoder=model.image_encoder)
    if options.backend == "inductor":
        model.warmup()  # compile every shape class now, not inside the first generate
    return model

