"""Structured output: the grammar pieces a speculative cycle needs, one module each:

  response_format.py  what the user asked for (OpenAI response_format, vLLM guided_*) -> GrammarSpec
  grammar.py          GrammarSpec -> xgrammar CompiledGrammar for one tokenizer, cached; GrammarError
  matcher.py          GrammarState: a request's matcher at its committed output; the verify's masks
  bitmask.py          packed int32 bitmasks unpacked and applied in plain torch (inside graphs)

Nothing is imported here: bitmask.py and response_format.py work without xgrammar (the optional
`structured` extra), grammar.py and matcher.py need it.
"""
