"""A pruned draft vocabulary (eagle_fx.draft_vocab): the pruned draft's logits are the kept columns
of the full draft's, its ids map back through d2t, it saves and loads, and the pair still generates
exactly HF's greedy tokens; on the bundled pair, with its acceptance kept."""
import json
from collections import Counter

import pytest
import torch

import eagle_fx
from eagle_fx.draft_vocab import base_output_counts, coverage, most_frequent, prune_draft_vocab
from eagle_fx.drafts import DraftLoadError, load_draft, save_draft

from conftest import hf_greedy, make_prompts, tiny_base, tiny_draft

KEEP = torch.tensor(sorted({2, 5, 7, 11, 13, 20, 31, 40, 41, 42, 55, 60, 63, 70, 77, 81, 88, 90, 95}))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_pruned_logits_are_the_kept_columns_and_ids_map_back(method):
    base, draft = tiny_base("llama"), tiny_draft("llama", method)
    pruned = prune_draft_vocab(draft, base, KEEP)
    assert pruned.draft_vocab_size == len(KEEP) and type(pruned) is type(draft)
    out = torch.randn(2, 5, base.config.hidden_size)
    full, small = draft.logits(out, base.lm_head), pruned.logits(out, base.lm_head)
    torch.testing.assert_close(small, full[..., KEEP])  # fp32 tolerance: a narrower GEMM blocks its sums otherwise
    ids = torch.arange(len(KEEP))
    assert torch.equal(pruned.to_target(ids), KEEP)
    # the body is the draft's own: same features out
    ids_in, pos = torch.tensor([[3, 9, 4]]), torch.arange(3)[None]
    hidden = torch.randn(1, 3, draft.feature_dim)
    torch.testing.assert_close(pruned.body(ids_in, pos, pruned.project(hidden)),
                               draft.body(ids_in, pos, draft.project(hidden)), rtol=0, atol=0)
    # pruning again keeps a subset of the kept rows: the same as pruning once to it
    fewer = KEEP[::2]
    torch.testing.assert_close(prune_draft_vocab(pruned, base, fewer).logits(out, base.lm_head), full[..., fewer])
    with pytest.raises(ValueError, match="not in the draft's vocabulary"):
        prune_draft_vocab(pruned, base, torch.tensor([2, 3]))


def test_bad_keep_sets_are_refused():
    base, draft = tiny_base("llama"), tiny_draft("llama", "eagle")
    for keep, message in [([5, 2], "ascending"), ([2, 2], "ascending"), ([], "non-empty"), ([2, 96], "outside"),
                          (list(range(96)), "nothing to prune")]:
        with pytest.raises(ValueError, match=message):
            prune_draft_vocab(draft, base, torch.tensor(keep, dtype=torch.long))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_pruned_draft_saves_loads_and_generates_hfs_greedy(method, tmp_path):
    base, draft = tiny_base("llama"), tiny_draft("llama", method)
    pruned = prune_draft_vocab(draft, base, KEEP)
    loaded = load_draft(save_draft(pruned, tmp_path / "d"), base)
    assert type(loaded) is type(pruned) and loaded.draft_vocab_size == len(KEEP)
    for k, v in pruned.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    prompts = make_prompts(4)
    out = eagle_fx.compile(base, loaded, num_spec_tokens=3).generate(prompts, max_new_tokens=12)
    assert out.sequences == hf_greedy("llama", prompts, 12)


def test_a_pruned_eagle1_checkpoint_without_d2t_or_with_a_bad_one_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    base, draft = tiny_base("llama"), tiny_draft("llama", "eagle")
    folder = save_draft(prune_draft_vocab(draft, base, KEEP), tmp_path / "d")
    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "d2t"}, str(folder / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="missing key 'd2t'"):
        load_draft(folder, base)
    save_file({**state, "d2t": state["d2t"] + 90}, str(folder / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="outside the base vocab"):
        load_draft(folder, base)


def test_most_frequent_keeps_eos_then_the_most_counted_then_fills():
    counts = Counter({7: 5, 3: 9, 4: 5, 9: 1})
    assert most_frequent(counts, 3, always=[2]).tolist() == [2, 3, 4]  # 4 before 7: a tie goes to the lower id
    assert most_frequent(counts, 7, always=[2], vocab_size=10).tolist() == [0, 1, 2, 3, 4, 7, 9]  # 0, 1: filler
    with pytest.raises(ValueError, match="cannot hold"):
        most_frequent(counts, 1, always=[1, 2])
    assert coverage(counts, torch.tensor([3, 4])) == pytest.approx(14 / 20)
    assert coverage(Counter(), torch.tensor([3])) == 0.0


def test_base_output_counts_count_hfs_greedy_up_to_the_first_eos():
    base = tiny_base("llama")
    prompts = make_prompts(3, seed=4, lengths=(6,))  # one length: the batch needs no padding
    refs = hf_greedy("llama", prompts, 10)
    eos = refs[0][3]  # a token the first continuation emits: its count stops there
    expected = Counter()
    for ref in refs:
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        expected.update(ref[:cut])
    assert base_output_counts(base, prompts, 10, eos=[eos], batch_size=3, progress=False) == expected


def test_the_bundled_pruned_draft_keeps_greedy_exact_and_its_acceptance(capsys):
    """models/tiny-sharegpt/eagle-v256 (`eagle-fx prune-draft-vocab --size 256`): HF's greedy tokens,
    and a mean acceptance length within 5% of the full draft's on held-out prompts."""
    from eagle_fx.bench.prompts import sharegpt_prompts
    from eagle_fx.bundled import BUNDLED, load_pair, pair_dirs

    tok, base, draft = load_pair(*pair_dirs())
    pruned = load_draft(BUNDLED / "eagle-v256", base)
    assert pruned.draft_vocab_size == 256 and 2 in pruned.to_target(torch.arange(256)).tolist()
    prompts = sharegpt_prompts(tok, 6, 256)
    runs = {name: eagle_fx.compile(base, d, num_spec_tokens=3).generate(prompts, max_new_tokens=48)
            for name, d in (("full", draft), ("pruned", pruned))}
    with torch.no_grad():
        for p, seq in zip(prompts, runs["pruned"].sequences):
            ref = base.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False, pad_token_id=0, eos_token_id=None)
            assert seq == ref[0, len(p):].tolist()
    full, small = (runs[n].stats.mean_acceptance_length for n in ("full", "pruned"))
    assert small >= 0.95 * full, (small, full)
    report = json.loads((BUNDLED / "eagle-v256" / "draft_vocab.json").read_text())
    assert report["size"] == 256 and report["held_out"]["coverage"] > 0.99


def test_the_cli_writes_a_pruned_draft_and_its_figures(tmp_path, capsys):
    """`eagle-fx prune-draft-vocab` on the bundled pair, a few prompts: the folder loads, keeps eos,
    keeps the tokens its own calibration counted most, and states their coverage."""
    from eagle_fx.bench.prompts import sharegpt_prompts
    from eagle_fx.bundled import load_pair, pair_dirs
    from eagle_fx.cli import main

    out = tmp_path / "pruned"
    main(["prune-draft-vocab", "--out", str(out), "--size", "40", "--num-prompts", "6", "--max-new-tokens", "8",
          "--held-out-prompts", "3", "--batch-size", "4"])
    printed = capsys.readouterr().out
    assert "40-token vocabulary (of 2048)" in printed and "held_out: base's greedy outputs on 3 prompts" in printed
    tok, base, _ = load_pair(*pair_dirs())
    pruned = load_draft(out, base)
    kept = pruned.to_target(torch.arange(40))
    counts = base_output_counts(base, sharegpt_prompts(tok, 6, 512, part="train"), 8, eos=[2], batch_size=4,
                                progress=False)
    assert torch.equal(kept, most_frequent(counts, 40, always=[2], vocab_size=2048))
    report = json.loads((out / "draft_vocab.json").read_text())
    assert report["calibration"]["output_tokens"] == sum(counts.values())
    assert report["calibration"]["coverage"] == round(coverage(counts, kept), 4)


def test_cli_refuses_bad_sizes(tmp_path, capsys):
    from eagle_fx.cli import main

    for argv, message in [(["--size", "1"], "--size must be >= 2"), (["--size", "2048"], "a pruned one must be smaller"),
                          (["--size", "8", "--num-prompts", "0"], "--num-prompts")]:
        with pytest.raises(SystemExit) as e:
            main(["prune-draft-vocab", "--out", str(tmp_path / "x")] + argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
