"""TextState, the engine's detokenisation of a request's output: decoded incrementally (a window of
the newest tokens each step), it gives the text a full decode gives, and streams it in pieces that
add up to that text, on the bundled byte-level tokenizer (characters of several tokens)."""
import functools
import random

import pytest

from eagle_fx.bundled import pair_dirs
from eagle_fx.serving.requests import TextState

TEXTS = ["Hello wörld 你好 🙂 café  naïve", "def f(x):\n    return x ** 2  # ✓\n\n", "Ünïcödé—“quotes”… 日本語のテキスト 🚀🚀",
         "plain ascii words, numbers 12345 and punctuation!?"]


@functools.lru_cache(maxsize=None)
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair_dirs()[0])


def _sequences():
    tok, rng = _tokenizer(), random.Random(0)
    sequences = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    sequences.append(tok.encode(" ".join(TEXTS), add_special_tokens=False) + [tok.eos_token_id])
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(5, 200))] for _ in range(20)]  # any bytes
    return sequences


def _fed(tokens, stop=(), seed=0):
    """TextState fed `tokens` in pieces of 1-4 (as cycles commit them); (state, the deltas, the text
    after each update, the tokens so far at each update)."""
    tok, rng = _tokenizer(), random.Random(seed)
    state, deltas, texts, lengths, n = TextState(tok, tuple(stop)), [], [], [], 0
    while n < len(tokens) and not state.stopped:
        n = min(len(tokens), n + rng.randint(1, 4))
        state.update(tokens[:n], finished=n == len(tokens))
        deltas.append(state.take_delta())
        texts.append(state.text)
        lengths.append(n)
    return state, deltas, texts, lengths


@pytest.mark.parametrize("index", range(25))
def test_incremental_text_is_the_full_decode(index):
    tok, tokens = _tokenizer(), _sequences()[index]
    state, deltas, texts, lengths = _fed(tokens, seed=index)
    full = tok.decode(tokens, skip_special_tokens=True)
    assert state.text == full and "".join(deltas) == full
    for text, n in zip(texts, lengths):  # while running: the full decode of the tokens so far, less a
        so_far = tok.decode(tokens[:n], skip_special_tokens=True)  # character still being spelled
        assert so_far.startswith(text) and "\ufffd" in so_far[len(text):] or so_far == text


@pytest.mark.parametrize("index", range(4))
def test_a_stop_string_cuts_the_full_decode(index):
    tok, tokens = _tokenizer(), _sequences()[index]
    full = tok.decode(tokens, skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    state, deltas, _, _ = _fed(tokens + tokens, stop=[stop, "never there"], seed=index)
    assert state.stopped and state.text == full[:full.index(stop)] == "".join(deltas)
