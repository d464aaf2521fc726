"""Structured output in the serving engine: each request's grammar (eagle_fx.structured), compiled
when the request is added (a bad schema, regex or grammar is an error then, before anything runs),
the masks of its first token and of each cycle's drafts and verify.

xgrammar is imported only when a request asks for a response_format (the `structured` extra)."""
from __future__ import annotations

import torch


class EngineGrammars:
    """The engine's grammar compilers (one per eos set: the grammar's stop tokens are the request's
    eos ids) over its tokenizer and the base's logits width."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compilers: dict[frozenset, object] = {}

    def state_for(self, params, eos: frozenset):
        """A GrammarState at the start of params.response_format's grammar, or None (no grammar)."""
        if params.response_format is None:
            return None
        from eagle_fx.structured.matcher import GrammarState

        return GrammarState(self.compiled(params.response_format, eos))

    def compiled(self, spec, eos: frozenset):
        """The xgrammar CompiledGrammar of a GrammarSpec for requests whose eos ids are `eos` (cached)."""
        if self.tokenizer is None:
            raise ValueError("a response_format needs the engine's tokenizer (Engine(model, tokenizer)): its grammar is "
                             "compiled against the token strings")
        if not eos:
            raise ValueError("a response_format needs an eos token: the grammar ends the output with one")
        compiler = self._compilers.get(eos)
        if compiler is None:
            from eagle_fx.structured.grammar import GrammarCompiler

            # JSON compactly, as xgrammar's separators write it: with any whitespace between tokens a
            # small model can write newlines until max_tokens (the bundled base does)
            compiler = self._compilers[eos] = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                              stop_token_ids=sorted(eos), any_whitespace=False)
        return compiler.compile(spec)

    def first_allowed(self, requests, device) -> torch.Tensor | None:
        """bool [n, V]: the tokens each request's first token may be (all for one without a
        grammar); None when none of them has one."""
        if all(r.grammar is None for r in requests):
            return None
        from eagle_fx.structured.bitmask import unpack_bitmask
        from eagle_fx.structured.cycle_masks import CycleMasks

        words = CycleMasks([r.grammar for r in requests], self.vocab_size, 0).draft_row(0, None)
        return unpack_bitmask(words.to(device), self.vocab_size)

    def cycle_masks(self, requests, num_drafts: int, stats=None):
        """The CycleMasks of a cycle of `requests` (those without a grammar get all-allowed rows);
        stats: the SpecDecodeStats that counts its cycles and host seconds."""
        from eagle_fx.structured.cycle_masks import CycleMasks

        return CycleMasks([r.grammar for r in requests], self.vocab_size, num_drafts, stats)


def commit(request, tokens: list[int]) -> None:
    """Advance the request's grammar over tokens it committed (every one was allowed by its masks)."""
    if request.grammar is not None and request.grammar.commit(tokens) != len(tokens):
        raise RuntimeError(f"request {request.request_id}: a committed token is not allowed by its grammar "
                           f"({tokens}): the masks and the matcher disagree")


@torch.no_grad()
def compile_grammar_cycles(engine) -> None:
    """Run each of the engine's cycles (every k it may choose) once under grammar masks, greedy, for
    one sequence and for two, so that a compiling backend compiles the grammar's cycle variants now
    and not inside the first structured request (inductor on 2 CPU cores: about a minute each).
    The rows are all-allowed (no grammar is compiled: xgrammar is still needed); the cycles write
    only blocks taken from the engine's pool and given back."""
    from eagle_fx.runtime.sampling import Sampler
    from eagle_fx.serving.cost_probe import cycle_inputs
    from eagle_fx.structured.cycle_masks import CycleMasks

    kv = engine.kv
    for batch in (1, 2)[:engine.model.options.max_batch_size]:
        blocks = kv.allocator.allocate(2 * batch)
        try:
            for k, cycle in engine.cycles.items():
                masks = CycleMasks([None] * batch, engine.grammars.vocab_size, k)
                cycle(engine.executor, Sampler(), *cycle_inputs(engine, blocks, batch, 1), masks=masks)
        finally:
            kv.allocator.release(blocks)
