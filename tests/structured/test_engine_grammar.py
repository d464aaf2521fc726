"""Structured output under speculation against its oracle: the engine's greedy output under a
grammar (a JSON schema, a regex, an EBNF grammar, json_object), drafts masked, equals HF greedy
generate with xgrammar's logits processor for the same compiled grammar (fp32, token for token),
batched with each other and with a request without a grammar (which equals plain HF greedy)."""
import itertools
import json

import pytest
import torch

pytest.importorskip("xgrammar", reason="structured output is the optional 'structured' extra")

import eagle_fx  # noqa: E402
from eagle_fx.bundled import load_pair, pair_dirs  # noqa: E402
from eagle_fx.serving import Engine, SamplingParams  # noqa: E402
from eagle_fx.structured.grammar import GrammarError  # noqa: E402
from eagle_fx.structured.response_format import GrammarSpec  # noqa: E402

from .conftest import EOS  # noqa: E402
from .hf_oracle import hf_grammar_greedy  # noqa: E402
from .schema_check import schema_errors  # noqa: E402
from .test_hf_oracle import PET  # noqa: E402

SPECS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}},
    "json_object": {"type": "json_object"},
    "regex": GrammarSpec("regex", r"(yes|no), because [a-z ]{1,40}\."),
    "ebnf": GrammarSpec("ebnf", 'root ::= "The answer is " num "."\nnum ::= [0-9]+ | "forty-two"'),
}
TEXTS = ["Describe a pet as JSON:", "Is the sky blue?", "Hello, how are you?", "Write a poem about the sea"]


@pytest.fixture(scope="module")
def pair():
    tok, base, draft = load_pair(*pair_dirs())
    return tok, base, draft, [tok(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def model(pair):
    tok, base, draft, _ = pair
    return eagle_fx.compile(base, draft, num_spec_tokens=3, backend="eager", max_batch_size=4, max_seq_len=512)


def finish(engine, ids):
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.mark.parametrize("speculation", [3, "adaptive"])
def test_greedy_under_each_grammar_equals_hf_with_xgrammar_s_logits_processor(pair, model, speculation):
    tok, base, _, prompts = pair
    engine = Engine(model, tok, speculation=speculation)
    max_tokens = 96
    requests = [(prompts[i % len(prompts)], name) for i, name in enumerate(SPECS)] + [(prompts[3], None)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, response_format=SPECS.get(name)))
           for p, name in requests]
    outs = finish(engine, ids)
    for (prompt, name), out, rid in zip(requests, outs, ids):
        if name is None:  # batched beside the grammars, without one: plain HF greedy
            want = base.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
            assert out.token_ids == want
            continue
        compiled = engine.grammars.compiled(SamplingParams(response_format=SPECS[name]).response_format,
                                            frozenset({EOS}))
        assert out.token_ids == hf_grammar_greedy(base, prompt, compiled, max_tokens, EOS), name
        if name.startswith("json") and out.finish_reason == "stop":
            value = json.loads(tok.decode(out.token_ids[:-1]))
            assert schema_errors(value, PET) == [] if name == "json_schema" else isinstance(value, dict)
    assert engine.metrics()["kv_blocks_used"] == 0
    if speculation == 3:  # speculation stayed on under the grammars, and paid
        assert engine.stats.num_accepted_tokens > 0


def test_a_grammar_s_cycles_are_neither_priced_nor_counted_as_switches(pair, model):
    """A cycle under a grammar pays its masks' host time: it prices no k, and the first cycle after a
    switch of k, when under a grammar, is not counted with the switches either (it was, priced at its k's
    unmasked cost). Oracle: k alternating 0 and 3 every step (every cycle a switch), nothing measured (the
    costs' observe a recorder): requests under a grammar -> no switch cycle and nothing measured; the same
    requests without one -> every cycle a switch cycle, nothing measured; every output equals HF's."""
    tok, base, _, prompts = pair
    for spec in (SPECS["regex"], None):
        # (the check against plain decoding off: its plain epochs would skip the scripted pick_k)
        engine = Engine(model, tok, speculation="adaptive", ks=[0, 3], measure=False, plain_check=False)
        observed, turns, cycles = [], itertools.count(), itertools.count()
        engine.costs.observe = lambda *args, **kwargs: observed.append(args)
        engine.pick_k = lambda spec_, off: ((0, 3)[next(turns) % 2], False)
        run_cycle = engine._cycle
        engine._cycle = lambda k, group, outputs: (next(cycles), run_cycle(k, group, outputs))
        ids = [engine.add_request(p, SamplingParams(max_tokens=24, response_format=spec)) for p in prompts[:2]]
        for prompt, out in zip(prompts[:2], finish(engine, ids)):
            if spec is None:
                want = base.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                     eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
            else:
                want = hf_grammar_greedy(base, prompt, engine.grammars.compiled(
                    SamplingParams(response_format=spec).response_format, frozenset({EOS})), 24, EOS)
            assert out.token_ids == want
        ran = next(cycles)
        assert ran > 4 and observed == []
        assert engine.metrics()["switch_cycles_total"] == (0 if spec is not None else ran)


def test_bad_grammars_are_errors_when_added(pair, model):
    tok, _, _, prompts = pair
    engine = Engine(model, tok, speculation=3)
    for spec, match in [(GrammarSpec("regex", "(unclosed"), "regex"),
                        ({"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}, "schema"),
                        (GrammarSpec("ebnf", "root ::= undefined_rule"), "grammar|ebnf|EBNF")]:
        with pytest.raises(GrammarError, match=match):
            engine.add_request(prompts[0], SamplingParams(response_format=spec))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(response_format={"type": "json_object"}, ignore_eos=True)
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(model, speculation=3).add_request(prompts[0], SamplingParams(response_format={"type": "json_object"}))
    assert not engine.has_unfinished()


def test_generate_takes_a_response_format(pair, model):
    """model.generate(response_format=..., tokenizer=...): the same oracle; without the tokenizer, or
    on a draft tree, a clear error before decoding."""
    tok, base, draft, prompts = pair
    spec = GrammarSpec("regex", r"(yes|no), because [a-z ]{1,40}\.")
    out = model.generate([prompts[1], prompts[2]], max_new_tokens=40, response_format=spec, tokenizer=tok)
    compiled = Engine(model, tok, speculation=3).grammars.compiled(spec, frozenset({EOS}))
    for prompt, seq in zip(prompts[1:3], out.sequences):
        assert seq == hf_grammar_greedy(base, prompt, compiled, 40, EOS)
    assert out.stats.grammar_cycles > 0
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate([prompts[0]], max_new_tokens=4, response_format=spec)
    with pytest.raises(ValueError, match="eos"):
        model.generate([prompts[0]], max_new_tokens=4, response_format=spec, tokenizer=tok, eos_token_id=None)
    tree = eagle_fx.compile(base, draft, num_spec_tokens=2, backend="eager", max_batch_size=1, max_seq_len=128,
                            draft_tree=dict(top_k=2, depth=2, total_tokens=4))
    with pytest.raises(ValueError, match="draft tree"):
        tree.generate([prompts[0]], max_new_tokens=4, response_format=spec, tokenizer=tok)


def test_a_compiled_cycle_under_a_grammar_is_one_graph_with_the_mask_ops_inside(pair):
    """With a compiled chain cycle (here dynamo with fullgraph and a backend that runs what it
    traced), a cycle under grammar masks is one traced graph whose masks come from the grammar ops
    inside it (eagle_fx.structured.mask_op: the host's matchers called back from the graph), for a
    batch of grammar requests and one without: the same oracles."""
    from test_chain_cycle import traced_chain_cycle  # (tests/ is on the path: no __init__.py there)

    tok, base, draft, prompts = pair
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, backend="eager", max_batch_size=3, max_seq_len=512)
    model.chain_cycle, traced = traced_chain_cycle(model, 3)
    engine = Engine(model, tok, speculation=3)
    spec = SPECS["regex"]
    formats = [spec, spec, None]
    ids = [engine.add_request(p, SamplingParams(max_tokens=40, response_format=f))
           for p, f in zip(prompts[1:4], formats)]
    outs = finish(engine, ids)
    compiled = engine.grammars.compiled(spec, frozenset({EOS}))
    for prompt, out in zip(prompts[1:3], outs):
        assert out.token_ids == hf_grammar_greedy(base, prompt, compiled, 40, EOS)
    want = base.generate(torch.tensor([prompts[3]]), max_new_tokens=40, do_sample=False, eos_token_id=EOS,
                         pad_token_id=0)[0, len(prompts[3]):].tolist()
    assert outs[2].token_ids == want  # in the grammar's cycle, all-allowed rows: plain HF greedy
    assert engine.stats.grammar_cycles > 0
    # a graph per batch size and kind seen: the grammar's cycle at 3 and 2 sequences, then the free
    # text request alone in the plain cycle
    counts = []
    for gm in traced:
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        counts.append((targets.count("eagle_fx.grammar_draft_row.default"),
                       targets.count("eagle_fx.grammar_verify_rows.default")))
    assert (3, 1) in counts  # k = 3: rows 0..2 for the drafts, then the verify's k + 1 rows, in one graph
    assert set(counts) <= {(3, 1), (0, 0)}


def test_compiling_the_grammar_cycles_first_leaves_nothing_to_trace_for_structured_requests(pair):
    """compile_grammar_cycles (`eagle-fx serve --warm-up-structured`) runs every k's cycle under
    grammar masks for one sequence and for two: structured requests afterwards trace nothing new,
    give their blocks back, and still equal the oracle."""
    from test_chain_cycle import traced_chain_cycle

    from eagle_fx.serving.grammars import compile_grammar_cycles

    tok, base, draft, prompts = pair
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, backend="eager", max_batch_size=2, max_seq_len=512)
    model.chain_cycle, traced = traced_chain_cycle(model, 3)
    engine = Engine(model, tok, speculation=3)
    probed = len(traced)  # (a cost probe's unmasked cycles, if one ran)
    compile_grammar_cycles(engine)
    assert len(traced) == probed + 2 and engine.metrics()["kv_blocks_used"] == 0  # one sequence, and several
    spec = SPECS["ebnf"]
    ids = [engine.add_request(p, SamplingParams(max_tokens=24, response_format=spec)) for p in prompts[:2]]
    outs = finish(engine, ids)
    assert len(traced) == probed + 2
    compiled = engine.grammars.compiled(spec, frozenset({EOS}))
    for prompt, out in zip(prompts[:2], outs):
        assert out.token_ids == hf_grammar_greedy(base, prompt, compiled, 24, EOS)
