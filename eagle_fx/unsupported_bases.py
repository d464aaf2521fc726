"""Bases eagle_fx refuses at compile, before any capture, with what is unsupported and what to do.

- sharded over devices (`device_map` with several devices): the step graphs are captured on one
  device (tensor parallelism is its own issue);
- quantized (a `quantization_config`, bitsandbytes / GPTQ / AWQ / ...): the passes and kernels
  work on float weights;
- mixture-of-experts: routed MLPs choose their experts from data, which the captured step graphs
  (one static dataflow per step) do not express;
- ALiBi position bias (Falcon with alibi=True, BLOOM, MPT): eagle_fx's cached attention is causal
  (plus a sliding window), with no additive bias;
- soft-capped attention logits (Gemma 2's attn_logit_softcapping): transformers computes it only
  with eager attention, which eagle_fx does not rewrite.
"""
from __future__ import annotations

# config fields that count a mixture-of-experts model's experts, across HF families
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
ALIBI_FAMILIES = ("bloom", "mpt")  # always ALiBi; Falcon when its config says alibi=True


def refuse_unsupported_base(base) -> None:
    """ValueError naming why `base` cannot be captured, or nothing."""
    config = base.config
    text = config.get_text_config()
    devices = sorted({str(d) for d in (getattr(base, "hf_device_map", None) or {}).values()})
    if len(devices) > 1:
        raise ValueError(f"the base is sharded over {len(devices)} devices ({', '.join(devices)}; device_map=...): "
                         "eagle_fx captures its step graphs on one device; load the base on one device "
                         "(device_map=None, then .to(device))")
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None or getattr(base, "is_quantized", False):
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", None)) or "unknown method"
        raise ValueError(f"the base is quantized ({method}): eagle_fx's passes and kernels work on float weights; "
                         "load it unquantized in bfloat16, float16 or float32")
    experts = [(name, getattr(text, name)) for name in EXPERT_COUNTS if isinstance(getattr(text, name, None), int)]
    experts = [(name, count) for name, count in experts if count > 1]
    if experts:  # the first field that counts them (some configs alias it under a second name)
        name, count = experts[0]
        raise ValueError(f"the base is a mixture-of-experts model ({text.model_type}, {name}={count}): its routed "
                         "MLPs pick experts from the data, which eagle_fx's captured step graphs do not express; "
                         "use a dense base")
    if text.model_type in ALIBI_FAMILIES or getattr(text, "alibi", False) is True:
        raise ValueError(f"the base ({text.model_type}) adds an ALiBi position bias to its attention scores: "
                         "eagle_fx's cached attention is causal with no additive bias; use a base with rotary or "
                         "learned positions (the README's family table lists them)")
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap:
        raise ValueError(f"the base ({text.model_type}) soft-caps its attention logits (attn_logit_softcapping="
                         f"{softcap}), which transformers computes only with eager attention and eagle_fx's "
                         "attention does not express; Gemma 3 (no soft-capping) is supported")
