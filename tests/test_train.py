"""The draft trainer: loss goes down, checkpoints load, resume continues where it stopped."""
import json
import re

import pytest
import torch

from conftest import tiny_base
from eagle_fx import load_draft
from eagle_fx.train import draft_loss, train_draft


def _rows(n=16, s=24):
    # a learnable stream: each row counts up modulo the vocab from a random start
    start = torch.randint(0, 96, (n, 1))
    return (start + torch.arange(s)) % 96


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_train_checkpoint_resume(tmp_path, method):
    torch.manual_seed(0)
    base = tiny_base("llama")
    rows = _rows()
    out = tmp_path / method
    draft = train_draft(base, rows, out, method=method, steps=6, batch_size=4, checkpoint_every=3, progress=False)
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 6
    loaded = load_draft(out, base)
    for (n, a), b in zip(draft.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=n)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1

    resumed = train_draft(base, rows, out, method=method, steps=9, batch_size=4, resume=True, progress=False)
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 9
    assert not torch.equal(resumed.fc.weight, loaded.fc.weight)


def test_loss_decreases(tmp_path):
    torch.manual_seed(0)
    base = tiny_base("qwen2")
    from eagle_fx.drafts import new_draft

    draft = new_draft(base, "eagle", seed=0)
    rows = _rows(8, 20)
    with torch.no_grad():
        before, _ = draft_loss(base, draft, rows, noise=0.0)
    # 60 steps: at 30 the ratio sat at 0.69-0.71 across draft seeds, a coin toss at the threshold
    train_draft(base, rows, tmp_path / "d", steps=60, batch_size=8, lr=3e-3, warmup=5, progress=False, draft=draft)
    with torch.no_grad():
        after, _ = draft_loss(base, draft, rows, noise=0.0)
    assert after < 0.7 * before


def test_kv_share_training_and_cli_errors(tmp_path, capsys):
    """train-draft --kv-share: the draft records its layer and RoPE, loads as a sharing draft,
    learns, and compiles into kv_share mode by default; bad layers are refused before any work."""
    torch.manual_seed(0)
    base = tiny_base("llama")
    rows = _rows(8, 20)
    from eagle_fx.drafts import new_draft

    draft = new_draft(base, "eagle", seed=0, kv_share=-2)
    with torch.no_grad():
        before, _ = draft_loss(base, draft, rows, noise=0.0)
    train_draft(base, rows, tmp_path / "d", method="eagle", steps=30, batch_size=8, lr=3e-3, warmup=5,
                progress=False, draft=draft)
    with torch.no_grad():
        after, _ = draft_loss(base, draft, rows, noise=0.0)
    assert after < 0.8 * before
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["eagle_fx_kv_share_layer"] == 2
    loaded = load_draft(tmp_path / "d", base)
    assert loaded.kv_share_layer == 2

    import eagle_fx

    assert eagle_fx.compile(base, loaded, max_batch_size=1, max_seq_len=64).kv_cache.kv_mode == "layer"
    with pytest.raises(ValueError, match="holds a draft sharing base layer 2, not 1"):
        train_draft(base, rows, tmp_path / "d", method="eagle", steps=31, resume=True, kv_share=1, progress=False)

    from eagle_fx.cli import main

    base_dir = str(_save_base(tmp_path))
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as e:
        main(["train-draft", "--base", base_dir, "--out", str(tmp_path / "x"), "--kv-share", "9"])
    assert e.value.code == 2
    assert "eagle-fx train-draft: error: --kv-share: kv_share=9: the base has 4 layers" in capsys.readouterr().err


def _save_base(tmp_path):
    """The tiny base as a model folder, with the bundled tokenizer's files (the CLI checks a folder
    has a tokenizer before loading; these tests fail later, on their own flags)."""
    import shutil

    from eagle_fx.bundled import BUNDLED

    path = tmp_path / "base"
    tiny_base("llama").save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / "base" / name, path / name)
    return path


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_bf16_base_trains_an_fp32_draft_that_runs_beside_it(tmp_path, method):
    """A bf16 base: the draft keeps fp32 master weights, its forward runs under bf16 autocast, the
    loss goes down, the base stays bf16 and frozen, and the checkpoint loads and runs in bf16."""
    import copy

    import eagle_fx
    from conftest import make_prompts
    from eagle_fx.drafts import new_draft

    losses = {}
    for dtype in (torch.float32, torch.bfloat16):  # the same draft init and data at each precision
        torch.manual_seed(0)
        base = copy.deepcopy(tiny_base("llama")).to(dtype)
        before_weights = {k: v.clone() for k, v in base.state_dict().items()}
        rows = _rows(8, 20)
        draft = new_draft(base, method, seed=0)
        with torch.no_grad():
            before, _ = draft_loss(base, draft.float(), rows, noise=0.0)
        trained = train_draft(base, rows, tmp_path / str(dtype), method=method, steps=40, batch_size=8, lr=3e-3,
                              warmup=5, progress=False, draft=draft)
        with torch.no_grad():
            losses[dtype] = before, draft_loss(base, trained, rows, noise=0.0)[0]
    before, after = losses[torch.bfloat16]
    # EAGLE-1's feature regression learns fast; EAGLE-3's loss is a cross-entropy against this random
    # base's near-uniform distribution, close to its floor from the start
    assert torch.isfinite(after) and after < (0.85 if method == "eagle" else 1.0) * before
    assert abs(after - losses[torch.float32][1]) <= 0.03 * losses[torch.float32][1]  # learns as in fp32
    assert next(trained.parameters()).dtype == torch.float32
    assert all(torch.equal(v, before_weights[k]) for k, v in base.state_dict().items())  # untouched, still bf16
    loaded = load_draft(tmp_path / str(torch.bfloat16), base)
    assert next(loaded.parameters()).dtype == torch.bfloat16 and loaded.shares_base_embeddings
    out = eagle_fx.compile(base, loaded, max_batch_size=2, max_seq_len=64).generate(make_prompts(2), max_new_tokens=8)
    assert all(len(s) == 8 for s in out.sequences)


def test_train_draft_cli_device_and_dtype(tmp_path, capsys):
    from eagle_fx.cli import main

    base = str(_save_base(tmp_path))
    capsys.readouterr()  # save_pretrained's progress bar
    cases = [(["--device", "gpu0"], r"--device 'gpu0'"), (["--steps", "0"], "--steps and --batch-size must be >= 1")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], r"--device cuda: CUDA is not available here \(use --device cpu\)"))
    for extra, message in cases:
        with pytest.raises(SystemExit) as e:
            main(["train-draft", "--base", base, "--out", str(tmp_path / "x")] + extra)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1
        assert re.search("eagle-fx train-draft: error: " + message, err), err
    with pytest.raises(SystemExit):  # argparse: invalid choice
        main(["train-draft", "--base", base, "--out", str(tmp_path / "x"), "--dtype", "int8"])
