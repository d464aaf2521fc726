"""Which RoPE variants eagle_fx's captured step graphs compute as Hugging Face does, at any position.

A step graph holds the model's rotary embedding as traced: right when the rotation is a fixed
function of the position. Per transformers' `rope_type` (config.rope_parameters):

  default, linear, llama3, yarn, proportional   fixed inverse frequencies: equal to HF at every
                                                position, past original_max_position_embeddings too
                                                (tests/test_rope.py)
  longrope   short factors up to original_max_position_embeddings, long factors once the longest
             position of a forward call passes it. HF decides per call, so the rotation of a
             token depends on which tokens share its forward call (a verify holds k + 1 of
             them, HF's decode one): equal only while every position a call computes, the
             speculated ones included, stays within original_max_position_embeddings, so
             max_seq_len + lookahead + 1 must not exceed it.
  dynamic    NTK scaling recomputed from the running sequence length, a data-dependent branch a
             step graph cannot hold: refused (within original_max_position_embeddings it is
             'default', which says what to do).

Anything else is refused by name. Base and draft are both checked (a loaded draft can carry its
own scaling, as Llama-3 EAGLE-3 drafts carry llama3).
"""
from __future__ import annotations

FIXED = ("default", "linear", "llama3", "yarn", "proportional")


def rope_sets(config) -> list[dict]:
    """Each RoPE parameter set of a config (one, or one per layer type as in Gemma 3)."""
    rp = getattr(config, "rope_parameters", None) or {}
    if rp and all(isinstance(v, dict) for v in rp.values()):
        return [dict(v) for v in rp.values()]
    return [dict(rp)] if rp else []


def longest_exact_sequence(config, who: str) -> int | None:
    """The longest sequence (tokens) this config's RoPE is captured exactly for (None: no limit);
    a ValueError naming the rope_type and what to do when it cannot be captured at all."""
    limit = None
    for params in rope_sets(config):
        kind = params.get("rope_type", "default")
        original = params.get("original_max_position_embeddings") or getattr(config, "max_position_embeddings", None)
        if kind in FIXED:
            continue
        if kind == "longrope":
            limit = original if limit is None else min(limit, original)
        elif kind == "dynamic":
            raise ValueError(
                f"the {who}'s rope_type 'dynamic' recomputes its frequencies from the running sequence length, "
                "which a captured step graph cannot follow; up to original_max_position_embeddings "
                f"({original}) it equals 'default': set config.rope_parameters['rope_type'] = 'default' before "
                "loading the model to run sequences up to that length, or use a checkpoint with 'yarn' or 'linear' "
                "scaling for longer ones")
        else:
            raise ValueError(f"the {who}'s rope_type {kind!r} is not one eagle_fx has checked against transformers "
                             f"(supported: {', '.join(FIXED)}; 'longrope' up to original_max_position_embeddings)")
    return limit


def pair_rope_limit(base, draft) -> int | None:
    """The longest sequence the pair's RoPE is exact for (None: no limit); an unsupported RoPE
    type is refused here. Options.check_for_pair checks max_seq_len against it."""
    limits = [lim for lim in (longest_exact_sequence(base.config.get_text_config(), "base"),
                              longest_exact_sequence(draft.config, "draft")) if lim is not None]
    return min(limits) if limits else None


def check_max_seq_len(max_seq_len: int, lookahead: int, limit: int | None) -> None:
    """A call's positions reach max_seq_len - 1 + lookahead (the verify's drafts) + 1 (the draft
    extend's offset); all must stay below `limit` for longrope's short factors to hold."""
    if limit is not None and max_seq_len + lookahead + 1 > limit:
        raise ValueError(
            f"max_seq_len={max_seq_len}: this pair's rope_type 'longrope' switches every position of a forward call "
            f"to its long factors once the call passes original_max_position_embeddings ({limit}), so a token's "
            f"rotation would depend on the tokens verified with it; with {lookahead} positions of lookahead per step, "
            f"pass max_seq_len <= {limit - lookahead - 1} (eagle_fx then equals transformers exactly)")
