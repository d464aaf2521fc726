"""The exactness oracle of structured output (issue 28): Hugging Face greedy `generate` with
xgrammar's own HF logits processor (xgrammar.contrib.hf.LogitsProcessor, which works as is with
transformers 5.24) for the same compiled grammar. eagle_fx's greedy output under a grammar must
equal this token for token."""
import torch
import xgrammar as xgr
import xgrammar.contrib.hf


def hf_grammar_greedy(base, prompt: list[int], compiled: xgr.CompiledGrammar, max_new_tokens: int,
                      eos_token_id: int | list[int], pad_token_id: int = 0) -> list[int]:
    """The new tokens of HF greedy generate under `compiled` (one prompt, no padding; eos kept)."""
    processor = xgrammar.contrib.hf.LogitsProcessor(compiled)  # one per generate call: it holds the matcher
    with torch.no_grad():
        out = base.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=max_new_tokens, do_sample=False, logits_processor=[processor],
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    return out[0, len(prompt):].tolist()
