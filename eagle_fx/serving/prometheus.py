"""`engine.metrics()` as Prometheus text exposition (format 0.0.4), without prometheus_client.

Names are vLLM's with the `eagle_fx:` prefix (`eagle_fx:spec_decode_num_drafts_total`,
`eagle_fx:num_requests_running`, ...), each sample labelled with model_name as vLLM does, each
family with its `# HELP` and `# TYPE` lines. A key missing from the snapshot is left out (the
family is not written), so the exposition follows the engine's metrics as they grow.
"""
from __future__ import annotations

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (exposed name, type, engine.metrics() key, help)
SCALARS = (
    ("eagle_fx:num_requests_running", "gauge", "num_requests_running", "Number of requests in the running batch."),
    ("eagle_fx:num_requests_waiting", "gauge", "num_requests_waiting", "Number of requests waiting to be scheduled."),
    ("eagle_fx:kv_cache_blocks_used", "gauge", "kv_blocks_used", "KV cache blocks in use."),
    ("eagle_fx:kv_cache_blocks_total", "gauge", "kv_blocks_total", "KV cache blocks in the pool."),
    ("eagle_fx:num_spec_tokens_current", "gauge", "num_spec_tokens_current",
     "Draft tokens per step the engine runs now (adaptive speculation moves it)."),
    ("eagle_fx:spec_decode_num_drafts_total", "counter", "spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("eagle_fx:spec_decode_num_draft_tokens_total", "counter", "spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("eagle_fx:spec_decode_num_accepted_tokens_total", "counter", "spec_decode_num_accepted_tokens",
     "Number of accepted tokens."),
    ("eagle_fx:prompt_tokens_total", "counter", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("eagle_fx:generation_tokens_total", "counter", "generation_tokens_total", "Number of generation tokens processed."),
    ("eagle_fx:num_preemptions_total", "counter", "num_preemptions_total", "Cumulative number of preemptions."),
    ("eagle_fx:prefix_cache_hits_total", "counter", "prefix_cache_hit_tokens_total",
     "Prompt tokens served from the prefix cache."),
    ("eagle_fx:num_requests_structured", "gauge", "num_requests_structured",
     "Running requests under a grammar (response_format / guided_*)."),
    ("eagle_fx:grammar_cycles_total", "counter", "grammar_cycles_total",
     "Speculative cycles run under grammar masks."),
    ("eagle_fx:grammar_mask_seconds_total", "counter", "grammar_mask_seconds_total",
     "Host seconds the grammar matchers spent filling the masks of those cycles."),
    ("eagle_fx:k_switch_cycles_total", "counter", "switch_cycles_total",
     "Decode cycles whose k did not run in the step before (a switch of k, or the first cycle after a step "
     "without one; a grammar's cycles, which pay their masks, not counted): 20-30% slower in the engine alone "
     "on a CPU, about their price in a server, and not what adaptive speculation prices a k by."),
    ("eagle_fx:k_switch_seconds_total", "counter", "switch_seconds_total", "Seconds those cycles took."),
    ("eagle_fx:k_switch_priced_seconds_total", "counter", "switch_priced_seconds_total",
     "What adaptive speculation priced those cycles at (the difference from k_switch_seconds_total is what "
     "switching k cost beyond its prices: it may be negative)."),
    ("eagle_fx:draft_catch_up_seconds_total", "counter", "draft_catch_up_seconds_total",
     "Seconds of the draft's catch-up calls over tokens committed at k = 0 and prompts whose draft prefill "
     "was deferred (lazy draft prefill), before a cycle at k > 0."),
    ("eagle_fx:plain_check_ratio", "gauge", "plain_check_ratio",
     "Speculation's output tokens per request-second over plain decoding's, in adjacent epochs (the geometric "
     "mean of the last comparisons: the leading arm's, full or adaptive, or while plain decoding leads, those of the "
     "speculating arm closer to it); below 1 the engine decodes at k = 0, checking speculation now and then."),
)

# (exposed name, type, engine.metrics() key of a {label value: number} dict, label, help); a tuple of
# labels: a {(label value, ...): number} dict
LABELLED = (
    ("eagle_fx:request_success_total", "counter", "request_success_total", "finished_reason",
     "Count of finished requests, by finish reason."),
    ("eagle_fx:speculation_off", "gauge", "speculation_off", "reason",
     "Running requests with speculation switched off, by reason."),
    ("eagle_fx:speculation_off_events_total", "counter", "speculation_off_events_total", "reason",
     "Times speculation was switched off for a request, by reason."),
    ("eagle_fx:plain_check_epochs_total", "counter", "plain_check_epochs_total", "arm",
     "Decode epochs run by adaptive speculation's choices (arm adaptive), at k = 0 (arm plain) and at the largest k "
     "for every request (arm full), as its check against plain decoding ran them."),
    ("eagle_fx:decode_cycles_total", "counter", "cycles_by_k", "k",
     "Decode cycles run, by draft tokens per request k (0: plain decoding; adaptive speculation picks k per cycle)."),
    ("eagle_fx:step_outside_cycles_seconds", "gauge", "outside_seconds", "batch_size",
     "Seconds of a decode step outside its cycles, by running requests (adaptive speculation adds them to every k)."),
    ("eagle_fx:cycle_cost_seconds", "gauge", "cycle_cost_seconds", ("k", "batch_size"),
     "Seconds of one decode cycle at k for batch_size requests, at no attention keys, at each measured size (what "
     "adaptive speculation prices each k by: the median of recent cycles, or the startup probe's scaled; "
     "interpolated between sizes)."),
)


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _family(name: str, kind: str, help_text: str, samples: list[tuple[dict, object]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples]
    return lines


def render_metrics(metrics: dict, model_name: str | None = None) -> str:
    """The Prometheus text of one `engine.metrics()` snapshot."""
    base = {"model_name": model_name} if model_name is not None else {}
    lines: list[str] = []
    for name, kind, key, help_text in SCALARS:
        if metrics.get(key) is not None:
            lines += _family(name, kind, help_text, [(base, metrics[key])])
    used, total = metrics.get("kv_blocks_used"), metrics.get("kv_blocks_total")
    if used is not None and total:
        lines += _family("eagle_fx:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                         [(base, used / total)])
    per_pos = metrics.get("spec_decode_num_accepted_tokens_per_pos")
    if per_pos is not None:
        lines += _family("eagle_fx:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                         "Accepted tokens per draft position.",
                         [({**base, "position": str(i)}, n) for i, n in enumerate(per_pos)])
    for name, kind, key, labels, help_text in LABELLED:
        values = metrics.get(key)
        if values is not None:
            if isinstance(labels, str):
                labels, values = (labels,), {(k,): v for k, v in values.items()}
            lines += _family(name, kind, help_text, [({**base, **dict(zip(labels, k))}, v)
                                                     for k, v in sorted(values.items(), key=_numeric_key)])
    return "\n".join(lines) + "\n"


def _numeric_key(item):
    """Label values in order, numbers as numbers (batch size 2 before 16)."""
    return tuple((0, int(v), "") if v.isdigit() else (1, 0, v) for v in item[0])


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{labels}': value} of a text exposition (comments skipped); for tests and quick checks."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples
