"""One request's place in its grammar, and the token bitmasks a speculative cycle needs from it.

A `GrammarState` wraps an xgrammar GrammarMatcher that sits at the request's committed output.
Each cycle:

    rows, valid = state.masks_for_chain(drafts)   # [k+1, W] int32: row j = mask after drafts[:j]
    ... verify with rows (eagle_fx.structured.bitmask.unpack_bitmask / mask_logits, on device) ...
    state.commit(accepted_tokens)                  # the accepted drafts and the bonus token

Bitmask layout (xgrammar's): int32 words, W = ceil(vocab_size / 32) per row; token t is allowed
when bit (t % 32) of word (t // 32) is 1 (bit 31 is the int32 sign bit). Bits past vocab_size in
the last word carry nothing and may be 1.

Termination: the matcher's stop tokens (GrammarCompiler's stop_token_ids, the base's eos ids) are
allowed only where the grammar is complete; accepting one terminates the grammar and no mask
exists after it. Rollback in xgrammar 0.2.8 is unlimited (max_rollback_tokens is deprecated and
always -1), so drafts of any length can be taken back.

Host cost per cycle, with k drafts of which the grammar allows the first a: a + 1 mask fills
(`fill_next_token_bitmask`), a token accepts (under 1 µs each), one rollback; then commit's
accepts. Measured on the bundled 2048-token vocabulary (one CPU core, xgrammar 0.2.8): a fill
costs about 1 µs at most states of a JSON schema, but up to ~120 µs inside a string with
maxLength (a bounded repetition is outside xgrammar's precomputed token masks);
masks_for_chain over 3 drafts, median 7 µs. Larger vocabularies cost more per fill. The rows
are written into a CPU tensor (pass a pinned `out` to copy it to the device without a sync).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from eagle_fx.structured.grammar import GrammarError

ALL_ALLOWED = -1  # an int32 word with all 32 bits set


class GrammarState:
    """A request's grammar matcher at its committed output.

    compiled: a grammar from GrammarCompiler.compile. The masks are `vocab_size` tokens wide (the
    compiler's vocab_size, the base's logits width), `width` int32 words per row.
    """

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.width = xgr.get_bitmask_shape(1, self.vocab_size)[1]
        self.stop_token_ids = tuple(self.matcher.stop_token_ids)

    @property
    def terminated(self) -> bool:
        """A stop token was committed where the grammar was complete: the output is finished."""
        return self.matcher.is_terminated()

    @property
    def completed(self) -> bool:
        """The committed output is a complete match of the grammar (a stop token may come next)."""
        return self.matcher.is_completed()

    def commit(self, tokens: Sequence[int]) -> int:
        """Advance over committed tokens in order; how many were accepted.

        Stops at the first token the grammar does not allow (so fewer than len(tokens) means the
        caller committed a token its masks forbade: a bug upstream) or after a stop token, which
        the grammar accepts only where it is complete and which terminates it.
        """
        for n, token in enumerate(tokens):
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                return n
        return len(tokens)

    def allowed_now(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bitmask row (int32 [width]) of the tokens allowed next, at the committed state."""
        row = self._rows(1, out if out is None else out.view(1, -1))
        self._fill(row, row.numpy(), 0)
        return row[0]

    def masks_for_chain(self, drafts: Sequence[int], out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """The verify's bitmask rows for a chain of drafts, and how many rows are real.

        Returns (rows int32 [len(drafts) + 1, width], valid). Row 0 is the mask at the committed
        state, row j the mask after drafts[:j]. The walk stops at the first draft the grammar does
        not allow (or after a stop token, which ends the grammar): rows from there on are
        all-allowed filler and `valid` counts the real rows before them (1 <= valid <= len+1).
        Filler is harmless: the verify masks the rejected draft's own row, so it cannot accept
        that draft, and nothing after it is used; all-allowed keeps a softmax over it finite.
        A real row allows nothing only where the grammar needs a character the vocabulary cannot
        spell; the next cycle's row 0 then raises GrammarError (as allowed_now does).
        The matcher is back at the committed state on return. `out`: a CPU int32 tensor of that
        shape to write into (e.g. pinned memory), else a new one.
        """
        rows = self._rows(len(drafts) + 1, out)
        words = rows.numpy()  # the same memory: numpy's scalar reads cost a tenth of torch's
        words[1:] = ALL_ALLOWED
        self._fill(rows, words, 0)
        accepted = 0
        valid = 1
        try:
            for j, token in enumerate(drafts, start=1):
                if not self.take_draft(int(token), words[j - 1]):
                    break
                accepted += 1
                if self.matcher.is_terminated():
                    break
                self.matcher.fill_next_token_bitmask(rows, j)
                valid += 1
        finally:
            if accepted:
                self.matcher.rollback(accepted)
        return rows, valid

    def take_draft(self, token: int, row) -> bool:
        """Accept a draft tentatively (the caller rolls it back) if `row` (the int32 words of the mask
        it was drafted under) allows it; False, the matcher unchanged, where it does not."""
        if not (0 <= token < self.vocab_size and allowed(row, token)):
            return False
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"xgrammar's mask allowed token {token} but its matcher rejected it")
        return True

    def _rows(self, n: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty(n, self.width, dtype=torch.int32)
        if out.shape != (n, self.width) or out.dtype != torch.int32 or out.device.type != "cpu":
            raise ValueError(f"out must be a CPU int32 tensor of shape ({n}, {self.width}), got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        return out

    def _fill(self, rows: torch.Tensor, words, index: int) -> None:
        """Fill rows[index] (words: rows.numpy()) at the committed state; a GrammarError where
        nothing is allowed there."""
        if self.matcher.is_terminated():
            raise RuntimeError("the grammar has terminated (a stop token was committed): the request is finished, "
                               "there is no next mask")
        self.matcher.fill_next_token_bitmask(rows, index)
        if not words[index].any():
            raise GrammarError("the grammar reached a state that no token of the vocabulary can continue (it "
                               "needs a character the vocabulary does not spell)")


def allowed(row, token: int) -> bool:
    """Whether bit `token` of a bitmask row (a tensor or numpy array of int32 words) is set."""
    return bool((int(row[token // 32]) >> (token % 32)) & 1)
