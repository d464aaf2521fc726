"""`eagle_fx.serving.server.serve` as `eagle-fx serve` runs it: in a process of its own, on its main
thread (the bundled tiny pair, eager backend, fixed k = 3).

Oracles: every cycle of the engine runs on the main thread, the one that compiled the model (the
OpenMP reason is in eagle_fx.serving.engine_loop); a stream in flight when SIGINT arrives still
ends with all its tokens, equal to HF greedy, and `[DONE]`, and serve() then returns (exit 0); a
taken port makes serve() raise uvicorn's startup-failure exit instead of hanging with no server.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import torch
from uvicorn.server import STARTUP_FAILURE

from eagle_fx.bundled import load_pair, pair_dirs

MAX_TOKENS = 40

SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, threading
    import httpx
    import eagle_fx
    from eagle_fx.bundled import load_pair, pair_dirs
    from eagle_fx.serving.server import serve

    taken_port, max_tokens = int(sys.argv[1]), int(sys.argv[2])
    tok, base, draft = load_pair(*pair_dirs())
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, backend="eager", max_batch_size=2, max_seq_len=256)
    cycle_threads, result = set(), {}
    cycle = model.chain_cycle

    def recording_cycle(*args, **kwargs):
        cycle_threads.add(threading.current_thread().name)
        return cycle(*args, **kwargs)

    model.chain_cycle = recording_cycle
    try:
        serve(model, tok, port=taken_port, speculation=3, log_level="critical")
    except SystemExit as e:
        result["taken_port_exit"] = e.code

    def client(host, port):
        body = {"model": "eagle-fx", "prompt": "Write a short story about", "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "return_token_ids": True, "ignore_eos": True}
        ids, done = [], False
        with httpx.Client(timeout=60) as http, http.stream("POST", f"http://{host}:{port}/v1/completions",
                                                           json=body) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
                    if len(ids) and "signalled" not in result:
                        result["signalled"] = len(ids)
                        os.kill(os.getpid(), signal.SIGINT)  # graceful: this stream must still finish
        result.update(ids=ids, done=done)

    def ready(host, port):
        threading.Thread(target=client, args=(host, port), daemon=True).start()

    serve(model, tok, port=0, speculation=3, log_level="critical", on_ready=ready)
    result["cycle_threads"] = sorted(cycle_threads)
    result["main_thread"] = threading.main_thread().name
    print("RESULT " + json.dumps(result))
''')


def test_serve_runs_the_engine_on_the_main_thread_and_sigint_lets_a_stream_finish():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(taken.getsockname()[1]), str(MAX_TOKENS)],
                              capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["taken_port_exit"] == STARTUP_FAILURE
    assert result["cycle_threads"] == [result["main_thread"]]
    assert result["done"] and result["signalled"] < MAX_TOKENS

    tok, base, _ = load_pair(*pair_dirs())
    prompt = tok("Write a short story about")["input_ids"]
    with torch.no_grad():
        ref = base.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    assert result["ids"] == ref
