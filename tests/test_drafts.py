"""load_draft reads SafeAILab EAGLE-1/EAGLE-3 and speculators EAGLE-3, and refuses bad files clearly."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_base
from eagle_fx import load_draft
from eagle_fx.drafts import DraftLoadError, Eagle1Draft, Eagle3Draft, new_draft, save_draft


def _outputs(draft, base):
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (1, 7))
    pos = torch.arange(7)[None]
    feats = torch.randn(7, draft.feature_dim)
    with torch.no_grad():
        out = draft.body(ids, pos, draft.project(feats)[None])[0]
        return draft.logits(out, base.lm_head)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("embeddings", [True, False])
def test_safeai_roundtrip(tmp_draft_dir, method, embeddings):
    base = tiny_base("llama")
    draft = new_draft(base, method, seed=3)
    save_draft(draft, tmp_draft_dir, include_embeddings=embeddings)
    keys = set(load_file(str(tmp_draft_dir / "model.safetensors")))
    if method == "eagle":
        assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.post_attention_layernorm.weight"} <= keys
        assert not any("input_layernorm" in k for k in keys) and "norm.weight" not in keys
    else:
        assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight", "lm_head.weight", "d2t"} <= keys
        assert load_file(str(tmp_draft_dir / "model.safetensors"))["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert ("embed_tokens.weight" in keys) == embeddings
    loaded = load_draft(tmp_draft_dir, base)
    assert type(loaded) is type(draft)
    torch.testing.assert_close(_outputs(loaded, base), _outputs(draft, base))


def test_eagle1_bin_without_bias(tmp_draft_dir):
    base = tiny_base("qwen2")
    draft = new_draft(base, "eagle", seed=4, bias=False)
    save_draft(draft, tmp_draft_dir)
    state = load_file(str(tmp_draft_dir / "model.safetensors"))
    (tmp_draft_dir / "model.safetensors").unlink()
    torch.save(state, tmp_draft_dir / "pytorch_model.bin")
    cfg = json.loads((tmp_draft_dir / "config.json").read_text())
    assert cfg["bias"] is False and "fc.bias" not in state
    loaded = load_draft(tmp_draft_dir, base)
    assert loaded.fc.bias is None
    torch.testing.assert_close(_outputs(loaded, base), _outputs(draft, base))


def test_speculators_layout(tmp_draft_dir):
    base = tiny_base("llama")
    draft = new_draft(base, "eagle3", seed=5, draft_vocab_size=64)
    draft.d2t.copy_(torch.arange(64) % 3)  # target = draft + d2t[draft]
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    tmp_draft_dir.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_draft_dir / "model.safetensors"))
    cfg = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "draft_vocab_size": 64,
        "norm_before_residual": False, "target_hidden_size": 64, "eagle_aux_hidden_state_layer_ids": [2, 2, 1],
        "transformer_layer_config": draft.config.to_dict(),
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}], "verifier": {"architectures": ["LlamaForCausalLM"]}},
    }
    (tmp_draft_dir / "config.json").write_text(json.dumps(cfg, default=str))
    loaded = load_draft(tmp_draft_dir, base)
    assert isinstance(loaded, Eagle3Draft) and loaded.aux_layer_ids == (2, 2, 1)
    torch.testing.assert_close(_outputs(loaded, base), _outputs(draft, base))
    assert loaded.to_target(torch.tensor([0, 1, 2, 63])).tolist() == [0, 2, 4, 63]


def _saved(tmp_draft_dir, method="eagle"):
    base = tiny_base("llama")
    save_draft(new_draft(base, method, seed=1), tmp_draft_dir)
    return base


def test_missing_key_names_file_key_and_fix(tmp_draft_dir):
    base = _saved(tmp_draft_dir)
    f = tmp_draft_dir / "model.safetensors"
    state = load_file(str(f))
    del state["layers.0.mlp.up_proj.weight"]
    save_file(state, str(f))
    with pytest.raises(DraftLoadError, match=r"model.safetensors.*missing keys \['layers.0.mlp.up_proj.weight'\]"):
        load_draft(tmp_draft_dir, base)


def test_unexpected_key(tmp_draft_dir):
    base = _saved(tmp_draft_dir)
    f = tmp_draft_dir / "model.safetensors"
    state = load_file(str(f))
    state["layers.1.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(state, str(f))
    with pytest.raises(DraftLoadError, match=r"unexpected keys \['layers.1.mlp.up_proj.weight'\]"):
        load_draft(tmp_draft_dir, base)


def test_hidden_size_mismatch(tmp_draft_dir):
    _saved(tmp_draft_dir)
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(DraftLoadError, match="hidden_size 64 != base hidden_size 32"):
        load_draft(tmp_draft_dir, other)


def test_vocab_mismatch(tmp_draft_dir):
    base = _saved(tmp_draft_dir)
    cfg = json.loads((tmp_draft_dir / "config.json").read_text())
    cfg["vocab_size"] = 100
    (tmp_draft_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftLoadError, match="vocab_size 100 != base vocab_size 96"):
        load_draft(tmp_draft_dir, base)


def test_unknown_layout(tmp_draft_dir):
    base = tiny_base("llama")
    tmp_draft_dir.mkdir()
    save_file({"model.layers.0.weight": torch.zeros(2)}, str(tmp_draft_dir / "model.safetensors"))
    (tmp_draft_dir / "config.json").write_text("{}")
    with pytest.raises(DraftLoadError, match="unknown draft layout"):
        load_draft(tmp_draft_dir, base)


def test_corrupt_file(tmp_draft_dir):
    base = _saved(tmp_draft_dir)
    f = tmp_draft_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: 200])
    with pytest.raises(DraftLoadError, match="model.safetensors: cannot read the draft weights.*corrupt"):
        load_draft(tmp_draft_dir, base)


def test_no_weights_and_no_config(tmp_draft_dir):
    base = tiny_base("llama")
    tmp_draft_dir.mkdir()
    with pytest.raises(DraftLoadError, match="config.json: missing"):
        load_draft(tmp_draft_dir, base)
    (tmp_draft_dir / "config.json").write_text("{}")
    with pytest.raises(DraftLoadError, match=r"no draft weights found.*model.safetensors"):
        load_draft(tmp_draft_dir, base)
    with pytest.raises(DraftLoadError, match="not a directory"):
        load_draft(tmp_draft_dir / "nope", base)


def test_eagle3_needs_four_layers():
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="at least 4 layers"):
        new_draft(small, "eagle3")
    assert isinstance(new_draft(small, "eagle"), Eagle1Draft)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_draft_embeddings_are_the_bases_module(tmp_draft_dir, method):
    """new_draft and a checkpoint without embeddings share the base's embedding module (no copy):
    not a draft parameter, untouched by draft.to(), one tensor in the compiled graphs and the export."""
    import eagle_fx

    base = tiny_base("llama")
    embed = base.get_input_embeddings()
    draft = new_draft(base, method, seed=1)
    assert draft.shares_base_embeddings and draft.embed_tokens is embed
    assert all(p is not embed.weight for p in draft.parameters()) and "embed_tokens.weight" not in draft.state_dict()
    draft.double().float()
    assert embed.weight.dtype == torch.float32 and draft.embed_tokens is embed
    save_draft(draft, tmp_draft_dir)
    assert "embed_tokens.weight" not in load_file(str(tmp_draft_dir / "model.safetensors"))
    assert load_draft(tmp_draft_dir, base).embed_tokens is embed
    save_draft(draft, tmp_draft_dir, include_embeddings=True)  # a checkpoint with its own: the draft's own copy
    own = load_draft(tmp_draft_dir, base)
    assert not own.shares_base_embeddings and torch.equal(own.embed_tokens.weight, embed.weight)
    model = eagle_fx.compile(base, draft)
    ptr = embed.weight.data_ptr()
    for name in ("base", "draft_step"):
        assert any(t.data_ptr() == ptr for t in getattr(model.graphs, name).parameters()), name


def test_gemma_draft_keeps_the_embedding_scale():
    base = tiny_base("gemma3")
    draft = new_draft(base, "eagle", seed=1)
    ids = torch.tensor([[3, 7, 11]])
    scale = base.config.hidden_size ** 0.5
    assert torch.allclose(draft.embed_tokens(ids), base.get_input_embeddings().weight[ids] * scale)


def test_empty_config_is_not_called_a_hidden_size_mismatch(tmp_draft_dir):
    save_draft(new_draft(tiny_base("llama"), "eagle", seed=0), tmp_draft_dir)
    (tmp_draft_dir / "config.json").write_text("{}")
    with pytest.raises(DraftLoadError, match=r"no hidden_size: not the config of an EAGLE draft \(eagle weights\)"):
        load_draft(tmp_draft_dir, tiny_base("llama"))
