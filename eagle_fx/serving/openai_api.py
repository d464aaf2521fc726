"""OpenAI's /v1/completions and /v1/chat/completions bodies: checked and turned into (prompt token
ids, SamplingParams), and the responses, stream chunks and errors in OpenAI's shapes.

A field this server does not know, or a value it cannot honour (n > 1, echo, logprobs, penalties),
is a `RequestError` (HTTP 400 with `{"error": {"message", "type": "invalid_request_error",
"param", "code"}}`), never silently ignored. Extensions (as in vLLM): top_k, ignore_eos,
stop_token_ids, add_special_tokens (completions), return_token_ids (each choice and stream chunk
then carries the output's token ids), and structured output: OpenAI's response_format (json_schema,
json_object, text) or vLLM's guided_json / guided_regex / guided_grammar (EBNF), one per request.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from eagle_fx.serving.requests import SamplingParams
from eagle_fx.structured.response_format import OPENAI_TYPES, grammar_spec

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
                 "n", "logprobs", "user", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos",
                 "stop_token_ids", "return_token_ids", "response_format", "guided_json", "guided_regex", "guided_grammar"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix", "add_special_tokens"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls"}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256  # chat without max_tokens, when the context length is not known


class RequestError(ValueError):
    """A request the server refuses: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):  # noqa: A002 - OpenAI's key
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return error_body(self.message, self.param, self.type, self.code)


def error_body(message: str, param: str | None = None, type: str = "invalid_request_error",  # noqa: A002
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ParsedRequest:
    """What the server needs from a completion or chat body."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object, or a RequestError."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} (this server accepts: {', '.join(sorted(allowed))})",
                           param=unknown[0])


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _check_unsupported(body: dict) -> None:
    """Fields accepted only at their no-op values."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise RequestError(f"n must be 1 (one choice per request), got {n!r}", param="n")
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of != 1):
        raise RequestError(f"best_of must be 1, got {best_of!r}", param="best_of")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        param = "logprobs" if body.get("logprobs") not in (None, False) else "top_logprobs"
        raise RequestError("logprobs are not supported by this server", param=param)
    if body.get("echo") not in (None, False):
        raise RequestError("echo is not supported by this server (only echo=false)", param="echo")
    if body.get("suffix") is not None:
        raise RequestError("suffix is not supported by this server", param="suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != 0):
            raise RequestError(f"{name} is not supported by this server (only 0)", param=name)
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported by this server", param="logit_bias")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("user must be a string", param="user")


def _sampling_params(body: dict, max_tokens: int) -> SamplingParams:
    kwargs = {"max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids"):
        if body.get(name) is not None:
            kwargs[name] = body[name]
    if isinstance(kwargs.get("stop"), list):
        kwargs["stop"] = tuple(kwargs["stop"])
    if isinstance(kwargs.get("stop_token_ids"), list):
        kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
    kwargs["ignore_eos"] = _bool(body, "ignore_eos")
    guided = ("response_format", "guided_json", "guided_regex", "guided_grammar")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or
                                        response_format.get("type") not in OPENAI_TYPES):
        raise RequestError(f"response_format must be an object whose type is one of {', '.join(OPENAI_TYPES)}; got "
                           f"{response_format!r}", param="response_format")
    try:  # structured output: one of them (compiled when the engine takes the request: a bad one is a 400 then)
        kwargs["response_format"] = grammar_spec(**{name: body.get(name) for name in guided})
    except (ValueError, TypeError) as e:
        raise RequestError(str(e), param=next((n for n in guided if body.get(n) is not None), None)) from None
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:  # SamplingParams names the field first: "top_p must be ..."
        param = str(e).split(" ", 1)[0]
        raise RequestError(str(e), param=param if param in COMPLETION_FIELDS | CHAT_FIELDS else None) from None


def _max_tokens(body: dict, names: tuple[str, ...], num_prompt: int, max_model_len: int | None,
                default: int) -> int:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(f"{name} must be an integer >= 1, got {value!r}", param=name)
        if max_model_len is not None and num_prompt >= max_model_len:
            break  # the prompt alone is too long: said below
        if max_model_len is not None and num_prompt + value > max_model_len:
            raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                               f"requested {num_prompt + value} tokens ({num_prompt} in the prompt, {value} in the "
                               f"completion). Please reduce the length of the prompt or {name}.", param=name)
        return value
    if max_model_len is None:
        return default
    room = max_model_len - num_prompt
    if room < 1:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
                           f"{num_prompt}: no room left for the completion. Please reduce the length of the prompt.",
                           param="messages" if "messages" in body else "prompt")
    return min(default, room) if default else room


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise RequestError(f"stream_options must be an object with include_usage, got {options!r}",
                           param="stream_options")
    return stream, _bool(options, "include_usage")


def _model(body: dict, model_name: str) -> str:
    model = body.get("model")
    if model is None:
        return model_name
    if model != model_name:
        raise RequestError(f"The model `{model}` does not exist (this server serves `{model_name}`).", param="model",
                           status=404, code="model_not_found")
    return model


def _prompt_ids(body: dict, tokenizer) -> list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", param="prompt")
        add_special = _bool(body, "add_special_tokens", default=True)
        return list(tokenizer(prompt, add_special_tokens=add_special)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise RequestError("prompt token ids must be >= 0", param="prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("only one prompt per request is supported (send one request per prompt)", param="prompt")
    raise RequestError("prompt must be a non-empty string or a non-empty list of token ids", param="prompt")


def parse_completion(body: dict, tokenizer, model_name: str, max_model_len: int | None = None) -> ParsedRequest:
    """A /v1/completions body -> ParsedRequest, or a RequestError."""
    _check_fields(body, COMPLETION_FIELDS)
    model = _model(body, model_name)
    _check_unsupported(body)
    stream, include_usage = _stream_flags(body)
    prompt_ids = _prompt_ids(body, tokenizer)
    max_tokens = _max_tokens(body, ("max_tokens",), len(prompt_ids), max_model_len, DEFAULT_COMPLETION_MAX_TOKENS)
    return ParsedRequest(prompt_ids, _sampling_params(body, max_tokens), stream, include_usage,
                         _bool(body, "return_token_ids"), model)


def _message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                   "are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def chat_prompt_ids(messages, tokenizer) -> list[int]:
    """The chat template over `messages` (with the generation prompt), tokenised without special
    tokens added (the template writes them)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise RequestError(f"messages[{i}] must be an object with a string role and a content", param="messages")
        if set(m) - {"role", "content", "name"}:
            raise RequestError(f"messages[{i}]: unsupported key {sorted(set(m) - {'role', 'content', 'name'})[0]!r}",
                               param="messages")
        turns.append({"role": m["role"], "content": _message_text(m["content"], i)})
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template may raise on roles it does not know
        raise RequestError(f"the chat template failed on these messages: {e}", param="messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_chat(body: dict, tokenizer, model_name: str, max_model_len: int | None = None) -> ParsedRequest:
    """A /v1/chat/completions body -> ParsedRequest, or a RequestError."""
    _check_fields(body, CHAT_FIELDS)
    model = _model(body, model_name)
    _check_unsupported(body)
    stream, include_usage = _stream_flags(body)
    if "messages" not in body:
        raise RequestError("messages is required", param="messages")
    prompt_ids = chat_prompt_ids(body["messages"], tokenizer)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), len(prompt_ids), max_model_len, 0)
    if max_model_len is None and body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        max_tokens = DEFAULT_CHAT_MAX_TOKENS
    return ParsedRequest(prompt_ids, _sampling_params(body, max_tokens), stream, include_usage,
                         _bool(body, "return_token_ids"), model)


# ---- responses ----

def usage(out) -> dict:
    prompt, completion = out.num_prompt_tokens, len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def completion_response(request_id: str, model: str, created: int, out, return_token_ids: bool) -> dict:
    choice = {"index": 0, "text": out.text or "", "logprobs": None, "finish_reason": out.finish_reason}
    if return_token_ids:
        choice["token_ids"] = list(out.token_ids)
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage(out)}


def chat_response(request_id: str, model: str, created: int, out, return_token_ids: bool) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": out.text or ""}, "logprobs": None,
              "finish_reason": out.finish_reason}
    if return_token_ids:
        choice["token_ids"] = list(out.token_ids)
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage(out)}


def completion_chunk(request_id: str, model: str, created: int, text: str, finish_reason: str | None,
                     token_ids: list[int] | None = None, include_usage: bool = False) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(request_id: str, model: str, created: int, delta: dict, finish_reason: str | None,
               token_ids: list[int] | None = None, include_usage: bool = False) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, model: str, created: int, chat: bool, out) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(out)}


def sse(data) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`) and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = sse("[DONE]")


def models_response(model_name: str, max_model_len: int | None, created: int | None = None) -> dict:
    card = {"id": model_name, "object": "model", "created": created or int(time.time()), "owned_by": "eagle_fx",
            "root": model_name, "parent": None}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}
