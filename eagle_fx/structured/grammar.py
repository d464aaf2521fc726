"""GrammarSpecs compiled with xgrammar against one tokenizer and one logits width, cached per spec.

A `GrammarCompiler` belongs to one (tokenizer, vocab_size) pair: vocab_size is the width of the
base's logits (`base.config.vocab_size`), which may exceed len(tokenizer) (padded lm_heads: the
extra ids are never allowed) or fall short of it. Every bad grammar is a `GrammarError` (a
ValueError) raised by `compile`, before any decoding:

- a schema, regex or EBNF grammar xgrammar cannot parse: the message names the kind and quotes
  xgrammar's own words;
- a grammar no token of this tokenizer can start (a regex needing a character the vocabulary
  cannot spell): the compiled grammar's first mask allows nothing.

xgrammar's compiled grammars are cached here, least recently used first out, `cache_size` specs at
most; xgrammar's own cache (unbounded by default) is turned off so this one is the only one.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence

import torch

from eagle_fx.structured.response_format import GrammarSpec

try:
    import xgrammar as xgr
except ImportError as e:  # the optional extra
    raise ImportError(f"structured output needs xgrammar ({e}): pip install 'eagle_fx[structured]'") from e

KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
              "ebnf": "EBNF grammar"}
# xgrammar's C++ errors start "[hh:mm:ss] /path/file.cc:123: "; the rest is the message
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A grammar that cannot be used with this tokenizer: invalid, or impossible to start."""


def xgrammar_message(error: Exception) -> str:
    """xgrammar's error text without its log prefix (time, C++ file and line)."""
    return _XGRAMMAR_LOG_PREFIX.sub("", str(error).strip())


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's TokenizerInfo for a HF tokenizer and a logits width, with the tokenizer's special
    added tokens (pad, bos, chat-template markers; `added_tokens_decoder[i].special`) other than the
    stop tokens made unspellable.

    Why: xgrammar.TokenizerInfo.from_huggingface spells an added token such as `<|user|>` as its
    text, so a regex `<.*>` or a JSON string could be written with it; decoded with
    skip_special_tokens those characters vanish and the output no longer matches. An id whose
    vocabulary entry is empty is a special token to xgrammar, never allowed by a mask. The
    vocabulary type and prefix-space setting are those from_huggingface detects.
    """
    stop = [int(t) for t in stop_token_ids]
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
    special = {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if token.special and i < vocab_size and i not in stop}
    if not special:
        return detected
    encoded = [""] * vocab_size  # as from_huggingface builds it: the vocabulary's own (encoded) strings by id
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special:
            encoded[i] = token
    return xgr.TokenizerInfo(encoded, vocab_type=detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stop,
                             add_prefix_space=detected.add_prefix_space)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and logits width; an LRU cache of compiled grammars.

    tokenizer: the base's HF tokenizer. vocab_size: the base's logits width. stop_token_ids: the
    tokens that end the output where the grammar is complete (default: the tokenizer's eos; pass
    the base's generation_config eos ids). any_whitespace: JSON grammars allow any whitespace
    between elements (xgrammar's and vLLM's default); False allows exactly xgrammar's default
    separators (", " and ": ") and no newlines — small models otherwise can loop on whitespace.
    cache_size: how many compiled specs are kept.
    """

    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                 any_whitespace: bool = True, cache_size: int = 64):
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"vocab_size must be the base's logits width (a positive int), got {vocab_size!r}")
        if not isinstance(cache_size, int) or isinstance(cache_size, bool) or cache_size < 1:
            raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
        if stop_token_ids is None:
            if getattr(tokenizer, "eos_token_id", None) is None:
                raise ValueError("the tokenizer has no eos_token_id: pass stop_token_ids= (the base's "
                                 "generation_config.eos_token_id)")
            stop_token_ids = [tokenizer.eos_token_id]
        stop_token_ids = [int(t) for t in stop_token_ids]
        if not stop_token_ids or not all(0 <= t < vocab_size for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-empty ids below vocab_size={vocab_size}, "
                             f"got {stop_token_ids}")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.any_whitespace = bool(any_whitespace)
        self.cache_size = cache_size
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self.hits = self.misses = 0

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec` (cached), or a GrammarError saying why it cannot be used."""
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"compile takes a GrammarSpec (eagle_fx.structured.response_format.grammar_spec makes "
                            f"one), got {type(spec).__name__}")
        if spec in self._cache:
            self.hits += 1
            self._cache.move_to_end(spec)
            return self._cache[spec]
        self.misses += 1
        try:
            compiled = self._compile(spec)
        except RuntimeError as e:  # xgrammar reports every parse error as a RuntimeError (or a subclass)
            raise GrammarError(f"invalid {KIND_NAMES[spec.kind]}: {xgrammar_message(e)}") from None
        check_startable(spec, compiled)
        self._cache[spec] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":
            return self._compiler.compile_json_schema(spec.source, any_whitespace=self.any_whitespace)
        if spec.kind == "json_object":
            # the builtin JSON grammar takes any JSON value; OpenAI's json_object means an object
            return self._compiler.compile_json_schema('{"type":"object"}', any_whitespace=self.any_whitespace)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.source)
        return self._compiler.compile_grammar(spec.source)


def check_startable(spec: GrammarSpec, compiled: xgr.CompiledGrammar) -> None:
    """A GrammarError when no token may come first under `compiled` (not even a stop token, which
    is allowed where the grammar accepts the empty output): the tokenizer cannot spell the start."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(torch.any(bitmask != 0)):
        raise GrammarError(f"the {KIND_NAMES[spec.kind]} cannot be followed with this tokenizer: no token of its "
                           "vocabulary can start it (it needs a character the vocabulary does not spell)")
