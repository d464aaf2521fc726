"""Structured output: the grammar pieces a speculative cycle needs, one module each:

  response_format.py  what the user asked for (OpenAI response_format, vLLM guided_*) -> GrammarSpec
  grammar.py          GrammarSpec -> xgrammar CompiledGrammar for one tokenizer, cached; GrammarError
  matcher.py          GrammarState: a request's matcher at its committed output; the verify's masks
  bitmask.py          packed int32 bitmasks unpacked and applied in plain torch (inside graphs)
  cycle_masks.py      CycleMasks: one cycle's rows for a group of requests, filled as drafts come
  mask_op.py          the ops a cycle graph calls for its masks (the host's matchers called back)

Nothing is imported here: bitmask.py, mask_op.py and response_format.py work without xgrammar (the
optional `structured` extra), grammar.py, matcher.py and cycle_masks.py need it.
"""
