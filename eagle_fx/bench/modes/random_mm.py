"""--dataset-name random-mm: shifted vs unshifted draft prefill on a vision-language pair (a LLaVA
around the base, random vision tower), prefix caching on, interleaved per batch."""
from __future__ import annotations

import torch

from eagle_fx.bench.prompts import random_mm_prompts
from eagle_fx.bench.timing import interleaved


def llava_around(base, image_token_id: int, seed: int = 0):
    """A LLaVA whose language model and lm_head are `base`'s (same weights) and whose CLIP vision tower
    (16x16 images, 16 tokens each) and projector are random: a vision-language pair for the bundled draft."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=4, num_channels=3, projection_dim=64)
    config = LlavaConfig(text_config=base.config, vision_config=vision, image_token_id=image_token_id,
                         projector_hidden_act="gelu", vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    vlm = LlavaForConditionalGeneration(config).to(dtype=next(base.parameters()).dtype).eval()
    vlm.model.language_model.load_state_dict(base.model.state_dict())
    vlm.lm_head.load_state_dict(base.lm_head.state_dict())
    vlm.generation_config = base.generation_config
    return vlm


def run(args, text_base, eagle_dir, tokenizer, backend: str) -> dict:
    import eagle_fx

    eos = tokenizer.eos_token_id
    image_token_id = text_base.config.vocab_size - 1
    vlm = llava_around(text_base, image_token_id, args.seed)
    draft = eagle_fx.load_draft(eagle_dir, vlm)
    vision = vlm.config.vision_config
    tokens_per_image = (vision.image_size // vision.patch_size) ** 2  # CLIP patches ("default": the CLS token dropped)
    prompts, pixels = random_mm_prompts(args, tokenizer, text_base.config.vocab_size, image_token_id, tokens_per_image)
    max_len = max(len(p) for p in prompts) + args.output_len
    schemes = ("shifted", "unshifted")
    models = []
    for scheme in schemes:
        model = eagle_fx.compile(vlm, draft, num_spec_tokens=args.num_spec_tokens, prefill_shift=scheme == "shifted",
                                 backend=backend, max_batch_size=args.max_num_seqs, max_seq_len=max_len,
                                 prefix_caching=True, prefill_chunk_size=args.prefill_chunk_size)
        model.generate(prompts[:1], max_new_tokens=4, eos_token_id=eos, pixel_values=pixels[:1])  # warm-up
        model.reset()  # no free prefix hits from the warm-up
        models.append(model)
    stats, outputs = interleaved(models, prompts, args.max_num_seqs, "random-mm", per_prompt={"pixel_values": pixels},
                                 max_new_tokens=args.output_len, eos_token_id=eos)
    rows = [{"scheme": scheme, **st.as_dict(), "tokens_per_s": st.total_num_output_tokens / st.wall_time_s}
            for scheme, st in zip(schemes, stats)]
    n_images = sum(0 if p is None else len(p) for p in pixels)
    print(f"random-mm: {len(prompts)} prompts, {n_images} images ({tokens_per_image} tokens each), prefix caching on")
    print("-" * 96)
    print(f"{'scheme':<11}{'mean acc len':>13}{'tok/s':>9}{'draft prefill computed':>24}{'draft prefix hits':>19}{'== other':>10}")
    same = sum(a == b for a, b in zip(*outputs))
    for r in rows:
        print(f"{r['scheme']:<11}{r['mean_acceptance_length']:>13.2f}{r['tokens_per_s']:>9.1f}"
              f"{r['prefill_tokens_computed_draft']:>24}{r['prefix_hit_tokens_draft']:>19}{f'{same}/{len(prompts)}':>10}")
    return {"random_mm": rows}
