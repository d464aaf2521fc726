"""The bench's prompts: held-out ShareGPT first turns (or random tokens), multi-turn pairs, and
prompts with images for the vision-language bench."""
from __future__ import annotations

import sys

import torch


def load_prompts(args, tokenizer, vocab_size: int) -> list[list[int]]:
    """--num-prompts prompts: random token ids (--dataset-name random, --input-len each), else the
    held-out ShareGPT first user turns, chat-rendered, that fit --max-prompt-len."""
    if args.dataset_name == "random":
        g = torch.Generator().manual_seed(args.seed)
        return [torch.randint(3, vocab_size, (args.input_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    prompts = sharegpt_prompts(tokenizer, args.num_prompts, args.max_prompt_len, args.dataset_path)
    if len(prompts) < args.num_prompts:
        print(f"note: only {len(prompts)} held-out prompts fit --max-prompt-len {args.max_prompt_len}", file=sys.stderr)
    return prompts


def sharegpt_prompts(tokenizer, n: int, max_prompt_len: int, dataset_path=None, part: str = "held_out") -> list[list[int]]:
    """Up to `n` ShareGPT first user turns of the held-out (or "train") conversations, chat-rendered,
    of 4 to max_prompt_len tokens."""
    from eagle_fx.data import first_user_prompts, load_conversations, split
    from eagle_fx.train import render

    train, held = split(load_conversations(dataset_path))
    prompts = []
    for text in first_user_prompts({"held_out": held, "train": train}[part]):
        ids = tokenizer(render(tokenizer, [("user", text)], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        if 4 <= len(ids) <= max_prompt_len:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def multiturn_prompts(args, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(turn-1 prompt ids, turn-2 question ids rendered as a user turn + generation prompt) pairs."""
    from eagle_fx.data import load_conversations, split
    from eagle_fx.train import render

    def user_turn(text):
        return tokenizer(render(tokenizer, [("user", text)], add_generation_prompt=True), add_special_tokens=False)["input_ids"]

    _, held = split(load_conversations(args.dataset_path))
    pairs = []
    for conversation in held:
        questions = [text for role, text in conversation["turns"] if role == "user"]
        if conversation["turns"][0][0] != "user" or len(questions) < 2:
            continue
        first, second = user_turn(questions[0]), user_turn(questions[1])
        if 4 <= len(first) <= args.max_prompt_len and len(second) <= args.max_prompt_len:
            pairs.append((first, second))
        if len(pairs) == args.num_prompts:
            break
    return pairs


def random_mm_prompts(args, tokenizer, vocab_size: int, image_token_id: int, tokens_per_image: int):
    """(prompts, pixel_values): a shared 32-token system prefix, then 0-2 images drawn from a pool of
    4 random images (so prefix caching sees repeats), then a ShareGPT question."""
    g = torch.Generator().manual_seed(args.seed)
    image_pool = torch.rand(4, 3, 16, 16, generator=g)
    system = torch.randint(3, vocab_size - 1, (32,), generator=g).tolist()
    prompts, pixels = [], []
    for question in load_prompts(args, tokenizer, vocab_size):
        n_images = int(torch.randint(0, 3, (), generator=g))
        picked = torch.randint(0, len(image_pool), (n_images,), generator=g)
        question = [t for t in question if t != image_token_id]
        prompts.append(system + [image_token_id] * (tokens_per_image * n_images) + question)
        pixels.append(image_pool[picked] if n_images else None)
    return prompts, pixels
