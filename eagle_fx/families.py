"""What eagle_fx reads from a base's config, across Hugging Face families that name it differently.

Llama-like configs say `num_key_value_heads`, `head_dim`, `intermediate_size`; GPT2 says `n_inner`
(None: 4 x width), OPT `ffn_dim`, Falcon `ffn_hidden_size` and `num_kv_heads` (which a classic
multi-query Falcon ignores: one kv head, and the new Falcon architecture broadcasts to every head
before its cache). Every reader of these fields goes through here.
"""
from __future__ import annotations


def kv_shape(config) -> tuple[int, int]:
    """(kv heads, head dim) of the base's attention, as its K/V tensors are shaped."""
    c = config.get_text_config()
    heads = c.num_attention_heads
    if c.model_type == "falcon":  # transformers' FalconAttention: one kv head when classic multi-query; the
        kv = 1 if (c.multi_query and not c.new_decoder_architecture) else heads  # new one broadcasts K/V to all heads
    else:
        kv = getattr(c, "num_key_value_heads", None) or heads
    return kv, getattr(c, "head_dim", None) or c.hidden_size // heads


def mlp_width(config) -> int:
    """The width of the base's MLP (the draft layer's intermediate size)."""
    c = config.get_text_config()
    for name in ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner"):
        width = getattr(c, name, None)
        if isinstance(width, int):
            return width
    return 4 * c.hidden_size  # GPT2 with n_inner=None, Falcon without ffn_hidden_size


def norm_eps(config) -> float:
    c = config.get_text_config()
    for name in ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"):
        eps = getattr(c, name, None)
        if isinstance(eps, float):
            return eps
    return 1e-6


def max_positions(config) -> int:
    c = config.get_text_config()
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None) or 2048
