"""generate as Hugging Face users call it: padded tensors with attention_mask, BatchEncodings,
do_sample, generation_config, streamers, text; misuse answered with what to pass instead."""
import pytest
import torch
from transformers import GenerationConfig

from conftest import compiled, hf_greedy, make_prompts, tiny_base

NEW = 12


def _padded(prompts, side):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        sl = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, sl], mask[i, sl] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_with_attention_mask_equals_hf_generate_on_it(side):
    prompts = make_prompts(3)
    model = compiled("llama", "eagle")
    ids, mask = _padded(prompts, side)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert out.sequences == hf_greedy("llama", prompts, NEW)
    left, left_mask = _padded(prompts, "left")  # HF generate on the same (left-)padded batch
    with torch.no_grad():
        ref = tiny_base("llama").generate(left, attention_mask=left_mask, max_new_tokens=NEW, do_sample=False,
                                          pad_token_id=0)[:, left.shape[1]:].tolist()
    assert out.sequences == ref
    assert model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW).sequences == ref


def test_batch_encoding_and_text():
    from transformers import BatchEncoding

    prompts = make_prompts(2)
    ids, mask = _padded(prompts, "left")
    model = compiled("llama", "eagle")
    enc = BatchEncoding({"input_ids": ids, "attention_mask": mask})
    assert model.generate(enc, max_new_tokens=NEW).sequences == hf_greedy("llama", prompts, NEW)

    class Tok:  # the two calls generate_text makes of a tokenizer
        def __call__(self, text):
            return {"input_ids": [ord(c) % 96 for c in text]}

        def decode(self, ids, skip_special_tokens=True):
            return ",".join(map(str, ids))

    texts = model.generate_text(["hi there", "abc"], tokenizer=Tok(), max_new_tokens=5)
    assert texts == [",".join(map(str, r)) for r in hf_greedy("llama", [Tok()("hi there")["input_ids"],
                                                                          Tok()("abc")["input_ids"]], 5)]


def test_do_sample_and_generation_config():
    prompts = make_prompts(2)
    model = compiled("llama", "eagle")
    greedy = hf_greedy("llama", prompts, NEW)
    assert model.generate(prompts, max_new_tokens=NEW, do_sample=False, temperature=0.7).sequences == greedy
    sampled = model.generate(prompts, max_new_tokens=NEW, do_sample=True, seed=0)  # temperature 1
    assert sampled.sequences == model.generate(prompts, max_new_tokens=NEW, temperature=1.0, seed=0).sequences
    gc = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=7)
    by_config = model.generate(prompts, generation_config=gc, seed=1)
    assert by_config.sequences == model.generate(prompts, temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=7,
                                                 seed=1).sequences
    assert all(len(s) == 7 for s in by_config.sequences)
    # the call's own settings win over the config's; do_sample=False makes a sampling config greedy
    assert model.generate(prompts, generation_config=gc, do_sample=False, max_new_tokens=NEW).sequences == greedy
    assert all(len(s) == 5 for s in model.generate(prompts, generation_config=gc, max_new_tokens=5, seed=2).sequences)
    with pytest.warns(UserWarning, match=r"does not apply generation_config's no_repeat_ngram_size, repetition_penalty"):
        model.generate(prompts, max_new_tokens=3,
                       generation_config=GenerationConfig(repetition_penalty=1.2, no_repeat_ngram_size=3))
    with pytest.raises(ValueError, match="num_beams=4: eagle_fx speculates for greedy decoding and sampling"):
        model.generate(prompts, generation_config=GenerationConfig(num_beams=4))


def test_explicit_settings_equal_to_the_defaults_win_over_a_sampling_config():
    """An argument the call passes wins over generation_config's even when it equals generate's
    default: temperature=0.0 with a sampling config is HF greedy (it used to sample at the config's
    0.7), and max_new_tokens / top_k / top_p / eos passed at their defaults are not the config's."""
    prompts = make_prompts(2)
    model = compiled("llama", "eagle")
    gc = GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=NEW)
    assert model.generate(prompts, generation_config=gc, temperature=0.0, seed=0).sequences == \
        hf_greedy("llama", prompts, NEW)


@pytest.mark.parametrize("name,passed", [("max_new_tokens", 128), ("top_p", 1.0), ("top_k", 0), ("eos_token_id", None)])
def test_each_passed_setting_wins_over_the_config(name, passed):
    from eagle_fx.runtime.hf_inputs import NOT_GIVEN, settings_from
    from eagle_fx.runtime.model import GENERATE_DEFAULTS

    order = ("temperature", "top_p", "top_k", "max_new_tokens", "eos_token_id")
    gc = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.5, top_k=5, max_new_tokens=3, eos_token_id=7)
    call = dict.fromkeys(order, NOT_GIVEN) | {name: passed}
    got = dict(zip(order, settings_from(gc, None, *(call[n] for n in order), GENERATE_DEFAULTS)))
    assert got == dict(temperature=0.7, top_p=0.5, top_k=5, max_new_tokens=3, eos_token_id=7) | {name: passed}
    not_passed = dict(zip(order, settings_from(None, None, *(NOT_GIVEN for _ in order), GENERATE_DEFAULTS)))
    assert not_passed == GENERATE_DEFAULTS


def test_streamer_gets_the_prompt_then_every_token():
    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    prompt = make_prompts(1)[0]
    rec = Recorder()
    out = compiled("llama", "eagle").generate([prompt], max_new_tokens=NEW, streamer=rec)
    assert rec.puts[0] == [prompt] and [t for p in rec.puts[1:] for t in p] == out.sequences[0] and rec.ended
    with pytest.raises(ValueError, match="streamer= streams one prompt"):
        compiled("llama", "eagle").generate(make_prompts(2), max_new_tokens=3, streamer=rec)


def test_transformers_text_streamer_prints_the_text(capsys):
    from transformers import TextStreamer

    class Tok:
        def decode(self, ids, **kw):
            return "".join(chr(65 + t % 26) for t in ids)

    prompt = make_prompts(1)[0]
    out = compiled("llama", "eagle").generate([prompt], max_new_tokens=NEW, streamer=TextStreamer(Tok(), skip_prompt=True))
    assert capsys.readouterr().out.strip() == Tok().decode(out.sequences[0])


def test_misuse_says_what_to_pass():
    model = compiled("llama", "eagle")
    with pytest.raises(TypeError, match=r"not text: use model.generate_text\(texts, tokenizer=tok\)"):
        model.generate("hello")
    with pytest.raises(TypeError, match=r"not text"):
        model.generate(["hello", "world"])
    with pytest.raises(TypeError, match=r"mapping without 'input_ids'"):
        model.generate({"ids": [[1, 2]]})
    ids, mask = _padded(make_prompts(2), "left")
    import eagle_fx
    from conftest import tiny_draft

    padded_family = eagle_fx.compile(tiny_base("phi"), tiny_draft("phi", "eagle"))  # its config says pad_token_id=0
    with pytest.raises(ValueError, match=r"row 0 begins or ends with the pad token 0: a padded batch needs its "
                                         r"attention_mask"):
        padded_family.generate(ids, max_new_tokens=3)
    bad = mask.clone()
    bad[0, -2] = 0
    with pytest.raises(ValueError, match="attention_mask row 0 has zeros between its tokens"):
        model.generate(ids, attention_mask=bad)
    with pytest.raises(ValueError, match=r"attention_mask must have input_ids' shape"):
        model.generate(ids, attention_mask=mask[:, 1:])
    with pytest.raises(TypeError, match=r"eos_token_id must be a token id \(int\), a list of ids or None, got '</s>'"):
        model.generate(make_prompts(1), eos_token_id="</s>")
