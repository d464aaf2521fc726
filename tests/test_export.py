"""eagle_fx.export / load_exported: the loaded model decodes exactly like the in-memory one
(same tokens, same accepted drafts) for exported_program and aoti; clear errors otherwise."""
import functools
import json
import shutil

import pytest
import torch

import eagle_fx
from eagle_fx.bundled import BUNDLED
from eagle_fx.export import ExportError

PROMPTS = [list(range(5, 25)), list(range(40, 47)), [3, 9, 4]]


@functools.lru_cache(maxsize=None)
def bundled_model():
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(BUNDLED / "base", dtype=torch.float32).eval()
    return eagle_fx.compile(base, eagle_fx.load_draft(BUNDLED / "eagle", base), max_batch_size=3, max_seq_len=128)


def _pair_weight_bytes() -> int:
    """Bytes of the bundled pair's distinct parameters and buffers (a tensor shared by base and draft once)."""
    model = bundled_model()
    tensors = {}
    for gm in (getattr(model.graphs, name) for name in model.graphs.names()):
        for t in list(gm.parameters()) + list(gm.buffers()):
            tensors[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _same(model, loaded):
    a = model.replace().generate(PROMPTS, max_new_tokens=24)
    b = loaded.generate(PROMPTS, max_new_tokens=24)
    assert a.sequences == b.sequences
    assert a.stats.num_accepted_tokens == b.stats.num_accepted_tokens > 0  # the draft graphs agree too


@pytest.fixture(scope="module")
def exported_bundled(tmp_path_factory):
    """The bundled pair exported once as ExportedPrograms (tests that alter it work on a copy)."""
    return eagle_fx.export(bundled_model(), tmp_path_factory.mktemp("export") / "exported_program")


@pytest.mark.heavy
@pytest.mark.parametrize("target", ["exported_program", "aoti"])
def test_round_trip(tmp_path, target, request):
    model = bundled_model()
    if target == "exported_program":
        out = request.getfixturevalue("exported_bundled")
    else:
        out = eagle_fx.export(model, tmp_path / target, target=target)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == target and set(manifest["graphs"]) == {"base", "verify", "draft_prefill", "draft_extend", "draft_step"}
    assert manifest["num_spec_tokens"] == 3 and manifest["draft_method"] == "eagle" and manifest["kv_share"] == "pool"
    assert manifest["torch_version"] == torch.__version__ and manifest["eagle_fx_version"] == eagle_fx.__version__
    assert manifest["weights_file"] == "weights.safetensors"
    loaded = eagle_fx.load_exported(out)
    assert loaded.graphs is None and loaded.kv_cache.kv_mode == "pool"
    _same(model, loaded)
    # one weights file, no weights or sample KV pool inside the graph files (an AOTInductor package
    # holds its compiled code besides, ~2 MB per graph: that folder is ~1.5x)
    weight_bytes = _pair_weight_bytes()
    assert (out / "weights.safetensors").stat().st_size <= 1.01 * weight_bytes
    if target == "exported_program":
        assert sum(f.stat().st_size for f in out.iterdir()) <= 1.5 * weight_bytes
        assert all((out / g["file"]).stat().st_size < weight_bytes / 10 for g in manifest["graphs"].values())
    if target == "exported_program":  # sizes are dynamic: other batch / pool sizes and k run too
        other = eagle_fx.load_exported(out, max_batch_size=1, num_spec_tokens=2, max_seq_len=256)
        assert other.generate(PROMPTS, max_new_tokens=24).sequences == model.generate(PROMPTS, max_new_tokens=24).sequences


def test_round_trip_kv_sharing_eagle3(tmp_path):
    from conftest import make_prompts, tiny_base
    from eagle_fx.drafts import new_draft

    base = tiny_base("qwen3")
    model = eagle_fx.compile(base, new_draft(base, "eagle3", seed=3, kv_share=-1), max_batch_size=2, max_seq_len=64)
    loaded = eagle_fx.load_exported(eagle_fx.export(model, tmp_path / "x"))
    assert loaded.kv_cache.kv_mode == "layer" and loaded.kv_cache.draft_layer == 3 and torch.equal(loaded.spec.d2t, model.spec.d2t)
    prompts = make_prompts(2)
    assert loaded.generate(prompts, max_new_tokens=10).sequences == model.generate(prompts, max_new_tokens=10).sequences


@pytest.mark.heavy
def test_round_trip_draft_tree(tmp_path):
    """A tree model exports its tree graphs too, and the loaded one accepts the same drafts."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(BUNDLED / "base", dtype=torch.float32).eval()
    tree = dict(top_k=2, depth=3, total_tokens=5)
    model = eagle_fx.compile(base, eagle_fx.load_draft(BUNDLED / "eagle3", base), max_batch_size=3, max_seq_len=128,
                             draft_tree=tree)
    out = eagle_fx.export(model, tmp_path / "tree")
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"verify_tree", "draft_tree_step"} <= set(manifest["graphs"]) and manifest["options"]["draft_tree"] == tree | {"score_temperature": 1.0}
    loaded = eagle_fx.load_exported(out)
    assert loaded.tree == model.tree
    _same(model, loaded)


def test_errors(tmp_path, exported_bundled):
    model = bundled_model()
    with pytest.raises(ExportError, match="target must be one of"):
        eagle_fx.export(model, tmp_path / "bad", target="onnx")
    out = tmp_path / "ok"
    shutil.copytree(exported_bundled, out)
    copy = tmp_path / "old"
    shutil.copytree(out, copy)
    mf = json.loads((copy / "manifest.json").read_text())
    mf["eagle_fx_version"] = "0.0.1"
    (copy / "manifest.json").write_text(json.dumps(mf))
    with pytest.raises(ExportError, match=r"exported by eagle_fx 0.0.1 .* export the model again"):
        eagle_fx.load_exported(copy)
    release = torch.__version__.split("+")[0]
    for torch_version, loads in ((release + "+cu128", True), (release, True), ("2.12.0+cpu", False)):
        mf = json.loads((out / "manifest.json").read_text())
        (copy / "manifest.json").write_text(json.dumps({**mf, "torch_version": torch_version}))
        if loads:  # the local build tag (+cpu, +cu128) is not a version difference
            assert eagle_fx.load_exported(copy).graphs is None
        else:
            with pytest.raises(ExportError, match=r"torch 2.12.0\+cpu .* export the model again"):
                eagle_fx.load_exported(copy)
    mf = json.loads((out / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**mf, "target": "aoti"}))
    with pytest.raises(ExportError, match=r"aoti graphs compiled for cpu; they cannot run on cuda: export again"):
        eagle_fx.load_exported(copy, device="cuda")
    (out / "weights.safetensors").unlink()
    with pytest.raises(ExportError, match=r"missing file\(s\) \['weights.safetensors'\]"):
        eagle_fx.load_exported(out)
    shutil.copy(exported_bundled / "weights.safetensors", out)
    (out / "draft_step.pt2").unlink()
    with pytest.raises(ExportError, match=r"missing file\(s\) \['draft_step.pt2'\]"):
        eagle_fx.load_exported(out)
    with pytest.raises(ExportError, match="not an eagle_fx.export folder"):
        eagle_fx.load_exported(tmp_path / "nothing")
    with pytest.raises(ExportError, match="a loaded model has no graphs"):
        eagle_fx.export(eagle_fx.load_exported(exported_bundled), tmp_path / "again")


def test_tensorrt_needs_torch_tensorrt(tmp_path):
    try:
        import torch_tensorrt  # noqa: F401
    except Exception:
        with pytest.raises(ExportError, match="target='tensorrt' needs torch_tensorrt"):
            eagle_fx.export(bundled_model(), tmp_path / "trt", target="tensorrt")
        return
    pytest.skip("torch_tensorrt imports here: test_tensorrt_round_trip covers it")


def test_tensorrt_round_trip(tmp_path):
    pytest.importorskip("torch_tensorrt", reason="torch_tensorrt does not import here (it needs CUDA and TensorRT)")
    if not torch.cuda.is_available():
        pytest.skip("torch_tensorrt imports but there is no CUDA device to build engines on")
    model = bundled_model()
    out = eagle_fx.export(model, tmp_path / "trt", target="tensorrt")
    _same(model, eagle_fx.load_exported(out))


def test_backends_that_cannot_run_here_say_what_is_missing():
    from conftest import tiny_base, tiny_draft

    base, draft = tiny_base("llama"), tiny_draft("llama", "eagle")
    try:
        import torch_tensorrt  # noqa: F401
        have_trt = True
    except Exception:
        have_trt = False
    if not have_trt:
        with pytest.raises(ValueError, match="backend='tensorrt' cannot run here: .*needs torch_tensorrt"):
            eagle_fx.compile(base, draft, backend="tensorrt")
    elif not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend='tensorrt' cannot run here: the model is on cpu"):
            eagle_fx.compile(base, draft, backend="tensorrt")
    with pytest.raises(ValueError, match="backend must be one of"):
        eagle_fx.compile(base, draft, backend="onnxruntime")
