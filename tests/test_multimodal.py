"""Vision-language bases (tiny random LLaVA and Qwen2-VL): greedy == HF generate with images, for both prefill
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


START, END = 93, 92  # Qwen2-VL's vision start / end tokens


@functools.lru_cache(maxsize=None)
def qwen2vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    # initializer_range 0.2: attention sharp enough that M-RoPE positions change the greedy output
    text = {k: v for k, v in COMMON.items() if k != "head_dim"} | {"initializer_range": 0.2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3, mlp_ratio=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=94,
                        vision_start_token_id=START, vision_end_token_id=END, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    base = Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in base.model.visual.merger.parameters():
            p.mul_(5)
    return base


BASES = {"llava": llava, "qwen2vl": qwen2vl}


@functools.lru_cache(maxsize=None)
def compiled(family="llava", method="eagle", shift=False):
    base = BASES[family]()
    return eagle_fx.compile(base, new_draft(base, method, seed=3), prefill_shift=shift, max_batch_size=4)


def images(n, seed, family="llava"):
    """n images: LLaVA pixels, or Qwen2-VL flattened patches with grids (1, 4, 4) and (1, 2, 4)."""
    g = torch.Generator().manual_seed(seed)
    if family == "llava":
        return torch.randn(n, 3, 8, 8, generator=g), None
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]] * n)[:n]
    return torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 2 * 2, generator=g), grid


def tokens(grid_row, family):
    """The placeholder run of one image (Qwen2-VL: between vision start and end)."""
    if family == "llava":
        return [IMG] * PER_IMAGE
    return [START] + [IMG] * (int(grid_row.prod()) // 4) + [END]


def hf(prompt, pixels, max_new=12, family="llava", grid=None):
    ids = torch.tensor([prompt])
    kw = {} if pixels is None else {"pixel_values": pixels}
    if grid is not None:
        kw |= {"image_grid_thw": grid, "mm_token_type_ids": (ids == IMG).int()}
    with torch.no_grad():
        out = BASES[family]().generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                       do_sample=False, pad_token_id=0, eos_token_id=None, **kw)
    return out[0, len(prompt):].tolist()


def case(family):
    """Prompts with an image first, two images apart, no image, an image last; their pixels and grids."""
    imgs = [images(1, 1, family), images(2, 2, family), (None, None), images(1, 4, family)]
    one = [None if g is None else [tokens(r, family) for r in g] for _, g in imgs]
    if family == "llava":
        one = [[[IMG] * 4], [[IMG] * 4, [IMG] * 4], None, [[IMG] * 4]]
    prompts = [one[0][0] + [7, 8, 9], [3] + one[1][0] + [4, 5] + one[1][1] + [6], [9, 10, 11, 12, 13],
               [20, 21, 22] + one[3][0]]
    return prompts, [p for p, _ in imgs], [g for _, g in imgs]


def generate(model, prompts, pixels, grids, family, **kw):
    extra = {"image_grid_thw": grids} if family == "qwen2vl" else {}
    return model.generate(prompts, eos_token_id=None, pixel_values=pixels, **extra, **kw)


@pytest.mark.parametrize("family", ["llava", "qwen2vl"])
def test_images_change_the_output(family):
    prompts, pixels, grids = case(family)
    other, _ = images(1, 9, family)
    assert hf(prompts[0], pixels[0], family=family, grid=grids[0]) != hf(prompts[0], other, family=family, grid=grids[0])
    if family == "qwen2vl":  # M-RoPE: image tokens' positions are not their cache positions, and that matters
        _, delta = compiled(family).image_encoder.rope_positions(prompts[1], grids[1])
        assert delta != 0
        ids = torch.tensor([prompts[1]])
        kw = dict(pixel_values=pixels[1], image_grid_thw=grids[1], mm_token_type_ids=(ids == IMG).int())
        with torch.no_grad():
            mrope = qwen2vl()(input_ids=ids, **kw).logits
            flat = qwen2vl()(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand(3, 1, -1), **kw).logits
        assert not torch.equal(mrope.argmax(-1), flat.argmax(-1))


@pytest.mark.parametrize("chunk", [None, 1, 2, 3, 5])
@pytest.mark.parametrize("method,shift", [("eagle", False), ("eagle", True), ("eagle3", False), ("eagle3", True)])
@pytest.mark.parametrize("family", ["llava", "qwen2vl"])
def test_greedy_matches_hf_with_images(family, method, shift, chunk):
    prompts, pixels, grids = case(family)
    model = compiled(family, method, shift).replace(prefill_chunk_size=chunk)
    out = generate(model, prompts, pixels, grids, family, max_new_tokens=12)
    assert out.sequences == [hf(p, v, family=family, grid=g) for p, v, g in zip(prompts, pixels, grids)]


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("family", ["llava", "qwen2vl"])
def test_draft_kv_is_bit_identical_chunked(family, shift):
    """Chunks of 2 end right before an image (position 2 of [a, b, IMG x4, ...]) and cut through one;
    the draft's KV equals one whole prefill's, bit for bit (batch_invariant numerics)."""
    base = BASES[family]()
    model = eagle_fx.compile(base, new_draft(base, "eagle", seed=3), prefill_shift=shift, batch_invariant=True,
                             kv_share=None, max_batch_size=1, block_size=4)
    pixels, grid = images(2, 6, family)
    runs = [[IMG] * 4, [IMG] * 4] if family == "llava" else [[IMG] * 4, [IMG] * 2]
    prompt = [30, 31] + runs[0] + [32, 33, 34] + runs[1] + [35]
    pools = []
    for chunk in (None, 2, 3):
        m = model.replace(prefill_chunk_size=chunk)
        out = generate(m, [prompt], [pixels], [grid], family, max_new_tokens=1)  # prefill only
        assert out.sequences == [hf(prompt, pixels, 1, family, grid)]
        pools.append(m.kv_cache.draft_pool.clone())
    n = len(prompt) - shift  # shifted: the last slot waits for the sampled token
    flat = [p[0].reshape(2, -1, *p.shape[-2:])[:, :n] for p in pools]  # the one sequence's slots, in order
    assert flat[0].abs().sum() > 0
    assert torch.equal(flat[0], flat[1]) and torch.equal(flat[0], flat[2])


@pytest.mark.parametrize("family", ["llava", "qwen2vl"])
def test_prefix_cache_keys_include_the_image(family):
    model = compiled(family).replace(prefix_caching=True, block_size=4, max_batch_size=1)
    (a, grid), (b, _) = images(1, 11, family), images(1, 12, family)
    prompt = tokens(grid[0], family) if grid is not None else [IMG] * 4
    prompt = prompt + [40, 41, 42, 43, 44, 45]
    run = lambda px: generate(model, [prompt], [px], [grid], family, max_new_tokens=8)  # noqa: E731
    first, other, again = run(a), run(b), run(a.clone())
    assert first.sequences == again.sequences == [hf(prompt, a, 8, family, grid)]
    assert other.sequences == [hf(prompt, b, 8, family, grid)]
    assert other.stats.prefix_hit_tokens_base == 0  # same placeholder tokens, another image: no shared block
    assert again.stats.prefix_hit_tokens_base >= 8  # the same image: its blocks are hits


def test_errors():
    model = compiled()
    PROMPTS, PIXELS, _ = case("llava")
    images1 = lambda n, seed: images(n, seed)[0]  # noqa: E731
    with pytest.raises(ValueError, match="no pixel_values were given"):
        model.generate([PROMPTS[0]], max_new_tokens=2)
    with pytest.raises(ValueError, match="give 8 features"):
        model.generate([PROMPTS[0]], max_new_tokens=2, pixel_values=[images1(2, 0)])
    with pytest.raises(ValueError, match="no image placeholder"):
        model.generate([[5, 6, 7]], max_new_tokens=2, pixel_values=[images1(1, 0)])
    with pytest.raises(ValueError, match="entry is None"):
        model.generate([PROMPTS[0]], max_new_tokens=2, pixel_values=[None])
    with pytest.raises(ValueError, match="one entry per prompt"):
        model.generate([PROMPTS[0], [5]], max_new_tokens=2, pixel_values=[images1(1, 0)])
    with pytest.raises(ValueError, match=r"\[num_images, C, H, W\]"):
        model.generate([PROMPTS[0]], max_new_tokens=2, pixel_values=[torch.zeros(3, 8, 8)])
    from conftest import compiled as text_model

    with pytest.raises(ValueError, match="not a vision-language model"):
        text_model("llama", "eagle").generate([[5, 6]], max_new_tokens=2, pixel_values=[images1(1, 0)])
    qwen = compiled("qwen2vl")
    pixels, grid = images(1, 0, "qwen2vl")
    prompt = tokens(grid[0], "qwen2vl")
    with pytest.raises(ValueError, match="needs its image_grid_thw"):
        qwen.generate([prompt], max_new_tokens=2, pixel_values=[pixels])
    with pytest.raises(ValueError, match="has 16 patches but its image_grid_thw"):
        qwen.generate([prompt], max_new_tokens=2, pixel_values=[pixels], image_grid_thw=[torch.tensor([[1, 2, 2]])])
    # the model still works after every refusal
    assert model.generate([PROMPTS[0]], max_new_tokens=4, eos_token_id=None, pixel_values=[PIXELS[0]]).sequences == [
        hf(PROMPTS[0], PIXELS[0], 4)]


def test_export_round_trip_text_prompts(tmp_path):
    """A Qwen2-VL pair exports (image rows and M-RoPE positions are graph inputs); the loaded graphs
    run text prompts like the in-memory model, and images need the compiled model's vision tower."""
    model = compiled("qwen2vl")
    loaded = eagle_fx.load_exported(eagle_fx.export(model, tmp_path / "vl"))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    assert loaded.generate(prompts, max_new_tokens=8, eos_token_id=None).sequences == model.generate(
        prompts, max_new_tokens=8, eos_token_id=None).sequences
    pixels, grid = images(1, 0, "qwen2vl")
    with pytest.raises(ValueError, match="no image encoder"):
        loaded.generate([tokens(grid[0], "qwen2vl")], max_new_tokens=2, pixel_values=[pixels], image_grid_thw=[grid])


def test_unsupported_families_and_static_steps_are_refused():
    from types import SimpleNamespace

    from eagle_fx.multimodal import check_vision_language

    gemma = SimpleNamespace(config=SimpleNamespace(model_type="gemma3"))
    with pytest.raises(ValueError, match="model_type 'gemma3'.* not supported"):
        check_vision_language(gemma)
    with pytest.raises(ValueError, match="static_steps is not supported"):
        compiled("llava").replace(static_steps=True)
