"""The OpenAI-compatible HTTP server over the serving Engine (FastAPI + uvicorn).

`build_app(engine_loop, tokenizer, model_name)` serves /v1/completions and /v1/chat/completions
(plain JSON, or server-sent events with `stream: true`), /v1/models, /health and /metrics
(Prometheus text). A bad body is a 400 with OpenAI's error JSON (FastAPI's 422 validation errors
too); an engine failure is a 500 (a stream ends with an error event and `[DONE]`). A client that
goes away aborts its request, so the engine frees its KV blocks at once: a stream when Starlette
cancels its generator, a plain request when the handler sees the disconnect (polled while it waits).
`serve(model, tokenizer, ...)` builds the Engine, its EngineLoop and the app, and runs uvicorn on
127.0.0.1 by default.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle_fx.serving import openai_api as api
from eagle_fx.serving.engine_loop import EngineError, EngineLoop
from eagle_fx.serving.prometheus import CONTENT_TYPE, render_metrics

log = logging.getLogger("eagle_fx.serving")

DISCONNECT_POLL_S = 0.1  # how often a waiting non-stream request checks that its client is still there


def _error(message: str, status: int, param: str | None = None, type: str = "invalid_request_error",  # noqa: A002
           code: str | None = None) -> JSONResponse:
    return JSONResponse(api.error_body(message, param, type, code), status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(f"invalid request: {first.get('msg', exc)}", 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(str(exc.detail), exc.status_code, type=kind)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error(f"internal server error: {type(exc).__name__}: {exc}", 500, type="server_error")


async def _final_output(stream):
    final = None
    async for out in stream:
        final = out
    return final


async def _wait_unless_disconnected(request: Request, engine_loop: EngineLoop, stream):
    """The finished RequestOutput, or None when the client went away (the request is then aborted)."""
    task = asyncio.ensure_future(_final_output(stream))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client of %s went away: aborting it", stream.request_id)
                task.cancel()
                engine_loop.abort(stream.request_id)
                return None
    except asyncio.CancelledError:
        task.cancel()
        engine_loop.abort(stream.request_id)
        raise


async def _sse_events(engine_loop: EngineLoop, stream, parsed: api.ParsedRequest, chat: bool, created: int):
    """The stream's chunks as server-sent events; aborts the request unless it finished."""
    rid, model = stream.request_id, parsed.model
    ids_or_none = (lambda ids: list(ids)) if parsed.return_token_ids else (lambda ids: None)

    def chunk(text: str, finish_reason: str | None, token_ids) -> dict:
        if chat:
            delta = {"content": text} if text or finish_reason is None else {}
            return api.chat_chunk(rid, model, created, delta, finish_reason, token_ids, parsed.include_usage)
        return api.completion_chunk(rid, model, created, text, finish_reason, token_ids, parsed.include_usage)

    finished = False
    try:
        if chat:
            yield api.sse(api.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None,
                                         ids_or_none([]), parsed.include_usage))
        async for out in stream:
            text = out.delta or ""
            if out.finished:
                finished = True
                yield api.sse(chunk(text, out.finish_reason, ids_or_none(out.new_token_ids)))
                if parsed.include_usage:
                    yield api.sse(api.usage_chunk(rid, model, created, chat, out))
            elif text or (parsed.return_token_ids and out.new_token_ids):
                yield api.sse(chunk(text, None, ids_or_none(out.new_token_ids)))
        yield api.SSE_DONE
    except EngineError as e:
        finished = True  # the loop already dropped it
        yield api.sse(api.error_body(str(e), type="server_error"))
        yield api.SSE_DONE
    finally:
        if not finished:
            engine_loop.abort(rid)


def build_app(engine_loop: EngineLoop, tokenizer, model_name: str, max_model_len: int | None = None) -> FastAPI:
    """The FastAPI app serving `engine_loop` under the name `model_name`."""
    max_model_len = max_model_len if max_model_len is not None else engine_loop.max_model_len
    started = int(time.time())
    app = FastAPI(title="eagle-fx serve", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)

    async def generate(request: Request, chat: bool):
        created = int(time.time())
        try:
            body = api.parse_json_body(await request.body())
            parse = api.parse_chat if chat else api.parse_completion
            parsed = parse(body, tokenizer, model_name, max_model_len)
        except api.RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            stream = await engine_loop.submit(parsed.prompt_ids, parsed.params, request_id)
        except ValueError as e:
            return _error(str(e), 400)
        except EngineError as e:
            return _error(str(e), 503, type="server_error")
        if parsed.stream:
            return StreamingResponse(_sse_events(engine_loop, stream, parsed, chat, created),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            out = await _wait_unless_disconnected(request, engine_loop, stream)
        except EngineError as e:
            return _error(str(e), 500, type="server_error")
        if out is None:  # the client is gone; nobody reads this
            return JSONResponse(api.error_body("client disconnected"), status_code=499)
        respond = api.chat_response if chat else api.completion_response
        return JSONResponse(respond(request_id, parsed.model, created, out, parsed.return_token_ids))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return api.models_response(model_name, max_model_len, started)

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return _error("the engine is not running", 503, type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        snapshot = await asyncio.wrap_future(engine_loop.request_metrics())
        return PlainTextResponse(render_metrics(snapshot, model_name), media_type=CONTENT_TYPE)

    return app


def _bound_port(server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


def start_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                    timeout: float = 30.0, on_exit=None):
    """Run `app` under uvicorn in a daemon thread; (server, thread, port) once it listens (port 0:
    a free port). Stop it with `server.should_exit = True; thread.join()`. on_exit(): called on that
    thread when uvicorn ends, whether it shut down or failed. A uvicorn that fails to start raises
    its error here (SystemExit(3) when the port is taken); one that fails later leaves it in
    `thread.error` (None otherwise)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off"))

    def run() -> None:
        try:
            server.run()
        except BaseException as e:  # noqa: BLE001 - uvicorn exits with SystemExit when it cannot bind
            thread.error = e
        finally:
            if on_exit is not None:
                on_exit()

    thread = threading.Thread(target=run, name="eagle-fx-uvicorn", daemon=True)
    thread.error = None
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            thread.join(0.1)
            if thread.error is not None:
                raise thread.error
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.02)
    return server, thread, _bound_port(server)


def serve(model, tokenizer, host: str = "127.0.0.1", port: int = 8000, model_name: str = "eagle-fx",
          speculation="adaptive", log_level: str = "info", on_ready=None, ks=None,
          admission: str = "continuous", warm_up_structured: bool = False, split_by_length: bool = False,
          plain_check: bool = True) -> None:
    """Serve `model` (an eagle_fx.compile result) until SIGINT or SIGTERM (then uvicorn shuts down
    gracefully: streams in flight finish) and return. on_ready(host, port) is called once uvicorn
    listens. ks, admission, split_by_length, plain_check: the Engine's (the k values adaptive
    speculation chooses from; "continuous" or "waves" admission; cycles by length groups; adaptive's
    check against plain decoding). warm_up_structured: compile
    the cycles under grammar masks before listening (eagle_fx.serving.grammars.compile_grammar_cycles).

    The engine runs on the calling thread, the one that compiled the model, and uvicorn on a thread
    of its own (eagle_fx.serving.engine_loop says why: OpenMP's worker pools). A uvicorn that fails
    (the port is taken) stops the engine, and its error is raised here. The SIGINT / SIGTERM
    handlers are installed only when serve() is called on the main thread (Python's rule); from
    another thread, stop it by stopping the process."""
    import signal

    from eagle_fx.serving.engine import Engine

    engine = Engine(model, tokenizer=tokenizer, speculation=speculation, ks=ks, admission=admission,
                    split_by_length=split_by_length, plain_check=plain_check)
    if warm_up_structured:
        from eagle_fx.serving.grammars import compile_grammar_cycles

        compile_grammar_cycles(engine)
    options = getattr(model, "options", None)
    engine_loop = EngineLoop(engine, max_model_len=getattr(options, "max_seq_len", None), start_thread=False)
    server, thread, bound = start_in_thread(build_app(engine_loop, tokenizer, model_name), host, port, log_level,
                                            on_exit=lambda: engine_loop.shutdown(timeout=0))

    def stop(signum, frame) -> None:  # the first signal shuts down gracefully, a second at once
        server.force_exit = server.should_exit
        server.should_exit = True

    on_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    try:
        if on_ready is not None:
            on_ready(host, bound)
        engine_loop.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.should_exit = True
        thread.join(30)
    if thread.error is not None and not (isinstance(thread.error, SystemExit) and not thread.error.code):
        raise thread.error
