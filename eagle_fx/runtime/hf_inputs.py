"""What Hugging Face users pass to `generate`, as eagle_fx's prompts and decoding settings.

- prompts: a list of token-id lists (eagle_fx's own form), a 2-D `input_ids` tensor with its
  `attention_mask` (left or right padding: the padding is dropped), or a tokenizer's
  BatchEncoding (or any mapping with "input_ids"). Text is refused with what to call instead.
- settings: HF's `do_sample`, and a `generation_config` whose temperature / top_p / top_k /
  max_new_tokens / eos_token_id apply where the call does not pass them (NOT_GIVEN: an explicit
  value equal to generate's default still wins), and whose do_sample applies unless the call passes
  do_sample or temperature; its other settings, which eagle_fx does not apply, are warned about by
  name (beam search is an error).
- streamer: transformers' streamers (`put(ids)` / `end()`), one prompt at a time, as HF's.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

class _NotGiven:
    """The default of generate's decoding settings: the call did not pass this argument, so a
    generation_config's value applies, else generate's own default (GENERATE_DEFAULTS)."""

    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN = _NotGiven()

# GenerationConfig fields eagle_fx applies, or that carry no decoding behaviour
APPLIED = {"do_sample", "temperature", "top_p", "top_k", "max_new_tokens", "eos_token_id", "pad_token_id",
           "bos_token_id", "transformers_version", "_from_model_config", "use_cache", "return_dict_in_generate",
           "output_scores", "output_logits", "output_attentions", "output_hidden_states", "max_length",
           "cache_implementation", "compile_config"}


def prompts_from(prompts, input_ids, attention_mask, pad_token_id: int | None):
    """eagle_fx's prompts (a list of token-id lists, or `prompts` as given for check_prompts to judge)."""
    if input_ids is not None:
        if prompts is not None:
            raise TypeError("generate got both prompts and input_ids=; pass one of them")
        prompts = input_ids
    if isinstance(prompts, Mapping) or hasattr(prompts, "data") and isinstance(getattr(prompts, "data"), Mapping):
        enc = prompts if isinstance(prompts, Mapping) else prompts.data
        if "input_ids" not in enc:
            raise TypeError(f"generate got a mapping without 'input_ids' (keys {sorted(enc)}); pass the tokenizer's "
                            "output (tok(texts)) or a list of token-id lists")
        if attention_mask is not None:
            raise TypeError("generate got a BatchEncoding and attention_mask=; the BatchEncoding's own mask is used")
        prompts, attention_mask = enc["input_ids"], enc.get("attention_mask")
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], str)):
        raise TypeError("generate takes token ids, not text: use model.generate_text(texts, tokenizer=tok), or pass "
                        "tok(texts) (a BatchEncoding) or tok(text)['input_ids']")
    if attention_mask is not None:
        return _unpad(prompts, attention_mask)
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 2 and prompts.shape[0] > 1 and pad_token_id is not None:
        edges = torch.cat([prompts[:, :1], prompts[:, -1:]], dim=1)
        padded = (edges == pad_token_id).any(dim=1).nonzero().flatten().tolist()
        if padded:
            raise ValueError(f"input_ids row {padded[0]} begins or ends with the pad token {pad_token_id}: a padded "
                             "batch needs its attention_mask (generate(input_ids, attention_mask=mask)), else the "
                             "padding would be read as prompt tokens")
    return prompts


def _unpad(input_ids, attention_mask) -> list[list[int]]:
    ids = torch.as_tensor(input_ids)
    mask = torch.as_tensor(attention_mask)
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape [batch, length]; got {tuple(mask.shape)} for "
                         f"input_ids {tuple(ids.shape)}")
    out = []
    for i, (row, keep) in enumerate(zip(ids.tolist(), mask.tolist())):
        on = [j for j, m in enumerate(keep) if m]
        if not on:
            raise ValueError(f"attention_mask row {i} is all zeros: that row has no prompt tokens")
        if on[-1] - on[0] + 1 != len(on):
            raise ValueError(f"attention_mask row {i} has zeros between its tokens; eagle_fx takes left- or "
                             "right-padded rows (one run of ones per row)")
        out.append(row[on[0]:on[-1] + 1])
    return out


def settings_from(generation_config, do_sample, temperature, top_p, top_k, max_new_tokens, eos_token_id,
                  defaults: dict) -> tuple:
    """(temperature, top_p, top_k, max_new_tokens, eos_token_id): each as the call passed it, else
    (NOT_GIVEN) generation_config's, else `defaults`'; then do_sample (the call's; else the config's
    when the call passes no temperature): False: greedy; True: temperature 1 if none."""
    values = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                  eos_token_id=eos_token_id)
    given = {name for name, value in values.items() if value is not NOT_GIVEN}
    if generation_config is not None:
        gc = generation_config
        if (getattr(gc, "num_beams", 1) or 1) > 1:
            raise ValueError(f"generation_config.num_beams={gc.num_beams}: eagle_fx speculates for greedy decoding and "
                             "sampling, not beam search; set num_beams=1")
        ignored = sorted(set(gc.to_diff_dict()) - APPLIED)
        if ignored:
            warnings.warn(f"eagle_fx does not apply generation_config's {', '.join(ignored)} (it applies do_sample, "
                          "temperature, top_p, top_k, max_new_tokens, eos_token_id)", stacklevel=3)
        if do_sample is None and "temperature" not in given:  # an explicit temperature decides on its own
            do_sample = bool(gc.do_sample)
        for name in set(values) - given:
            value = getattr(gc, name, None)
            if value is not None:
                values[name] = value
    values = {name: defaults[name] if value is NOT_GIVEN else value for name, value in values.items()}
    if do_sample is False:
        values["temperature"] = 0.0
    elif do_sample is True and not values["temperature"]:
        values["temperature"] = 1.0  # HF's default temperature when sampling
    return tuple(values.values())


def check_streamer(streamer, num_prompts: int) -> None:
    if streamer is None:
        return
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise TypeError(f"streamer must have put(ids) and end(), as transformers' streamers do; got {type(streamer).__name__}")
    if num_prompts != 1:
        raise ValueError(f"streamer= streams one prompt (as HF's streamers do); got {num_prompts} prompts")
