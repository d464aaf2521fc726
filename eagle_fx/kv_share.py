"""KV-sharing drafts (kv_share=LAYER): when a draft may read base layer LAYER's K/V.

A sharing draft's attention, for a sequence whose base KV holds positions 0..m-1, reads the keys
and values of positions < m from base layer LAYER's cache and those of positions >= m (the
speculated tokens, and the bonus token the base has not run yet) from the draft's own k/v
projections. That only lines up when

  - the draft prefill is unshifted (draft slot p holds token t_p, like base slot p),
  - the draft's kv heads and head dim are the base layer's,
  - the draft's queries are rotated like the base layer's keys (same RoPE parameters).

Each rule below raises a ValueError that says what to change.
"""
from __future__ import annotations

from eagle_fx import families

ROPE_DEFAULTS = {"rope_type": "default", "partial_rotary_factor": 1.0}


def resolve_layer(base, layer) -> int:
    """LAYER as a non-negative base layer index (negative counts from the last layer)."""
    n = base.config.get_text_config().num_hidden_layers
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise TypeError(f"kv_share must be 'pool', 'auto', None or a base layer index (int), got {layer!r}")
    if not -n <= layer < n:
        raise ValueError(f"kv_share={layer}: the base has {n} layers; use a layer index in [{-n}, {n - 1}]")
    return layer % n


def base_kv_shape(base) -> tuple[int, int]:
    return families.kv_shape(base.config)


def rope_of(config, layer: int | None = None) -> dict:
    """The RoPE parameters a config applies at `layer` (flat; per-layer-type configs resolved)."""
    rp = dict(getattr(config, "rope_parameters", None) or {})
    types = getattr(config, "layer_types", None)
    if rp and all(isinstance(v, dict) for v in rp.values()):  # {layer_type: params} (e.g. Gemma 3)
        kind = types[layer] if types is not None and layer is not None else "full_attention"
        rp = dict(rp.get(kind) or next(iter(rp.values())))
    if "rope_theta" not in rp and getattr(config, "rope_theta", None) is not None:
        rp["rope_theta"] = config.rope_theta
    prf = getattr(config, "partial_rotary_factor", None)
    if prf is not None:
        rp.setdefault("partial_rotary_factor", prf)
    out = {**ROPE_DEFAULTS, **{k: v for k, v in rp.items() if v is not None}}
    out["rope_theta"] = float(out.get("rope_theta", 10000.0))
    return out


def check_pair(base, draft, layer: int, prefill_shift: bool) -> None:
    """Raise a ValueError naming the mismatch when `draft` cannot read base layer `layer`'s K/V."""
    if prefill_shift:
        raise ValueError(f"kv_share={layer} needs the unshifted draft prefill (draft slot p = base slot p); "
                         "prefill_shift=True shifts the draft's slots by one: use prefill_shift=False or kv_share='pool'")
    dc = draft.config
    if (dc.num_key_value_heads, dc.head_dim) != base_kv_shape(base):
        raise ValueError(f"kv_share={layer}: the draft has {dc.num_key_value_heads} kv heads x head dim {dc.head_dim}, "
                         f"base layer {layer} has {base_kv_shape(base)[0]} x {base_kv_shape(base)[1]}; a sharing draft needs "
                         "the base's kv heads and head dim (train one with eagle-fx train-draft --kv-share)")
    want, have = rope_of(base.config.get_text_config(), layer), rope_of(dc)
    if want["partial_rotary_factor"] != 1.0:
        raise ValueError(f"kv_share={layer}: base layer {layer} rotates only part of each head "
                         f"(partial_rotary_factor {want['partial_rotary_factor']}); eagle_fx drafts rotate whole heads")
    if want != have:
        raise ValueError(f"kv_share={layer}: RoPE mismatch: base layer {layer} rotates keys with {want}, the draft "
                         f"rotates queries with {have}; a sharing draft needs the base layer's RoPE "
                         "(eagle-fx train-draft --kv-share builds it so)")
