"""Shared by bench/serve_load.py and bench/soak.py: held-out prompts, HF greedy references, an
`eagle-fx serve` subprocess (started and stopped by its pid), a streamed /v1/completions client and
/metrics snapshots. Not a script of its own."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load_tokenizer_and_base():
    from eagle_fx.bundled import load_pair, pair_dirs

    tok, base, _ = load_pair(*pair_dirs())
    return tok, base


def held_out_prompts(tok, n: int, max_prompt_len: int) -> list[list[int]]:
    """`n` chat-rendered held-out ShareGPT first user turns (token ids), as the bench loads them."""
    from eagle_fx.bench.prompts import load_prompts

    ns = argparse.Namespace(dataset_name="sharegpt", dataset_path=None, num_prompts=n, max_prompt_len=max_prompt_len,
                            seed=0, input_len=0)
    return load_prompts(ns, tok, tok.vocab_size)


def hf_greedy(base, prompts, max_new_tokens: int) -> dict[tuple, list[int]]:
    """{tuple(prompt ids): HF's greedy continuation, max_new_tokens long (eos does not stop it)}, one
    `generate` per distinct prompt; a shorter request's reference is a prefix of it."""
    import torch

    refs: dict[tuple, list[int]] = {}
    distinct = list(dict.fromkeys(tuple(p) for p in prompts))
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, p in enumerate(distinct):
            out = base.generate(torch.tensor([list(p)]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
            refs[p] = out[0, len(p):].tolist()
            assert len(refs[p]) == max_new_tokens, (len(refs[p]), max_new_tokens)
            if (i + 1) % 25 == 0:
                log(f"HF greedy references: {i + 1}/{len(distinct)}")
    log(f"HF greedy references: {len(distinct)} prompts x {max_new_tokens} tokens in {time.perf_counter() - t0:.1f} s")
    return refs


def add_server_flags(ap: argparse.ArgumentParser, max_batch_size: int, out: str) -> None:
    """The flags both scripts take for their prompts, their servers and their results."""
    ap.add_argument("--max-prompt-len", type=int, default=512, help="skip longer held-out prompts (tokens)")
    ap.add_argument("--backend", choices=["eager", "inductor"], default="inductor", help="the servers' backend")
    ap.add_argument("--max-batch-size", type=int, default=max_batch_size, help="the servers' --max-batch-size")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="the servers' --max-seq-len")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to compile and listen")
    ap.add_argument("--out", default=out, help="JSON results")


class Server:
    """`python -m eagle_fx.cli serve ...` in a process (and process group) of its own, on a free
    loopback port (--port 0; the port is read from its ready line). Use as a context manager."""

    def __init__(self, args: list[str], name: str = "server", start_timeout: float = 900.0):
        self.args, self.name, self.start_timeout = args, name, start_timeout
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"eagle-fx-{name}-", suffix=".log")[1])

    def start(self) -> Server:
        cmd = [sys.executable, "-m", "eagle_fx.cli", "serve", "--host", "127.0.0.1", "--port", "0", *self.args]
        log(f"{self.name}: starting {' '.join(cmd[1:])} (log {self.log_path})")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        t0, deadline = time.monotonic(), time.monotonic() + self.start_timeout
        while self.url is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {self.start_timeout:.0f} s:\n{self.tail()}")
            found = re.search(r"ready on (http://[\d.]+:\d+)", self.log_path.read_text(errors="replace"))
            if found:
                self.url = found.group(1)
            else:
                time.sleep(0.5)
        for _ in range(100):
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{self.name}: /health never answered 200:\n{self.tail()}")
        log(f"{self.name}: ready on {self.url} (pid {self.proc.pid}) after {time.monotonic() - t0:.0f} s")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mb(self) -> float | None:
        try:
            text = Path(f"/proc/{self.proc.pid}/status").read_text()
        except (OSError, AttributeError):
            return None
        found = re.search(r"VmRSS:\s+(\d+) kB", text)
        return int(found.group(1)) / 1024 if found else None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT (uvicorn shuts down cleanly), then SIGTERM, then SIGKILL, to this server's group."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        log(f"{self.name}: stopped (exit {self.proc.returncode})")
        self._log.close()
        self.proc = None

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()


def server_args(backend: str, max_batch_size: int, max_seq_len: int, setting: str, num_spec_tokens: int = 3,
                extra: list[str] | None = None) -> list[str]:
    """serve flags for a setting: 'adaptive', 'k=N' (fixed k; k=0 compiles without the draft)."""
    args = ["--backend", backend, "--max-batch-size", str(max_batch_size), "--max-seq-len", str(max_seq_len),
            "--log-level", "warning"]
    if setting == "adaptive":
        args += ["--speculation", "adaptive", "--num-spec-tokens", str(num_spec_tokens)]
    else:
        args += ["--speculation", "fixed", "--num-spec-tokens", str(int(setting.split("=")[1]))]
    return args + (extra or [])


async def get_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    from eagle_fx.serving.prometheus import parse_metrics

    r = await client.get(url + "/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


def metric(samples: dict[str, float], name: str) -> float:
    """The sum of `name`'s samples (every label set)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def by_label(samples: dict[str, float], name: str, label: str, *more: str) -> dict:
    """{label value: sample} of `name`'s samples that carry `label` ({(value, value, ...): sample}
    with `more` labels)."""
    found = {}
    for key, value in samples.items():
        if key.split("{")[0] == name:
            got = [re.search(name_ + r'="([^"]*)"', key) for name_ in (label, *more)]
            if all(got):
                found[tuple(g.group(1) for g in got) if more else got[0].group(1)] = value
    return found


def cycle_costs_ms(samples: dict[str, float]) -> dict[str, dict[str, float]]:
    """{k: {batch size: ms}}: the cycle costs (at no keys) a server's adaptive speculation prices
    each k by (eagle_fx:cycle_cost_seconds)."""
    costs: dict[str, dict[str, float]] = {}
    for (k, batch), seconds in by_label(samples, "eagle_fx:cycle_cost_seconds", "k", "batch_size").items():
        costs.setdefault(k, {})[batch] = round(1000 * seconds, 3)
    return {k: dict(sorted(by.items(), key=lambda kv: int(kv[0]))) for k, by in sorted(costs.items())}


def cycles_by_k(before: dict, after: dict) -> dict[str, int]:
    """Decode cycles the engine ran at each k between two snapshots (eagle_fx:decode_cycles_total)."""
    start = by_label(before, "eagle_fx:decode_cycles_total", "k")
    end = by_label(after, "eagle_fx:decode_cycles_total", "k")
    return {k: int(n - start.get(k, 0)) for k, n in sorted(end.items())}


def growth(before: dict, after: dict, name: str) -> float:
    """How much counter `name` (every label set) grew between two snapshots."""
    return metric(after, name) - metric(before, name)


def running_costs(before: dict, after: dict) -> dict:
    """What running adaptive's choices cost between two snapshots, beyond its prices: cycles after a
    switch of k and their seconds less their price (eagle_fx:k_switch_*: signed, the sum of each such
    cycle's seconds less its price), and the draft's catch-up seconds after k = 0 cycles
    (eagle_fx:draft_catch_up_seconds_total)."""
    extra = (growth(before, after, "eagle_fx:k_switch_seconds_total")
             - growth(before, after, "eagle_fx:k_switch_priced_seconds_total"))
    return {"switch_cycles": int(growth(before, after, "eagle_fx:k_switch_cycles_total")),
            "switch_extra_s": round(extra, 4),
            "catch_up_s": round(growth(before, after, "eagle_fx:draft_catch_up_seconds_total"), 4)}


def acceptance(before: dict, after: dict) -> float | None:
    """Mean acceptance length between two snapshots: 1 + accepted / drafts (None: no drafts)."""
    drafts = growth(before, after, "eagle_fx:spec_decode_num_drafts_total")
    accepted = growth(before, after, "eagle_fx:spec_decode_num_accepted_tokens_total")
    return 1 + accepted / drafts if drafts > 0 else None


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, abort_after: int | None = None) -> dict:
    """POST a streamed /v1/completions (return_token_ids on); the token ids and their arrival times.
    abort_after: close the stream after that many data chunks (the request is then abandoned)."""
    body = {**body, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    out = {"status": None, "ids": [], "times": [], "finish_reason": None, "aborted": False, "error": None,
           "sent": t0, "end": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode(errors="replace")[:300]
                out["end"] = time.perf_counter()
                return out
            chunks, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out["error"] = obj["error"].get("message")
                    continue
                choice = obj["choices"][0]
                new = choice.get("token_ids") or []
                if new:
                    out["ids"] += new
                    out["times"].append((time.perf_counter(), len(new)))
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    out["aborted"] = True
                    break
            if not done and not out["aborted"] and out["error"] is None:
                out["error"] = "stream ended without [DONE]"
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["end"] = time.perf_counter()
    return out


def ttft_tpot(result: dict) -> tuple[float | None, float | None]:
    """(time to first token, time per output token after the first) of a stream, in seconds."""
    times = result["times"]
    if not times:
        return None, None
    ttft = times[0][0] - result["sent"]
    n = sum(k for _, k in times)
    tpot = (times[-1][0] - times[0][0]) / (n - 1) if n > 1 else None
    return ttft, tpot


def percentile(values, q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    at = (len(values) - 1) * q / 100
    lo, hi = int(at), min(int(at) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (at - lo)


def median_interval(values, confidence: float = 0.9) -> tuple[float, float, float] | None:
    """(median, low, high): a distribution-free interval for the median of whatever the values
    sample: the j-th smallest and j-th largest value, j the largest with P(Binomial(n, 1/2) < j) <=
    (1 - confidence) / 2 (the median lies outside it only when fewer than j samples fall on one
    side). None for too few values to bound it (n = 4 at 90%: even the extremes cover 87.5%)."""
    values, n = sorted(values), len(values)
    if not n:
        return None
    tail, below, j = (1 - confidence) / 2, 0.0, 0
    while below + math.comb(n, j) / 2 ** n <= tail:  # P(B <= j) still within the tail: j + 1 is safe
        below += math.comb(n, j) / 2 ** n
        j += 1
    if j == 0:
        return None
    return statistics.median(values), values[j - 1], values[n - j]


def median_text(values, confidence: float = 0.9) -> str:
    """"median [low, high]" of median_interval, "[n < 5]" (at 90%) where too few values bound it."""
    bounds = median_interval(values, confidence)
    if bounds is None:
        return f"{statistics.median(values):.2f} [n < 5]" if values else "-"
    return f"{bounds[0]:.2f} [{bounds[1]:.2f}, {bounds[2]:.2f}]"


def sigterm_as_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt, so the `with Server(...)` blocks stop their servers."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)
