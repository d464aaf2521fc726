"""EAGLE-1 and EAGLE-3 draft heads, and their checkpoint loaders and writers.

Both drafts are plain modules with the same three-part interface used by capture:

    h   = draft.project(features)                # EAGLE-1: identity; EAGLE-3: fc over the 3 base layers
    out = draft.body(input_ids, positions, h)    # [B, T] tokens, [B, T, F] features: one decoder layer
    tok = draft.to_target(draft_ids)       # EAGLE-3, a pruned vocab: target_id = draft_id + d2t[draft_id]

and logits through `draft.logits(out, base_lm_head)` (EAGLE-1 uses the base's lm_head, no norm; an
EAGLE-1 draft with a pruned vocabulary, eagle_fx.draft_vocab, its own copy of some of its rows).
Layouts read: SafeAILab EAGLE-1 (`layers.0.*`, `fc`), SafeAILab EAGLE-3 (`midlayer.*`) and
vllm-project/speculators EAGLE-3 (`layers.0.*`, `speculators_model_type: "eagle3"`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle_fx import families
from eagle_fx.kv_share import resolve_layer, rope_of
from eagle_fx.model_inputs import embed_tokens


class DraftAttention(nn.Module):
    def __init__(self, config: LlamaConfig, in_dim: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = bool(getattr(config, "qkv_bias", False) or getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, attend=None):
        """attend(q, k, v, scale) -> o replaces causal self-attention (training over a base layer's K/V)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if attend is not None:
            o = attend(q, k, v, self.head_dim**-0.5)
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.head_dim**-0.5, enable_gqa=self.num_heads != self.num_kv_heads
            )
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class Eagle1Layer(nn.Module):
    """A Llama decoder layer without its input norm (EAGLE-1's layer 0)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = DraftAttention(config, config.hidden_size)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, attend=None):
        x = x + self.self_attn(x, cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


def _embeddings(draft: nn.Module, config: LlamaConfig, embed: nn.Module | None) -> None:
    """The draft's token embedding: its own nn.Embedding, or (embed given) the base's module,
    borrowed: read by the draft's forward but not one of its parameters, so draft.to(),
    draft.parameters(), state_dict() and training leave it alone and no copy exists."""
    if embed is None:
        draft.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    else:
        object.__setattr__(draft, "embed_tokens", embed)  # an attribute, not a registered submodule


def _in_dtype(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A borrowed embedding's output in the draft's dtype (they differ while a bf16 base's draft trains
    in fp32); no op in the graph when they agree, so the captured graphs keep their patterns."""
    return e if e.dtype == dtype else e.to(dtype)


class Eagle1Draft(nn.Module):
    method = "eagle"

    def __init__(self, config: LlamaConfig, embed: nn.Module | None = None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        _embeddings(self, config, embed)
        self.fc = nn.Linear(2 * h, h, bias=bool(getattr(config, "bias", True)))
        self.layers = nn.ModuleList([Eagle1Layer(config)])
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.feature_dim = h
        self.aux_layer_ids: tuple[int, ...] = ()
        # a pruned vocabulary (eagle_fx.draft_vocab): its own lm_head over draft_vocab_size of the base's rows,
        # d2t mapping its ids back as in EAGLE-3; else the base's lm_head, and no d2t
        dv = getattr(config, "draft_vocab_size", None)
        self.draft_vocab_size = dv if dv is not None and dv != config.vocab_size else None
        self.lm_head = None if self.draft_vocab_size is None else nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", None if self.draft_vocab_size is None else torch.zeros(dv, dtype=torch.long))

    @property
    def shares_base_embeddings(self) -> bool:
        """The token embedding is the base's module (no copy); else the draft's own."""
        return "embed_tokens" not in self._modules

    @property
    def kv_share_layer(self) -> int | None:
        """The base layer whose K/V this draft was trained to read (eagle_fx.kv_share), or None."""
        return getattr(self.config, "eagle_fx_kv_share_layer", None)

    def project(self, features):
        return features

    def body(self, input_ids, positions, hidden, attend=None, mm_embeds=None):
        e = _in_dtype(embed_tokens(input_ids, self.embed_tokens, mm_embeds), self.fc.weight.dtype)  # [B, T, H]
        x = self.fc(torch.cat([e, hidden.to(e.dtype)], dim=-1))
        cos, sin = self.rotary_emb(x, positions)
        return self.layers[0](x, cos, sin, attend)

    def logits(self, out, base_lm_head):
        return base_lm_head(out) if self.lm_head is None else self.lm_head(out)

    def to_target(self, draft_ids):
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]


class Eagle3Layer(nn.Module):
    def __init__(self, config: LlamaConfig, norm_before_residual: bool):
        super().__init__()
        h = config.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, 2 * h)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, e, x, cos, sin, attend=None):
        hx = self.hidden_norm(x)
        r = hx if self.norm_before_residual else x
        x = r + self.self_attn(torch.cat([self.input_layernorm(e), hx], dim=-1), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    method = "eagle3"

    def __init__(self, config: LlamaConfig, target_hidden_size: int, aux_layer_ids, draft_vocab_size: int,
                 norm_before_residual: bool = False, embed: nn.Module | None = None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        _embeddings(self, config, embed)
        self.fc = nn.Linear(len(aux_layer_ids) * target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(config, norm_before_residual)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.feature_dim = len(aux_layer_ids) * target_hidden_size
        self.target_hidden_size = target_hidden_size
        self.aux_layer_ids = tuple(int(i) for i in aux_layer_ids)
        self.draft_vocab_size = draft_vocab_size

    kv_share_layer = Eagle1Draft.kv_share_layer
    shares_base_embeddings = Eagle1Draft.shares_base_embeddings

    def project(self, features):
        return self.fc(features)

    def body(self, input_ids, positions, hidden, attend=None, mm_embeds=None):
        e = _in_dtype(embed_tokens(input_ids, self.embed_tokens, mm_embeds), self.lm_head.weight.dtype)
        x = hidden.to(e.dtype)
        cos, sin = self.rotary_emb(x, positions)
        return self.midlayer(e, x, cos, sin, attend)

    def logits(self, out, base_lm_head):
        return self.lm_head(self.norm(out))

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


Draft = Eagle1Draft | Eagle3Draft


# ----------------------------------------------------------------------------- construction


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's feature layers: the inputs of base layers (2, L//2, L-3), i.e. hidden_states[i]."""
    ids = (2, num_layers // 2, num_layers - 3)
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 needs a base with at least 4 layers (feature layers {ids}); this base has {num_layers}")
    return ids


def draft_config_for(base, **overrides) -> LlamaConfig:
    """A one-layer Llama config that matches the base's attention shapes."""
    c = base.config.get_text_config()
    kv_heads, head_dim = families.kv_shape(c)
    kw = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=families.mlp_width(c),
        num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=families.norm_eps(c),
        max_position_embeddings=families.max_positions(c),
        tie_word_embeddings=False,
    )
    if "rope_parameters" not in overrides:
        kw["rope_theta"] = 10000.0
    kw.update(overrides)
    return LlamaConfig(**kw)


def new_draft(base, method: str = "eagle", seed: int | None = None, draft_vocab_size: int | None = None,
              aux_layer_ids=None, kv_share: int | None = None, **config_overrides) -> Draft:
    """A randomly initialised draft shaped for `base` (for training, and for tests).

    kv_share=LAYER builds a draft that reads base layer LAYER's K/V (eagle_fx.kv_share): it takes
    that layer's RoPE, and records the layer in its config (`eagle_fx_kv_share_layer`)."""
    if seed is not None:
        torch.manual_seed(seed)
    if kv_share is not None:
        layer = resolve_layer(base, kv_share)
        config_overrides = {"rope_parameters": rope_of(base.config.get_text_config(), layer),
                            "eagle_fx_kv_share_layer": layer, **config_overrides}
        config_overrides.pop("rope_theta", None)
    config = draft_config_for(base, **config_overrides)
    if "rope_parameters" in config_overrides:  # LlamaConfig folds rope_theta into rope_parameters
        config.rope_parameters = dict(config_overrides["rope_parameters"])
    embed = base.get_input_embeddings()  # the base's module, shared
    if method == "eagle":
        draft = Eagle1Draft(config, embed=embed)
    elif method == "eagle3":
        c = base.config.get_text_config()
        aux = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(c.num_hidden_layers)
        draft = Eagle3Draft(config, c.hidden_size, aux, draft_vocab_size or c.vocab_size, embed=embed)  # d2t = 0
    else:
        raise ValueError(f"method must be 'eagle' or 'eagle3', got {method!r}")
    _init_like_llama(draft, config.initializer_range)
    p = next(base.parameters())
    return draft.to(device=p.device, dtype=p.dtype).eval()


def _init_like_llama(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


# ----------------------------------------------------------------------------- files


class DraftLoadError(ValueError):
    pass


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _read_weights(path: Path) -> tuple[dict, Path]:
    for name in WEIGHT_FILES:
        f = path / name
        if f.exists():
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    return load_file(str(f)), f
                return torch.load(f, map_location="cpu", weights_only=True), f
            except Exception as e:  # torch, pickle and safetensors each raise their own error types
                raise DraftLoadError(f"{f}: cannot read the draft weights ({type(e).__name__}: {e}); the file is corrupt or truncated, download or export it again") from e
    found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    raise DraftLoadError(f"{path}: no draft weights found; expected one of {list(WEIGHT_FILES)}, found {found}")


def detect_layout(config: dict, keys) -> str:
    """'eagle' (SafeAILab EAGLE-1), 'eagle3' (SafeAILab EAGLE-3) or 'speculators' (speculators EAGLE-3)."""
    keys = set(keys)
    if config.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in (config.get("architectures") or []):
        return "speculators"
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return "eagle"
    raise DraftLoadError(
        "unknown draft layout: expected SafeAILab EAGLE-1 (fc.weight + layers.0.*), SafeAILab EAGLE-3 (midlayer.*) "
        f"or a speculators config (speculators_model_type: eagle3); keys start with {sorted({k.split('.')[0] for k in keys})}"
    )


def _llama_config(d: dict) -> LlamaConfig:
    d = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    return LlamaConfig(**d)


def load_draft(path, base, dtype: torch.dtype | None = None) -> Draft:
    """Load an EAGLE-1 / EAGLE-3 draft for `base` from a SafeAILab or speculators checkpoint folder."""
    path = Path(path)
    if not path.is_dir():
        raise DraftLoadError(f"{path}: not a directory; pass the folder that holds config.json and the weights")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise DraftLoadError(f"{cfg_file}: missing; a draft folder needs config.json next to its weights")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DraftLoadError(f"{cfg_file}: not valid JSON ({e})") from e
    state, weights_file = _read_weights(path)
    layout = detect_layout(config, state.keys())
    if layout != "speculators" and "hidden_size" not in config:
        raise DraftLoadError(f"{cfg_file}: no hidden_size: not the config of an EAGLE draft ({layout} weights); a "
                             "draft folder holds the config.json its weights were saved with")
    # a checkpoint without embeddings (the usual EAGLE release) reads the base's, shared
    base_embed = base.get_input_embeddings() if "embed_tokens.weight" not in state else None
    bc = base.config.get_text_config()
    H, V = bc.hidden_size, bc.vocab_size

    if layout == "eagle":
        dc = _llama_config(config)
        if dc.hidden_size != H:
            raise DraftLoadError(f"{cfg_file}: hidden_size {dc.hidden_size} != base hidden_size {H}; this draft was trained for another base")
        draft = Eagle1Draft(dc, embed=base_embed)
        if draft.d2t is not None and "d2t" not in state:
            raise DraftLoadError(f"{weights_file}: missing key 'd2t' for draft_vocab_size {draft.draft_vocab_size} != "
                                 f"base vocab {V} (a pruned EAGLE-1 draft keeps d2t and lm_head.weight)")
        if "bias" not in config and "fc.bias" not in state:
            raise DraftLoadError(f"{weights_file}: missing key 'fc.bias'; set \"bias\": false in {cfg_file} if the draft has no fc bias")
    else:
        if layout == "speculators":
            tlc = dict(config.get("transformer_layer_config") or {})
            if not tlc:
                raise DraftLoadError(f"{cfg_file}: speculators config without 'transformer_layer_config'")
            dc = _llama_config(tlc)
            aux = config.get("eagle_aux_hidden_state_layer_ids")
            nbr = bool(config.get("norm_before_residual", False))
            state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
            for flag in ("norm_before_fc", "fc_norm", "norm_output"):
                if config.get(flag):
                    raise DraftLoadError(f"{cfg_file}: speculators option {flag!r} is not supported by eagle_fx yet")
        else:
            dc = _llama_config(config)
            aux = config.get("eagle_aux_hidden_state_layer_ids")
            nbr = bool(config.get("norm_before_residual", False))
        th = int(config.get("target_hidden_size") or dc.hidden_size)
        if th != H:
            raise DraftLoadError(f"{cfg_file}: target_hidden_size {th} != base hidden_size {H}; this draft was trained for another base")
        aux = tuple(aux) if aux else default_aux_layer_ids(bc.num_hidden_layers)
        if min(aux) < 0 or max(aux) > bc.num_hidden_layers:
            raise DraftLoadError(f"{cfg_file}: feature layers {aux} out of range [0, {bc.num_hidden_layers}] for a "
                                 f"{bc.num_hidden_layers}-layer base")
        dv = int(config.get("draft_vocab_size") or dc.vocab_size)
        draft = Eagle3Draft(dc, th, aux, dv, nbr, embed=base_embed)
        state.pop("t2d", None)  # training only
        if "d2t" not in state:
            if dv != V:
                raise DraftLoadError(f"{weights_file}: missing key 'd2t' for draft_vocab_size {dv} != base vocab {V}")
            state["d2t"] = torch.zeros(dv, dtype=torch.long)

    if dc.vocab_size != V:
        raise DraftLoadError(f"{cfg_file}: vocab_size {dc.vocab_size} != base vocab_size {V}; the draft and base tokenizers differ")
    expected = set(draft.state_dict().keys()) - {k for k in draft.state_dict() if "rotary_emb" in k}
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise DraftLoadError(
            f"{weights_file}: layout {layout!r}: missing keys {missing}, unexpected keys {unexpected}; "
            "the checkpoint does not match its config.json (wrong layout, or a config for another draft)"
        )
    own = draft.state_dict()
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise DraftLoadError(f"{weights_file}: key {k!r} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)} from {cfg_file}")
    draft.load_state_dict(state, strict=False)
    if draft.d2t is not None:
        target_ids = torch.arange(len(draft.d2t)) + draft.d2t
        if int(target_ids.max()) >= V or int(target_ids.min()) < 0:
            raise DraftLoadError(f"{weights_file}: d2t maps draft ids outside the base vocab (0..{V - 1})")
    p = next(base.parameters())
    return draft.to(device=p.device, dtype=dtype or p.dtype).eval()


def save_draft(draft: Draft, path, include_embeddings: bool = False, dtype: torch.dtype | None = None) -> Path:
    """Write `draft` in the SafeAILab layout (config.json + model.safetensors) that `load_draft` reads."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = draft.config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    if isinstance(draft, Eagle1Draft):
        cfg["bias"] = draft.fc.bias is not None
    else:
        cfg["draft_vocab_size"] = draft.draft_vocab_size
        cfg["target_hidden_size"] = draft.target_hidden_size
        cfg["eagle_aux_hidden_state_layer_ids"] = list(draft.aux_layer_ids)
        cfg["norm_before_residual"] = draft.midlayer.norm_before_residual
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() if v.is_floating_point() else v.detach().contiguous().cpu()
             for k, v in draft.state_dict().items() if "rotary_emb" not in k}
    if include_embeddings and draft.shares_base_embeddings:
        state["embed_tokens.weight"] = draft.embed_tokens.weight.detach().to(dtype or draft.embed_tokens.weight.dtype).contiguous().cpu()
    if not include_embeddings:
        state.pop("embed_tokens.weight", None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    tmp = path / "model.safetensors.tmp"
    save_file(state, str(tmp))
    os.replace(tmp, path / "model.safetensors")
    return path
