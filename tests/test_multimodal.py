"""Vision-language bases (a tiny random LLaVA): greedy == HF generate with images, for both prefill
schemes and chunk sizes that cut through and beside images; draft KV bit-identical chunked vs
whole; prefix caching keyed by image content; clear errors."""
import functools

import pytest
import torch

import eagle_fx
from conftest import COMMON
from eagle_fx.drafts import new_draft

IMG = 95  # the image placeholder token
PER_IMAGE = 4  # (8 / 4) ** 2 patches, CLS dropped


@functools.lru_cache(maxsize=None)
def llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                          patch_size=4, num_channels=3, projection_dim=32)
    cfg = LlavaConfig(text_config=LlamaConfig(**COMMON), vision_config=vc, image_token_id=IMG,
                      projector_hidden_act="gelu", vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    base = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # image embeddings as large as token embeddings, so images change the output
        for p in base.model.multi_modal_projector.parameters():
            p.mul_(5)
    return base


@functools.lru_cache(maxsize=None)
def compiled(method="eagle", shift=False):
    base = llava()
    return eagle_fx.compile(base, new_draft(base, method, seed=3), prefill_shift=shift, max_batch_size=4)


def images(n, seed):
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def hf(prompt, pixels, max_new=12):
    ids = torch.tensor([prompt])
    kw = {} if pixels is None else {"pixel_values": pixels}
    with torch.no_grad():
        out = llava().generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                               do_sample=False, pad_token_id=0, eos_token_id=None, **kw)
    return out[0, len(prompt):].tolist()


# an image first, two images apart, no image, an image last
PROMPTS = [[IMG] * 4 + [7, 8, 9], [3] + [IMG] * 4 + [4, 5] + [IMG] * 4 + [6], [9, 10, 11, 12, 13], [20, 21, 22] + [IMG] * 4]
PIXELS = [images(1, 1), images(2, 2), None, images(1, 4)]


def test_images_change_the_output():
    assert hf(PROMPTS[0], images(1, 1)) != hf(PROMPTS[0], images(1, 9))


@pytest.mark.parametrize("chunk", [None, 1, 2, 3, 5])
@pytest.mark.parametrize("method,shift", [("eagle", False), ("eagle", True), ("eagle3", False), ("eagle3", True)])
def test_greedy_matches_hf_with_images(method, shift, chunk):
    model = compiled(method, shift).replace(prefill_chunk_size=chunk)
    out = model.generate(PROMPTS, max_new_tokens=12, eos_token_id=None, pixel_values=PIXELS)
    assert out.sequences == [hf(p, v) for p, v in zip(PROMPTS, PIXELS)]


@pytest.mark.parametrize("shift", [False, True])
def test_draft_kv_is_bit_identical_chunked(shift):
    """Chunks of 2 end right before an image (position 2 of [a, b, IMG x4, ...]) and cut through one;
    the draft's KV equals one whole prefill's, bit for bit (batch_invariant numerics)."""
    base = llava()
    model = eagle_fx.compile(base, new_draft(base, "eagle", seed=3), prefill_shift=shift, batch_invariant=True,
                             kv_share=None, max_batch_size=1, block_size=4)
    prompt, pixels = [30, 31] + [IMG] * 4 + [32, 33, 34] + [IMG] * 4 + [35], [images(2, 6)]
    pools = []
    for chunk in (None, 2, 3):
        m = model.replace(prefill_chunk_size=chunk)
        out = m.generate([prompt], max_new_tokens=1, eos_token_id=None, pixel_values=pixels)  # prefill only
        assert out.sequences == [hf(prompt, pixels[0], 1)]
        pools.append(m.draft_pool.clone())
    n = len(prompt) - shift  # shifted: the last slot waits for the sampled token
    flat = [p[0].reshape(2, -1, *p.shape[-2:])[:, :n] for p in pools]  # the one sequence's slots, in order
    assert flat[0].abs().sum() > 0
    assert torch.equal(flat[0], flat[1]) and torch.equal(flat[0], flat[2])


def test_prefix_cache_keys_include_the_image():
    model = compiled().replace(prefix_caching=True, block_size=4, max_batch_size=1)
    prompt = [IMG] * 4 + [40, 41, 42, 43, 44, 45]
    a, b = images(1, 11), images(1, 12)
    first = model.generate([prompt], max_new_tokens=8, eos_token_id=None, pixel_values=[a])
    other = model.generate([prompt], max_new_tokens=8, eos_token_id=None, pixel_values=[b])
    again = model.generate([prompt], max_new_tokens=8, eos_token_id=None, pixel_values=[a.clone()])
    assert first.sequences == again.sequences == [hf(prompt, a, 8)] and other.sequences == [hf(prompt, b, 8)]
    assert other.stats.prefix_hit_tokens_base == 0  # same placeholder tokens, another image: no shared block
    assert again.stats.prefix_hit_tokens_base >= 8  # the same image: its blocks are hits


def test_errors():
    model = compiled()
    with pytest.raises(ValueError, match="no pixel_values were given"):
        model.generate([PROMPTS[0]], max_new_tokens=2)
    with pytest.raises(ValueError, match="give 8 features"):
        model.generate([PROMPTS[0]], max_new_tokens=2, pixel_values=[images(2, 0)])
    with pytest.raises(ValueError, match="no image placeholder"):
        model.generate([[5, 6, 7]], max_new_tokens=2, pixel_values=[images(1, 0)])
    with pytest.raises(ValueError, match="entry is None"):
        model.generate([PROMPTS[0]], max_new_tokens=2, pixel_values=[None])
    with pytest.raises(ValueError, match="one entry per prompt"):
        model.generate([PROMPTS[0], [5]], max_new_tokens=2, pixel_values=[images(1, 0)])
    with pytest.raises(ValueError, match=r"\[num_images, C, H, W\]"):
        model.generate([PROMPTS[0]], max_new_tokens=2, pixel_values=[torch.zeros(3, 8, 8)])
    from conftest import compiled as text_model

    with pytest.raises(ValueError, match="not a vision-language model"):
        text_model("llama", "eagle").generate([[5, 6]], max_new_tokens=2, pixel_values=[images(1, 0)])
    # the model still works after every refusal
    assert model.generate([PROMPTS[0]], max_new_tokens=4, eos_token_id=None, pixel_values=[PIXELS[0]]).sequences == [
        hf(PROMPTS[0], PIXELS[0], 4)]
