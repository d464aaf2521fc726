"""Soak test of `eagle-fx serve`: many requests, some abandoned mid-stream, some malformed.

One server (a subprocess; inductor by default, adaptive speculation) gets --num-requests requests
at --concurrency in flight: streamed greedy /v1/completions with ignore_eos and return_token_ids,
max_tokens drawn from --min-tokens..--max-tokens, prompts (token ids) from a pool of --num-prompts
held-out ShareGPT prompts whose HF greedy continuations are computed before the server starts.
--abort-frac of them close the stream after 1..3 chunks; --malformed-frac are malformed (cycling
over: invalid JSON, negative max_tokens, n=2, an unknown field, a prompt longer than the context),
each of which must get a 400.

Checks: the server process never dies and /health is ok at the end; every stream that ran to its
end has exactly HF's greedy tokens (nothing lost or duplicated) and finish_reason "length"; every
malformed request got a 400; at the end /metrics shows eagle_fx:kv_cache_blocks_used, running and
waiting at 0 (polled for a few seconds, aborts are handled at the engine's next step). The server's
RSS (VmRSS of its process) is sampled every --rss-every finished requests; the series and the
growth from request 200 to the end are printed. Exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx

from serve_common import (Server, acceptance, add_server_flags, cycles_by_k, get_metrics, held_out_prompts, hf_greedy,
                          load_tokenizer_and_base, log, metric, server_args, sigterm_as_interrupt, stream_completion)

MALFORMED = ("invalid_json", "negative_max_tokens", "n_2", "unknown_field", "prompt_too_long")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " (see the module docstring for the checks)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_server_flags(ap, max_batch_size=16, out="soak.json")
    ap.add_argument("--num-requests", type=int, default=1000, help="requests in all (malformed and aborted included)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    ap.add_argument("--min-tokens", type=int, default=8, help="max_tokens is drawn from --min-tokens..--max-tokens")
    ap.add_argument("--max-tokens", type=int, default=48, help="max_tokens is drawn from --min-tokens..--max-tokens")
    ap.add_argument("--abort-frac", type=float, default=0.10, help="share of requests abandoned after 1..3 chunks")
    ap.add_argument("--malformed-frac", type=float, default=0.05, help="share of malformed requests (must get 400)")
    ap.add_argument("--num-prompts", type=int, default=50, help="distinct held-out prompts (HF references each)")
    ap.add_argument("--setting", default="adaptive", help="the server's speculation: adaptive or k=N")
    ap.add_argument("--rss-every", type=int, default=100, help="sample the server's RSS every this many requests")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    return ap.parse_args(argv)


def plan(args, prompts) -> list[dict]:
    """The requests, in sending order: kind (ok | abort | malformed), prompt, max_tokens, ..."""
    rng = random.Random(args.seed)
    n = args.num_requests
    n_bad, n_abort = round(n * args.malformed_frac), round(n * args.abort_frac)
    kinds = ["malformed"] * n_bad + ["abort"] * n_abort + ["ok"] * (n - n_bad - n_abort)
    rng.shuffle(kinds)
    reqs, bad = [], 0
    for i, kind in enumerate(kinds):
        r = {"i": i, "kind": kind, "prompt": prompts[rng.randrange(len(prompts))],
             "max_tokens": rng.randint(args.min_tokens, args.max_tokens)}
        if kind == "abort":
            r["abort_after"] = rng.randint(1, 3)
        if kind == "malformed":
            r["malformed"] = MALFORMED[bad % len(MALFORMED)]
            bad += 1
        reqs.append(r)
    return reqs


def body(r: dict, args) -> dict:
    return {"prompt": list(r["prompt"]), "max_tokens": r["max_tokens"], "temperature": 0, "ignore_eos": True}


async def send_malformed(client, url, r, args) -> dict:
    b = {**body(r, args), "stream": True, "return_token_ids": True}
    kind = r["malformed"]
    if kind == "invalid_json":
        resp = await client.post(url + "/v1/completions", content=b'{"prompt": [1, 2, 3], "max_tokens": 4,',
                                 headers={"content-type": "application/json"})
    else:
        if kind == "negative_max_tokens":
            b["max_tokens"] = -5
        elif kind == "n_2":
            b["n"] = 2
        elif kind == "unknown_field":
            b["frobnicate"] = True
        elif kind == "prompt_too_long":
            b["prompt"] = (list(r["prompt"]) * (args.max_seq_len // len(r["prompt"]) + 2))[:args.max_seq_len + 8]
        resp = await client.post(url + "/v1/completions", json=b)
    return {"status": resp.status_code, "error": None if resp.status_code == 400 else resp.text[:300]}


async def soak(server: Server, refs, reqs, args) -> dict:
    url = server.url
    sem = asyncio.Semaphore(args.concurrency)
    rss, done = [(0, server.rss_mb())], [0]
    log(f"RSS before the first request: {rss[0][1]:.1f} MB")
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        before = await get_metrics(client, url)
        t0 = time.perf_counter()

        async def one(r):
            async with sem:
                try:
                    if r["kind"] == "malformed":
                        res = await send_malformed(client, url, r, args)
                    else:
                        res = await stream_completion(client, url, body(r, args), r.get("abort_after"))
                except Exception as e:  # noqa: BLE001 - recorded as this request's failure
                    res = {"status": None, "error": f"{type(e).__name__}: {e}"}
            res["req"] = r
            done[0] += 1
            if done[0] % args.rss_every == 0:
                rss.append((done[0], server.rss_mb()))
                alive = server.alive()
                log(f"{done[0]}/{len(reqs)} requests, {time.perf_counter() - t0:.0f} s, server RSS "
                    f"{rss[-1][1] if rss[-1][1] is not None else float('nan'):.1f} MB, alive {alive}")
            return res

        results = await asyncio.gather(*(one(r) for r in reqs))
        wall = time.perf_counter() - t0
        end_metrics, health, settle = None, None, time.perf_counter()
        try:
            for _ in range(50):  # aborts are taken at the engine's next step
                await asyncio.sleep(0.2)
                end_metrics = await get_metrics(client, url)
                if all(metric(end_metrics, f"eagle_fx:{n}") == 0 for n in
                       ("kv_cache_blocks_used", "num_requests_running", "num_requests_waiting")):
                    break
            health = (await client.get(url + "/health")).status_code
        except httpx.HTTPError as e:
            log(f"the server did not answer at the end: {type(e).__name__}: {e}")
        settle = time.perf_counter() - settle
    return {"results": results, "wall_s": wall, "rss": rss, "metrics_before": before, "metrics_end": end_metrics,
            "settle_s": settle, "health": health}


def check(out: dict, refs, server_alive: bool) -> dict:
    results = out["results"]
    ok = [r for r in results if r["req"]["kind"] != "malformed" and not r.get("aborted")]
    aborted = [r for r in results if r.get("aborted")]
    bad = [r for r in results if r["req"]["kind"] == "malformed"]
    exact, mismatches = 0, []
    for r in ok:
        want = refs[tuple(r["req"]["prompt"])][:r["req"]["max_tokens"]]
        if r.get("error") is None and r.get("status") == 200 and r["ids"] == want and r["finish_reason"] == "length":
            exact += 1
        elif len(mismatches) < 10:
            got = r.get("ids", [])
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mismatches.append({"i": r["req"]["i"], "status": r.get("status"), "error": r.get("error"),
                               "finish_reason": r.get("finish_reason"), "got_len": len(got), "want_len": len(want),
                               "first_diff": first, "got": got[first:first + 5], "want": want[first:first + 5]})
    errored = sum(1 for r in ok if r.get("error") is not None or r.get("status") != 200)
    aborted_prefix_ok = sum(1 for r in aborted if r["ids"] == refs[tuple(r["req"]["prompt"])][:len(r["ids"])])
    bad_400 = sum(1 for r in bad if r.get("status") == 400)
    bad_wrong = [{"kind": r["req"]["malformed"], "status": r.get("status"), "error": r.get("error")}
                 for r in bad if r.get("status") != 400][:10]
    m = out["metrics_end"] or {}
    end = {n: metric(m, f"eagle_fx:{n}") if m else None for n in ("kv_cache_blocks_used", "num_requests_running",
                                                                   "num_requests_waiting")}
    rss = out["rss"]
    at200 = next((mb for n, mb in rss if n >= 200), None)
    growth = (rss[-1][1] - at200) if at200 is not None and rss[-1][1] is not None else None
    tokens = sum(len(r.get("ids", [])) for r in results)
    checks = {"server_alive": server_alive, "health_ok_at_end": out["health"] == 200,
              "completed_exact": exact == len(ok), "malformed_all_400": bad_400 == len(bad),
              "kv_blocks_used_0": end["kv_cache_blocks_used"] == 0, "running_0": end["num_requests_running"] == 0,
              "waiting_0": end["num_requests_waiting"] == 0}
    return {"checks": checks, "passed": all(checks.values()), "completed": len(ok), "completed_exact": exact,
            "completed_errors": errored, "completed_wrong_tokens": len(ok) - exact - errored, "mismatches": mismatches, "aborted": len(aborted), "aborted_prefix_exact": aborted_prefix_ok,
            "aborts_planned": sum(1 for r in results if r["req"]["kind"] == "abort"),
            "malformed": len(bad), "malformed_400": bad_400, "malformed_wrong": bad_wrong, "end_metrics": end,
            "settle_s": out["settle_s"], "rss_mb_series": rss, "rss_growth_from_200_mb": growth,
            "wall_s": out["wall_s"], "output_tokens": tokens, "tok_s": tokens / out["wall_s"],
            "acceptance": acceptance(out["metrics_before"], m) if m else None,
            "cycles_by_k": cycles_by_k(out["metrics_before"], m) if m else None,
            "finished_by_reason": {k: v for k, v in m.items() if k.startswith("eagle_fx:request_success_total")}}


def main(argv=None) -> int:
    args = parse_args(argv)
    sigterm_as_interrupt()
    log(f"soak: {args.num_requests} requests at concurrency {args.concurrency}, backend {args.backend}, "
        f"setting {args.setting}")
    tok, base = load_tokenizer_and_base()
    prompts = held_out_prompts(tok, args.num_prompts, min(args.max_prompt_len, args.max_seq_len - args.max_tokens - 8))
    refs = hf_greedy(base, prompts, args.max_tokens)  # before the server starts
    del base
    reqs = plan(args, prompts)
    sargs = server_args(args.backend, args.max_batch_size, args.max_seq_len, args.setting)
    summary = {"args": vars(args), "server_args": sargs}
    try:
        with Server(sargs, name="soak-server", start_timeout=args.start_timeout) as server:
            out = asyncio.run(soak(server, refs, reqs, args))
            alive = server.alive()
            summary.update(check(out, refs, alive))
            if not alive:
                summary["server_log_tail"] = server.tail()
    except KeyboardInterrupt:
        log("interrupted: the server was stopped")
        return 130
    finally:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2, default=str)
        log(f"wrote {args.out}")
    s = summary
    if "checks" not in s:
        print("soak: no results (the run failed before its checks)")
        return 1
    print(f"soak: {args.num_requests} requests, concurrency {args.concurrency}, backend {args.backend}, "
          f"{s['wall_s']:.0f} s, {s['output_tokens']} output tokens ({s['tok_s']:.1f} tok/s), acceptance "
          f"{'-' if s['acceptance'] is None else format(s['acceptance'], '.2f')}, decode cycles by k {s['cycles_by_k']}")
    print(f"  completed streams exact vs HF greedy: {s['completed_exact']}/{s['completed']} (not exact: "
          f"{s['completed_errors']} ended with an error, {s['completed_wrong_tokens']} with wrong tokens)")
    print(f"  aborted mid-stream: {s['aborted']} (planned {s['aborts_planned']}; the rest finished within their "
          f"chunks), their partial output a prefix of HF greedy: {s['aborted_prefix_exact']}/{s['aborted']}")
    print(f"  malformed -> 400: {s['malformed_400']}/{s['malformed']}" +
          (f" wrong: {s['malformed_wrong']}" if s["malformed_wrong"] else ""))
    print(f"  end metrics (after {s['settle_s']:.1f} s): {s['end_metrics']}; finished by reason: "
          f"{s['finished_by_reason']}")
    print("  server RSS MB: " + ", ".join(f"{n}: {mb:.1f}" for n, mb in s["rss_mb_series"] if mb is not None))
    growth = s["rss_growth_from_200_mb"]
    print(f"  RSS growth from request 200 to the end: {'-' if growth is None else format(growth, '+.1f')} MB")
    for m in s["mismatches"]:
        print(f"  MISMATCH {m}")
    print(f"  checks: {s['checks']} -> {'PASS' if s['passed'] else 'FAIL'}")
    return 0 if s["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
