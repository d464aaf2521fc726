"""Fixtures of the structured-output tests: the bundled base's tokenizer (a real 2048-token
byte-level BPE vocabulary) and a compiler for it, and a tokenizer that can only spell digits."""
import functools

import pytest

from eagle_fx.bundled import BUNDLED

EOS = 2  # the bundled base's eos (config and generation_config)


@functools.lru_cache(maxsize=None)
def bundled_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BUNDLED / "base")


@functools.lru_cache(maxsize=None)
def bundled_compiler(vocab_size: int = 2048, any_whitespace: bool = True):
    from eagle_fx.structured.grammar import GrammarCompiler

    return GrammarCompiler(bundled_tokenizer(), vocab_size, stop_token_ids=[EOS], any_whitespace=any_whitespace)


@pytest.fixture
def tokenizer():
    return bundled_tokenizer()


@pytest.fixture
def compiler():
    return bundled_compiler()


def digits_tokenizer():
    """A 12-token word-level tokenizer: <pad>, <eos> and the ten digits, nothing else."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{str(d): d + 2 for d in range(10)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   eos_token="<eos>", pad_token="<pad>")
