"""Deployment export: the step graphs as files, and a SpeculativeModel loaded back from them.

    eagle_fx.export(model, out_dir, target="exported_program" | "aoti" | "tensorrt")
    model = eagle_fx.load_exported(out_dir)

Each step graph (base, verify, draft_prefill, draft_extend, draft_step, and with draft_tree
verify_tree and draft_tree_step), after every eagle_fx pass, is
exported again with torch.export (token, sequence and pool sizes dynamic) and written as

  exported_program  OUT/<graph>.pt2          torch.export.save; runs anywhere torch runs
  aoti              OUT/<graph>.aoti.pt2     AOTInductor package (compiled C++/CUDA; CPU works)
  tensorrt          OUT/<graph>.trt.pt2      torch_tensorrt.dynamo.compile of the ExportedProgram,
                                             saved by torch_tensorrt.save (needs CUDA + torch_tensorrt;
                                             the eagle_fx ops run as PyTorch fallbacks)

plus OUT/manifest.json (graph files and inputs, the pair's shapes, k, cache layout, draft method,
prefill scheme, KV-sharing mode, eagle_fx and torch versions) and OUT/tensors.pt (EAGLE-3's d2t
and the bootstrap feature). The KV pools are inputs of the graphs, not state in them: the loaded
model allocates its own, laid out as the manifest says.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

import eagle_fx
from eagle_fx.options import Options
from eagle_fx.runtime import PairSpec, SpeculativeModel
from eagle_fx.runtime.signature import StepSignature

TARGETS = ("exported_program", "aoti", "tensorrt")
SUFFIX = {"exported_program": ".pt2", "aoti": ".aoti.pt2", "tensorrt": ".trt.pt2"}
FORMAT = 3  # 2: the pair records draft_kv and mrope; 3: a verify graph of its own (device-side attention)


class ExportError(ValueError):
    pass


def _torch_tensorrt():
    try:
        import torch_tensorrt
    except Exception as e:  # ImportError, or its CUDA libraries failing to load
        raise ExportError(f"target='tensorrt' needs torch_tensorrt, which does not import here ({type(e).__name__}: "
                          f"{e}); install torch-tensorrt on a machine with CUDA and TensorRT") from None
    return torch_tensorrt


def export_step_graph(model: SpeculativeModel, name: str):
    """(ExportedProgram, example kwargs) of step graph `name`, sizes dynamic."""
    gm = getattr(model.graphs, name)
    sig = model.signatures[name]
    # scratch pools: this model's KV is untouched; a decode-step graph gets the same rows per sequence
    example = model.replace().example_inputs(name, [3, 3] if sig.uniform_rows else [2, 3],
                                             all_logits=name in ("verify", "verify_tree"))
    # size-oblivious: a dimension seen as 2 in the example stays valid at 1 (one sequence, one token)
    with torch.no_grad(), torch.fx.experimental._config.patch(backed_size_oblivious=True):
        ep = torch.export.export(gm, (), kwargs=example, dynamic_shapes=model.signatures[name].dynamic_shapes(),
                                 strict=False)
    return ep, example


def tensorrt_callables(model: SpeculativeModel) -> dict:
    """Each step graph compiled by torch_tensorrt.dynamo (the eagle_fx ops run as PyTorch fallbacks)."""
    trt = _torch_tensorrt()
    out = {}
    for name in model.graphs.names():
        ep, example = export_step_graph(model, name)
        out[name] = torch.no_grad()(trt.dynamo.compile(ep, arg_inputs=(), kwarg_inputs=example, min_block_size=1))
    return out


def export(model: SpeculativeModel, out_dir, target: str = "exported_program") -> Path:
    """Write `model`'s step graphs for `target` and a manifest to out_dir; returns out_dir."""
    if target not in TARGETS:
        raise ExportError(f"target must be one of {TARGETS}, got {target!r}")
    if not isinstance(model, SpeculativeModel) or model.graphs is None:
        raise ExportError("export takes a model from eagle_fx.compile (a loaded model has no graphs to export)")
    trt = _torch_tensorrt() if target == "tensorrt" else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in model.graphs.names():
        names = list(model.signatures[name].inputs)
        ep, example = export_step_graph(model, name)
        path = out / f"{name}{SUFFIX[target]}"
        if target == "exported_program":
            torch.export.save(ep, path)
        elif target == "aoti":
            torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
        else:
            compiled = trt.dynamo.compile(ep, arg_inputs=(), kwarg_inputs=example, min_block_size=1)
            trt.save(compiled, str(path), output_format="exported_program", arg_inputs=(), kwarg_inputs=example)
        files[name] = {"file": path.name, "inputs": names}
    spec = model.spec
    torch.save({"d2t": spec.d2t, "bootstrap": model.options.bootstrap}, out / "tensors.pt")
    o = model.options
    manifest = {
        "format": FORMAT,
        "eagle_fx_version": eagle_fx.__version__,
        "torch_version": torch.__version__,
        "target": target,
        "graphs": files,
        "pair": {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("d2t", "device", "dtype")}
        | {"dtype": str(spec.dtype).removeprefix("torch."), "device": spec.device.type},
        "options": {f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.name not in ("bootstrap", "draft_tree")}
        | {"draft_tree": None if o.draft_tree is None else dataclasses.asdict(o.draft_tree)},
        "cache_layout": {"kv_pool": "[layers, 2, blocks, block_size, kv_heads, head_dim]", "kv_mode": spec.draft_kv,
                         "pool_layers": int(model.kv_cache.base_pool.shape[0]), "draft_layer": model.kv_cache.draft_layer,
                         "spec_kv": "[2, max_batch_size (+1 scratch), k, kv_heads, head_dim]"
                         if model.kv_cache.spec_kv is not None else None},
        "draft_method": spec.draft_method,
        "num_spec_tokens": o.num_spec_tokens,
        "prefill_shift": o.prefill_shift,
        "kv_share": {"own": None, "pool": "pool", "layer": spec.kv_share_layer}[spec.draft_kv],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    return out


def load_exported(out_dir, device=None, **runtime_options) -> SpeculativeModel:
    """A SpeculativeModel running the graphs `eagle_fx.export` wrote to out_dir. runtime_options
    (num_spec_tokens, max_batch_size, max_seq_len, prefill_chunk_size, prefix_caching, ...) override
    the exported model's, as in model.replace()."""
    out = Path(out_dir)
    mf = out / "manifest.json"
    if not mf.exists():
        raise ExportError(f"{mf}: missing; {out} is not an eagle_fx.export folder")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{mf}: not valid JSON ({e})") from None
    have = {"eagle_fx": eagle_fx.__version__, "torch": torch.__version__, "format": FORMAT}
    was = {"eagle_fx": manifest.get("eagle_fx_version"), "torch": manifest.get("torch_version"),
           "format": manifest.get("format")}

    def release(versions: dict) -> dict:  # without torch's local build tag (+cpu, +cu128): the same release
        return {**versions, "torch": str(versions["torch"]).split("+")[0]}

    if release(was) != release(have):
        raise ExportError(f"{mf}: exported by eagle_fx {was['eagle_fx']} / torch {was['torch']} (format {was['format']}); "
                          f"this is eagle_fx {have['eagle_fx']} / torch {have['torch']} (format {have['format']}): "
                          "export the model again with this version")
    target = manifest["target"]
    missing = [g["file"] for g in manifest["graphs"].values() if not (out / g["file"]).exists()]
    if not (out / "tensors.pt").exists():
        missing.append("tensors.pt")
    if missing:
        raise ExportError(f"{out}: missing file(s) {missing} listed in manifest.json; copy the whole export folder")
    tensors = torch.load(out / "tensors.pt", map_location="cpu", weights_only=True)
    pair = dict(manifest["pair"])
    dev = torch.device(device) if device is not None else torch.device(pair.pop("device"))
    pair.pop("device", None)
    spec = PairSpec(**{**pair, "eos": tuple(pair["eos"]), "dtype": getattr(torch, pair["dtype"]), "device": dev,
                       "d2t": None if tensors["d2t"] is None else tensors["d2t"].to(dev)})
    options = Options(**{**manifest["options"], "bootstrap": tensors["bootstrap"]})
    if options.backend == "triton":  # the graphs call eagle_fx::triton_* ops: define them first
        from eagle_fx.ops.triton import load_kernels, triton_status

        ok, why = triton_status(dev)
        if not ok:
            raise ExportError(f"{out} was exported from backend='triton': its graphs need the Triton kernels, "
                              f"which cannot run here ({why})")
        load_kernels()
    callables, signatures = {}, {}
    for name, g in manifest["graphs"].items():
        path = out / g["file"]
        if target == "aoti":
            fn = torch._inductor.aoti_load_package(str(path))
        elif target == "tensorrt":
            _torch_tensorrt()
            fn = torch.export.load(path).module()
        else:
            fn = torch.export.load(path).module()
        callables[name] = torch.no_grad()(fn)
        signatures[name] = StepSignature(name, tuple(g["inputs"]))
    model = SpeculativeModel(None, callables, options, spec, signatures)
    return model.replace(**runtime_options) if runtime_options else model
