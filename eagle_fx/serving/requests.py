"""One request of the serving engine: its sampling settings, its stopping rules, its output so far.

`SamplingParams` is validated when a request is added (a bad value is a ValueError naming it, never
an error inside a running batch). `RequestOutput` is what `Engine.step()` returns for each request
that got tokens or finished in that step. Text (when the engine has a tokenizer): `text` is the
whole output decoded, cut before a stop string; `delta` the part of it not given out before and
safe to stream (text that could still become a stop string, or an unfinished multi-byte
character, is held back until it is decided).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from eagle_fx.structured.response_format import grammar_spec

FINISH_REASONS = ("stop", "length", "abort")


def _number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")
    return float(value)


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """Per-request settings. temperature 0: greedy (HF's greedy decode, token for token, in fp32);
    top_k 0 or -1: off; top_p 1: off. eos_token_id None: the model's generation_config eos;
    ignore_eos: never stop at an eos. stop: strings that end the output (cut before them; needs the
    engine's tokenizer); stop_token_ids: extra ids that end it (kept in the output, as eos is).
    seed: this request's own generator (reproducible whatever it is batched with).
    response_format: structured output (eagle_fx.structured.response_format.grammar_spec: an
    OpenAI response_format dict, a JSON schema dict, or a GrammarSpec for a regex / EBNF grammar):
    every token, drafts included, only where the grammar allows it; needs the engine's tokenizer."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: tuple[int, ...] | None = None
    ignore_eos: bool = False
    response_format: object = None

    def __post_init__(self):
        _int("max_tokens", self.max_tokens, 1)
        _number("temperature", self.temperature, 0.0, 100.0)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 and -1: off), got {self.top_k!r}")
        if self.seed is not None:
            _int("seed", self.seed, 0)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("stop_token_ids", "eos_token_id"):
            ids = getattr(self, name)
            if ids is None:
                continue
            ids = (ids,) if isinstance(ids, int) and not isinstance(ids, bool) else ids
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in ids):
                raise ValueError(f"{name} must be a token id or a list of token ids, got {getattr(self, name)!r}")
            object.__setattr__(self, name, tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "response_format", grammar_spec(self.response_format))
        if self.response_format is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot apply with a response_format: once the output is complete the "
                             "grammar allows only eos, which ends the request")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    """A request's progress after one engine step."""

    request_id: str
    new_token_ids: list[int]  # tokens this step added
    token_ids: list[int]  # every output token so far
    finished: bool = False
    finish_reason: str | None = None  # "stop" (eos, stop token or string), "length", "abort"
    text: str | None = None  # the output decoded (cut before a stop string); None without a tokenizer
    delta: str | None = None  # text not returned before and safe to stream
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the same request's next one as one (a stream's consumer that fell behind
        reads what queued up as one output): the new tokens and text deltas of both, the rest the later's."""
        delta = None if self.delta is None and later.delta is None else (self.delta or "") + (later.delta or "")
        return RequestOutput(later.request_id, self.new_token_ids + later.new_token_ids, later.token_ids,
                             later.finished, later.finish_reason, later.text, delta, later.num_prompt_tokens,
                             later.num_cached_tokens)


@dataclass
class TextState:
    """Detokenisation of one request's output, with stop strings (the engine's tokenizer).

    Incremental while the request runs: each update decodes only a window of the newest tokens
    (vLLM's prefix / read offsets: the tokens of the last decoded piece and the new ones, decoded
    together and compared with the piece alone, so that a tokenizer's joins across tokens, a word's
    leading space or a character of several tokens, come out as a full decode gives them); a full
    decode of the output each step cost time growing with its length (0.5 ms at 2000 tokens, per
    request and step). The text is decoded whole once, when the request finishes or meets a stop
    string: the final text is the full decode, cut before the first stop string, as it always was."""

    tokenizer: object
    stop: tuple[str, ...]
    sent: int = 0  # characters of `text` given out as deltas
    text: str = ""
    stopped: bool = False  # a stop string was found: text is final

    ready: int = 0  # characters of `text` decided (safe to give out)
    prefix: int = 0  # output tokens from which the last window was decoded
    read: int = 0  # output tokens decoded into `text`

    def update(self, token_ids: list[int], finished: bool) -> None:
        """Decode the output so far and cut it before the first stop string (then `stopped`)."""
        if self.stopped:
            return
        text = self.text + self._new_text(token_ids)
        if finished or any(s in text for s in self.stop):  # final: the whole output decoded
            whole = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            text = whole if finished or any(s in whole for s in self.stop) else text
        hold = 0
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                text, self.stopped = text[:at], True
        if not self.stopped and not finished:
            if text.endswith("\ufffd"):  # an unfinished multi-byte character
                hold = 1
            for s in self.stop:  # a tail that may still grow into a stop string
                for n in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:n]):
                        hold = max(hold, n)
                        break
        self.text = text
        self.ready = max(self.sent, len(text) - hold)

    def _new_text(self, token_ids: list[int]) -> str:
        """The text the tokens past `read` add (none while they end inside a character: they wait)."""
        decode = self.tokenizer.decode
        before = decode(token_ids[self.prefix:self.read], skip_special_tokens=True)
        window = decode(token_ids[self.prefix:], skip_special_tokens=True)
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(token_ids)
        return window[len(before):]

    def take_delta(self) -> str:
        """The decided text not given out before."""
        delta = self.text[self.sent:self.ready]
        self.sent = self.ready
        return delta


@dataclass
class Request:
    """The engine's record of one request (engine-internal)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    eos: frozenset[int]
    arrival: int  # order of arrival: first come, first served
    output: list[int] = field(default_factory=list)
    text: TextState | None = None
    finish_reason: str | None = None
    generator: object = None  # a torch.Generator when sampling
    # the engine's bookkeeping once admitted
    slot: int | None = None  # its row of the engine's buffers, for life
    blocks: object = None  # its WaveBlocks (one row)
    cached: int = 0  # prompt tokens from the prefix cache
    committed: int = 0  # tokens in the base KV (the last output token is pending)
    draft_upto: int = 0  # the draft has processed slots <= this (== committed when in step)
    lazy: bool = False  # its prompt's draft prefill deferred to the draft's catch-up (lazy_draft_prefill), or skipped (draft_free)
    speculating: bool = True
    off_reason: str | None = None
    probe_at: int = 0  # output length at which a collapsed request speculates again
    watch: object = None  # its CollapseWatch
    acceptance: object = None  # its adaptive.Acceptance
    grammar: object = None  # its eagle_fx.structured GrammarState (a response_format), at its committed output

    @property
    def context(self) -> list[int]:
        return self.prompt + self.output

    def append(self, new: list[int]) -> list[int]:
        """Append tokens up to the first stop (eos / a stop token: kept; max_tokens; a stop string in
        the text: cut there): sets finish_reason; returns the tokens appended."""
        added = []
        for t in new:
            added.append(t)
            self.output.append(t)
            if t in self.eos:
                self.finish_reason = "stop"
                break
            if len(self.output) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        if self.text is not None:
            self.text.update(self.output, self.finish_reason is not None)
            if self.text.stopped:
                self.finish_reason = "stop"
        return added

    def progress(self, added: list[int]) -> RequestOutput:
        """What a step gives out about this request (`added`: its new tokens)."""
        text = self.text
        return RequestOutput(self.request_id, added, list(self.output), self.finish_reason is not None,
                             self.finish_reason, text.text if text is not None else None,
                             text.take_delta() if text is not None else None, len(self.prompt), self.cached)


def checked_prompt(engine, prompt, params: SamplingParams) -> list[int]:
    """The prompt (token ids) of a request the engine can run, or a ValueError that says why not."""
    model, kv = engine.model, engine.kv
    from eagle_fx.runtime.scheduler import check_prompts

    try:
        prompt = check_prompts([prompt], params.max_tokens, model.vocab_size, model.options.max_seq_len)[0]
    except (TypeError, ValueError) as e:  # worded for generate's list of prompts: say it of this one
        message = str(e).replace("prompts must be", "a prompt must be").replace("prompt 0", "the prompt")
        raise ValueError(message.replace("max_new_tokens", "max_tokens")) from None
    need = kv.allocator.blocks_for(len(prompt) + params.max_tokens + model.lookahead)
    if need > kv.num_blocks and engine.call is None:  # (generate: the pool's own PoolExhausted, as before)
        raise ValueError(f"the request needs {need} KV blocks, the pool has {kv.num_blocks}: shorten the prompt "
                         "or max_tokens")
    if params.stop and engine.tokenizer is None:
        raise ValueError("stop strings need the engine's tokenizer (Engine(model, tokenizer))")
    return prompt
