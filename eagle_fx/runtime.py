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

from eagle_fx.cache import BlockAllocator, PoolExhausted, block_hashes, block_table_tensor, new_kv_pool, slot_mapping
from eagle_fx.capture import StepGraphs
from eagle_fx.draft_tree import DraftTree, greedy_walk, rerank, sampled_walk, tree_mask
from eagle_fx.kv_share import base_kv_shape
from eagle_fx.multimodal import image_token_id, is_vision_language, prompt_images, refuse_options, rope_positions, wave_inputs
from eagle_fx.options import Options
from eagle_fx.sampling import greedy, greedy_accept, rejection_accept, sample, warp
from eagle_fx.static_steps import StaticPrefill, StaticStep


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters (examples/offline_inference/spec_decode.py formulas)."""

    num_spec_tokens: int  # the most drafts one verify can accept (k; a tree's depth)
    draft_tokens_per_step: int | None = None  # tokens drafted per verify (k; a tree's total_tokens)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    total_num_output_tokens: int = 0
    wall_time_s: float = 0.0
    # where the time went (seconds): base prefill + draft prefill, draft steps + extends, verify
    time_prefill_s: float = 0.0
    time_draft_prefill_s: float = 0.0  # the draft's share of time_prefill_s
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    # prefix caching: prompt tokens served from cached blocks vs computed, per model
    prefix_hit_tokens_base: int = 0
    prefix_hit_tokens_draft: int = 0
    prefill_tokens_computed_base: int = 0
    prefill_tokens_computed_draft: int = 0

    def __post_init__(self):
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_spec_tokens
        if self.draft_tokens_per_step is None:
            self.draft_tokens_per_step = self.num_spec_tokens

    def record(self, accepted: list[int]) -> None:
        """One verification step: `accepted[s]` tokens accepted for each sequence that had drafts."""
        for a in accepted:
            self.num_drafts += 1
            self.num_draft_tokens += self.draft_tokens_per_step
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
        self.time_draft_prefill_s += other.time_draft_prefill_s
        self.time_draft_s += other.time_draft_s
        self.time_verify_s += other.time_verify_s
        for name in ("prefix_hit_tokens_base", "prefix_hit_tokens_draft", "prefill_tokens_computed_base",
                     "prefill_tokens_computed_draft"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

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
            "draft_prefill_s": self.time_draft_prefill_s,
            "prefix_hit_tokens_base": self.prefix_hit_tokens_base,
            "prefix_hit_tokens_draft": self.prefix_hit_tokens_draft,
            "prefill_tokens_computed_base": self.prefill_tokens_computed_base,
            "prefill_tokens_computed_draft": self.prefill_tokens_computed_draft,
        }


@dataclass
class GenerateOutput:
    sequences: list[list[int]]
    stats: SpecDecodeStats


class _ConfigEos:
    """Default of generate(eos_token_id=...): the base's generation_config eos, as HF generate does
    when eos_token_id is not passed (an explicit None means: never stop at an eos token)."""

    def __repr__(self) -> str:
        return "<generation_config.eos_token_id>"


CONFIG_EOS = _ConfigEos()


def _ids_list(x) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


@dataclass(frozen=True)
class PairSpec:
    """What the runtime needs to know about the base + draft pair besides the step graphs (so a
    pair loaded from exported graphs runs without the original modules)."""

    vocab_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    eos: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    draft_method: str
    draft_kv_heads: int
    draft_heads: int
    draft_head_dim: int
    draft_hidden_size: int
    feature_dim: int
    kv_share_layer: int | None  # the base layer a KV-sharing draft reads (when compiled so)
    d2t: torch.Tensor | None = None  # EAGLE-3: target id = draft id + d2t[draft id]
    embed_dim: int = 0  # a vision-language base: the width of its input (and image) embeddings
    image_token_id: int | None = None  # a vision-language base: its image placeholder token

    @classmethod
    def from_pair(cls, base, draft, kv_share_layer: int | None = None) -> "PairSpec":
        bc, dc = base.config.get_text_config(), draft.config
        p = next(base.parameters())
        eos = base.generation_config.eos_token_id if getattr(base, "generation_config", None) is not None else None
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        kvh, head_dim = base_kv_shape(base)
        d2t = getattr(draft, "d2t", None)
        vl = is_vision_language(base)
        return cls(bc.vocab_size, bc.num_hidden_layers, kvh, head_dim, eos, p.device, p.dtype, draft.method,
                   dc.num_key_value_heads, dc.num_attention_heads, dc.head_dim, dc.hidden_size, draft.feature_dim,
                   kv_share_layer, None if d2t is None else d2t.detach().clone(),
                   base.get_input_embeddings().weight.shape[1] if vl else 0, image_token_id(base) if vl else None)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]


class SpeculativeModel:
    """A base + EAGLE draft pair captured as step graphs over paged KV pools.

    More prompts than `max_batch_size` are run in waves of at most `max_batch_size` sequences.
    `graphs` (the GraphModules, with their pass log) is None for a pair loaded from exported files.
    """

    def __init__(self, graphs: StepGraphs | None, callables: dict, options: Options, spec: PairSpec,
                 input_names: dict[str, list[str]] | None = None, image_encoder=None):
        self._init_args = (graphs, callables, spec, input_names, image_encoder)
        self.image_encoder = image_encoder  # a vision-language base's images -> embeddings (eagle_fx.multimodal)
        self.graphs = graphs
        self.options = options
        self.spec = spec
        self._fns = callables
        self._inputs = input_names or {name: [n.target for n in getattr(graphs, name).graph.nodes if n.op == "placeholder"]
                                       for name in callables}
        self.device, self.dtype = spec.device, spec.dtype
        self.vocab_size = spec.vocab_size
        self._to_target = spec.to_target  # EAGLE-3: draft vocab id -> target id (d2t); EAGLE-1: identity
        self.default_eos = set(spec.eos)
        o = options
        k = o.num_spec_tokens
        self.tree = o.draft_tree  # a DraftTree (EAGLE-2) or None (a chain of k)
        if self.tree is not None and "verify_tree" not in callables:
            raise ValueError("draft_tree needs the tree step graphs: pass draft_tree= to eagle_fx.compile")
        # cache slots past the committed tokens one speculation step writes
        self.lookahead = k + 1 if self.tree is None else self.tree.width
        self.blocks_per_seq = -(-(o.max_seq_len + self.lookahead) // o.block_size)
        num_blocks = o.num_blocks or o.max_batch_size * self.blocks_per_seq
        self.allocator = BlockAllocator(num_blocks, o.block_size)
        # static steps pad the batch with sequences that live in one scratch block past the allocator's
        # a vision-language pair's graphs take the wave's image rows (mm_embeds); generate(pixel_values=)
        self.mm = "mm_embeds" in self._inputs["base"]
        self._mm_table = None  # set per wave: [rows, embed_dim], at least one row
        self._rope = None  # M-RoPE bases: set per wave (prompt positions, lengths, deltas)
        if self.mm:
            refuse_options(o)
        self.static_steps = o.static_steps if o.static_steps is not None else o.backend == "triton" and not self.mm
        scratch = int(self.static_steps)
        inputs = self._inputs["draft_step"]
        # kv_mode: "layer" (kv_share=LAYER: the draft reads base layer `draft_layer`, and keeps only its
        # speculated positions in the spec_kv ring), "pool" (its KV is layer L of the base's pool), or
        # "own" (a pool of its own)
        self.kv_mode = "layer" if "spec_kv" in inputs else "own" if "draft_kv_pool" in inputs else "pool"
        self.kv_aliased = self.kv_mode != "own"
        if self.tree is not None and self.kv_mode == "layer":
            raise ValueError("draft_tree does not run with a KV-sharing draft (kv_share=LAYER)")
        L = spec.num_layers
        self.base_pool = new_kv_pool(L + (self.kv_mode == "pool"), num_blocks + scratch, o.block_size,
                                     spec.kv_heads, spec.head_dim, self.dtype, self.device)
        self.draft_pool = self.base_pool if self.kv_aliased else new_kv_pool(
            1, num_blocks + scratch, o.block_size, spec.draft_kv_heads, spec.draft_head_dim, self.dtype, self.device)
        self.draft_layer = {"own": 0, "pool": L, "layer": spec.kv_share_layer}[self.kv_mode]
        # a sharing draft's own K/V: the k speculated positions (bonus + k-1 steps) of each sequence
        self.spec_kv = torch.zeros(2, o.max_batch_size + scratch, k, spec.draft_kv_heads, spec.draft_head_dim,
                                   dtype=self.dtype, device=self.device) if self.kv_mode == "layer" else None
        self.cuda_graphs = False
        self._steps = self._static_steps(num_blocks) if self.static_steps else {}
        feature_dim = spec.feature_dim
        b = o.bootstrap if o.bootstrap is not None else torch.zeros(feature_dim)
        if tuple(b.shape) != (feature_dim,):
            raise ValueError(f"bootstrap must be a [{feature_dim}] feature vector (the draft's input feature size), got {tuple(b.shape)}")
        self.bootstrap = b.to(device=self.device, dtype=self.dtype)[None]
        self.draft_hidden_size = spec.draft_hidden_size
        self.block_feature = torch.zeros(num_blocks, feature_dim, device=self.device, dtype=self.dtype)
        # test-only: hook(contexts, j, proposals[B]) -> proposals[B], replaces draft proposal j
        self._propose_hook = None
        # test-only: hook(contexts, tokens [A, N], parents [A, N]) -> tokens, replaces a draft tree's tokens
        self._tree_hook = None
        self._sampling = None  # set per generate(): None (greedy) or ((temperature, top_k, top_p), generator)

    RUNTIME_OPTIONS = ("num_spec_tokens", "max_batch_size", "max_seq_len", "block_size", "prefill_chunk_size",
                       "prefix_caching", "bootstrap", "num_blocks", "static_steps", "draft_tree")

    def _static_steps(self, scratch_block: int) -> dict:
        """The draft step (1 row per sequence), the verify (k+1 rows) and the base and draft prefills
        (bucketed by batch and tokens) over static buffers; captured as CUDA graphs when on a GPU and
        every op of their graphs can be captured."""
        o = self.options
        eager_ops = (torch.ops.eagle_fx.cached_attention.default, torch.ops.eagle_fx.shared_cached_attention.default,
                     torch.ops.eagle_fx.rowwise_linear.default)  # torch references that sync with the host
        blocking = self.graphs is None or any(
            n.op == "call_function" and n.target in eager_ops
            for name in ("base", "draft_step", "draft_prefill") for n in getattr(self.graphs, name).graph.nodes)
        self.cuda_graphs = self.device.type == "cuda" and not blocking
        common = dict(max_batch_size=o.max_batch_size, scratch_block=scratch_block, block_size=o.block_size,
                      scratch_ring_row=o.max_batch_size, capture=self.cuda_graphs)
        max_tokens = (o.prefill_chunk_size or o.max_seq_len) * o.max_batch_size
        return {"draft_step": StaticStep(self._fns["draft_step"], self._inputs["draft_step"], 1, **common),
                "verify": StaticStep(self._fns["base"], self._inputs["base"], o.num_spec_tokens + 1, **common),
                "base": StaticPrefill(self._fns["base"], self._inputs["base"], ("seqs", "tokens"),
                                      max_tokens=max_tokens, **common),
                "draft_prefill": StaticPrefill(self._fns["draft_prefill"], self._inputs["draft_prefill"], ("seqs", "seqs"),
                                               max_tokens=max_tokens, **common)}

    def replace(self, **changes) -> "SpeculativeModel":
        """A model over the same captured graphs with other runtime options (k, batch, lengths; new pools)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Options)})
        if unknown:
            raise ValueError(f"replace(): unknown option(s) {unknown}; it takes {self.RUNTIME_OPTIONS}")
        bad = sorted(set(changes) - set(self.RUNTIME_OPTIONS))
        if bad:
            raise ValueError(f"replace() takes {self.RUNTIME_OPTIONS}; {bad} change the captured graphs: call eagle_fx.compile again")
        graphs, callables, spec, input_names, encoder = self._init_args
        return SpeculativeModel(graphs, callables, dataclasses.replace(self.options, **changes), spec, input_names, encoder)

    @property
    def num_spec_tokens(self) -> int:
        return self.options.num_spec_tokens

    def new_stats(self) -> SpecDecodeStats:
        """Empty counters for this model's speculation (a chain of k, or a tree)."""
        if self.tree is None:
            return SpecDecodeStats(self.num_spec_tokens)
        return SpecDecodeStats(self.tree.depth, self.tree.total_tokens)

    # ------------------------------------------------------------------ validation

    def _check(self, prompts, max_new_tokens, eos_token_id) -> tuple[list[list[int]], set[int]]:
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
        if eos_token_id is CONFIG_EOS:  # like HF generate without eos_token_id: the model's own
            eos = set(self.default_eos)
        elif eos_token_id is None:
            eos = set()
        elif isinstance(eos_token_id, int):
            eos = {eos_token_id}
        else:
            eos = set(int(e) for e in eos_token_id)
        return out, eos

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 128, eos_token_id=CONFIG_EOS, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, pixel_values=None,
                 image_grid_thw=None) -> GenerateOutput:
        """Speculative decoding of a ragged batch of token-id lists.

        temperature=0.0: greedy (token for token HF's greedy generate). temperature > 0 samples,
        with top_k (0 or -1: off) and top_p (1.0: off) applied in HF's order; drafts are sampled from
        the draft's equally warped distribution and accepted by speculative rejection sampling, so
        the output is distributed exactly as sampling the base alone. seed makes it reproducible.
        eos_token_id: an id or a list of ids; not given: the base's generation_config eos (as HF
        generate); None: never stop early. Returns .sequences (new tokens per prompt, eos included
        when hit) and .stats. pixel_values (a vision-language base): one entry per prompt, None or
        that prompt's images (LLaVA: [num_images, C, H, W]; Qwen2-VL: the processor's [patches, D]
        with image_grid_thw=[per prompt [num_images, 3]]); their features fill the prompt's image
        placeholder tokens in order (each image is encoded once)."""
        prompts, eos = self._check(prompts, max_new_tokens, eos_token_id)
        images = prompt_images(self.image_encoder, self.spec.image_token_id, prompts, pixel_values, image_grid_thw,
                               self.device, self.dtype)
        self._sampling = self._sampling_state(temperature, top_p, top_k, seed)
        stats = self.new_stats()
        t0 = time.perf_counter()
        sequences: list[list[int]] = []
        mb = self.options.max_batch_size
        for w in range(0, len(prompts), mb):
            sequences += self._run_wave(prompts[w:w + mb], max_new_tokens, eos, stats, images[w:w + mb])
        stats.total_num_output_tokens = sum(len(s) for s in sequences)
        stats.wall_time_s = time.perf_counter() - t0
        return GenerateOutput(sequences, stats)

    def _sampling_state(self, temperature, top_p, top_k, seed):
        """None for greedy; else ((temperature, top_k, top_p), generator)."""
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise ValueError(f"top_k must be an int >= 0, or -1 (0 and -1: off), got {top_k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if temperature == 0:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return (float(temperature), max(top_k, 0), float(top_p)), gen

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The base's token from its logits: argmax, or a sample from the warped distribution."""
        if self._sampling is None:
            return greedy(logits)
        params, gen = self._sampling
        return sample(warp(logits, *params), gen)

    def _draft_pick(self, dlogits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's proposal (target ids) and, when sampling, its distribution q over target ids."""
        if self._sampling is None:
            return self._to_target(greedy(dlogits)), None
        params, gen = self._sampling
        qd = warp(dlogits, *params)
        if self.spec.d2t is None:
            q = qd
        else:  # EAGLE-3: draft id i is target id i + d2t[i]
            q = qd.new_zeros(qd.shape[0], self.vocab_size)
            q.index_add_(1, torch.arange(qd.shape[1], device=qd.device) + self.spec.d2t.to(qd.device), qd)
        return sample(q, gen), q

    def _run_wave(self, prompts: list[list[int]], max_new: int, eos: set[int], stats: SpecDecodeStats,
                  images: list) -> list[list[int]]:
        """Take blocks (cached prefix first), decode, then cache the finished sequences' full blocks."""
        bs, k = self.options.block_size, self.num_spec_tokens
        caching = self.options.prefix_caching
        rows: list[list[int]] = []
        start: list[int] = []
        valid: list[int | None] = [None] * len(prompts)
        graph_prompts = keys = prompts
        if self.mm:  # this wave's image rows and M-RoPE table; placeholders as virtual ids / image keys
            graph_prompts, keys, self._mm_table, self._rope = wave_inputs(
                prompts, images, self.vocab_size, self.spec.image_token_id, self.spec.embed_dim,
                "rope_positions" in self._inputs["base"], self.device, self.dtype)
        try:
            for p, key in zip(prompts, keys):
                need = self.allocator.blocks_for(len(p) + max_new + self.lookahead)
                if need > self.allocator.num_blocks:
                    raise PoolExhausted(
                        f"one request needs {need} blocks but the KV pool has {self.allocator.num_blocks}; "
                        "raise num_blocks (eagle_fx.compile(..., num_blocks=N) or model.replace(num_blocks=N)), "
                        "or shorten the prompt / max_new_tokens")
                hit: list[int] = []
                if caching:
                    usable = (len(p) - 1) // bs  # keep at least one prompt token to compute
                    hit = self.allocator.match(key, usable)
                    if self.options.prefill_shift and hit:
                        # shifted, a block's last draft slot depends on the next block's first token: the
                        # last matched block is recomputed (vLLM drops it the same way)
                        self.allocator.release([hit.pop()])
                rows.append(hit)
                rows[-1] = hit + self.allocator.allocate(need - len(hit))
                start.append(len(hit) * bs)
            block_table = block_table_tensor(rows, self.device, self.blocks_per_seq)
            carry = self.bootstrap.expand(len(prompts), -1).clone()
            for i, a in enumerate(start):
                if a:
                    carry[i] = self.block_feature[rows[i][a // bs - 1]]
            hits = sum(start)
            stats.prefix_hit_tokens_base += hits
            stats.prefix_hit_tokens_draft += hits
            computed = sum(len(p) for p in prompts) - hits
            stats.prefill_tokens_computed_base += computed
            outputs = self._decode(prompts, max_new, eos, stats, block_table, start, carry, valid, graph_prompts)
            if caching:
                for key, out, blocks, n_valid in zip(keys, outputs, rows, valid):
                    tokens = key + out
                    for i, (b, h) in enumerate(zip(blocks, block_hashes(tokens, bs, min(n_valid, len(tokens)) // bs))):
                        if not self.allocator.register(b, h, tokens[i * bs:(i + 1) * bs]) and self.options.prefill_shift:
                            # shifted, the cached block for this hash ends with a draft slot computed from
                            # another request's next token: later blocks of this chain must not follow it
                            break
            return outputs
        finally:
            for blocks in rows:
                self.allocator.release(blocks)

    def _graph_inputs(self, name: str, inputs: dict) -> dict:
        """The inputs step graph `name` declares (passes may add or drop some). Draft graphs get
        their own pool as `draft_kv_pool`, or the shared one as `kv_pool`, and a sharing draft its
        spec_kv ring."""
        if name not in ("base", "verify_tree"):
            inputs["draft_kv_pool"] = inputs["kv_pool"] = self.draft_pool
            inputs["spec_kv"] = self.spec_kv
        inputs.setdefault("mm_embeds", self._mm_table)
        if "rope_positions" in self._inputs[name] and "rope_positions" not in inputs:
            inputs["rope_positions"] = rope_positions(self._rope, inputs["positions"], inputs["query_start_loc"],
                                                      inputs.get("seq_rows"))
        return {k: inputs[k] for k in self._inputs[name]}

    def _call(self, name: str, **inputs):
        """Run step graph `name` as is."""
        return self._fns[name](**self._graph_inputs(name, inputs))

    def _clock(self) -> float:
        """perf_counter, after the device's queued work: exact step timings on a GPU too."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _prefill_call(self, name: str, **inputs):
        """A base or draft prefill call: through its length-bucketed static buffers when static_steps is on."""
        if name not in self._steps:
            return self._call(name, **inputs)
        return self._steps[name](**self._graph_inputs(name, inputs))

    def _step(self, name: str, n_seq: int, **inputs):
        """The draft step or the verify (the base graph): through its static buffers when static_steps is on."""
        graph = "base" if name == "verify" else name
        if name not in self._steps:
            return self._call(graph, **inputs)
        return self._steps[name](n_seq, **self._graph_inputs(graph, inputs))

    @property
    def draft_kv(self):
        """The K/V the draft attends to for cached positions: [2, blocks, block_size, kv_heads, head_dim]
        (kv_share=LAYER: the base layer it reads)."""
        return self.draft_pool[self.draft_layer]

    def kv_bytes(self) -> dict:
        """Bytes of KV memory: the base's layers, what the draft holds besides them, and the draft's
        bytes per cached token (0 when it reads a base layer: its ring does not grow with length)."""
        base = self.base_pool[:self.base_pool.shape[0] - (self.kv_mode == "pool")]
        per_token = self.draft_kv.numel() * self.draft_kv.element_size() // (self.draft_kv.shape[1] * self.options.block_size)
        if self.kv_mode == "layer":
            draft, per_token = self.spec_kv.numel() * self.spec_kv.element_size(), 0
        elif self.kv_mode == "pool":
            draft = self.draft_kv.numel() * self.draft_kv.element_size()
        else:
            draft = self.draft_pool.numel() * self.draft_pool.element_size()
        return {"base": base.numel() * base.element_size(), "draft": draft, "draft_per_token": per_token}

    def _prefill(self, prompts, block_table, stats, start: list[int], carry: torch.Tensor):
        """Base + draft prefill of prompts[s][start[s]:], in chunks of `prefill_chunk_size` tokens.

        Returns (pending [B], last_features [B, F], draft logits/hidden of the last call [B, ...]).
        Unshifted chunk [a, c): draft tokens t_a..t_{c-1}, features (carry = f_{a-1}), f_a..f_{c-2}.
        Shifted chunk [a, c): draft tokens t_{a+1}..t_c, where t_c is the real next prompt token
        for an inner chunk and the sampled token only for the last one.
        """
        dev, bs = self.device, self.options.block_size
        long = dict(dtype=torch.long, device=dev)
        B = len(prompts)
        lens = [len(p) for p in prompts]
        chunk = self.options.prefill_chunk_size or max(lens)
        pos0 = list(start)
        pending = torch.zeros(B, **long)
        last_feats = carry.clone()
        dlogits = dhidden = None
        clock = self._clock
        while True:
            sel = [s for s in range(B) if pos0[s] < lens[s]]
            if not sel:
                break
            spans = [(pos0[s], min(pos0[s] + chunk, lens[s])) for s in sel]
            n_tok = torch.tensor([c - a for a, c in spans], **long)
            qsl = torch.zeros(len(sel) + 1, **long)
            qsl[1:] = n_tok.cumsum(0)
            ids = torch.tensor([t for s, (a, c) in zip(sel, spans) for t in prompts[s][a:c]], **long)
            pos = torch.cat([torch.arange(a, c, **long) for a, c in spans])
            seq = torch.repeat_interleave(torch.arange(len(sel), **long), n_tok)
            bt = block_table[sel]
            slots = slot_mapping(bt, seq, pos, bs)
            last = qsl[1:] - 1
            t = clock()
            logits, feats = self._prefill_call("base", input_ids=ids[None], positions=pos[None], logits_indices=last,
                                               kv_pool=self.base_pool, slot_mapping=slots, block_table=bt,
                                               query_start_loc=qsl, seq_rows=torch.tensor(sel, **long))
            final = [c == lens[s] for s, (a, c) in zip(sel, spans)]
            sampled = self._pick(logits)
            fin = torch.tensor(final, dtype=torch.bool, device=dev)
            next_tokens = None
            if "next_tokens" in self._inputs["draft_prefill"]:  # shifted: the look-ahead token
                look_ahead = torch.tensor([prompts[s][c] if not f else 0 for s, (a, c), f in zip(sel, spans, final)], **long)
                next_tokens = torch.where(fin, sampled, look_ahead)
            sel_t = torch.tensor(sel, **long)
            ends = torch.tensor([c for a, c in spans], **long)
            t_draft = clock()
            dl, dh = self._prefill_call("draft_prefill", input_ids=ids[None], positions=pos[None], features=feats,
                                logits_indices=last, next_tokens=next_tokens, carry_features=carry[sel_t],
                                query_start_loc=qsl, kv_pool=self.draft_pool, slot_mapping=slots, block_table=bt,
                                spec_rows=sel_t, committed_len=ends)
            stats.time_prefill_s += clock() - t
            stats.time_draft_prefill_s += clock() - t_draft
            # the draft computes every prompt token, or (kv_share=LAYER, rows pruned) one per sequence
            stats.prefill_tokens_computed_draft += len(sel) if self.kv_mode == "layer" else ids.numel()
            if self.options.prefix_caching:
                self._keep_block_features(bt, seq, pos, feats)
            carry[sel_t] = feats[last]
            if dlogits is None:
                dlogits = dl.new_zeros(B, dl.shape[-1])
                dhidden = dh.new_zeros(B, dh.shape[-1])
            fin_rows = sel_t[fin]
            pending[fin_rows] = sampled[fin]
            last_feats[fin_rows] = feats[last][fin]
            dlogits[fin_rows], dhidden[fin_rows] = dl[fin], dh[fin]
            for s, (a, c) in zip(sel, spans):
                pos0[s] = c
        return pending, last_feats, dlogits, dhidden

    def _decode(self, prompts, max_new, eos, stats, block_table, start, carry, valid, graph_prompts) -> list[list[int]]:
        """Prefill then speculate until every sequence stops. graph_prompts: the prompts as the
        graphs see them (image placeholders as virtual ids; eagle_fx.multimodal).

        valid[s] is set, when sequence s stops, to the number of leading positions whose base AND
        draft KV are final (what the prefix cache may keep).
        """
        dev, bs, k = self.device, self.options.block_size, self.num_spec_tokens
        o = 0 if self.options.prefill_shift else 1  # draft position offset: unshifted slot p holds t_p
        B = len(prompts)
        long = dict(dtype=torch.long, device=dev)
        clock = self._clock
        pending, last_feats, dlogits, dhidden = self._prefill(graph_prompts, block_table, stats, start, carry)
        outputs: list[list[int]] = [[] for _ in range(B)]
        contexts = [list(p) for p in prompts]
        active = []
        for i in range(B):
            if self._emit(outputs[i], contexts[i], [int(pending[i])], max_new, eos):
                valid[i] = len(prompts[i])
            else:
                active.append(i)
        if not active:
            return outputs
        m = torch.tensor([len(p) for p in prompts], **long)  # tokens in the base KV per sequence
        rows = torch.tensor(active, **long)
        pending, m, bt, srow = pending[rows], m[rows], block_table[rows], rows
        A = len(active)
        ar = torch.arange(B + 1, **long)
        if o:  # unshifted: the sampled token t_n enters the draft at position n with feature f_{n-1}
            t = clock()
            dlogits, dhidden = self._call("draft_extend", input_ids=pending[None], positions=m[None],
                                          features=last_feats[rows], logits_indices=ar[:A], next_tokens=pending,
                                          query_start_loc=ar[:A + 1], kv_pool=self.draft_pool,
                                          slot_mapping=slot_mapping(bt, ar[:A], m, bs), block_table=bt,
                                          spec_rows=rows, committed_len=m)
            stats.time_prefill_s += clock() - t
        else:
            dlogits, dhidden = dlogits[rows], dhidden[rows]
        speculate = self._speculate_tree if self.tree is not None else self._speculate_chain
        while active:
            A = len(active)
            one = ar[:A]
            accepted, bonus, drafted, path_feats = speculate(contexts, active, pending, dlogits, dhidden, m, bt, srow,
                                                             stats)
            acc = accepted.tolist()
            stats.record(acc)
            W = drafted.shape[1]  # the longest acceptable path
            if self.options.prefix_caching:  # features of [pending, accepted...] (past them: overwritten later)
                path_pos = m[:, None] + torch.arange(W + 1, **long)[None]
                self._keep_block_features(bt, torch.repeat_interleave(one, W + 1), path_pos.reshape(-1),
                                          path_feats.reshape(A * (W + 1), -1))
            keep = []
            for r, s in enumerate(active):
                new = drafted[r, :acc[r]].tolist() + [int(bonus[r])]
                if not self._emit(outputs[s], contexts[s], new, max_new, eos):
                    keep.append(r)
                else:  # base KV is final up to m + a; the draft's up to m - 1 (+1 unshifted)
                    valid[s] = int(m[r]) + o
            if not keep:
                break
            kr = torch.tensor(keep, **long)
            n_ext = accepted[kr] + 1
            e_seq = torch.repeat_interleave(torch.arange(len(keep), **long), n_ext)
            e_off = torch.arange(int(n_ext.sum()), **long) - torch.repeat_interleave(n_ext.cumsum(0) - n_ext, n_ext)
            tok_all = torch.cat([drafted, bonus[:, None]], dim=1)  # [A, W+1]; the bonus goes at column a
            tok_all[one, accepted] = bonus
            e_ids = tok_all[kr][e_seq, e_off]
            e_pos = m[kr][e_seq] + e_off + o
            e_feats = path_feats[kr][e_seq, e_off]
            e_qsl = torch.zeros(len(keep) + 1, **long)
            e_qsl[1:] = n_ext.cumsum(0)
            bt, srow = bt[kr], srow[kr]
            m = m[kr] + n_ext  # the base KV now holds every accepted token; the bonus is pending
            t = clock()
            dlogits, dhidden = self._call("draft_extend", input_ids=e_ids[None], positions=e_pos[None], features=e_feats,
                                          logits_indices=e_qsl[1:] - 1, next_tokens=bonus[kr], query_start_loc=e_qsl,
                                          kv_pool=self.draft_pool, slot_mapping=slot_mapping(bt, e_seq, e_pos, bs),
                                          block_table=bt, spec_rows=srow, committed_len=m)
            stats.time_draft_s += clock() - t
            pending = bonus[kr]
            active = [active[r] for r in keep]
        return outputs

    def _speculate_chain(self, contexts, active, pending, dlogits, dhidden, m, bt, srow, stats):
        """k chained draft steps, then one verify of [pending, d_1..d_k] per sequence.

        Returns (accepted [A], next token [A], drafts [A, k] (the first `accepted` are kept), base
        features at [pending, d_1..d_k] [A, k+1, F])."""
        dev, bs, k = self.device, self.options.block_size, self.num_spec_tokens
        o = 0 if self.options.prefill_shift else 1
        long = dict(dtype=torch.long, device=dev)
        clock = self._clock
        A = len(active)
        ar = torch.arange(A + 1, **long)
        one = ar[:A]
        proposals, qs = [], []
        d, q = self._draft_pick(dlogits)
        d = self._propose(contexts, active, 0, d)
        proposals.append(d)
        qs.append(q)
        h = dhidden
        t = clock()
        for j in range(1, k):
            p_j = m - 1 + j + o
            dl, h = self._step("draft_step", A, input_ids=d[None], positions=p_j[None], features=h, logits_indices=one,
                               next_tokens=d, query_start_loc=ar[:A + 1], kv_pool=self.draft_pool,
                               slot_mapping=slot_mapping(bt, one, p_j, bs), block_table=bt,
                               spec_rows=srow, committed_len=m)
            d, q = self._draft_pick(dl)
            d = self._propose(contexts, active, j, d)
            proposals.append(d)
            qs.append(q)
        D = torch.stack(proposals, dim=1)  # [A, k]
        stats.time_draft_s += clock() - t

        v_ids = torch.cat([pending[:, None], D], dim=1).reshape(-1)
        v_pos = (m[:, None] + torch.arange(k + 1, **long)[None]).reshape(-1)
        v_seq = torch.repeat_interleave(one, k + 1)
        t = clock()
        logits, feats = self._step("verify", A, input_ids=v_ids[None], positions=v_pos[None],
                                   logits_indices=torch.arange(A * (k + 1), **long), kv_pool=self.base_pool,
                                   slot_mapping=slot_mapping(bt, v_seq, v_pos, bs), block_table=bt,
                                   query_start_loc=ar[:A + 1] * (k + 1), seq_rows=srow)
        stats.time_verify_s += clock() - t
        if self._sampling is None:
            accepted, bonus = greedy_accept(D, greedy(logits).view(A, k + 1))
        else:
            params, gen = self._sampling
            p = warp(logits.view(A, k + 1, -1), *params)
            accepted, bonus = rejection_accept(D, torch.stack(qs, dim=1), p, gen)
        return accepted, bonus, D, feats.view(A, k + 1, -1)

    def _speculate_tree(self, contexts, active, pending, dlogits, dhidden, m, bt, srow, stats):
        """EAGLE-2: grow a draft tree (eagle_fx.draft_tree), verify it in one tree-masked base call,
        accept along it, and move the accepted path's base K/V to the slots right after m.

        Returns what _speculate_chain does, with the accepted path in place of the chain."""
        dev, bs, tree = self.device, self.options.block_size, self.tree
        o = 0 if self.options.prefill_shift else 1
        long = dict(dtype=torch.long, device=dev)
        clock = self._clock
        A, K, N, depth = len(active), tree.top_k, tree.total_tokens, tree.depth
        t = clock()
        tokens, parents = self._grow_tree(dlogits, dhidden, m, bt, srow, o)
        stats.time_draft_s += clock() - t
        if self._tree_hook is not None:
            tokens = self._tree_hook([contexts[s] for s in active], tokens, parents)

        mask = tree_mask(parents)  # [A, N+1, N+1] over [pending, nodes]
        node_depth = mask.sum(-1) - 1
        nodes = torch.cat([pending[:, None], tokens], dim=1)
        v_seq = torch.repeat_interleave(torch.arange(A, **long), N + 1)
        logical = (m[:, None] + torch.arange(N + 1, **long)[None]).reshape(-1)
        t = clock()
        logits, feats = self._call("verify_tree", input_ids=nodes.reshape(1, -1), positions=(m[:, None] + node_depth).reshape(1, -1),
                                   logits_indices=torch.arange(A * (N + 1), **long), kv_pool=self.base_pool,
                                   slot_mapping=slot_mapping(bt, v_seq, logical, bs), block_table=bt,
                                   query_start_loc=torch.arange(A + 1, **long) * (N + 1),
                                   tree_mask=mask.reshape(A * (N + 1), N + 1), tree_start=m, seq_rows=srow)
        stats.time_verify_s += clock() - t
        if self._sampling is None:
            accepted, bonus, path = greedy_walk(parents, tokens, greedy(logits).view(A, N + 1), depth)
        else:
            params, gen = self._sampling
            accepted, bonus, path = sampled_walk(parents, tokens, warp(logits.view(A, N + 1, -1), *params), depth, gen)
        self._compact_path(path, accepted, m, bt)
        drafted = nodes.gather(1, path[:, 1:])
        return accepted, bonus, drafted, feats.view(A, N + 1, -1).gather(1, path[..., None].expand(-1, -1, feats.shape[-1]))

    def _grow_tree(self, dlogits, dhidden, m, bt, srow, o):
        """The draft tree of each sequence: (tokens [A, N], parents [A, N]) (eagle_fx.draft_tree)."""
        dev, bs, tree = self.device, self.options.block_size, self.tree
        long = dict(dtype=torch.long, device=dev)
        A, K, H = dlogits.shape[0], tree.top_k, dhidden.shape[-1]
        tau = tree.score_temperature
        top = torch.log_softmax(dlogits.float() / tau, dim=-1).topk(K, dim=-1)
        toks, scores = [self._to_target(top.indices)], [top.values]
        parents = [torch.full((A, K), -1, **long)]
        front_tok, front_score = toks[0], top.values
        front_cand = torch.arange(K, **long).expand(A, K)
        front_h = dhidden[:, None].expand(A, K, H)
        W = tree.draft_slots
        front_mask = torch.zeros(A, K, W, dtype=torch.bool, device=dev)
        start = m + o  # the draft's first free slot: its tree's slots follow
        seq = torch.repeat_interleave(torch.arange(A, **long), K)
        rows = torch.arange(A * K, **long)
        n_cand = K
        for i in range(tree.depth - 1):
            slot = i * K + torch.arange(K, **long)
            front_mask[:, torch.arange(K, **long), slot] = True
            pos = (m + o + i)[:, None].expand(A, K).reshape(-1)
            dl, h = self._call("draft_tree_step", input_ids=front_tok.reshape(1, -1), positions=pos[None],
                               features=front_h.reshape(A * K, H), logits_indices=rows, next_tokens=front_tok[:, 0],
                               query_start_loc=torch.arange(A + 1, **long) * K, kv_pool=self.draft_pool,
                               slot_mapping=slot_mapping(bt, seq, (start[:, None] + slot[None]).reshape(-1), bs),
                               block_table=bt, tree_mask=front_mask.reshape(A * K, W), tree_start=start,
                               spec_rows=srow, committed_len=m)
            child = torch.log_softmax(dl.float() / tau, dim=-1).view(A, K, -1).topk(K, dim=-1)
            child_score = (front_score[:, :, None] + child.values).reshape(A, K * K)
            toks.append(self._to_target(child.indices).reshape(A, K * K))
            scores.append(child_score)
            parents.append(front_cand[:, :, None].expand(A, K, K).reshape(A, K * K))
            if i < tree.depth - 2:  # the next layer to expand: the top_k children by cumulative score
                best = torch.sort(-child_score, dim=1, stable=True).indices[:, :K]
                parent_row = best // K
                front_tok, front_score = toks[-1].gather(1, best), child_score.gather(1, best)
                front_cand = n_cand + best
                front_h = h.view(A, K, H).gather(1, parent_row[..., None].expand(A, K, H))
                front_mask = front_mask.gather(1, parent_row[..., None].expand(A, K, W))
            n_cand += K * K
        return rerank(torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1), tree.total_tokens)

    def _compact_path(self, path, accepted, m, bt) -> None:
        """Move the base K/V of each accepted tree node (written at slot m + node) to slot m + depth,
        so the committed tokens are contiguous again."""
        j = torch.arange(1, path.shape[1], device=self.device)
        moved = (j[None] <= accepted[:, None]) & (path[:, 1:] != j[None])
        if not bool(moved.any()):
            return
        seq, col = moved.nonzero(as_tuple=True)
        bs = self.options.block_size
        src = slot_mapping(bt, seq, m[seq] + path[seq, col + 1], bs)
        dst = slot_mapping(bt, seq, m[seq] + col + 1, bs)
        L = self.spec.num_layers
        pool = self.base_pool[:L].view(L, 2, -1, *self.base_pool.shape[-2:])
        pool[:, :, dst] = pool[:, :, src]

    def warmup(self) -> None:
        """Call every step graph once per shape class it will see (1 vs many tokens, sequences,
        logits rows), so a compiling backend does its work here and not inside a timed generate.
        Runs on scratch pools: this model's KV and prefix cache are untouched."""
        self.replace()._run_warmup()

    def _run_warmup(self) -> None:
        for lens in ([1], [3], [1, 1], [2, 3]):
            for name in self._fns:
                for all_logits in ((False, True) if name == "base" else (False,)):
                    self._call(name, **self.example_inputs(name, lens, all_logits))

    def example_inputs(self, name: str, lens: list[int], all_logits: bool = False) -> dict:
        """Inputs for step graph `name` on sequences of `lens` tokens at positions 0.. (zeros for
        tokens and features), on this model's pools: for warm-up and export. all_logits: logits
        at every token (a verify), else at each sequence's last token."""
        dev = self.device
        long = dict(dtype=torch.long, device=dev)
        bs = self.options.block_size
        feat = {"base": 0, "verify_tree": 0, "draft_prefill": self.bootstrap.shape[-1],
                "draft_extend": self.bootstrap.shape[-1], "draft_step": self.draft_hidden_size,
                "draft_tree_step": self.draft_hidden_size}[name]
        B, T = len(lens), sum(lens)
        qsl = torch.tensor([0] + list(lens), **long).cumsum(0)
        pos = torch.cat([torch.arange(n, **long) for n in lens])
        seq = torch.repeat_interleave(torch.arange(B, **long), torch.tensor(lens, **long))
        bt = torch.arange(B * self.blocks_per_seq, **long).view(B, -1) % self.allocator.num_blocks
        pool = self.base_pool if name in ("base", "verify_tree") else self.draft_pool
        # tree graphs: each sequence's tokens as a chain-shaped tree from slot 0 (the causal mask)
        W = max(lens)
        tree = torch.zeros(T, W, dtype=torch.bool, device=dev)
        for s, n in enumerate(lens):
            tree[int(qsl[s]):int(qsl[s]) + n, :n] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        kw = dict(input_ids=torch.zeros(1, T, **long), positions=pos[None],
                  logits_indices=torch.arange(T, **long) if all_logits else qsl[1:] - 1,
                  features=torch.zeros(T, feat, device=dev, dtype=self.dtype),
                  carry_features=torch.zeros(B, feat, device=dev, dtype=self.dtype),
                  next_tokens=torch.zeros(B, **long), query_start_loc=qsl, kv_pool=pool, draft_kv_pool=pool,
                  spec_kv=self.spec_kv, slot_mapping=slot_mapping(bt, seq, pos, bs), block_table=bt,
                  spec_rows=torch.arange(B, **long) % self.options.max_batch_size,
                  committed_len=pos[qsl[1:] - 1] + (name == "draft_prefill"),
                  tree_mask=tree, tree_start=torch.zeros(B, **long),
                  mm_embeds=torch.zeros(1, max(self.spec.embed_dim, 1), device=dev, dtype=self.dtype),
                  rope_positions=pos.expand(3, -1)[:, None].contiguous())
        return {k: kw[k] for k in self._inputs[name]}

    def _keep_block_features(self, bt, seq, pos, feats) -> None:
        """Remember the base feature at each block's last position: the carry for a prefix hit."""
        last = pos % self.options.block_size == self.options.block_size - 1
        if bool(last.any()):
            self.block_feature[bt[seq[last], pos[last] // self.options.block_size]] = feats[last]

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
