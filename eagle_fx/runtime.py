"""The generate loop: prefill, propose, verify, commit; and its statistics.

Positions, for a sequence whose base KV holds x_0..x_{m-1} and whose last sampled token x_m is
pending (shifted scheme: draft slot p holds (x_{p+1}, f_p)):

  the last draft call ran at position m-1 and proposed d_1;
  draft step j = 1..k-1: token d_j at position m-1+j, feature = the draft's previous output -> d_{j+1};
  verify: base on [x_m, d_1..d_k] at positions m..m+k -> accepted a, bonus token;
  extend: draft on [d_1..d_a, bonus] at positions m..m+a with the verified base features
          f_m..f_{m+a} -> the next d_1;  m += a + 1.

Stale K/V past a sequence's committed length (rejected proposals) are never read: attention is
bounded by each query's position, and later tokens overwrite those slots.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from eagle_fx.cache import BlockAllocator, block_table_tensor, new_kv_pool, slot_mapping
from eagle_fx.capture import StepGraphs
from eagle_fx.options import Options
from eagle_fx.sampling import greedy, greedy_accept


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters (examples/offline_inference/spec_decode.py formulas)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    total_num_output_tokens: int = 0
    wall_time_s: float = 0.0
    # where the time went (seconds): base prefill + draft prefill, draft steps + extends, verify
    time_prefill_s: float = 0.0
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0

    def __post_init__(self):
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_spec_tokens

    def record(self, accepted: list[int]) -> None:
        """One verification step: `accepted[s]` tokens accepted for each sequence that had drafts."""
        for a in accepted:
            self.num_drafts += 1
            self.num_draft_tokens += self.num_spec_tokens
            self.num_accepted_tokens += a
            for j in range(a):
                self.accepted_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def acceptance_at(self) -> list[float]:
        return [c / self.num_drafts if self.num_drafts else 0.0 for c in self.accepted_per_pos]

    def merge(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)]
        self.total_num_output_tokens += other.total_num_output_tokens
        self.time_prefill_s += other.time_prefill_s
        self.time_draft_s += other.time_draft_s
        self.time_verify_s += other.time_verify_s

    def profile(self) -> dict:
        """Seconds in prefill, draft, verify, and everything else (host work: metadata, acceptance)."""
        busy = self.time_prefill_s + self.time_draft_s + self.time_verify_s
        return {"prefill": self.time_prefill_s, "draft": self.time_draft_s, "verify": self.time_verify_s,
                "host": max(0.0, self.wall_time_s - busy)}

    def as_dict(self) -> dict:
        return {
            "total_num_output_tokens": self.total_num_output_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_at": self.acceptance_at,
            "wall_time_s": self.wall_time_s,
            "profile_s": self.profile(),
        }


@dataclass
class GenerateOutput:
    sequences: list[list[int]]
    stats: SpecDecodeStats


def _ids_list(x) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


class SpeculativeModel:
    """A base + EAGLE draft pair captured as step graphs over paged KV pools.

    More prompts than `max_batch_size` are run in waves of at most `max_batch_size` sequences.
    """

    def __init__(self, graphs: StepGraphs, callables: dict, options: Options, base, draft):
        self._init_args = (graphs, callables, base, draft)
        self.graphs = graphs
        self.options = options
        self._base_fn = callables["base"]
        self._draft_prefill = callables["draft_prefill"]
        self._draft_extend = callables["draft_extend"]
        self._draft_step = callables["draft_step"]
        bc = base.config.get_text_config()
        p = next(base.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.vocab_size = bc.vocab_size
        self.d2t = getattr(draft, "d2t", None)
        self.draft_method = draft.method
        o = options
        k = o.num_spec_tokens
        self.blocks_per_seq = -(-(o.max_seq_len + k + 1) // o.block_size)
        num_blocks = o.max_batch_size * self.blocks_per_seq
        self.allocator = BlockAllocator(num_blocks, o.block_size)
        head_dim = getattr(bc, "head_dim", None) or bc.hidden_size // bc.num_attention_heads
        kvh = getattr(bc, "num_key_value_heads", None) or bc.num_attention_heads
        self.base_pool = new_kv_pool(bc.num_hidden_layers, num_blocks, o.block_size, kvh, head_dim, self.dtype, self.device)
        dc = draft.config
        self.draft_pool = new_kv_pool(1, num_blocks, o.block_size, dc.num_key_value_heads, dc.head_dim, self.dtype, self.device)
        # test-only: hook(contexts, j, proposals[B]) -> proposals[B], replaces draft proposal j
        self._propose_hook = None

    RUNTIME_OPTIONS = ("num_spec_tokens", "max_batch_size", "max_seq_len", "block_size")

    def replace(self, **changes) -> "SpeculativeModel":
        """A model over the same captured graphs with other runtime options (k, batch, lengths; new pools)."""
        bad = sorted(set(changes) - set(self.RUNTIME_OPTIONS))
        if bad:
            raise ValueError(f"replace() takes {self.RUNTIME_OPTIONS}; {bad} change the captured graphs: call eagle_fx.compile again")
        graphs, callables, base, draft = self._init_args
        return SpeculativeModel(graphs, callables, dataclasses.replace(self.options, **changes), base, draft)

    @property
    def num_spec_tokens(self) -> int:
        return self.options.num_spec_tokens

    # ------------------------------------------------------------------ validation

    def _check(self, prompts, max_new_tokens, eos_token_id, temperature) -> tuple[list[list[int]], set[int]]:
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist() if prompts.dim() == 2 else None
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple, torch.Tensor)) for p in prompts):
            raise TypeError("prompts must be a list of token-id lists, e.g. [[1, 2, 3], [4, 5]]")
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
        out = []
        for i, p in enumerate(prompts):
            p = _ids_list(p)
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise TypeError(f"prompt {i} holds non-integer token ids; pass ints")
            bad = [t for t in p if t < 0 or t >= self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token id(s) {bad[:5]} outside the vocab [0, {self.vocab_size})")
            out.append(p)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        for i, p in enumerate(out):
            if len(p) + max_new_tokens > self.options.max_seq_len:
                raise ValueError(
                    f"prompt {i}: {len(p)} prompt tokens + max_new_tokens {max_new_tokens} > max_seq_len "
                    f"{self.options.max_seq_len}; shorten the prompt, lower max_new_tokens, or compile with a larger max_seq_len"
                )
        if temperature != 0.0:
            raise ValueError("only greedy decoding (temperature=0.0) is implemented; sampling comes with lossless rejection sampling")
        if eos_token_id is None:
            eos = set()
        elif isinstance(eos_token_id, int):
            eos = {eos_token_id}
        else:
            eos = set(int(e) for e in eos_token_id)
        return out, eos

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 128, eos_token_id=None, temperature: float = 0.0) -> GenerateOutput:
        prompts, eos = self._check(prompts, max_new_tokens, eos_token_id, temperature)
        stats = SpecDecodeStats(self.num_spec_tokens)
        t0 = time.perf_counter()
        sequences: list[list[int]] = []
        mb = self.options.max_batch_size
        for w in range(0, len(prompts), mb):
            sequences += self._run_wave(prompts[w:w + mb], max_new_tokens, eos, stats)
        stats.total_num_output_tokens = sum(len(s) for s in sequences)
        stats.wall_time_s = time.perf_counter() - t0
        return GenerateOutput(sequences, stats)

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def _run_wave(self, prompts: list[list[int]], max_new: int, eos: set[int], stats: SpecDecodeStats) -> list[list[int]]:
        dev, bs, k = self.device, self.options.block_size, self.num_spec_tokens
        B = len(prompts)
        need = [self.allocator.blocks_for(len(p) + max_new + k + 1) for p in prompts]
        allocated: list[list[int]] = []
        try:
            for n in need:
                allocated.append(self.allocator.allocate(n))
            return self._decode(prompts, max_new, eos, stats, block_table_tensor(allocated, dev))
        finally:
            for blocks in allocated:
                self.allocator.release(blocks)

    def _decode(self, prompts, max_new, eos, stats, block_table) -> list[list[int]]:
        dev, bs, k = self.device, self.options.block_size, self.num_spec_tokens
        B = len(prompts)
        long = dict(dtype=torch.long, device=dev)
        lens = torch.tensor([len(p) for p in prompts], **long)
        qsl = torch.zeros(B + 1, **long)
        qsl[1:] = lens.cumsum(0)
        ids = torch.tensor([t for p in prompts for t in p], **long)
        seq_index = torch.repeat_interleave(torch.arange(B, **long), lens)
        pos = torch.arange(ids.numel(), **long) - qsl[:-1][seq_index]
        slots = slot_mapping(block_table, seq_index, pos, bs)
        last = qsl[1:] - 1

        clock = time.perf_counter
        t = clock()
        logits, feats = self._base_fn(input_ids=ids[None], positions=pos[None], logits_indices=last,
                                      kv_pool=self.base_pool, slot_mapping=slots, block_table=block_table,
                                      query_start_loc=qsl)
        pending = greedy(logits)
        outputs: list[list[int]] = [[] for _ in range(B)]
        contexts = [list(p) for p in prompts]
        active = [i for i in range(B) if not self._emit(outputs[i], contexts[i], [int(pending[i])], max_new, eos)]
        if not active:
            return outputs
        dlogits, dhidden = self._draft_prefill(input_ids=ids[None], positions=pos[None], features=feats,
                                               logits_indices=last, next_tokens=pending, query_start_loc=qsl,
                                               kv_pool=self.draft_pool, slot_mapping=slots, block_table=block_table)
        stats.time_prefill_s += clock() - t
        m = lens.clone()  # tokens in the base KV per sequence
        rows = torch.tensor(active, **long)
        dlogits, dhidden, pending, m = dlogits[rows], dhidden[rows], pending[rows], m[rows]
        ar = torch.arange(B + 1, **long)
        while active:
            A = len(active)
            bt = block_table[rows]
            one = ar[:A]
            proposals = []
            d = self._propose(contexts, active, 0, self._to_target(greedy(dlogits)))
            proposals.append(d)
            h = dhidden
            t = clock()
            for j in range(1, k):
                p_j = m - 1 + j
                dl, h = self._draft_step(input_ids=d[None], positions=p_j[None], features=h, logits_indices=one,
                                         next_tokens=d, query_start_loc=ar[:A + 1], kv_pool=self.draft_pool,
                                         slot_mapping=slot_mapping(bt, one, p_j, bs), block_table=bt)
                d = self._propose(contexts, active, j, self._to_target(greedy(dl)))
                proposals.append(d)
            D = torch.stack(proposals, dim=1)  # [A, k]
            stats.time_draft_s += clock() - t

            v_ids = torch.cat([pending[:, None], D], dim=1).reshape(-1)
            v_pos = (m[:, None] + torch.arange(k + 1, **long)[None]).reshape(-1)
            v_seq = torch.repeat_interleave(one, k + 1)
            v_qsl = ar[:A + 1] * (k + 1)
            t = clock()
            logits, feats = self._base_fn(input_ids=v_ids[None], positions=v_pos[None],
                                          logits_indices=torch.arange(A * (k + 1), **long), kv_pool=self.base_pool,
                                          slot_mapping=slot_mapping(bt, v_seq, v_pos, bs), block_table=bt,
                                          query_start_loc=v_qsl)
            stats.time_verify_s += clock() - t
            accepted, bonus = greedy_accept(D, greedy(logits).view(A, k + 1))
            acc = accepted.tolist()
            stats.record(acc)

            keep = []
            for r, s in enumerate(active):
                new = D[r, :acc[r]].tolist() + [int(bonus[r])]
                if not self._emit(outputs[s], contexts[s], new, max_new, eos):
                    keep.append(r)
            if not keep:
                break
            kr = torch.tensor(keep, **long)
            a_k = accepted[kr]
            n_ext = a_k + 1
            e_seq = torch.repeat_interleave(torch.arange(len(keep), **long), n_ext)
            e_off = torch.arange(int(n_ext.sum()), **long) - torch.repeat_interleave(n_ext.cumsum(0) - n_ext, n_ext)
            tok_all = torch.cat([D, bonus[:, None]], dim=1)  # [A, k+1]; the bonus is placed at column a
            tok_all[torch.arange(A, **long), accepted] = bonus
            e_ids = tok_all[kr][e_seq, e_off]
            e_pos = m[kr][e_seq] + e_off
            e_feats = feats.view(A, k + 1, -1)[kr][e_seq, e_off]
            e_qsl = torch.zeros(len(keep) + 1, **long)
            e_qsl[1:] = n_ext.cumsum(0)
            bt_k = bt[kr]
            t = clock()
            dlogits, dhidden = self._draft_extend(input_ids=e_ids[None], positions=e_pos[None], features=e_feats,
                                                  logits_indices=e_qsl[1:] - 1, next_tokens=bonus[kr],
                                                  query_start_loc=e_qsl, kv_pool=self.draft_pool,
                                                  slot_mapping=slot_mapping(bt_k, e_seq, e_pos, bs), block_table=bt_k)
            stats.time_draft_s += clock() - t
            m = m[kr] + n_ext
            pending = bonus[kr]
            active = [active[r] for r in keep]
            rows = rows[kr]
        return outputs

    def _propose(self, contexts, active, j, proposal: torch.Tensor) -> torch.Tensor:
        if self._propose_hook is None:
            return proposal
        return self._propose_hook([contexts[s] for s in active], j, proposal)

    @staticmethod
    def _emit(out: list[int], context: list[int], new: list[int], max_new: int, eos: set[int]) -> bool:
        """Append new tokens, stopping at eos (kept) or max_new; True when the sequence is finished."""
        for t in new:
            out.append(t)
            context.append(t)
            if t in eos or len(out) >= max_new:
                return True
        return False
