"""Triton implementations of the canonical ops (lowered in by `lower_draft_prefill`)."""
