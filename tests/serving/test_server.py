"""`eagle-fx serve` end to end: uvicorn on a free loopback port over the real serving Engine (the
bundled tiny pair, eager backend), driven by the `openai` client and by raw httpx.

Oracle: greedy completions equal Hugging Face's `base.generate(do_sample=False)` on the prompt ids
the server builds (token ids, via the return_token_ids extension, and text); streamed text equals
the non-stream text and streamed token ids the usage count; concurrent requests each equal the
oracle. Bad bodies are 400s with OpenAI's error JSON; a client that goes away gets its request
aborted and its KV blocks freed; /metrics speaks Prometheus with vLLM's names. The EngineLoop's
failure paths (an exception in step(), a refused request) run against a tiny fake engine.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

import eagle_fx
from eagle_fx.bundled import load_pair, pair_dirs
from eagle_fx.serving.engine_loop import EngineError, EngineLoop
from eagle_fx.serving.prometheus import parse_metrics
from eagle_fx.serving.requests import RequestOutput, SamplingParams
from eagle_fx.serving.server import build_app, start_in_thread

MODEL = "tiny-sharegpt"
MAX_TOKENS = 12
PROMPTS = ["Hello there", "What is the best way to learn", "Write a short story about", "The capital of France",
           "I want to buy a", "How do I"]
LONG = 480  # max_tokens of the requests a test disconnects from (never reached)


class Served:
    def __init__(self, tok, base, engine_loop, port):
        self.tok, self.base, self.engine_loop, self.port = tok, base, engine_loop, port
        self.initial_metrics = engine_loop.metrics()  # before any request
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=60)
        self._oracle: dict = {}

    def hf_greedy(self, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        """HF's greedy continuation of `ids` (eos kept, as the engine keeps it)."""
        key = (tuple(ids), max_tokens)
        if key not in self._oracle:
            with torch.no_grad():
                out = self.base.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens,
                                         pad_token_id=self.tok.pad_token_id)
            self._oracle[key] = out[0, len(ids):].tolist()
        return self._oracle[key]

    def completion_ids(self, prompt: str) -> list[int]:
        return self.tok(prompt)["input_ids"]  # as the server does (add_special_tokens on)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def finish_reason(self, ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
        return "stop" if ids and ids[-1] == self.tok.eos_token_id else "length"


@pytest.fixture(scope="module")
def served():
    from eagle_fx.serving.engine import Engine

    tok, base, draft = load_pair(*pair_dirs())
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, backend="eager", max_batch_size=4, max_seq_len=512)
    engine_loop = EngineLoop(Engine(model, tokenizer=tok, speculation="adaptive"), max_model_len=512)
    server, thread, port = start_in_thread(build_app(engine_loop, tok, MODEL))
    yield Served(tok, base, engine_loop, port)
    server.should_exit = True
    thread.join(10)
    engine_loop.shutdown()


def completion(served, prompt: str, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return served.client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                            extra_body={"return_token_ids": True}, **kwargs)


def streamed_completion(served, prompt: str, **kwargs):
    """(text, token ids, finish reason, usage) of a streamed completion."""
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    text, ids, finish, usage = "", [], None, None
    for chunk in served.client.completions.create(model=MODEL, prompt=prompt, temperature=0, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"return_token_ids": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            ids += choice.token_ids
            finish = choice.finish_reason or finish
    return text, ids, finish, usage


def test_completion_equals_hf_greedy(served):
    for prompt in PROMPTS[:3]:
        ids = served.completion_ids(prompt)
        want = served.hf_greedy(ids)
        out = completion(served, prompt)
        choice = out.choices[0]
        assert choice.token_ids == want, prompt
        assert choice.text == served.text(want)
        assert choice.finish_reason == served.finish_reason(want)
        assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(want))
        assert out.usage.total_tokens == len(ids) + len(want)


def test_completion_from_token_ids(served):
    ids = served.completion_ids(PROMPTS[3])
    out = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == served.text(served.hf_greedy(ids))


def test_stream_equals_non_stream(served):
    prompt = PROMPTS[1]
    want = served.hf_greedy(served.completion_ids(prompt))
    text, ids, finish, usage = streamed_completion(served, prompt)
    assert text == completion(served, prompt).choices[0].text == served.text(want)
    assert ids == want
    assert usage.completion_tokens == len(ids) == len(want)
    assert finish == served.finish_reason(want)


def test_chat_non_stream_and_stream(served):
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Tell me a joke"}]
    ids = served.chat_ids(messages)
    want = served.hf_greedy(ids)
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS,
                                                temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == served.text(want)
    assert out.choices[0].finish_reason == served.finish_reason(want)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(want))
    content, finish, usage, roles = "", None, None, []
    for chunk in served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            roles += [choice.delta.role] if choice.delta.role else []
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert content == served.text(want)
    assert finish == served.finish_reason(want)
    assert usage.completion_tokens == len(want)


def test_concurrent_requests_each_equal_the_request_alone(served):
    """More requests than the batch holds (4), from threads, half streamed: each equals HF's greedy."""
    def one(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            text, ids, _, _ = streamed_completion(served, prompt)
            return prompt, text, ids
        choice = completion(served, prompt).choices[0]
        return prompt, choice.text, choice.token_ids

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for prompt, text, ids in results:
        want = served.hf_greedy(served.completion_ids(prompt))
        assert (ids, text) == (want, served.text(want)), prompt


def test_models(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_stop_string_cuts_the_text(served):
    prompt = next(p for p in PROMPTS if len(served.text(served.hf_greedy(served.completion_ids(p)))) >= 12)
    full = served.text(served.hf_greedy(served.completion_ids(prompt)))
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[: full.find(stop)]
    out = completion(served, prompt, stop=[stop])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    text, _, finish, _ = streamed_completion(served, prompt, stop=stop)
    assert (text, finish) == (cut, "stop")


BAD_BODIES = {
    "invalid json": (b"{not json", "/v1/completions", None),
    "not an object": (b"[1, 2]", "/v1/completions", None),
    "missing prompt": ({"model": MODEL, "max_tokens": 4}, "/v1/completions", "prompt"),
    "negative max_tokens": ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "/v1/completions", "max_tokens"),
    "n=2": ({"model": MODEL, "prompt": "hi", "n": 2}, "/v1/completions", "n"),
    "temperature hot": ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "/v1/completions", "temperature"),
    "prompt too long": ({"model": MODEL, "prompt": [5] * 600, "max_tokens": 4}, "/v1/completions", "prompt"),
    "ids outside the vocabulary": ({"model": MODEL, "prompt": [5, 10 ** 6], "max_tokens": 4}, "/v1/completions",
                                   None),
    "logprobs": ({"model": MODEL, "prompt": "hi", "logprobs": 2}, "/v1/completions", "logprobs"),
    "echo": ({"model": MODEL, "prompt": "hi", "echo": True}, "/v1/completions", "echo"),
    "unknown field": ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, "/v1/completions", "frobnicate"),
    "top_p 0": ({"model": MODEL, "prompt": "hi", "top_p": 0}, "/v1/completions", "top_p"),
    "chat without messages": ({"model": MODEL}, "/v1/chat/completions", "messages"),
    "chat bad message": ({"model": MODEL, "messages": [{"content": "x"}]}, "/v1/chat/completions", "messages"),
    "chat stream_options without stream": ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                            "stream_options": {"include_usage": True}}, "/v1/chat/completions",
                                           "stream_options"),
    "two grammars": ({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"},
                      "guided_regex": "a+"}, "/v1/completions", "response_format"),
    "response_format type": ({"model": MODEL, "prompt": "hi", "response_format": {"type": "xml"}}, "/v1/completions",
                             "response_format"),
    "invalid regex": ({"model": MODEL, "prompt": "hi", "guided_regex": "(unclosed"}, "/v1/completions", None),
    "grammar with ignore_eos": ({"model": MODEL, "prompt": "hi", "guided_regex": "a+", "ignore_eos": True},
                                "/v1/completions", "ignore_eos"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_requests_are_400_with_an_openai_error(served, case):
    body, path, param = BAD_BODIES[case]
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(served.url + path, timeout=30, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["code"] is None
    assert error["param"] == param


def test_structured_output_equals_hf_with_the_grammar_and_parses(served):
    """response_format json_schema through the openai client: the token ids equal HF greedy with
    xgrammar's logits processor for the same grammar, and the text parses and validates; /metrics
    counts the cycles under the grammar and the matchers' host seconds."""
    pytest.importorskip("xgrammar", reason="structured output is the optional 'structured' extra")
    from structured.hf_oracle import hf_grammar_greedy
    from structured.schema_check import schema_errors

    schema = {"type": "object", "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"enum": [1, 2, 3]},
                             "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
              "required": ["city", "rank", "tags"]}
    messages = [{"role": "user", "content": "Name a city as JSON."}]
    before = metrics(served)
    r = served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    grammars = served.engine_loop.engine.grammars
    compiled = grammars.compiled(SamplingParams(response_format={"type": "json_schema", "json_schema": {
        "schema": schema}}).response_format, frozenset({served.tok.eos_token_id}))
    assert ids == hf_grammar_greedy(served.base, served.chat_ids(messages), compiled, 64, served.tok.eos_token_id)
    if r.choices[0].finish_reason == "stop":
        assert schema_errors(json.loads(r.choices[0].message.content), schema) == []
    after = metrics(served)
    assert sample(after, "eagle_fx:grammar_cycles_total") > sample(before, "eagle_fx:grammar_cycles_total")
    assert sample(after, "eagle_fx:grammar_mask_seconds_total") > sample(before, "eagle_fx:grammar_mask_seconds_total")
    assert sample(after, "eagle_fx:num_requests_structured") == 0  # it finished


def test_unknown_model_is_404_and_the_client_sees_it(served):
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="nope", prompt="hi", max_tokens=2)


def metrics(served) -> dict[str, float]:
    r = httpx.get(served.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse_metrics(r.text)


def sample(samples: dict, name: str, **labels) -> float:
    want = {f'{k}="{v}"' for k, v in {"model_name": MODEL, **labels}.items()}
    found = [v for key, v in samples.items() if key.split("{")[0] == name
             and set(key[key.index("{") + 1:-1].split(",")) == want]
    return found[0] if found else 0.0


def wait_until_released(served, aborts_before: float) -> dict:
    """Poll /metrics until nothing runs, no KV block is held and one more request was aborted."""
    deadline = time.monotonic() + 10
    while True:
        m = metrics(served)
        done = (sample(m, "eagle_fx:num_requests_running") == 0 and sample(m, "eagle_fx:kv_cache_blocks_used") == 0
                and sample(m, "eagle_fx:request_success_total", finished_reason="abort") == aborts_before + 1)
        if done or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_stream_disconnect_aborts_and_frees_blocks(served):
    aborts = sample(metrics(served), "eagle_fx:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", served.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    m = wait_until_released(served, aborts)
    assert sample(m, "eagle_fx:request_success_total", finished_reason="abort") == aborts + 1
    assert sample(m, "eagle_fx:num_requests_running") == 0
    assert sample(m, "eagle_fx:kv_cache_blocks_used") == 0  # prefix caching is off in this fixture


def test_non_stream_disconnect_aborts(served):
    aborts = sample(metrics(served), "eagle_fx:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    m = wait_until_released(served, aborts)
    assert sample(m, "eagle_fx:request_success_total", finished_reason="abort") == aborts + 1
    assert sample(m, "eagle_fx:kv_cache_blocks_used") == 0


def test_metrics_names_and_spec_decode_counters_grow(served):
    """Counters grow with requests. (Adaptive speculation may run a lone request at k = 0 when the
    measured costs say so, so drafts are compared with the count before any request, after a batch;
    CI once saw drafts run and none accepted, so acceptance is checked by identities, not as > 0.)"""
    before = metrics(served)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda prompt: completion(served, prompt), PROMPTS[:4]))
    text = httpx.get(served.url + "/metrics", timeout=30).text
    after = parse_metrics(text)
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
                 "num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total", "speculation_off",
                 "speculation_off_events_total", "num_preemptions_total", "num_spec_tokens_current",
                 "decode_cycles_total", "cycle_cost_seconds", "step_outside_cycles_seconds",
                 "k_switch_cycles_total", "k_switch_seconds_total", "k_switch_priced_seconds_total",
                 "draft_catch_up_seconds_total", "plain_check_epochs_total"):
        assert f"# TYPE eagle_fx:{name} " in text and f"# HELP eagle_fx:{name} " in text, name
    assert sample(after, "eagle_fx:spec_decode_num_drafts_total") > served.initial_metrics["spec_decode_num_drafts"]
    # vLLM's identities, whatever k each cycle ran at (a lone cycle may accept nothing, so no count is
    # asserted positive): the per-position counts sum to the accepted total and never grow with position
    per_pos = [sample(after, "eagle_fx:spec_decode_num_accepted_tokens_per_pos_total", position=i) for i in range(3)]
    assert sum(per_pos) == sample(after, "eagle_fx:spec_decode_num_accepted_tokens_total")
    assert per_pos == sorted(per_pos, reverse=True)
    assert per_pos[0] <= sample(after, "eagle_fx:spec_decode_num_drafts_total")
    assert sample(after, "eagle_fx:spec_decode_num_accepted_tokens_total") <= sample(
        after, "eagle_fx:spec_decode_num_draft_tokens_total")
    assert sample(after, "eagle_fx:generation_tokens_total") > sample(before, "eagle_fx:generation_tokens_total")
    assert sample(after, "eagle_fx:request_success_total", finished_reason="length") >= 1
    # cycles by k: some ran at a k > 0 (drafts grew), and every draft came from one (a cycle drafts once per row)
    cycles = {k: sample(after, "eagle_fx:decode_cycles_total", k=str(k)) for k in (0, 1, 3)}
    drafts = sample(after, "eagle_fx:spec_decode_num_drafts_total")
    assert 0 < cycles[1] + cycles[3] <= drafts <= 4 * (cycles[1] + cycles[3])  # (max_batch_size 4)
    # what adaptive speculation prices each k by, as the engine holds it (idle now): every (k, batch size)
    costs = served.engine_loop.engine.costs.measured()
    assert sorted(costs) == [0, 1, 3] and all(costs.values())
    for k, by_size in costs.items():
        for batch, seconds in by_size.items():
            assert sample(after, "eagle_fx:cycle_cost_seconds", k=str(k), batch_size=str(batch)) == seconds
    outside = served.engine_loop.engine.outside.measured()
    assert all(sample(after, "eagle_fx:step_outside_cycles_seconds", batch_size=str(b)) == v for b, v in outside.items())
    # what running its choices cost: the engine's counts (a request's first cycle follows a step without one)
    engine = served.engine_loop.engine
    assert sample(after, "eagle_fx:k_switch_cycles_total") == engine.switch_cycles >= 1
    assert sample(after, "eagle_fx:k_switch_seconds_total") == engine.switch_seconds > 0
    assert sample(after, "eagle_fx:k_switch_priced_seconds_total") == engine.switch_priced > 0
    assert sample(after, "eagle_fx:draft_catch_up_seconds_total") == engine.catch_up_seconds


def test_health(served):
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200


# ---- the EngineLoop's failure paths, against a fake engine (no model) ----

class FlakyEngine:
    """Refuses prompts with a 0 in them; step() raises while `broken`; else one token per step."""

    def __init__(self):
        self.requests, self.broken, self.steps = {}, False, 0

    def add_request(self, prompt, params, request_id):
        if 0 in prompt:
            raise ValueError("prompt token id 0 is not allowed here")
        self.requests[request_id] = (params.max_tokens, [])
        return request_id

    def abort(self, request_id):
        return self.requests.pop(request_id, None) is not None

    def has_unfinished(self):
        return bool(self.requests)

    def metrics(self):
        return {"num_requests_running": len(self.requests)}

    def step(self):
        self.steps += 1
        if self.broken:
            raise RuntimeError("boom")
        outs = []
        for rid, (max_tokens, out) in list(self.requests.items()):
            out.append(7)
            finished = len(out) >= max_tokens
            outs.append(RequestOutput(rid, [7], list(out), finished, "length" if finished else None))
            if finished:
                del self.requests[rid]
        return outs


def test_engine_loop_failures_reach_the_submitter_and_the_loop_lives_on():
    engine = FlakyEngine()
    loop = EngineLoop(engine, name="flaky-engine-loop")

    async def run(prompt, request_id):
        return [out async for out in await loop.submit(prompt, SamplingParams(max_tokens=3), request_id)]

    try:
        with pytest.raises(ValueError, match="token id 0"):
            asyncio.run(run([0, 1], "refused"))
        assert [o.token_ids for o in asyncio.run(run([1], "ok"))][-1] == [7, 7, 7]
        time.sleep(0.2)
        idle_steps = engine.steps
        time.sleep(0.3)
        assert engine.steps == idle_steps  # asleep with no work: no busy spin
        engine.broken = True
        with pytest.raises(EngineError, match="boom"):
            asyncio.run(run([1], "fails"))
        assert engine.requests == {}  # the failed request was aborted in the engine
        engine.broken = False
        assert asyncio.run(run([1], "after"))[-1].finish_reason == "length"
        assert loop.alive and loop.metrics() == {"num_requests_running": 0}
    finally:
        loop.shutdown()
    assert not any(t.name == "flaky-engine-loop" and t.is_alive() for t in threading.enumerate())


def test_a_stream_that_fell_behind_reads_what_queued_up_as_one_output():
    """Outputs queued while the consumer was away come as one: every token once and in order, the
    text deltas joined, the last one's state; an error queued after them is raised on the next read."""
    from eagle_fx.serving.engine_loop import RequestStream, _put_all

    async def run():
        stream = RequestStream("r", asyncio.get_running_loop())
        outs = [RequestOutput("r", [i], list(range(1, i + 1)), text="abc"[:i], delta="abc"[i - 1]) for i in (1, 2, 3)]
        _put_all([(stream, o) for o in outs[:2]])
        first = await stream.__anext__()
        _put_all([(stream, outs[2]), (stream, RequestOutput("r", [4], [1, 2, 3, 4], True, "length", "abcd", "d"))])
        second = await stream.__anext__()
        _put_all([(stream, outs[0]), (stream, EngineError("gone"))])
        other = RequestStream("s", asyncio.get_running_loop())
        _put_all([(other, outs[0]), (other, EngineError("gone"))])
        before_error = await other.__anext__()
        with pytest.raises(EngineError, match="gone"):
            await other.__anext__()
        return first, second, before_error

    first, second, before_error = asyncio.run(run())
    assert (first.new_token_ids, first.token_ids, first.delta, first.finished) == ([1, 2], [1, 2], "ab", False)
    assert (second.new_token_ids, second.token_ids, second.text, second.delta) == ([3, 4], [1, 2, 3, 4], "abcd", "cd")
    assert second.finished and second.finish_reason == "length"
    assert before_error.new_token_ids == [1]


def test_the_engine_loop_wakes_the_event_loop_once_per_step():
    """16 requests in flight: each step's outputs reach their streams in one call_soon_threadsafe."""
    engine = FlakyEngine()
    loop = EngineLoop(engine, name="wakeup-engine-loop")

    async def run():
        event_loop = asyncio.get_running_loop()
        calls = []
        original = event_loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            calls.append(callback)
            return original(callback, *args, **kwargs)

        event_loop.call_soon_threadsafe = counting
        streams = [await loop.submit([1], SamplingParams(max_tokens=4), f"r{i}") for i in range(16)]
        outs = [[o async for o in s] for s in streams]
        return calls, outs

    try:
        calls, outs = asyncio.run(run())
    finally:
        loop.shutdown()
    assert all(sum((o.new_token_ids for o in out), []) == [7, 7, 7, 7] for out in outs)
    deliveries = [c for c in calls if getattr(c, "__name__", "") == "_put_all"]
    assert 0 < len(deliveries) <= engine.steps  # at most one per step, for 16 streams


def test_serve_cli_flags_and_their_defaults():
    import argparse

    from eagle_fx.serving import cli_serve

    parser = argparse.ArgumentParser()
    cli_serve.add_args(parser)
    args = parser.parse_args([])
    assert (args.backend, args.num_spec_tokens, args.speculation, args.max_batch_size, args.max_seq_len,
            args.prefix_caching, args.prefill_chunk_size, args.host, args.port) == \
        ("inductor", 3, "adaptive", 16, 1024, True, 256, "127.0.0.1", 8000)
    assert cli_serve.speculation_setting(args) == "adaptive"
    assert cli_serve.speculation_setting(parser.parse_args(["--speculation", "fixed", "--num-spec-tokens", "2"])) == 2
    assert parser.parse_args(["--no-prefix-caching"]).prefix_caching is False
    assert args.plain_check is True and parser.parse_args(["--no-plain-check"]).plain_check is False
    with pytest.raises(SystemExit, match="--num-spec-tokens"):
        cli_serve.check_args(parser.parse_args(["--num-spec-tokens", "-1"]))
