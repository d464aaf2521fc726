"""The grammar masks of one speculative cycle of a group of requests, drafts included.

A cycle of k drafts needs k + 1 masks per request: row j allows the tokens the grammar allows after
the committed output and drafts d_1..d_j. Row j is also what draft d_{j+1} is chosen under, so the
draft proposes only tokens the grammar allows (its acceptance does not suffer from proposals the
verify must reject), and the verify takes all k + 1 rows as one mask tensor. Rows are xgrammar's
packed bitmasks (int32 words, eagle_fx.structured.bitmask), on the host; the cycle's mask ops
(eagle_fx.structured.mask_op) copy them to the device, where the graph unpacks them:

    masks = CycleMasks(states, vocab_size, k)           # states: GrammarState or None per request
    words_0 = masks.draft_row(0, None)                  # [B, W] int32: d_1 is picked under it
    words_j = masks.draft_row(j, d_j)                   # after d_j (j = 1..k-1)
    words = masks.verify_rows(drafts)                   # [B, k+1, W]; every matcher back where it was

Rows are filled on the host by each request's xgrammar matcher, which walks the drafts tentatively
and is rolled back at the end (the engine then commits the tokens the cycle accepted). A request
without a grammar gets all-allowed rows; so do the rows after a draft its grammar does not allow
(a draft picked where nothing in the draft's vocabulary was allowed) or after a stop token: the
verify's own row for that draft masks it, so it is never accepted, and nothing after it is used.
Host cost: one `fill_next_token_bitmask` per request per row (about 1 µs for a JSON schema on the
bundled vocabulary, eagle_fx.structured.matcher).
"""
from __future__ import annotations

import time

import torch

from eagle_fx.structured.bitmask import bitmask_width
from eagle_fx.structured.matcher import ALL_ALLOWED, GrammarState


class CycleMasks:
    """One cycle's masks for requests `states` (GrammarState, or None: no grammar)."""

    def __init__(self, states: list[GrammarState | None], vocab_size: int, num_drafts: int, stats=None):
        """stats: a SpecDecodeStats that counts the cycle (grammar_cycles) and the host's seconds
        in the matchers (grammar_mask_s), or None."""
        self.states, self.vocab_size, self.num_drafts = states, vocab_size, num_drafts
        self.stats = stats
        self.words = torch.full((len(states), num_drafts + 1, bitmask_width(vocab_size)), ALL_ALLOWED,
                                dtype=torch.int32)
        self._numpy = self.words.numpy()  # the same memory (numpy's scalar reads are cheaper)
        self._walked = [0] * len(states)  # drafts each matcher accepted tentatively
        self._following = [s is not None for s in states]  # the grammar still allows this request's drafts
        self._filled = 0  # rows filled so far

    def draft_row(self, j: int, previous: torch.Tensor | None) -> torch.Tensor:
        """int32 [B, W] on the host: row j, after the drafts so far; previous [B] is draft j (None
        for j = 0)."""
        self._fill_row(j, previous)
        return self.words[:, j]

    def verify_rows(self, drafts: torch.Tensor) -> torch.Tensor:
        """int32 [B, k+1, W] on the host: every row (the last after d_k); the matchers are rolled
        back after it."""
        try:
            for j in range(self._filled, self.num_drafts + 1):
                self._fill_row(j, drafts[:, j - 1] if j > 0 else None)
        finally:
            self.rollback()
        return self.words

    def rollback(self) -> None:
        """Every matcher back at its request's committed output (idempotent)."""
        for b, state in enumerate(self.states):
            if self._walked[b]:
                state.matcher.rollback(self._walked[b])
                self._walked[b] = 0

    def _fill_row(self, j: int, previous: torch.Tensor | None) -> None:
        if j != self._filled:
            raise ValueError(f"mask rows are filled in order: row {self._filled} next, not {j}")
        started = time.perf_counter()
        self._filled += 1
        tokens = previous.tolist() if previous is not None else None
        try:
            self._walk(j, tokens)
        finally:
            if self.stats is not None:
                self.stats.grammar_mask_s += time.perf_counter() - started
                self.stats.grammar_cycles += j == self.num_drafts

    def _walk(self, j: int, tokens: list[int] | None) -> None:
        for b, state in enumerate(self.states):
            if not self._following[b]:
                continue  # no grammar, or it stopped following the drafts: all-allowed rows
            if j == 0:
                state.allowed_now(out=self.words[b, 0])  # a GrammarError where nothing is allowed
                continue
            if not state.take_draft(int(tokens[b]), self._numpy[b, j - 1]):
                self._following[b] = False  # the verify's row j-1 rejects this draft
                continue
            self._walked[b] += 1
            if state.matcher.is_terminated():
                self._following[b] = False  # a stop token: the request ends there
                continue
            state.matcher.fill_next_token_bitmask(self.words[b], j)
