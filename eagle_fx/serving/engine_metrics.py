"""The serving engine's counters as one snapshot (what /metrics shows; eagle_fx.serving.prometheus
names them): requests running and waiting, KV blocks, vLLM's spec-decode counters, tokens,
finished requests per reason, speculation off per reason, decode cycles per k, structured output's
requests and cycles, and what adaptive speculation decides from: its cycle costs per (k, batch size)
at no keys (StepCosts.measured) and its seconds outside the cycles per batch size; and what running
its choices costs that its prices leave out (cycles after a switch of k, the draft's catch-ups); and
its check against plain decoding (epochs per arm, adaptive / plain over the last comparisons)."""
from __future__ import annotations

from eagle_fx.serving.plain_check import PLAIN

OFF_REASONS = ("cost", "acceptance_collapse", "plain_check")


def engine_metrics(engine) -> dict:
    st, check = engine.stats, engine.plain_check
    off = dict.fromkeys(OFF_REASONS, 0)
    for r in engine.running:
        if not (r.speculating and engine.can_speculate(r)):
            off[r.off_reason or "cost"] += 1
        elif engine.current_k == 0:
            off["plain_check" if check is not None and check.arm == PLAIN else "cost"] += 1
    allocator = engine.kv.allocator
    return dict(
        num_requests_running=engine.num_running, num_requests_waiting=engine.num_waiting,
        kv_blocks_used=allocator.num_blocks - allocator.num_free, kv_blocks_total=allocator.num_blocks,
        spec_decode_num_drafts=st.num_drafts, spec_decode_num_draft_tokens=st.num_draft_tokens,
        spec_decode_num_accepted_tokens=st.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(st.accepted_per_pos),
        prompt_tokens_total=engine.prompt_tokens, generation_tokens_total=engine.generation_tokens,
        request_success_total=dict(engine.finished_by_reason), speculation_off=off,
        speculation_off_events_total=dict(engine.off_events), num_preemptions_total=0,
        prefix_cache_hit_tokens_total=st.prefix_hit_tokens_base, num_spec_tokens_current=engine.current_k,
        cycles_by_k={str(k): n for k, n in engine.cycles_by_k.items()},
        num_requests_structured=sum(r.grammar is not None for r in engine.running),
        grammar_cycles_total=st.grammar_cycles, grammar_mask_seconds_total=st.grammar_mask_s,
        cycle_cost_seconds={(str(k), str(b)): v for k, by_size in engine.costs.measured().items()
                            for b, v in by_size.items()},
        outside_seconds={str(b): v for b, v in engine.outside.measured().items()},
        switch_cycles_total=engine.switch_cycles, switch_seconds_total=engine.switch_seconds,
        switch_priced_seconds_total=engine.switch_priced,
        draft_catch_up_seconds_total=engine.catch_up_seconds,
        **({} if check is None else {"plain_check_epochs_total": dict(check.epochs)}),
        **({} if check is None or check.ratio is None else {"plain_check_ratio": check.ratio}))
