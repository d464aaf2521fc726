"""Deployment export: the step graphs as files, and a SpeculativeModel loaded back from them.

    eagle_fx.export(model, out_dir, target="exported_program" | "aoti" | "tensorrt")
    model = eagle_fx.load_exported(out_dir)

Each step graph (eagle_fx.graph_kinds: the chain graphs, and with draft_tree the tree graphs),
after every eagle_fx pass, is exported again with torch.export (token, sequence and pool sizes dynamic) and written as

  exported_program  OUT/<graph>.pt2          torch.export.save; runs anywhere torch runs
  aoti              OUT/<graph>.aoti.pt2     AOTInductor package (compiled C++/CUDA; CPU works)
  tensorrt          OUT/<graph>.trt.pt2      torch_tensorrt.dynamo.compile of the ExportedProgram,
                                             saved by torch_tensorrt.save (needs CUDA + torch_tensorrt;
                                             the eagle_fx ops run as PyTorch fallbacks)

plus OUT/weights.safetensors (exported_program and aoti: every weight once, shared by the graphs,
which take their weights as inputs; a TensorRT engine keeps its own), OUT/manifest.json (graph
files, inputs and weight keys, the pair's shapes, k, cache layout, draft method, prefill scheme,
KV-sharing mode, eagle_fx and torch versions) and OUT/tensors.pt (EAGLE-3's d2t and the bootstrap
feature). The KV pools are inputs of the graphs, not state in them, and no example inputs are
stored: the loaded model allocates its own pools, laid out as the manifest says.
`load_exported(out, device=)` moves exported_program graphs to that device; aoti and tensorrt
graphs are compiled for one device type and refuse another.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch

from eagle_fx.draft_kv import DraftKV
from eagle_fx.export_weights import WEIGHTS_FILE, SharedWeights, lift_weights, load_weights
from eagle_fx.graph_kinds import GRAPH_KINDS
from eagle_fx.options import Options
from eagle_fx.runtime import PairSpec, SpeculativeModel
from eagle_fx.runtime.signature import StepSignature
from eagle_fx.version import __version__

TARGETS = ("exported_program", "aoti", "tensorrt")
SUFFIX = {"exported_program": ".pt2", "aoti": ".aoti.pt2", "tensorrt": ".trt.pt2"}
# 2: the pair records draft_kv and mrope; 3: a verify graph of its own (device-side attention);
# 4: weights are graph inputs from one weights.safetensors, no example inputs in the graph files
FORMAT = 4
# the installed eagle_fx (its package metadata; `import eagle_fx` here would close an import cycle)
EAGLE_FX_VERSION = __version__


class ExportError(ValueError):
    pass


def _torch_tensorrt():
    try:
        import torch_tensorrt
    except Exception as e:  # ImportError, or its CUDA libraries failing to load
        raise ExportError(f"target='tensorrt' needs torch_tensorrt, which does not import here ({type(e).__name__}: "
                          f"{e}); install torch-tensorrt on a machine with CUDA and TensorRT") from None
    return torch_tensorrt


def export_step_graph(model: SpeculativeModel, name: str, weights: SharedWeights | None = None):
    """(ExportedProgram, example kwargs, {weight input: file key}) of step graph `name`, sizes
    dynamic. With `weights`, the graph's weights become inputs (w_0, w_1, ... added to `weights`),
    and the program keeps no weights."""
    gm = getattr(model.graphs, name)
    sig = model.signatures[name]
    # scratch pools: this model's KV is untouched; a decode-step graph gets the same rows per sequence
    example = model.replace().example_inputs(name, [3, 3] if sig.uniform_rows else [2, 3],
                                             all_logits=GRAPH_KINDS[name].all_logits)
    dynamic = sig.dynamic_shapes()
    keys = {}
    if weights is not None:
        gm, lifted = lift_weights(gm)
        keys = {w: weights.add(attr, t) for w, (attr, t) in lifted.items()}
        example = example | {w: t for w, (_, t) in lifted.items()}
        dynamic = dynamic | {w: None for w in lifted}
    # size-oblivious: a dimension seen as 2 in the example stays valid at 1 (one sequence, one token)
    with torch.no_grad(), torch.fx.experimental._config.patch(backed_size_oblivious=True):
        ep = torch.export.export(gm, (), kwargs=example, dynamic_shapes=dynamic, strict=False)
    return ep, example, keys


def tensorrt_callables(model: SpeculativeModel) -> dict:
    """Each step graph compiled by torch_tensorrt.dynamo (the eagle_fx ops run as PyTorch fallbacks)."""
    trt = _torch_tensorrt()
    out = {}
    for name in model.graphs.names():
        ep, example, _ = export_step_graph(model, name)
        out[name] = torch.no_grad()(trt.dynamo.compile(ep, arg_inputs=(), kwarg_inputs=example, min_block_size=1))
    return out


def export(model: SpeculativeModel, out_dir, target: str = "exported_program") -> Path:
    """Write `model`'s step graphs for `target` and a manifest to out_dir; returns out_dir."""
    if target not in TARGETS:
        raise ExportError(f"target must be one of {TARGETS}, got {target!r}")
    if not isinstance(model, SpeculativeModel) or model.graphs is None:
        raise ExportError("export takes a model from eagle_fx.compile (a loaded model has no graphs to export)")
    if model.options.tensor_parallel > 1:
        raise ExportError("export a model compiled with tensor_parallel=1 (a rank's sharded graphs hold collectives "
                          "of this process group)")
    trt = _torch_tensorrt() if target == "tensorrt" else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    # exported_program and aoti: weights are graph inputs, in one file; a TensorRT engine keeps its own
    weights = SharedWeights() if target != "tensorrt" else None
    for name in model.graphs.names():
        names = list(model.signatures[name].inputs)
        ep, example, keys = export_step_graph(model, name, weights)
        path = out / f"{name}{SUFFIX[target]}"
        if target == "exported_program":
            ep.example_inputs = None  # torch.export.save would store them: a sample KV pool per file
            torch.export.save(ep, path)
        elif target == "aoti":
            torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
        else:
            compiled = trt.dynamo.compile(ep, arg_inputs=(), kwarg_inputs=example, min_block_size=1)
            trt.save(compiled, str(path), output_format="exported_program", arg_inputs=(), kwarg_inputs=example)
        files[name] = {"file": path.name, "inputs": names, "weights": keys}
    if weights is not None:
        weights.save(out)
    spec = model.spec
    torch.save({"d2t": spec.d2t, "bootstrap": model.options.bootstrap}, out / "tensors.pt")
    o = model.options
    manifest = {
        "format": FORMAT,
        "weights_file": WEIGHTS_FILE if weights is not None else None,
        "eagle_fx_version": EAGLE_FX_VERSION,
        "torch_version": torch.__version__,
        "target": target,
        "graphs": files,
        "pair": {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("d2t", "device", "dtype")}
        | {"dtype": str(spec.dtype).removeprefix("torch."), "device": spec.device.type},
        "options": {f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.name not in ("bootstrap", "draft_tree")}
        | {"draft_tree": None if o.draft_tree is None else dataclasses.asdict(o.draft_tree)},
        "cache_layout": {"kv_pool": "[layers, 2, blocks, block_size, kv_heads, head_dim]", "draft_kv": spec.draft_kv,
                         "pool_layers": int(model.kv_cache.base_pool.shape[0]), "draft_layer": model.kv_cache.draft_layer,
                         "spec_kv": "[2, max_batch_size (+1 scratch), k, kv_heads, head_dim]"
                         if model.kv_cache.spec_kv is not None else None},
        "draft_method": spec.draft_method,
        "num_spec_tokens": o.num_spec_tokens,
        "prefill_shift": o.prefill_shift,
        "kv_share": {DraftKV.OWN: None, DraftKV.POOL: "pool", DraftKV.LAYER: spec.kv_share_layer}[spec.draft_kv],
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
    have = {"eagle_fx": EAGLE_FX_VERSION, "torch": torch.__version__, "format": FORMAT}
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
    weights_file = manifest.get("weights_file")
    if weights_file and not (out / weights_file).exists():
        missing.append(weights_file)
    if missing:
        raise ExportError(f"{out}: missing file(s) {missing} listed in manifest.json; copy the whole export folder")
    tensors = torch.load(out / "tensors.pt", map_location="cpu", weights_only=True)
    pair = dict(manifest["pair"])
    saved = torch.device(pair.pop("device"))
    dev = torch.device(device) if device is not None else saved
    if dev.type != saved.type and target != "exported_program":
        raise ExportError(f"{out} holds {target} graphs compiled for {saved.type}; they cannot run on {dev.type}: "
                          f"export again from a model on {dev.type}, or export with target='exported_program' "
                          "(moves between devices)")
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
    weights = load_weights(out, dev) if weights_file else {}
    callables, signatures = {}, {}
    for name, g in manifest["graphs"].items():
        path = out / g["file"]
        if target == "aoti":
            fn = torch._inductor.aoti_load_package(str(path))
        elif target == "tensorrt":
            _torch_tensorrt()
            fn = torch.export.load(path).module()
        else:
            ep = torch.export.load(path)
            if dev.type != saved.type:  # the graph's own device arguments (factory ops) follow the weights
                ep = torch.export.passes.move_to_device_pass(ep, dev)
            fn = ep.module()
        graph_weights = {w: weights[key] for w, key in g.get("weights", {}).items()}
        callables[name] = torch.no_grad()(functools.partial(fn, **graph_weights) if graph_weights else fn)
        signatures[name] = StepSignature(name, tuple(g["inputs"]))
    options.check_for_pair(spec.vision_language, spec.rope_limit)
    model = SpeculativeModel(None, callables, options, spec, signatures)
    return model.replace(**runtime_options) if runtime_options else model
