"""The bundled pair and the bench: trained drafts are accepted, output equals HF greedy, figures add up."""
import functools
import json

import pytest
import torch

from eagle_fx.bench import main as bench_main
from eagle_fx.bundled import BUNDLED
from eagle_fx.runtime import TreeProposer

pytestmark = pytest.mark.skipif(not (BUNDLED / "base").exists(), reason="bundled pair missing")


@functools.lru_cache(maxsize=None)
def _pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED / "base")
    base = AutoModelForCausalLM.from_pretrained(BUNDLED / "base", dtype=torch.float32, attn_implementation="sdpa").eval()
    return tok, base


def _prompts(n):
    from types import SimpleNamespace

    from eagle_fx.bench.prompts import load_prompts

    tok, base = _pair()
    args = SimpleNamespace(dataset_name="sharegpt", dataset_path=None, num_prompts=n, max_prompt_len=512, seed=0)
    return load_prompts(args, tok, base.config.vocab_size)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_bundled_drafts_are_accepted_and_lossless(method):
    import eagle_fx

    tok, base = _pair()
    model = eagle_fx.compile(base, eagle_fx.load_draft(BUNDLED / method, base), num_spec_tokens=3)
    prompts = _prompts(4)
    out = model.generate(prompts, max_new_tokens=32, eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        ref = [base.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist() for p in prompts]
    assert out.sequences == ref
    # a random draft gets ~1.0; the trained ones are really accepted
    assert out.stats.mean_acceptance_length > 1.8


@pytest.mark.parametrize("method,score_temperature", [("eagle", 1.0), ("eagle3", 0.2)])
def test_bundled_drafts_with_trees_are_lossless(method, score_temperature):
    """EAGLE-2 trees on the trained pair: greedy == HF, and accepted paths leave the first branch."""
    import eagle_fx

    tok, base = _pair()
    model = eagle_fx.compile(base, eagle_fx.load_draft(BUNDLED / method, base), max_batch_size=4,
                             draft_tree=dict(top_k=3, depth=4, total_tokens=10, score_temperature=score_temperature))
    paths = []
    model = model.replace(proposer=TreeProposer(on_path=lambda path, accepted: paths.append((path, accepted))))
    prompts = _prompts(4)
    out = model.generate(prompts, max_new_tokens=32, eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        ref = [base.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist() for p in prompts]
    assert out.sequences == ref
    assert out.stats.mean_acceptance_length > 2.0
    j = torch.arange(1, 5)
    assert any(bool(((p[:, 1:] != j) & (j <= a[:, None])).any()) for p, a in paths)


def test_bench_cli_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench_main(["--backend", "eager", "--num-prompts", "2", "--output-len", "8", "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("eagle-fx bench: base ") and ("(llama, 4 layers, float32), draft " in printed
                                                            and "(eagle); k=3, backend eager, batch 1; sharegpt, 2 prompts,"
                                                            " up to 8 new tokens; greedy; outputs not checked against HF "
                                                            "here (add --compare)" in printed)
    for line in ("total_num_output_tokens:", "num_drafts:", "num_draft_tokens:", "num_accepted_tokens:",
                 "mean acceptance length:", "acceptance at token 0:", "acceptance at token 2:"):
        assert line in printed
    r = json.loads(out.read_text())["eagle_fx"]
    assert r["num_drafts"] > 0 and r["num_draft_tokens"] > 0
    assert r["total_num_output_tokens"] <= 16


def test_bench_times_without_profiling_on_the_resolved_backend(tmp_path, monkeypatch, capsys):
    """The timed generate calls run with profile off (profile=True synchronises per graph call on
    a GPU); the profile comes from a separate call. --enforce-eager (with --backend left at its
    default, inductor) compiles with backend="eager" and says so."""
    import eagle_fx
    from eagle_fx.bench.modes import main as main_mode

    timing, calls, backends = [False], [], []
    real_compile, real_timed = eagle_fx.compile, main_mode.timed

    class Recorded:
        def __init__(self, model):
            self.model = model

        def generate(self, *args, **kwargs):
            calls.append((timing[0], kwargs.get("profile", False)))
            return self.model.generate(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.model, name)

    def compile_recorded(*args, **kwargs):
        backends.append(kwargs.get("backend"))
        return Recorded(real_compile(*args, **kwargs))

    def timed_recorded(*args, **kwargs):
        timing[0] = True
        try:
            return real_timed(*args, **kwargs)
        finally:
            timing[0] = False

    monkeypatch.setattr(eagle_fx, "compile", compile_recorded)
    monkeypatch.setattr(main_mode, "timed", timed_recorded)
    out = tmp_path / "bench.json"
    bench_main(["--enforce-eager", "--num-prompts", "2", "--output-len", "8", "--json", str(out)])
    assert backends == ["eager"]
    assert "backend eager" in capsys.readouterr().out
    timed_calls = [profile for inside, profile in calls if inside]
    assert len(timed_calls) == 2 and not any(timed_calls)  # one call per prompt (batch 1), none profiled
    assert [profile for inside, profile in calls if not inside].count(True) == 1  # the separate profiled run
    r = json.loads(out.read_text())["eagle_fx"]
    assert r["backend"] == "eager" and r["profile_s"] is not None and r["profiled_prompts"] == 1


def test_bench_default_is_the_fast_path():
    """Plain `eagle-fx bench` compiles with inductor (frozen weights, the one-graph cycle)."""
    import argparse

    from eagle_fx.bench import add_args

    assert add_args(argparse.ArgumentParser()).parse_args([]).backend == "inductor"


def test_bench_refuses_what_it_cannot_do():
    with pytest.raises(SystemExit, match="--compare checks outputs against HF greedy; it needs --temp 0"):
        bench_main(["--temp", "0.8", "--compare"])
    with pytest.raises(SystemExit, match=r"--top-p in \(0, 1\]"):
        bench_main(["--temp", "0.8", "--top-p", "1.5"])
    with pytest.raises(SystemExit, match="--num-prompts must be >= 1"):
        bench_main(["--num-prompts", "0"])


def test_bench_samples_with_temperature(tmp_path):
    out = tmp_path / "sampled.json"
    bench_main(["--backend", "eager", "--num-prompts", "3", "--output-len", "12", "--temp", "0.8", "--top-k", "40", "--seed", "3",
                "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["config"]["temp"] == 0.8
    st = r["eagle_fx"]
    assert 0 < st["total_num_output_tokens"] <= 36 and st["num_draft_tokens"] == 3 * st["num_drafts"]


def test_bench_tree_vs_chain(tmp_path, capsys):
    out = tmp_path / "tree.json"
    bench_main(["--backend", "eager", "--num-prompts", "2", "--output-len", "8", "--draft-tree", "2,3,4,0.5", "--tree-vs-chain",
                "--json", str(out)])
    printed = capsys.readouterr().out
    assert "tree - chain at equal verify width" in printed
    rows = json.loads(out.read_text())["tree_vs_chain"]
    assert [r["draft"].split(" (")[0] for r in rows] == ["chain k=4", "chain k=3", "tree 2,3,4 score temp 1",
                                                        "tree 2,3,4 score temp 0.5"]
    assert rows[0]["num_draft_tokens"] == 4 * rows[0]["num_drafts"] and rows[-1]["num_draft_tokens"] == 4 * rows[-1]["num_drafts"]
    assert all(r["outputs_equal_to_chain"] == 2 for r in rows)  # greedy: every drafting gives the same tokens
    assert all(len(r["acceptance_at"]) == k for r, k in zip(rows, (4, 3, 3, 3)))


@pytest.mark.parametrize("argv,message", [(["--draft-tree", "2,3"], "TOPK,DEPTH,TOTAL"),
                                          (["--draft-tree", "2,2,9"], "candidates"),
                                          (["--tree-vs-chain"], "needs --draft-tree"),
                                          (["--draft-tree", "2,3,4", "--shift-table"], "measures chains")])
def test_bench_tree_arguments_are_checked(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench_main(argv)


def test_bench_random_mm(tmp_path, capsys):
    """A LLaVA around the bundled base: its text path is the base's own, so the same draft works."""
    from eagle_fx.bench.modes.random_mm import llava_around

    tok, base = _pair()
    vlm = llava_around(base, base.config.vocab_size - 1)
    ids = torch.tensor([_prompts(1)[0]])
    with torch.no_grad():
        assert torch.equal(vlm(input_ids=ids).logits, base(input_ids=ids).logits)
    out = tmp_path / "mm.json"
    bench_main(["--backend", "eager", "--dataset-name", "random-mm", "--num-prompts", "3", "--output-len", "8", "--json", str(out)])
    rows = json.loads(out.read_text())["random_mm"]
    assert [r["scheme"] for r in rows] == ["shifted", "unshifted"]
    assert all(r["total_num_output_tokens"] > 0 and r["mean_acceptance_length"] > 1.0 for r in rows)
    assert "== other" in capsys.readouterr().out


def test_generate_cli_with_a_tree(capsys):
    """`eagle-fx generate --draft-tree`: greedy, so the same text as the chain."""
    from eagle_fx.cli import main as cli_main

    texts = []
    for extra in ([], ["--draft-tree", "2,4,6,0.2"]):
        cli_main(["generate", "Tell me about the sea.", "--max-new-tokens", "16"] + extra)
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "x", "--draft-tree", "2,3"])
    assert e.value.code == 2 and "eagle-fx generate: error: --draft-tree takes" in capsys.readouterr().err


def test_throughput_rows_equal_hf_greedy():
    """The throughput mode's runners at batch 3: HF over a left-padded batch (eos off), eagle_fx
    without speculation and eagle_fx with k=3 each give every prompt exactly output_len tokens, equal
    to HF greedy on that prompt alone (the oracle; fp32)."""
    import eagle_fx
    from eagle_fx.bench.hf_baselines import hf_greedy
    from eagle_fx.bench.modes.throughput import eagle_fx_batches

    tok, base = _pair()
    prompts = [p[:24] for p in _prompts(3)]
    with torch.no_grad():
        alone = [base.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.pad_token_id)[0, len(p):].tolist() for p in prompts]
    assert len({len(p) for p in prompts}) > 1  # a ragged batch: HF pads it
    model = eagle_fx.compile(base, eagle_fx.load_draft(BUNDLED / "eagle", base), max_batch_size=3, max_seq_len=64)
    runners = {"hf": hf_greedy(base, None, tok.pad_token_id, 10), "k0": eagle_fx_batches(model, 3, 0, 10),
               "k3": eagle_fx_batches(model, 3, 3, 10)}
    for name, run in runners.items():
        assert run(prompts) == alone, name


def test_bench_throughput_arguments_are_checked():
    with pytest.raises(SystemExit, match="--throughput-batch-sizes takes positive batch sizes like 1,4,16"):
        bench_main(["--throughput-batch-sizes", "1,x"])
    with pytest.raises(SystemExit, match="--throughput-batch-sizes is a mode of its own .*drop --compare"):
        bench_main(["--throughput-batch-sizes", "1,4", "--compare"])


def test_bench_plot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "figs" / "bench.png"
    bench_main(["--backend", "eager", "--num-prompts", "2", "--output-len", "8", "--plot", str(png)])
    assert f"wrote {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(SystemExit, match="--plot draws the main bench"):
        bench_main(["--plot", str(png), "--throughput-batch-sizes", "1"])


def _report_malloc_setting(queue):
    import os
    import resource

    queue.put({"threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def test_long_context_memory_runs_get_the_fixed_mmap_threshold(monkeypatch):
    """--long-context measures peak RSS in a process started with MALLOC_MMAP_THRESHOLD_ fixed
    (glibc reads it at start), times in one started as is, and leaves the bench's own environment
    as it was."""
    from eagle_fx.bench.modes.long_context import MMAP_THRESHOLD, spawned

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert spawned(_report_malloc_setting, mmap_threshold=MMAP_THRESHOLD)["threshold"] == str(MMAP_THRESHOLD)
    assert "MALLOC_MMAP_THRESHOLD_" not in __import__("os").environ
    assert spawned(_report_malloc_setting)["threshold"] is None


def test_bench_real_proportions_mode(tmp_path, monkeypatch, capsys):
    """--synthetic-acceptance on a small stand-in for a real config (the real ones take minutes):
    HF greedy, CTranslate2 fp32 and eagle_fx k=0 agree token for token (eos off); the speculative
    row's acceptance follows its coin (P=1: every draft accepted, tau = k+1 exactly) and is marked
    as not comparable; the cycle/decode cost ratio is reported."""
    from eagle_fx.bench.modes import real_proportions

    monkeypatch.setenv("EAGLE_FX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(real_proportions.BASE_CONFIGS, "qwen2.5-0.5b", (
        "Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=True)))
    out = tmp_path / "real.json"
    bench_main(["--synthetic-acceptance", "1", "--backend", "eager", "--num-prompts", "3", "--input-len", "12",
                "--output-len", "12", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "the speculative rows' output is NOT the base's greedy decode" in printed
    r = json.loads(out.read_text())["real_proportions"]
    assert r["mean_acceptance_length"] == 4.0 == r["expected_tau"]
    rows = {row["method"]: row for row in r["rows"]}
    assert rows["eagle_fx without speculation (k=0, eager)"]["prompts_equal_hf"] == "3/3"
    assert rows["eagle_fx (k=3, eager, synthetic acceptance P=1.0)"]["prompts_equal_hf"] is None
    if "CTranslate2 fp32" in rows:  # the peers extra (in the test extra)
        assert rows["CTranslate2 fp32"]["prompts_equal_hf"] == "3/3"
    assert r["cycle_ms"] > 0 and r["decode_ms"] > 0
    with pytest.raises(SystemExit, match=r"--synthetic-acceptance takes a probability in \[0, 1\]"):
        bench_main(["--synthetic-acceptance", "1.2"])
    with pytest.raises(SystemExit, match="--synthetic-acceptance is a mode of its own .*drop --compare"):
        bench_main(["--synthetic-acceptance", "0.8", "--compare"])
