"""bench/engine_load.adaptive_held_at_zero ("adaptive at k=0", --held-at-k0): adaptive speculation
that still decides every step but runs every cycle at k = 0. Oracles: it ran no cycle at k > 0 though
its own choice would have, never ran the draft over a prompt (lazy draft prefill), and every output
== HF greedy."""
import importlib
from pathlib import Path

from eagle_fx.serving import Engine
from tests.serving.test_engine import hf_greedy, model, pair  # noqa: F401 (the same bundled pair, compiled alike)
from tests.serving.test_lazy_draft_prefill import five, run


def test_adaptive_held_at_k0_decides_but_runs_k0_only(pair, model, monkeypatch):
    tok, base, _, _ = pair
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    engine_load = importlib.import_module("engine_load")
    model.kv_cache.reset()
    # (lazy: the bench's default, prefix caching off; this model caches prefixes)
    engine = engine_load.adaptive_held_at_zero(model, tok, measure=False, lazy_draft_prefill=True)
    for k in engine.ks:  # priced so that adaptive's own choice is the largest k (speculation is cheap)
        engine.costs.observe(k, 1, 1.0)
    chosen, decide = [], Engine.pick_k  # (what adaptive's own pick_k, which the held engine calls, chose)
    monkeypatch.setattr(Engine, "pick_k", lambda self, spec, off: chosen.append(decide(self, spec, off)) or chosen[-1])
    prompts = five(pair)[:4]
    ids, finished = run(engine, prompts, 8)
    for rid, prompt in zip(ids, prompts):
        assert finished[rid] == hf_greedy(base, prompt, 8)
    assert engine.cycles_by_k[0] > 0 and all(engine.cycles_by_k[k] == 0 for k in engine.ks if k > 0)
    assert any(k > 0 for k, _ in chosen)  # its own choice was to speculate: held at k = 0 all the same
    assert engine.stats.prefill_tokens_computed_draft == 0 and engine.catch_up_seconds == 0.0
    assert engine.metrics()["kv_blocks_used"] == 0


def test_adaptive_full_arm_runs_the_largest_k_only_and_never_asks_pick_k(pair, model, monkeypatch):
    """bench/engine_load.adaptive_full_arm ("adaptive full arm", --held-at-full): every cycle at the
    largest k, pick_k never asked, its prompts (admitted before any decode) caught up, not prefilled for
    the draft, its check's epochs
    all full ones; every output == HF greedy and every block free at the end."""
    tok, base, _, _ = pair
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    engine_load = importlib.import_module("engine_load")
    model.kv_cache.reset()
    engine = engine_load.adaptive_full_arm(model, tok, measure=False, lazy_draft_prefill=True)
    engine.plain_check.epoch_seconds = 0.0  # (every step closes an epoch: each is counted)

    def never(self, spec, off):
        raise AssertionError("pick_k asked")
    monkeypatch.setattr(Engine, "pick_k", never)
    prompts = five(pair)[:4]
    ids, finished = run(engine, prompts, 8)
    for rid, prompt in zip(ids, prompts):
        assert finished[rid] == hf_greedy(base, prompt, 8)
    k_max = engine.ks[-1]
    assert k_max > 1 and engine.cycles_by_k[k_max] > 0
    assert all(engine.cycles_by_k[k] == 0 for k in engine.ks if k != k_max)
    assert engine.stats.prefill_tokens_computed_draft == 0 and engine.catch_up_seconds > 0.0
    epochs = engine.plain_check.epochs
    assert epochs["full"] > 0 and epochs["adaptive"] == epochs["plain"] == 0
    assert engine.metrics()["kv_blocks_used"] == 0
