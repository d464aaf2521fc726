"""`eagle-fx serve`: an OpenAI-compatible HTTP server over the pair (default: the bundled tiny pair).

`add_args(parser)` adds the flags to the subcommand's parser, `run(args)` checks them, loads and
compiles the pair, and serves it (eagle_fx.serving.server.serve) until interrupted, printing one
line to stderr once uvicorn listens.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

from eagle_fx.bundled import BUNDLED, check_pair_dirs, load_pair, pair_dirs

DESCRIPTION = ("Serve the pair (default: the bundled tiny pair) over HTTP with OpenAI's API: /v1/completions, "
               "/v1/chat/completions (stream or not), /v1/models, /health and /metrics (Prometheus, vLLM's "
               "spec-decode names under eagle_fx:). Requests are batched continuously by the serving engine.")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", help="HF base model folder with its tokenizer (default: the bundled base)")
    parser.add_argument("--eagle-dir", help="EAGLE draft folder (default: the bundled draft for --method)")
    parser.add_argument("--method", choices=["eagle", "eagle3"], default="eagle", help="the draft's kind")
    parser.add_argument("--backend", choices=["eager", "inductor"], default="inductor",
                        help="inductor compiles each cycle into one graph (faster decoding, about a minute to "
                             "compile); eager starts in seconds")
    parser.add_argument("--num-spec-tokens", type=int, default=3,
                        help="k, draft tokens per step at most (0: no speculation)")
    parser.add_argument("--speculation", choices=["adaptive", "fixed"], default="adaptive",
                        help="adaptive: the engine moves k in [0, --num-spec-tokens] with the batch and the "
                             "acceptance; fixed: always --num-spec-tokens")
    parser.add_argument("--adaptive-ks", default=None,
                        help="comma list of the k values adaptive speculation chooses from, e.g. 0,1,3 (0 is always "
                             "added; default: 0, 1 and --num-spec-tokens; each k is a compiled cycle, minutes of compile with inductor)")
    parser.add_argument("--plain-check", action=argparse.BooleanOptionalAction, default=True,
                        help="adaptive: check what its choices of k, the largest k for every request and plain "
                             "decoding (k = 0) deliver, in adjacent epochs of a fifth of a second, and decode with the "
                             "fastest (the largest k first; one epoch in up to 33 checks each other; "
                             "eagle_fx:plain_check_ratio in /metrics)")
    parser.add_argument("--admission", choices=["continuous", "waves"], default="continuous",
                        help="continuous: a request joins the running batch as soon as a slot and KV blocks are "
                             "free; waves: requests are admitted only when nothing runs, up to --max-batch-size at "
                             "once (the old wave runtime's policy, a baseline)")
    parser.add_argument("--split-by-length", action=argparse.BooleanOptionalAction, default=False,
                        help="run a step's batch as decode cycles of like context lengths where the cycle costs "
                             "measured at startup say that is cheaper (a cycle reads every row's keys as wide as its "
                             "longest row's; measured in a closed loop: 0.98-1.17x with a tenth of the prompts "
                             "long, 0.92-1.11x with short ones only); default one cycle of every running request "
                             "per step")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together at most")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="prompt + output tokens per request at most")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of a shared prompt prefix across requests")
    parser.add_argument("--prefill-chunk-size", type=int, default=256,
                        help="prompt tokens per prefill chunk (long prompts are prefilled in chunks)")
    parser.add_argument("--warm-up-structured", action="store_true",
                        help="compile the cycles that run under grammar masks (response_format / guided_*) before "
                             "listening, for every k the engine may choose: the first structured request then "
                             "compiles nothing (with inductor on a small CPU about a minute per k; needs the "
                             "'structured' extra)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients pass and /v1/models lists (default: the base folder's name)")
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                        help="uvicorn's log level (info logs each request)")


def check_args(args) -> None:
    """A SystemExit naming the bad flag, before any loading."""
    if args.num_spec_tokens < 0:
        raise SystemExit("eagle-fx serve: --num-spec-tokens must be >= 0")
    if args.max_batch_size < 1 or args.max_seq_len < 2 or args.prefill_chunk_size < 1:
        raise SystemExit("eagle-fx serve: --max-batch-size and --prefill-chunk-size must be >= 1, --max-seq-len >= 2")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"eagle-fx serve: --port {args.port}: not a port (0 to 65535)")
    adaptive_ks(args)
    if args.warm_up_structured and importlib.util.find_spec("xgrammar") is None:
        raise SystemExit("eagle-fx serve: --warm-up-structured needs xgrammar: pip install 'eagle-fx[structured]'")


def adaptive_ks(args):
    """--adaptive-ks as a sorted list of ints (None: the engine's default, 0, 1 and --num-spec-tokens)."""
    if getattr(args, "adaptive_ks", None) is None:
        return None
    try:
        ks = sorted({int(k) for k in args.adaptive_ks.split(",") if k.strip()})
    except ValueError:
        raise SystemExit(f"eagle-fx serve: --adaptive-ks {args.adaptive_ks!r}: not a comma list of ints") from None
    if not ks or ks[0] < 0 or ks[-1] > args.num_spec_tokens:
        raise SystemExit(f"eagle-fx serve: --adaptive-ks {args.adaptive_ks!r}: each k must be in 0..--num-spec-tokens "
                         f"({args.num_spec_tokens})")
    return ks


def speculation_setting(args):
    """What Engine(speculation=...) takes: "adaptive", or the fixed k."""
    if args.speculation == "fixed" or args.num_spec_tokens == 0:
        return args.num_spec_tokens
    return "adaptive"


def run(args) -> None:
    check_args(args)
    dirs = pair_dirs(args.model_dir, args.eagle_dir, args.method)
    check_pair_dirs(*dirs)
    import eagle_fx
    from eagle_fx.serving.server import serve

    model_name = args.served_model_name or (BUNDLED.name if args.model_dir is None else dirs[0].resolve().name)
    print(f"eagle-fx serve: loading {dirs[0]} + {dirs[1]}, compiling with backend {args.backend} ...", file=sys.stderr)
    tok, base, draft = load_pair(*dirs)
    model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, backend=args.backend,
                             max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                             prefill_chunk_size=args.prefill_chunk_size, prefix_caching=args.prefix_caching)
    speculation = speculation_setting(args)

    def ready(host: str, port: int) -> None:
        ks = adaptive_ks(args)
        spec = f"speculation {speculation}" + ((f", k in {ks}" if ks else f", k in {sorted({0, min(1, args.num_spec_tokens), args.num_spec_tokens})}")
                                               + f", plain check {'on' if args.plain_check else 'off'}"
                                               if speculation == "adaptive" else "")
        print(f"eagle-fx serve: ready on http://{host}:{port} (model {model_name}, backend {args.backend}, {spec}, "
              f"admission {args.admission}, length groups {'on' if args.split_by_length else 'off'}, "
              f"max batch {args.max_batch_size}, max seq len {args.max_seq_len}, "
              f"prefix caching "
              f"{'on' if args.prefix_caching else 'off'})", file=sys.stderr, flush=True)

    serve(model, tok, host=args.host, port=args.port, model_name=model_name, speculation=speculation,
          log_level=args.log_level, on_ready=ready,
          ks=adaptive_ks(args) if speculation == "adaptive" else None, admission=args.admission,
          warm_up_structured=args.warm_up_structured, split_by_length=args.split_by_length,
          plain_check=args.plain_check)  # returns after a signal
    print("eagle-fx serve: stopped", file=sys.stderr, flush=True)
