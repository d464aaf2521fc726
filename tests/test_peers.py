"""CTranslate2 as a bench baseline (eagle_fx.bench.ctranslate2_peer): converted once, decoded in a
child process. Oracle: its fp32 greedy output equals HF greedy on the bundled base, token for token,
with and without eos; int8 decodes (lossy: its tokens are not checked)."""
import pytest
import torch

from eagle_fx.bench import ctranslate2_peer
from eagle_fx.bundled import BUNDLED

pytest.importorskip("ctranslate2", reason="CTranslate2 is the optional 'peers' extra (in the test extra)")


@pytest.fixture(scope="module")
def base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(BUNDLED / "base", dtype=torch.float32).eval()


def _hf(base, prompt, n, eos):
    out = base.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_ctranslate2_fp32_equals_hf_greedy(base, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_FX_CACHE", str(tmp_path))
    prompts = [[1, 50, 60, 70, 80, 90], [1, 33, 44], list(range(3, 40))]
    for eos in (2, None):
        outputs, seconds = ctranslate2_peer.run_peer(BUNDLED / "base", prompts, 24, eos)
        assert seconds > 0
        assert outputs == [_hf(base, p, 24, eos) for p in prompts]
        if eos is None:
            assert all(len(o) == 24 for o in outputs)
    assert len(list((tmp_path / "ctranslate2").iterdir())) == 1  # converted once, reused
    int8, _ = ctranslate2_peer.run_peer(BUNDLED / "base", prompts, 8, None, batch_size=2, compute_type="int8")
    assert [len(o) for o in int8] == [8, 8, 8]


def test_ctranslate2_bad_compute_type():
    with pytest.raises(ValueError, match="compute_type must be one of"):
        ctranslate2_peer.run_peer(BUNDLED / "base", [[1, 2]], 4, None, compute_type="fp8")
