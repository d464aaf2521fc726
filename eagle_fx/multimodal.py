"""Vision-language bases (LLaVA and Qwen2-VL families): the language model the draft attaches to,
image encoding, and the virtual token ids that carry image embeddings through the step graphs.

A vision-language base is captured as its language model + lm_head over input embeddings, and
every step graph (base and draft) takes one more input, `mm_embeds [R, H]`. A token id
v >= vocab_size stands for row v - vocab_size of mm_embeds: its input embedding is that image
embedding (the vision tower's output, projected), for the base and the draft alike, as vLLM does
for multimodal EAGLE. The runtime encodes each image once per generate call, puts the rows of a
wave's images in mm_embeds, and replaces each prompt's image placeholder tokens by the virtual ids
of its image's rows, in order. So a chunk boundary anywhere, through or beside an image, sees the
same embeddings as one whole prefill; and the shifted scheme's look-ahead token before an image is
the virtual id of the image's first row, i.e. the image's first embedding.

Prefix caching keys a placeholder by a hash of its image's pixels and its index in the image, so
equal placeholder tokens with different images never share blocks.

Qwen2-VL's M-RoPE gives image tokens 3-D (temporal, height, width) positions and later text
positions shifted by a per-prompt delta, so its base graph takes `rope_positions [3, 1, T]` for
RoPE besides `positions` (the cache position each token's K/V is stored and masked at). The
runtime takes a prompt's rope positions from the model's own get_rope_index and gives every later
token cache position + delta. The draft keeps 1-D RoPE over cache positions.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from eagle_fx.model_inputs import embed_tokens, select_features

SUPPORTED = ("llava", "qwen2_vl")  # config.model_type of the vision-language families eagle_fx runs


def is_vision_language(base) -> bool:
    """A Hugging Face image-text-to-text model (image features merged at placeholder tokens)."""
    return callable(getattr(base, "get_image_features", None)) and getattr(base.config, "vision_config", None) is not None


def check_vision_language(base) -> None:
    """Refuse image-text families eagle_fx does not know (their embedding or RoPE may differ)."""
    kind = getattr(base.config, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(f"eagle_fx: vision-language base {type(base).__name__} (model_type {kind!r}) is not supported; "
                         f"supported families: {SUPPORTED}")
    rows, vocab = base.get_input_embeddings().num_embeddings, base.config.get_text_config().vocab_size
    if rows != vocab:
        raise ValueError(f"eagle_fx: the base's embedding has {rows} rows but its text vocab_size is {vocab}; image "
                         "rows are addressed past the vocab, so the two must be equal")


def image_token_id(base) -> int:
    c = base.config
    tid = getattr(c, "image_token_id", None)
    return int(tid if tid is not None else c.image_token_index)


def language_model(base) -> nn.Module:
    """The decoder the draft attaches to (takes inputs_embeds, returns hidden states)."""
    inner = getattr(base, "model", None)
    lm = getattr(inner, "language_model", None) or getattr(base, "language_model", None)
    if lm is None:
        raise TypeError(f"eagle_fx: cannot find the language model of {type(base).__name__} (no .model.language_model)")
    return lm


class VisionLanguageBaseStep(nn.Module):
    """BaseStep for a vision-language base: its language model on packed tokens whose image
    placeholders are virtual ids into mm_embeds; logits at `logits_indices`, features at every token.
    mrope (Qwen2-VL family): the language model's RoPE takes `rope_positions` [3, 1, T] (temporal,
    height, width), while `positions` stays each token's cache position (what the KV cache keys by)."""

    def __init__(self, base: nn.Module, feature_layers: tuple[int, ...] = (), mrope: bool = False):
        super().__init__()
        self.language_model = language_model(base)
        self.lm_head = base.get_output_embeddings()
        self.embed = base.get_input_embeddings()
        self.feature_layers = tuple(feature_layers)
        self.mrope = mrope

    def forward(self, input_ids, positions, logits_indices, mm_embeds, rope_positions=None):
        e = embed_tokens(input_ids, self.embed, mm_embeds)
        out = self.language_model(inputs_embeds=e, position_ids=rope_positions if self.mrope else positions,
                                  output_hidden_states=True, use_cache=False)
        logits = self.lm_head(out.last_hidden_state[:, logits_indices])
        return logits[0], select_features(out.hidden_states, self.feature_layers)[0]


class LlavaImages:
    """LLaVA family: a prompt's pixel_values are [num_images, C, H, W]; no grid sizes."""

    mrope = False
    pixels_layout = "[num_images, C, H, W]"

    def __init__(self, base):
        self.base = base

    def split(self, pixel_values: torch.Tensor, grid) -> list[torch.Tensor]:
        """The pixels of each image (for its content key)."""
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4 or pixel_values.shape[0] == 0:
            raise ValueError(f"must be a {self.pixels_layout} tensor")
        if grid is not None:
            raise ValueError("takes no image_grid_thw (a LLaVA base's images are whole pictures)")
        return list(pixel_values)

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, grid) -> list[torch.Tensor]:
        """One [tokens, H] feature tensor per image (vision tower + projector, run once per image)."""
        c = self.base.config
        p = next(self.base.parameters())
        out = self.base.get_image_features(pixel_values=pixel_values.to(device=p.device, dtype=p.dtype),
                                           vision_feature_layer=c.vision_feature_layer,
                                           vision_feature_select_strategy=c.vision_feature_select_strategy,
                                           return_dict=True).pooler_output
        return [f.reshape(-1, f.shape[-1]) for f in out]

    def rope_positions(self, prompt: list[int], grid) -> tuple[torch.Tensor, int] | None:
        return None


class Qwen2VLImages:
    """Qwen2-VL family: a prompt's pixel_values are the processor's flattened patches [patches, D]
    and its image_grid_thw [num_images, 3] (patches per image = t * h * w; tokens per image =
    t * h * w / spatial_merge_size**2). Its M-RoPE positions come from the model's get_rope_index."""

    mrope = True
    pixels_layout = "[patches, D] (flattened patches, as the processor gives)"

    def __init__(self, base):
        self.base = base
        self.image_token_id = image_token_id(base)

    def split(self, pixel_values: torch.Tensor, grid) -> list[torch.Tensor]:
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 2:
            raise ValueError(f"must be a {self.pixels_layout} tensor")
        if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
            raise ValueError("needs its image_grid_thw: a [num_images, 3] tensor of (t, h, w) patch counts")
        sizes = grid.prod(-1).tolist()
        if sum(sizes) != pixel_values.shape[0]:
            raise ValueError(f"has {pixel_values.shape[0]} patches but its image_grid_thw {grid.tolist()} gives {sum(sizes)}")
        return [(rows, tuple(int(x) for x in g)) for rows, g in zip(pixel_values.split(sizes), grid)]

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, grid) -> list[torch.Tensor]:
        p = next(self.base.parameters())
        out = self.base.model.get_image_features(pixel_values=pixel_values.to(device=p.device, dtype=p.dtype),
                                                 image_grid_thw=grid.to(p.device), return_dict=True).pooler_output
        return [f.reshape(-1, f.shape[-1]) for f in out]

    def rope_positions(self, prompt: list[int], grid) -> tuple[torch.Tensor, int] | None:
        """([3, len] M-RoPE positions of the prompt, delta: a later token at cache position p gets p + delta)."""
        if grid is None:
            return None
        dev = next(self.base.parameters()).device
        ids = torch.tensor([prompt], device=dev)
        pos, delta = self.base.model.get_rope_index(ids, mm_token_type_ids=(ids == self.image_token_id).int(),
                                                    image_grid_thw=grid.to(dev))
        return pos[:, 0], int(delta.reshape(-1)[0])


def image_inputs_for(base):
    """The image handling of a vision-language base (LLaVA or Qwen2-VL family)."""
    inner = getattr(base, "model", None)
    return Qwen2VLImages(base) if callable(getattr(inner, "get_rope_index", None)) else LlavaImages(base)


def image_key(image) -> int:
    """A 62-bit content hash of one image: its pixels (dtype and shape included), or (pixels, grid)."""
    pixels, extra = image if isinstance(image, tuple) else (image, ())
    data = pixels.detach().to("cpu").contiguous()
    meta = str((data.dtype, tuple(data.shape), extra)).encode()
    digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes() + meta, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def placeholder_keys(prompt: list[int], image_tokens: int, keys: list[int], sizes: list[int]) -> list[int]:
    """The prompt as prefix-cache keys: placeholder j of image g becomes -(1 + hash(image g, j))."""
    out, img, j = [], 0, 0
    for t in prompt:
        if t == image_tokens:
            out.append(-(1 + hash((keys[img], j)) % (1 << 62)))
            j += 1
            if j == sizes[img]:
                img, j = img + 1, 0
        else:
            out.append(t)
    return out


def prompt_images(encoder, image_token_id: int | None, prompts: list[list[int]], pixel_values, image_grid_thw,
                  device, dtype) -> list:
    """Check and encode generate()'s images. Per prompt: None (no images), or (feature rows
    [n, embed_dim], prefix-cache key tokens, M-RoPE (positions [3, len], delta) or None)."""
    tid = image_token_id
    if pixel_values is None:
        if image_grid_thw is not None:
            raise ValueError("image_grid_thw given without pixel_values")
        if tid is not None:
            bad = [i for i, p in enumerate(prompts) if tid in p]
            if bad:
                raise ValueError(f"prompt {bad[0]} has image placeholder tokens (id {tid}) but no pixel_values were "
                                 "given; pass pixel_values=[...] with one entry per prompt")
        return [None] * len(prompts)
    if tid is None:
        raise ValueError("pixel_values given, but the base is not a vision-language model (no image placeholders)")
    if encoder is None:
        raise ValueError("this model has no image encoder (a model loaded from exported graphs): run images through "
                         "a model from eagle_fx.compile")
    if not isinstance(pixel_values, (list, tuple)) or len(pixel_values) != len(prompts):
        raise ValueError(f"pixel_values must be a list with one entry per prompt ({len(prompts)}), each None or "
                         f"a {encoder.pixels_layout} tensor")
    grids = [None] * len(prompts) if image_grid_thw is None else image_grid_thw
    if not isinstance(grids, (list, tuple)) or len(grids) != len(prompts):
        raise ValueError(f"image_grid_thw must be a list with one entry per prompt ({len(prompts)})")
    out = []
    for i, (p, pv, grid) in enumerate(zip(prompts, pixel_values, grids)):
        n_ph = sum(t == tid for t in p)
        if pv is None:
            if grid is not None:
                raise ValueError(f"image_grid_thw[{i}] is given but pixel_values[{i}] is None")
            if n_ph:
                raise ValueError(f"prompt {i} has {n_ph} image placeholder tokens (id {tid}) but its pixel_values entry is None")
            out.append(None)
            continue
        try:
            images = encoder.split(pv, grid)
        except ValueError as e:
            raise ValueError(f"pixel_values[{i}] {e}") from None
        if n_ph == 0:
            raise ValueError(f"pixel_values[{i}] holds {len(images)} image(s) but prompt {i} has no image placeholder "
                             f"tokens (id {tid}); put each image's placeholders in the prompt")
        feats = encoder.encode(pv, grid)
        sizes = [f.shape[0] for f in feats]
        if sum(sizes) != n_ph:
            raise ValueError(f"prompt {i} has {n_ph} image placeholder tokens (id {tid}) but its {len(sizes)} image(s) "
                             f"give {sum(sizes)} features ({sizes} per image); the counts must match")
        keys = placeholder_keys(p, tid, [image_key(img) for img in images], sizes)
        out.append((torch.cat(feats).to(device=device, dtype=dtype), keys, encoder.rope_positions(p, grid)))
    return out


def wave_inputs(prompts: list[list[int]], images: list, vocab_size: int, image_token_id: int, embed_dim: int,
                mrope: bool, device, dtype):
    """A wave's (graph prompts: placeholders as virtual ids vocab_size + row, prefix-cache keys:
    placeholders as image-content keys, mm_embeds [rows, embed_dim] (never empty), M-RoPE table
    (prompt positions [B, 3, max_len], prompt lengths [B], deltas [B]) or None)."""
    rows, graph, keys = [], [], []
    n = 0
    for p, img in zip(prompts, images):
        if img is None:
            graph.append(p)
            keys.append(p)
            continue
        feats, key, _ = img
        it = iter(range(vocab_size + n, vocab_size + n + feats.shape[0]))
        graph.append([next(it) if t == image_token_id else t for t in p])
        keys.append(key)
        rows.append(feats)
        n += feats.shape[0]
    rows.append(torch.zeros(1, embed_dim, device=device, dtype=dtype))
    rope = None
    if mrope:
        long = dict(dtype=torch.long, device=device)
        lens = torch.tensor([len(p) for p in prompts], **long)
        table = torch.arange(int(lens.max()), **long).expand(len(prompts), 3, -1).clone()
        delta = torch.zeros(len(prompts), **long)
        for s, img in enumerate(images):
            if img is not None and img[2] is not None:
                pos, d = img[2]
                table[s, :, :pos.shape[1]] = pos.to(device)
                delta[s] = d
        rope = (table, lens, delta)
    return graph, keys, torch.cat(rows), rope


def rope_positions(rope, positions: torch.Tensor, query_start_loc: torch.Tensor, seq_rows) -> torch.Tensor:
    """[3, 1, T] M-RoPE positions of packed tokens: a prompt token's from its wave's table, a later
    token's its cache position + its sequence's delta (no table: the cache position). seq_rows: the
    wave row of each sequence of the call (None: 0, 1, ...)."""
    pos = positions.reshape(-1)
    if rope is None:
        return pos.expand(3, -1)[:, None].contiguous()
    table, lens, delta = rope
    n_seq = query_start_loc.shape[0] - 1
    rows = torch.arange(n_seq, device=pos.device) if seq_rows is None else seq_rows
    seq = torch.repeat_interleave(rows, query_start_loc.diff(), output_size=pos.shape[0])
    out = (pos + delta[seq]).expand(3, -1).clone()
    inside = pos < lens[seq]
    out[:, inside] = table[seq[inside], :, pos[inside]].T
    return out[:, None]
