"""Load test of `eagle-fx serve`: speculation settings x concurrency x arrival pattern.

One `eagle-fx serve` subprocess per setting (adaptive k in 0..3, fixed k=3, k=0), each compiling
its own pair (inductor by default) on a free loopback port. All of them are started first (one at a
time) and stay up; then the settings take turns at every point (concurrency x arrival), in the order
of --settings at even points and reversed at odd ones, so the machine's drift over the run (15-35%
on the 2-core machine between runs minutes apart) lands on every setting alike instead of on
whichever ran last. An idle server sleeps (its engine loop waits on a condition). At each
concurrency C it sends max(--min-requests, 4*C) streamed, greedy (temperature 0), ignore_eos
/v1/completions requests of --min-tokens to --max-tokens tokens (uniform, seeded per point: every
setting gets the same requests in the same order), with held-out ShareGPT prompts sent as token ids
(and the server's own tokenisation of the prompt text checked once per server), in two arrival
patterns:

  burst    all requests at t=0, at most C in flight (a semaphore of C);
  poisson  exponential inter-arrival gaps at rate lambda = C / W, W the mean request latency
           (send to last token) of the reference setting's burst run at the same C (k=0 when it
           runs, else the first of --settings): by Little's law (L = lambda W) that offers the
           reference about C requests in flight, still capped at C by the semaphore. Every setting
           gets the same arrival times: a setting faster than the reference keeps up with them
           at fewer requests in flight (its tok/s about the reference's, set by the arrivals;
           its response time lower); a slower one queues at the cap. So at a Poisson point
           compare the response time (arrival to last token, the wait for the cap included);
           tok/s there says whether a setting kept up. (Until stop 40 each setting was offered
           C / its own W, so a slow burst point lowered the same setting's Poisson point.)

Each point runs --repeats times per setting, the settings taking turns in each repeat (the order
reversed at every other turn). Reported per point: output tok/s (output tokens / wall of the
batch, first send to last token; the median over the repeats) and its ratio to k=0 at the same
point, and the paired ratio (its tok/s over k=0's in the same repeat: the median, with a
distribution-free 90% interval of it from 5 repeats up); the mean response time (a request's
arrival to its last token: in a burst every request
arrives at t=0, so it includes the wait for one of the C places; the median over the repeats) and
its ratio to k=0; TTFT p50/p99 and TPOT ((last - first token time) / (n - 1)) p50/p99 over every
request of the repeats (from the request's send); the mean acceptance length (1 + accepted /
drafts, from /metrics before the first repeat and after the last); the decode cycles run at each
k (eagle_fx:decode_cycles_total: which k adaptive chose), how many of them followed a switch of k
and their seconds less what adaptive priced them at (signed), and the draft's catch-up seconds
(eagle_fx:k_switch_*, eagle_fx:draft_catch_up_seconds_total: what running its choices cost beyond
its prices); the cycle costs per (k, batch size) the
server's engine held after the point (eagle_fx:cycle_cost_seconds: what adaptive priced each k
by; in the JSON); and greedy-exact n/n (every output's token ids against HF
`generate(do_sample=False)` of the same prompt, computed before any server starts). The JSON
(--out) has every point, with each repeat's tok/s, mean latency (send to last token: W above) and
response time, and the order the settings ran in at each repeat.

The waves-vs-continuous comparison (offline, in-process) is bench/waves_vs_continuous.py.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time

import httpx

from serve_common import (Server, acceptance, add_server_flags, cycle_costs_ms, cycles_by_k, get_metrics,
                          held_out_prompts, hf_greedy, load_tokenizer_and_base, log, median_text, percentile,
                          running_costs, server_args, sigterm_as_interrupt, stream_completion, ttft_tpot)

SETTINGS = ("adaptive", "k=3", "k=0")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " (see the module docstring for the method)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_server_flags(ap, max_batch_size=64, out="serve_load.json")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="comma list of engine settings: adaptive, k=N (fixed k; k=0 compiles without the draft)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma list of concurrency levels")
    ap.add_argument("--arrivals", default="burst,poisson", help="comma list: burst (all at once), poisson")
    ap.add_argument("--min-requests", type=int, default=64,
                    help="requests per point: max(this, 4 * concurrency) (a bounded run ends with a drain at a "
                         "shrinking batch: more requests make it a smaller part of the point)")
    ap.add_argument("--min-tokens", type=int, default=32,
                    help="output tokens per request (ignore_eos): uniform in --min-tokens..--max-tokens; equal "
                         "values give every request the same length, which keeps a k=0 batch in lockstep (all "
                         "finish at once and the next ones prefill together), unlike speculation or real traffic")
    ap.add_argument("--max-tokens", type=int, default=96, help="see --min-tokens")
    ap.add_argument("--num-prompts", type=int, default=128, help="distinct held-out prompts (requests cycle over them)")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up requests per server (not measured)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the Poisson gaps and the prompt order")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each point per setting, the settings taking turns (medians reported): one run's "
                         "ratios move by 10-50%% between runs on the 2-core machine")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: eager backend, concurrency 1 and 4, 8 requests per point, 2 repeats, 32 prompts")
    args = ap.parse_args(argv)
    if args.quick:
        args.backend, args.concurrency, args.min_requests, args.num_prompts = "eager", "1,4", 8, 32
        args.max_requests, args.repeats = 8, 2
    else:
        args.max_requests = None
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.arrivals = [a.strip() for a in args.arrivals.split(",")]
    for s in args.settings:
        if s != "adaptive" and not (s.startswith("k=") and s[2:].isdigit()):
            ap.error(f"--settings: {s!r} is not adaptive or k=N")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not 1 <= args.min_tokens <= args.max_tokens:
        ap.error("--min-tokens must be >= 1 and <= --max-tokens")
    if set(args.arrivals) - {"burst", "poisson"}:
        ap.error("--arrivals: burst and/or poisson")
    if max(args.concurrency) > args.max_batch_size:
        log(f"note: concurrency {max(args.concurrency)} > --max-batch-size {args.max_batch_size}: requests will queue")
    return args


def num_requests(args, c: int) -> int:
    n = max(args.min_requests, 4 * c)
    return min(n, args.max_requests) if args.max_requests else n


async def run_point(url: str, prompts, refs, c: int, n: int, arrival: str, rate: float | None, args, rng) -> dict:
    """One batch of n requests at concurrency c: its measurements, raw (merged() makes the point)."""
    order = [prompts[rng.randrange(len(prompts))] for _ in range(n)]
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(n)]
    gaps = [0.0] * n
    if arrival == "poisson":
        t = 0.0
        for i in range(n):
            gaps[i] = t
            t += rng.expovariate(rate)
    sem = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        before = await get_metrics(client, url)
        t0 = time.perf_counter()

        async def one(p, length, at):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with sem:
                body = {"prompt": list(p), "max_tokens": length, "temperature": 0, "ignore_eos": True}
                return await stream_completion(client, url, body)

        results = await asyncio.gather(*(one(p, length, at) for p, length, at in zip(order, lengths, gaps)))
        wall = max(r["end"] for r in results) - t0
        after = await get_metrics(client, url)
    tokens = sum(len(r["ids"]) for r in results)
    exact = sum(1 for r, p, length in zip(results, order, lengths)
                if r["error"] is None and r["ids"] == refs[tuple(p)][:length])
    errors = [r["error"] or f"status {r['status']}" for r in results if r["error"] or r["status"] != 200]
    return {"concurrency": c, "arrival": arrival, "requests": n, "poisson_rate": rate, "output_tokens": tokens,
            "metrics_before": before, "metrics_after": after, "ttft_tpot": [ttft_tpot(r) for r in results],
            "wall_s": wall, "tok_s": tokens / wall, "mean_latency_s": sum(r["end"] - r["sent"] for r in results) / n,
            "mean_response_s": sum(r["end"] - t0 - at for r, at in zip(results, gaps)) / n, "greedy_exact": exact,
            "errors": errors[:5], "num_errors": len(errors)}


async def tokenisation_check(url: str, tok, prompts, refs, args, k: int = 4) -> dict:
    """The prompt sent as text (the server tokenises it, add_special_tokens=False) must give the
    same greedy output as the token ids we send; also a warm-up."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        same, checked = 0, 0
        for p in prompts[:k]:
            text = tok.decode(p)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            m = min(8, args.max_tokens)
            r = await stream_completion(client, url, {"prompt": text, "add_special_tokens": False, "max_tokens": m,
                                                      "temperature": 0, "ignore_eos": True})
            checked += 1
            same += int(list(ids) == list(p) and r["ids"] == refs[tuple(p)][:m])
        sem = asyncio.Semaphore(8)

        async def warm(p):
            async with sem:
                return await stream_completion(client, url, {"prompt": list(p), "max_tokens": args.max_tokens,
                                                             "temperature": 0, "ignore_eos": True})
        await asyncio.gather(*(warm(prompts[i % len(prompts)]) for i in range(args.warmup)))
    return {"text_prompts_matching": same, "checked": checked}


def start_setting(setting: str, stack: contextlib.ExitStack, tok, prompts, refs, args) -> dict:
    """Start the setting's server (kept up by `stack`), check its tokenisation and warm it up."""
    sargs = server_args(args.backend, args.max_batch_size, args.max_seq_len, setting)
    server = stack.enter_context(Server(sargs, name=f"serve[{setting}]", start_timeout=args.start_timeout))
    check = asyncio.run(tokenisation_check(server.url, tok, prompts, refs, args))
    log(f"{setting}: server tokenisation of text prompts matches the token ids: "
        f"{check['text_prompts_matching']}/{check['checked']}")
    return {"setting": setting, "server_args": sargs, "tokenisation": check, "points": [], "server": server}


def reference_setting(running: list[dict]) -> dict | None:
    """Whose burst latency sets every setting's Poisson rate: k=0 when it runs, else the first."""
    alive = [r for r in running if not r.get("error")]
    return next((r for r in alive if r["setting"] == "k=0"), alive[0] if alive else None)


def poisson_rate(running: list[dict], c: int, n: int, prompts, refs, args) -> float | None:
    """C / W, W the reference setting's mean latency at the burst point of concurrency c (measured
    now, unrecorded, when it did not run one)."""
    ref = reference_setting(running)
    if ref is None:
        return None
    burst = [p for p in ref["points"] if p["concurrency"] == c and p["arrival"] == "burst"]
    w = burst[0]["mean_latency_s"] if burst else asyncio.run(run_point(
        ref["server"].url, prompts, refs, c, n, "burst", None, args, point_rng(args, c, "burst")))["mean_latency_s"]
    return c / w


def run_interleaved(running: list[dict], prompts, refs, args) -> None:
    """Every point (concurrency x arrival), --repeats turns of every running setting (the order
    reversed at every other turn); a setting whose server dies is marked failed and left out of later
    points. A Poisson point offers every setting the same arrivals (poisson_rate)."""
    turn = 0
    for c in args.concurrency:
        n = num_requests(args, c)
        for arrival in args.arrivals:
            rate = poisson_rate(running, c, n, prompts, refs, args) if arrival == "poisson" else None
            runs: dict[str, list[dict]] = {r["setting"]: [] for r in running}
            orders = []
            for _ in range(args.repeats):
                order = running if turn % 2 == 0 else running[::-1]
                orders.append([o["setting"] for o in order])
                turn += 1
                for r in order:
                    if not r.get("error"):
                        run_setting(r, c, n, arrival, rate, prompts, refs, args, runs)
            for r in running:
                if runs[r["setting"]] and not r.get("error"):
                    point = merged(runs[r["setting"]])
                    point["setting"], point["orders"] = r["setting"], orders
                    r["points"].append(point)
                    acc = "-" if point["acceptance"] is None else f"{point['acceptance']:.2f}"
                    log(f"{r['setting']} c={c} {arrival}: {point['tok_s']:.1f} tok/s (runs "
                        f"{', '.join(f'{t:.0f}' for t in point['tok_s_runs'])}), mean latency "
                        f"{point['mean_latency_s']:.2f} s, response {point['mean_response_s']:.2f} s, TTFT p50 {point['ttft_p50_ms']:.0f} ms, acceptance {acc}, "
                        f"cycles by k {point['cycles_by_k']} ({point['switch_cycles']} after a switch, "
                        f"{point['switch_extra_s']:+.3f} s against their price; catch-ups {point['catch_up_s']:.3f} s), greedy-exact {point['greedy_exact']}/{point['requests']}")


def run_setting(r: dict, c: int, n: int, arrival: str, rate, prompts, refs, args, runs: dict) -> None:
    """One run of the point on setting r's server into runs[setting]; its failure marks r failed."""
    try:
        runs[r["setting"]].append(asyncio.run(run_point(r["server"].url, prompts, refs, c, n, arrival, rate, args,
                                                        point_rng(args, c, arrival))))
    except (OSError, httpx.HTTPError) as e:
        r["error"] = f"{type(e).__name__}: {e}"
    if not r["server"].alive():
        r["error"] = f"the server died:\n{r['server'].tail()}"
    if r.get("error"):
        log(f"{r['setting']}: FAILED at c={c} {arrival}: {r['error']}")
    elif runs[r["setting"]][-1]["num_errors"]:
        log(f"{r['setting']} c={c} {arrival}: {runs[r['setting']][-1]['num_errors']} errors: "
            f"{runs[r['setting']][-1]['errors'][0]}")


def merged(runs: list[dict]) -> dict:
    """One point from its repeats: the median tok/s and mean latency, TTFT/TPOT percentiles over
    every request, acceptance and cycles by k over all of them (the server's counters from before
    the first to after the last: only this point's requests ran on it in between), the rest summed."""
    pairs = [pair for run in runs for pair in run["ttft_tpot"]]
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    before, after = runs[0]["metrics_before"], runs[-1]["metrics_after"]
    return {"concurrency": runs[0]["concurrency"], "arrival": runs[0]["arrival"],
            "poisson_rate": runs[0]["poisson_rate"], "repeats": len(runs),
            "requests": sum(run["requests"] for run in runs),
            "output_tokens": sum(run["output_tokens"] for run in runs),
            "tok_s": statistics.median(run["tok_s"] for run in runs), "tok_s_runs": [run["tok_s"] for run in runs],
            "mean_latency_s": statistics.median(run["mean_latency_s"] for run in runs),
            "mean_latency_s_runs": [run["mean_latency_s"] for run in runs],
            "mean_response_s": statistics.median(run["mean_response_s"] for run in runs),
            "mean_response_s_runs": [run["mean_response_s"] for run in runs],
            "wall_s_runs": [run["wall_s"] for run in runs],
            "ttft_p50_ms": ms(percentile([a for a, _ in pairs], 50)),
            "ttft_p99_ms": ms(percentile([a for a, _ in pairs], 99)),
            "tpot_p50_ms": ms(percentile([b for _, b in pairs], 50)),
            "tpot_p99_ms": ms(percentile([b for _, b in pairs], 99)),
            "acceptance": acceptance(before, after), "cycles_by_k": cycles_by_k(before, after),
            **running_costs(before, after), "cycle_costs_ms": cycle_costs_ms(after), "greedy_exact": sum(run["greedy_exact"] for run in runs),
            "errors": [e for run in runs for e in run["errors"]][:5],
            "num_errors": sum(run["num_errors"] for run in runs)}


def point_rng(args, c: int, arrival: str) -> random.Random:
    """The point's requests (prompts, lengths, Poisson gaps): the same for every setting."""
    return random.Random(f"{args.seed}/{c}/{arrival}")


def fmt(v, spec=".0f"):
    return "-" if v is None else format(v, spec)


def paired_text(point: dict, ref: dict | None) -> str:
    """The point's tok/s over k=0's in the same repeat (the settings take turns in each): their
    median and its distribution-free 90% interval (from 5 repeats up)."""
    if ref is None or len(point["tok_s_runs"]) != len(ref["tok_s_runs"]):
        return "-"
    return median_text([a / b for a, b in zip(point["tok_s_runs"], ref["tok_s_runs"])])


def table(results) -> str:
    base = {(p["concurrency"], p["arrival"]): p for r in results if r["setting"] == "k=0" for p in r["points"]}
    head = (f"{'setting':<9} {'conc':>4} {'arrival':<8} {'tok/s':>8} {'vs k=0':>6} {'paired vs k=0 [90%]':>20} "
            f"{'response':>8} {'vs k=0':>6} "
            f"{'TTFT p50':>8} {'p99':>7} {'TPOT p50':>8} {'p99':>7} {'accept':>6} {'exact':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        for p in r["points"]:
            ref = base.get((p["concurrency"], p["arrival"]))
            lines.append(f"{r['setting']:<9} {p['concurrency']:>4} {p['arrival']:<8} {p['tok_s']:>8.1f} "
                         f"{fmt(ref and p['tok_s'] / ref['tok_s'], '.2f'):>6} {paired_text(p, ref):>20} "
                         f"{p['mean_response_s']:>8.2f} "
                         f"{fmt(ref and p['mean_response_s'] / ref['mean_response_s'], '.2f'):>6} "
                         f"{fmt(p['ttft_p50_ms']):>8} {fmt(p['ttft_p99_ms']):>7} "
                         f"{fmt(p['tpot_p50_ms'], '.1f'):>8} {fmt(p['tpot_p99_ms'], '.1f'):>7} "
                         f"{fmt(p['acceptance'], '.2f'):>6} {p['greedy_exact']:>4}/{p['requests']:<3}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    sigterm_as_interrupt()
    log(f"serve_load: settings {args.settings}, concurrency {args.concurrency}, arrivals {args.arrivals}, "
        f"backend {args.backend}, output tokens {args.min_tokens}..{args.max_tokens}")
    tok, base = load_tokenizer_and_base()
    prompts = held_out_prompts(tok, args.num_prompts, args.max_prompt_len)
    refs = hf_greedy(base, prompts, args.max_tokens)  # before any server runs
    del base
    results = []
    started = time.time()
    try:
        with contextlib.ExitStack() as stack:
            for setting in args.settings:
                try:
                    results.append(start_setting(setting, stack, tok, prompts, refs, args))
                except (RuntimeError, OSError, httpx.HTTPError) as e:  # this setting failed: on with the others
                    log(f"{setting}: FAILED to start: {type(e).__name__}: {e}")
                    results.append({"setting": setting, "error": f"{type(e).__name__}: {e}", "points": []})
            run_interleaved(results, prompts, refs, args)
    except KeyboardInterrupt:
        log("interrupted: servers stopped; writing what was measured")
    finally:
        for r in results:
            r.pop("server", None)
        summary = {"args": {k: v for k, v in vars(args).items()}, "results": results,
                   "elapsed_s": time.time() - started}
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
        log(f"wrote {args.out}")
    print(table(results))
    total = sum(p["requests"] for r in results for p in r["points"])
    exact = sum(p["greedy_exact"] for r in results for p in r["points"])
    print(f"greedy-exact overall: {exact}/{total}")
    failed = [r["setting"] for r in results if r.get("error")]
    if failed:
        print(f"settings that failed: {failed}")
    return 0 if exact == total and total > 0 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
