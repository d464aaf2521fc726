"""The serving engine under load without the HTTP server: adaptive vs fixed k=3 vs k=0, in one process.

bench/serve_load.py measures through `eagle-fx serve` (one server per setting, all kept up, the
settings taking turns at each point); its points move between runs by more than the settings
differ, mostly in the HTTP path (SSE events serialised through uvicorn and parsed by a client on
the same cores). This bench measures what the
engine itself decides and costs: one compiled pair at k=3 serves `Engine(model, "adaptive")` and
`Engine(model, 3)`, a pair compiled with num_spec_tokens=0 (no draft, as `eagle-fx serve
--speculation 0` compiles it) serves `Engine(plain, 0)`. At each concurrency C a closed loop keeps
C requests in flight (a new one is added as one finishes) until max(--min-requests, 4 C) requests
are done: held-out ShareGPT prompts, greedy, ignore_eos, output lengths uniform in
--min-tokens..--max-tokens (seeded, the same requests for every setting). The settings run
interleaved, --repeats rounds of (adaptive, k=3, k=0) per point, after an untimed warm-up of each.
In a round (--interleave steps, the default) every setting's closed loop runs at once, in turns of
--slice-seconds of one engine's steps, a different one first each round, and each is timed by its
own steps only: the machine's drift (seconds, against turns of a quarter second) falls on every
setting alike (the speculating pair's KV pool then holds every speculating setting's sequences).
--interleave runs: the settings' loops back to back, each timed by its wall clock.
--held-at-k0 adds "adaptive at k=0": adaptive speculation whose every cycle is held at k = 0 (it
still decides each step and defers its prompts' draft prefill), against the draft-less k=0: what
adaptive costs beside its choices of k (its choices' share is the rest of adaptive / k=0).
--held-at-full adds "adaptive full arm": adaptive speculation whose check runs every epoch in its full
arm (every speculating request at the largest k, no pick_k, no plain epochs; lazy draft prefill,
catch-ups and collapse detection as adaptive's), against the fixed largest k: what adaptive's
bookkeeping and its catch-ups cost (the rest of adaptive / k=K is its choices and its
check's epochs of the other arms).
--num-spec-tokens K (default 3) compiles the pair at k = K: adaptive then chooses among 0, 1 and K,
and "k=K" (the fixed largest k) runs beside "k=3" (the targets' baseline, on the same pair).
--pair-k0 adds a fourth setting, "k=0 pair": `Engine(model, 0)` on the speculating pair, plain decoding on
adaptive's own compile (a fixed k = 0 never drafts: no draft prefill), against the draft-less k=0 (a
compile of its own: inductor chooses each compile's GEMMs anew) and adaptive against it (what
adaptive's choices cost or gain on the same kernels); its prefill and cycle seconds against k=0's.
--eager-draft-prefill adds "adaptive eager": adaptive speculation with every prompt's draft prefill
at admission (lazy_draft_prefill=False), against adaptive's default (without prefix caching: lazy,
the draft's prefill deferred to its catch-up). --unchecked adds "adaptive unchecked": adaptive
speculation without its check against plain decoding (plain_check=False: every step runs pick_k's
choice), against adaptive's default.

Reported per point and setting: output tok/s (median over the repeats, every repeat in the JSON),
the ratios of the medians and the paired ratios (a setting's tok/s over another's in the same round,
so that the machine's drift between rounds cancels: their median and a distribution-free 90%
interval of it, from 5 rounds up), the seconds in prefill calls and in decode cycles, the cycles each ran at each k,
the speculation-off events by reason (adaptive: "cost", a step that chose k = 0 after one at k > 0, explorations of k = 0 included;
"acceptance_collapse", a request's acceptance fell below the threshold; "plain_check", an epoch of plain
decoding began, eagle_fx.serving.plain_check), adaptive's epochs per arm, and greedy-exact n/n (every output against HF `generate(do_sample=False)` of its prompt). Prefix
caching is off (a repeat would otherwise reuse the blocks of the one before).

    python bench/engine_load.py                       # about 14 minutes on a 2-core CPU
    python bench/engine_load.py --concurrency 1,16 --repeats 3
    python bench/engine_load.py --concurrency 4,16 --repeats 3 --pair-k0
    python bench/engine_load.py --concurrency 4,16,64 --eager-draft-prefill
    python bench/engine_load.py --concurrency 4 --held-at-k0
    python bench/engine_load.py --concurrency 1,16 --held-at-full
    python bench/engine_load.py --concurrency 4,64 --unchecked
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter

from serve_common import held_out_prompts, hf_greedy, log, median_interval, median_text

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " (see the module docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--eagle-dir", default=None, help="EAGLE draft folder for the bundled base (default: the bundled "
                    "EAGLE-1 draft; models/tiny-sharegpt/eagle-v256 is it with a 256-token vocabulary)")
    ap.add_argument("--backend", choices=["eager", "inductor"], default="inductor", help="compile backend")
    ap.add_argument("--max-batch-size", type=int, default=64, help="the models' max_batch_size")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="the models' max_seq_len")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma list of concurrency levels")
    ap.add_argument("--min-requests", type=int, default=64, help="requests per point: max(this, 4 * concurrency)")
    ap.add_argument("--min-tokens", type=int, default=32, help="output tokens per request: uniform in "
                    "--min-tokens..--max-tokens (ignore_eos)")
    ap.add_argument("--max-tokens", type=int, default=96, help="see --min-tokens")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds of every setting per point "
                    "(5 or more for an interval of the paired ratios' median)")
    ap.add_argument("--num-prompts", type=int, default=128, help="distinct held-out prompts (requests cycle over them)")
    ap.add_argument("--max-prompt-len", type=int, default=512, help="skip longer held-out prompts (tokens)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths and the prompt order")
    ap.add_argument("--num-spec-tokens", type=int, default=3, help="the pair's k (adaptive's largest; default 3): "
                    'another value than 3 adds "k=K", the fixed largest k, beside the fixed "k=3" (the targets\' '
                    "baseline)")
    ap.add_argument("--pair-k0", action="store_true", help='also run "k=0 pair": k=0 on the speculating pair (adaptive\'s '
                    "compile; no draft prefill), against the draft-less k=0, and adaptive against it")
    ap.add_argument("--held-at-k0", action="store_true", help='also run "adaptive at k=0": adaptive whose every '
                    "cycle is held at k = 0, against the draft-less k=0 (adaptive's costs beside its choices)")
    ap.add_argument("--held-at-full", action="store_true", help='also run "adaptive full arm": adaptive whose '
                    "check runs its full arm in every epoch (the largest k, no pick_k, no plain epochs), against the "
                    "fixed largest k (what adaptive costs beside its choices and its check)")
    ap.add_argument("--eager-draft-prefill", action="store_true", help='also run "adaptive eager": adaptive '
                    "with lazy_draft_prefill=False (every prompt's draft prefill at admission), against adaptive")
    ap.add_argument("--unchecked", action="store_true", help='also run "adaptive unchecked": adaptive without '
                    "its check against plain decoding (plain_check=False), against adaptive")
    ap.add_argument("--split-by-length", action=argparse.BooleanOptionalAction, default=False,
                    help="every engine's length groups (a step's batch as cycles of like context lengths where priced "
                         "cheaper; eagle_fx.serving.length_groups)")
    ap.add_argument("--interleave", choices=["steps", "runs"], default="steps",
                    help="steps: in each round the settings' closed loops run at once, in turns of "
                         "--slice-seconds of one engine's steps, each timed by its own steps; runs: "
                         "each round runs the settings' loops back to back")
    ap.add_argument("--slice-seconds", type=float, default=0.25, help="--interleave steps: an engine's turn (its "
                    "steps until it has run this long)")
    ap.add_argument("--out", default="engine_load.json", help="JSON results")
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not 1 <= args.min_tokens <= args.max_tokens:
        ap.error("--min-tokens must be >= 1 and <= --max-tokens")
    if min(args.concurrency) < 1 or args.repeats < 1:
        ap.error("--concurrency and --repeats must be >= 1")
    if args.num_spec_tokens < 3:
        ap.error("--num-spec-tokens must be >= 3 (the fixed k=3 setting runs on the pair)")
    return args


class Timed:
    """Seconds an engine spends in its prefill calls and its decode cycles, and its cycles by k
    (wrapped methods: Engine._cycle(k, group, outputs))."""

    def __init__(self, engine):
        self.seconds, self.cycles_by_k = Counter(), Counter()
        for name in ("_prefill_chunk", "_cycle"):
            setattr(engine, name, self._wrap(name, getattr(engine, name)))

    def clear(self) -> None:
        self.seconds.clear()
        self.cycles_by_k.clear()

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            if name == "_cycle":
                self.cycles_by_k[args[0]] += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
        return timed


RATIOS = (("adaptive", "k=0"), ("adaptive", "k=3"), ("k=3", "k=0"))
EXTRA_RATIOS = (("adaptive", "k=0 pair"), ("k=0 pair", "k=0"), ("adaptive at k=0", "k=0"), ("adaptive eager", "k=0"),
                ("adaptive", "adaptive eager"), ("adaptive", "adaptive unchecked"), ("adaptive unchecked", "k=0"))
CONFIDENCE = 0.9


def ratio_pairs(k_max: int) -> tuple:
    """The paired ratios reported: RATIOS, adaptive and k=0 against the fixed largest k when it is not
    3, EXTRA_RATIOS, then the full arm against the fixed largest k and adaptive against the full arm."""
    largest = (("adaptive", f"k={k_max}"), (f"k={k_max}", "k=0")) if k_max != 3 else ()
    full_arm = (("adaptive full arm", f"k={k_max}"), ("adaptive", "adaptive full arm"))
    return RATIOS + largest + EXTRA_RATIOS + full_arm


def paired(runs: dict, a: str, b: str) -> dict:
    """a's tok/s over b's in each round (a drift of the machine between rounds cancels), with the
    median of those ratios and its distribution-free interval (serve_common.median_interval)."""
    ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(runs[a], runs[b])]
    bounds = median_interval(ratios, CONFIDENCE)
    return {"per_round": ratios, "median": statistics.median(ratios),
            "interval": None if bounds is None else list(bounds[1:])}


def adaptive_held_at_zero(model, tokenizer, **kwargs):
    """An adaptive engine whose every cycle runs at k = 0: it still decides each step (pick_k runs,
    its costs are kept) and defers its prompts' draft prefill (lazy), so against the draft-less k=0
    it shows what adaptive speculation costs beside its choices of k (its check against plain decoding
    off: its plain epochs would skip pick_k)."""
    from eagle_fx.serving.engine import Engine

    class AdaptiveHeldAtZero(Engine):
        def pick_k(self, spec, off):
            super().pick_k(spec, off)
            return 0, False

    return AdaptiveHeldAtZero(model, tokenizer, "adaptive", plain_check=False, **kwargs)


def adaptive_full_arm(model, tokenizer, **kwargs):
    """An adaptive engine whose check against plain decoding runs its full arm in every epoch: every
    speculating request at the largest k, pick_k never asked, no plain or adaptive epochs; lazy draft
    prefill as adaptive's (deferred to a catch-up for prompts admitted before it speculates) and its
    requests' acceptance watched as adaptive's. Against the fixed largest k it shows what adaptive
    speculation costs beside its choices and its check."""
    from eagle_fx.serving.engine import Engine
    from eagle_fx.serving.plain_check import FULL, PlainCheck

    class FullArm(PlainCheck):
        def arm_for(self, in_flight: int) -> str:
            return FULL

        def record(self, tokens: int, seconds: float, running: int, in_flight: int | None = None) -> None:
            self._seconds += seconds  # (epochs counted for the report; nothing is compared)
            if self._seconds >= self.epoch_seconds:
                self.epochs[FULL] += 1
                self._seconds = 0.0

    engine = Engine(model, tokenizer, "adaptive", **kwargs)
    engine.plain_check = FullArm(engine.plain_check.epoch_seconds)
    return engine


def requests_for(prompts, n: int, args, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(prompts[rng.randrange(len(prompts))], rng.randint(args.min_tokens, args.max_tokens)) for _ in range(n)]


class ClosedLoop:
    """c requests of `requests` in flight on one engine (a new one added as one finishes), stepped by
    the caller: step() runs one engine step and its client work, timed into `seconds`."""

    def __init__(self, engine, timed: Timed, requests, c: int):
        from eagle_fx.serving.requests import SamplingParams

        self.engine, self.timed, self.params = engine, timed, SamplingParams
        self.pending, self.outputs, self.ids, self.seconds = iter(enumerate(requests)), {}, {}, 0.0
        timed.clear()
        self.off_before, self.catch_up_before = dict(engine.off_events), engine.catch_up_seconds
        self.check = getattr(engine, "plain_check", None)  # (adaptive's check against plain decoding)
        self.epochs_before = dict(self.check.epochs) if self.check is not None else {}
        started = time.perf_counter()
        for _ in range(c):
            self._add()
        self.seconds += time.perf_counter() - started

    def _add(self) -> None:
        item = next(self.pending, None)
        if item is not None:
            i, (prompt, length) = item
            self.ids[self.engine.add_request(prompt, self.params(max_tokens=length, ignore_eos=True))] = i

    def done(self) -> bool:
        return not self.engine.has_unfinished()

    def step(self) -> None:
        started = time.perf_counter()
        for out in self.engine.step():
            if out.finished:
                self.outputs[self.ids.pop(out.request_id)] = list(out.token_ids)
                self._add()
        self.seconds += time.perf_counter() - started

    def result(self) -> dict:
        tokens, engine, timed = sum(len(o) for o in self.outputs.values()), self.engine, self.timed
        return {"tok_s": tokens / self.seconds, "wall_s": self.seconds, "output_tokens": tokens,
                "outputs": self.outputs, "prefill_s": timed.seconds["_prefill_chunk"],
                "cycles_s": timed.seconds["_cycle"], "catch_up_s": engine.catch_up_seconds - self.catch_up_before,
                "cycles_by_k": dict(sorted(timed.cycles_by_k.items())),
                "off_events": {reason: n - self.off_before[reason] for reason, n in engine.off_events.items()
                               if n > self.off_before[reason]},
                "plain_check_epochs": {arm: n - self.epochs_before[arm] for arm, n in self.check.epochs.items()}
                if self.check is not None else {}}


def closed_loop(engine, timed: Timed, requests, c: int) -> dict:
    """Keep c requests in flight until every one of `requests` is done."""
    loop = ClosedLoop(engine, timed, requests, c)
    while not loop.done():
        loop.step()
    return loop.result()


def step_interleaved(engines: dict, timers: dict, requests, c: int, order: list[str], slice_seconds: float) -> dict:
    """Every engine's closed loop at once, in turns (`order`) of steps of one engine until it has run
    `slice_seconds` (one step at least), until all are done; each timed by its own steps, so the
    machine's drift, slow against a turn, falls on every setting alike. (A turn of one step would leave
    every step's caches to the other engines' graphs: a cost none has alone, and adaptive speculation
    would price it.) An engine's measure of the time between its steps (Engine.outside, a cost adaptive
    speculation prices) is kept to its own: the other engines' turns are taken out of it."""
    loops = {name: ClosedLoop(engines[name], timers[name], requests, c) for name in order}
    while True:
        live = [name for name in order if not loops[name].done()]
        if not live:
            return {name: loop.result() for name, loop in loops.items()}
        for name in live:
            loop, started = loops[name], time.perf_counter()
            until = loop.seconds + slice_seconds
            loop.step()
            while loop.seconds < until and not loop.done():
                loop.step()
            turn = time.perf_counter() - started
            for other in live:  # this turn is not time the others spent between their steps
                if other != name and engines[other]._step_ended is not None:
                    engines[other]._step_ended += turn


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import eagle_fx
    from eagle_fx.bundled import check_pair_dirs, load_pair, pair_dirs
    from eagle_fx.serving.engine import Engine

    log(f"engine load: concurrency {args.concurrency}, {args.repeats} interleaved repeats, backend {args.backend}, "
        f"lengths {args.min_tokens}..{args.max_tokens}, length groups {'on' if args.split_by_length else 'off'}, "
        f"torch threads {torch.get_num_threads()}")
    dirs = pair_dirs(None, args.eagle_dir)
    check_pair_dirs(*dirs)
    tok, base, draft = load_pair(*dirs)
    log(f"draft: {dirs[1]}")
    prompts = held_out_prompts(tok, args.num_prompts, args.max_prompt_len)
    refs = hf_greedy(base, prompts, args.max_tokens)
    t0 = time.perf_counter()
    common = dict(backend=args.backend, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len)
    k_max = args.num_spec_tokens
    extra = (args.pair_k0, args.eager_draft_prefill, args.held_at_k0, args.unchecked, args.held_at_full)
    speculating = 2 + (k_max != 3) + sum(extra)  # the settings on the pair
    # interleaved steps: they run at once on the one pair at k = K (the same kernels: each compile autotunes
    # its GEMMs anew), so its KV pool holds every one's sequences (a pool of one setting's, times theirs)
    model = eagle_fx.compile(base, draft, num_spec_tokens=k_max, **common)
    if args.interleave == "steps" and speculating > 1:
        model = model.replace(num_blocks=speculating * model.kv_cache.num_blocks)
    plain = eagle_fx.compile(base, draft, num_spec_tokens=0, **common)
    split = dict(split_by_length=args.split_by_length)
    engines = {"adaptive": Engine(model, tok, "adaptive", **split), "k=3": Engine(model, tok, 3, **split),
               "k=0": Engine(plain, tok, 0, **split)}
    if k_max != 3:
        engines[f"k={k_max}"] = Engine(model, tok, k_max, **split)
    if args.pair_k0:
        engines["k=0 pair"] = Engine(model, tok, 0, **split)
    if args.held_at_k0:
        engines["adaptive at k=0"] = adaptive_held_at_zero(model, tok, **split)
    if args.held_at_full:
        engines["adaptive full arm"] = adaptive_full_arm(model, tok, **split)
    if args.eager_draft_prefill:
        engines["adaptive eager"] = Engine(model, tok, "adaptive", lazy_draft_prefill=False, **split)
    if args.unchecked:
        engines["adaptive unchecked"] = Engine(model, tok, "adaptive", plain_check=False, **split)
    settings = list(engines)
    timers = {name: Timed(engine) for name, engine in engines.items()}
    log(f"compiled both pairs and probed adaptive's costs in {time.perf_counter() - t0:.0f} s")
    for name, engine in engines.items():  # untimed: every compiled cycle's first calls, one and many sequences
        for c in sorted({1, min(4, args.max_batch_size), min(16, args.max_batch_size)}):
            closed_loop(engine, timers[name], requests_for(prompts, c + 2, args, seed=99), c)
    points, all_exact = [], True
    for c in args.concurrency:
        n = max(args.min_requests, 4 * c)
        requests = requests_for(prompts, n, args, seed=args.seed + c)
        runs = {name: [] for name in settings}
        for rep in range(args.repeats):
            order = settings[rep % len(settings):] + settings[:rep % len(settings)]  # each goes first in turn
            if args.interleave == "steps":
                results = step_interleaved(engines, timers, requests, c, order, args.slice_seconds)
            else:
                results = {name: closed_loop(engines[name], timers[name], requests, c) for name in order}
            for name in order:
                r = results[name]
                r["exact"] = sum(1 for i, (p, length) in enumerate(requests)
                                 if r["outputs"].get(i) == refs[tuple(p)][:length])
                all_exact &= r["exact"] == n
                del r["outputs"]
                runs[name].append(r)
                log(f"c={c} {name} #{rep + 1}: {r['tok_s']:.1f} tok/s (prefill {r['prefill_s']:.2f} s, cycles "
                    f"{r['cycles_s']:.2f} s, draft catch-ups {r['catch_up_s']:.2f} s, cycles by k {r['cycles_by_k']}, "
                    f"speculation-off events {r['off_events']}, plain-check epochs {r['plain_check_epochs']}), "
                    f"greedy-exact {r['exact']}/{n}")
        med = {name: statistics.median(r["tok_s"] for r in runs[name]) for name in settings}
        ratios = {f"{a}/{b}": paired(runs, a, b) for a, b in ratio_pairs(k_max) if a in runs and b in runs}
        points.append({"concurrency": c, "requests": n, "median_tok_s": med, "paired_ratios": ratios, "runs": runs})
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "points": points}, f, indent=2)
    log(f"wrote {args.out}")
    print(f"{'conc':>4} {'adaptive':>9} {'k=3':>8} {'k=0':>8} {'ad/k=0':>7} {'ad/k=3':>7} {'k=3/k=0':>7}  "
          "adaptive's cycles by k; its speculation-off events")
    for p in points:
        m = p["median_tok_s"]
        ks, off = Counter(), Counter()
        for r in p["runs"]["adaptive"]:
            ks.update(r["cycles_by_k"])
            off.update(r["off_events"])
        print(f"{p['concurrency']:>4} {m['adaptive']:>9.1f} {m['k=3']:>8.1f} {m['k=0']:>8.1f} "
              f"{m['adaptive'] / m['k=0']:>7.2f} {m['adaptive'] / m['k=3']:>7.2f} {m['k=3'] / m['k=0']:>7.2f}  "
              f"{dict(sorted(ks.items()))}; {dict(off)}")
    if args.pair_k0:
        print(f"{'conc':>4} {'k=0 pair / k=0':>15}  prefill s (k=0 pair / k=0)  cycles s (k=0 pair / k=0)")
        for p in points:
            spec, plain_runs = p["runs"]["k=0 pair"], p["runs"]["k=0"]
            seconds = {key: [statistics.median(r[key] for r in runs) for runs in (spec, plain_runs)]
                       for key in ("prefill_s", "cycles_s")}
            print(f"{p['concurrency']:>4} {p['median_tok_s']['k=0 pair'] / p['median_tok_s']['k=0']:>15.2f}  "
                  f"{seconds['prefill_s'][0]:>10.3f} / {seconds['prefill_s'][1]:<10.3f}      "
                  f"{seconds['cycles_s'][0]:>8.3f} / {seconds['cycles_s'][1]:.3f}")
    how = "stepped in turn" if args.interleave == "steps" else "back to back"
    print(f"\npaired ratios: per round (the settings' loops {how}, each first in turn), their median "
          f"[{CONFIDENCE:.0%} interval of the median]")
    shown = [pair for pair in ratio_pairs(k_max) if f"{pair[0]}/{pair[1]}" in points[0]["paired_ratios"]]
    print(f"{'conc':>4} " + " ".join(f"{a + ' / ' + b:>26}" for a, b in shown))
    for p in points:
        ratios = [p["paired_ratios"][f"{a}/{b}"]["per_round"] for a, b in shown]
        print(f"{p['concurrency']:>4} " + " ".join(f"{median_text(r, CONFIDENCE):>26}" for r in ratios))
    print(f"medians of {args.repeats} rounds per setting ({args.backend}, lengths {args.min_tokens}.."
          f"{args.max_tokens}, prefix caching off); greedy-exact in every run: {all_exact}")
    return 0 if all_exact else 1


if __name__ == "__main__":
    sys.exit(main())
