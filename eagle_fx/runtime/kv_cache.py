"""The KV cache: paged pools, blocks with reference counts, a prefix cache keyed by block hashes,
and the runtime's view of it (KVCache: pools, block tables, carried features, compaction, bytes).

A full block is identified by the hash chain of its tokens: h_i = hash(h_{i-1}, tokens of block i).
Blocks a finished sequence leaves behind are kept (reference count 0, evictable, LRU order) so a
later request whose prompt starts with the same token chain reuses them. Base and draft pools are
indexed by the same block ids, so one block id (and one hash) covers both caches.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


class PoolExhausted(RuntimeError):
    pass


def new_kv_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device) -> torch.Tensor:
    """[layers, 2 (k, v), blocks, block_size, kv_heads, head_dim], zero-filled."""
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def block_hashes(tokens: list[int], block_size: int, num_blocks: int | None = None) -> list[int]:
    """Hash chain of the first `num_blocks` full blocks of `tokens` (all full blocks by default)."""
    n = len(tokens) // block_size if num_blocks is None else num_blocks
    out, h = [], 0
    for i in range(n):
        h = hash((h, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class BlockAllocator:
    """Block ids with reference counts; cached blocks (ref 0) are evicted least recently used first."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._ref = [0] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._tokens_of: dict[int, tuple] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks a request can get now: never-used plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise PoolExhausted(
                f"KV pool exhausted: {n} blocks wanted, {self.num_free} of {self.num_blocks} free; "
                "raise num_blocks (eagle_fx.compile(..., num_blocks=N) or model.replace(num_blocks=N)) "
                "or lower max_batch_size"
            )
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # evict the least recently used cached block
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                del self._tokens_of[b]
            self._ref[b] = 1
            out.append(b)
        return out

    def match(self, tokens: list[int], num_blocks: int) -> list[int]:
        """Take a reference on the longest cached prefix of the first `num_blocks` full blocks of
        `tokens` (found by hash, confirmed token by token); return its block ids."""
        out = []
        for i, h in enumerate(block_hashes(tokens, self.block_size, num_blocks)):
            b = self._by_hash.get(h)
            if b is None or self._tokens_of[b] != tuple(tokens[i * self.block_size:(i + 1) * self.block_size]):
                break
            if self._ref[b] == 0:
                self._evictable.pop(b)
            self._ref[b] += 1
            out.append(b)
        return out

    def register(self, block: int, h: int, tokens: tuple) -> bool:
        """Make a full block findable by its hash; True when `h` now maps to `block`
        (False when another block already holds that hash)."""
        if h not in self._by_hash and block not in self._hash_of:
            self._by_hash[h] = block
            self._hash_of[block] = h
            self._tokens_of[block] = tuple(tokens)
        return self._by_hash.get(h) == block

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} released more often than it was taken (eagle_fx bug)")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                    self._evictable.move_to_end(b)
                else:
                    self._free.append(b)


def block_table_tensor(rows: list[list[int]], device, width: int | None = None) -> torch.Tensor:
    """Rows padded with block 0 to `width` (a fixed width keeps step-graph shapes stable)."""
    width = max(max(len(r) for r in rows), width or 0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def slot_mapping(block_table: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of each token: its sequence's block for the position, times block_size, plus the offset."""
    return block_table[seq_index, positions // block_size] * block_size + positions % block_size


@dataclass
class WaveBlocks:
    """The blocks a wave holds: per sequence its block ids (cached prefix first), how many of its
    prompt tokens came from the prefix cache, and the block table the graphs read."""

    rows: list[list[int]]
    cached_tokens: list[int]
    block_table: torch.Tensor


class KVCache:
    """The pools a model's step graphs read and write, and the blocks handed out of them.

    draft_kv (how the draft's K/V is kept, decided at compile and recorded in the PairSpec):
      "pool"  the draft's K/V is one more layer (index num_layers) of the base's pool;
      "own"   the draft has a pool of its own (shifted scheme, or other kv shapes);
      "layer" the draft reads base layer `draft_layer` for committed positions and keeps only its
              speculated positions in the `spec_kv` ring (k slots per sequence).
    With static buffers one scratch block (past the allocator's) and one scratch ring row hold what
    padding sequences write; nothing real reads them.
    """

    def __init__(self, spec, options, lookahead: int, scratch: bool):
        self.block_size = options.block_size
        self.kv_mode = spec.draft_kv
        self.blocks_per_seq = -(-(options.max_seq_len + lookahead) // options.block_size)
        self.num_blocks = options.num_blocks or options.max_batch_size * self.blocks_per_seq
        self.scratch_block = self.num_blocks  # used only when `scratch`
        self.allocator = BlockAllocator(self.num_blocks, options.block_size)
        num_layers, pool_blocks = spec.num_layers, self.num_blocks + int(scratch)
        self.base_pool = new_kv_pool(num_layers + (self.kv_mode == "pool"), pool_blocks, options.block_size,
                                     spec.kv_heads, spec.head_dim, spec.dtype, spec.device)
        self.draft_pool = self.base_pool if self.kv_mode != "own" else new_kv_pool(
            1, pool_blocks, options.block_size, spec.draft_kv_heads, spec.draft_head_dim, spec.dtype, spec.device)
        self.draft_layer = {"own": 0, "pool": num_layers, "layer": spec.kv_share_layer}[self.kv_mode]
        self.num_base_layers = num_layers
        # a sharing draft's own K/V: the k speculated positions (bonus + k-1 steps) of each sequence
        self.spec_kv = torch.zeros(2, options.max_batch_size + int(scratch), options.num_spec_tokens,
                                   spec.draft_kv_heads, spec.draft_head_dim, dtype=spec.dtype,
                                   device=spec.device) if self.kv_mode == "layer" else None
        # the base feature at each block's last position: a prefix hit's carried feature
        self.block_feature = torch.zeros(self.num_blocks, spec.feature_dim, device=spec.device, dtype=spec.dtype)

    def reset(self) -> None:
        """Empty the cache in place: zero the pools, forget every cached block."""
        for t in (self.base_pool, self.draft_pool, self.spec_kv, self.block_feature):
            if t is not None:
                t.zero_()
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)

    def pools(self, graph_reads_base: bool) -> dict:
        """The pool inputs of a step graph (its signature picks the ones it declares)."""
        if graph_reads_base:
            return {"kv_pool": self.base_pool}
        return {"kv_pool": self.draft_pool, "draft_kv_pool": self.draft_pool, "spec_kv": self.spec_kv}

    def pools_by_side(self) -> dict:
        """{"base": the base graphs' pool inputs, "draft": the draft graphs'} (a chain cycle calls both)."""
        return {"base": self.pools(True), "draft": self.pools(False)}

    @property
    def draft_kv(self) -> torch.Tensor:
        """The K/V the draft attends to for cached positions: [2, blocks, block_size, kv_heads, head_dim]
        (kv_share=LAYER: the base layer it reads)."""
        return self.draft_pool[self.draft_layer]

    def table_width(self, positions: int) -> int:
        """Blocks a block table needs to cover `positions` positions (the decode-step graphs take
        any width: their sizes are dynamic), capped at a sequence's whole row."""
        return min(self.allocator.blocks_for(positions), self.blocks_per_seq)

    def admit(self, keys: list[list[int]], prompt_lens: list[int], max_new: int, lookahead: int, caching: bool,
              prefill_shift: bool) -> WaveBlocks:
        """Blocks for each sequence of a wave: its cached prefix (when caching), then fresh blocks
        for prompt + max_new + lookahead positions. On failure nothing stays taken."""
        bs = self.block_size
        rows: list[list[int]] = []
        cached: list[int] = []
        try:
            for key, n in zip(keys, prompt_lens):
                need = self.allocator.blocks_for(n + max_new + lookahead)
                if need > self.allocator.num_blocks:
                    raise PoolExhausted(
                        f"one request needs {need} blocks but the KV pool has {self.allocator.num_blocks}; "
                        "raise num_blocks (eagle_fx.compile(..., num_blocks=N) or model.replace(num_blocks=N)), "
                        "or shorten the prompt / max_new_tokens")
                hit: list[int] = []
                if caching:
                    hit = self.allocator.match(key, (n - 1) // bs)  # keep at least one prompt token to compute
                    if prefill_shift and hit:
                        # shifted, a block's last draft slot depends on the next block's first token: the
                        # last matched block is recomputed (vLLM drops it the same way)
                        self.allocator.release([hit.pop()])
                rows.append(hit)
                rows[-1] = hit + self.allocator.allocate(need - len(hit))
                cached.append(len(hit) * bs)
        except BaseException:
            for blocks in rows:
                self.allocator.release(blocks)
            raise
        return WaveBlocks(rows, cached, block_table_tensor(rows, self.base_pool.device, self.blocks_per_seq))

    def carry_features(self, blocks: WaveBlocks, bootstrap: torch.Tensor) -> torch.Tensor:
        """The unshifted draft's feature before each sequence's first computed token: the bootstrap,
        or after a prefix hit the base feature at the last cached position."""
        carry = bootstrap.expand(len(blocks.rows), -1).clone()
        for seq, cached in enumerate(blocks.cached_tokens):
            if cached:
                carry[seq] = self.block_feature[blocks.rows[seq][cached // self.block_size - 1]]
        return carry

    def release(self, blocks: WaveBlocks) -> None:
        for row in blocks.rows:
            self.allocator.release(row)

    def cache_finished(self, keys: list[list[int]], outputs: list[list[int]], blocks: WaveBlocks,
                       final_positions: list[int], prefill_shift: bool) -> None:
        """Make the full blocks of finished sequences findable (only positions whose base and draft
        K/V are final: `final_positions` per sequence)."""
        bs = self.block_size
        for key, out, row, n_final in zip(keys, outputs, blocks.rows, final_positions):
            tokens = key + out
            for i, (block, h) in enumerate(zip(row, block_hashes(tokens, bs, min(n_final, len(tokens)) // bs))):
                if not self.allocator.register(block, h, tokens[i * bs:(i + 1) * bs]) and prefill_shift:
                    # shifted, the cached block for this hash ends with a draft slot computed from
                    # another request's next token: later blocks of this chain must not follow it
                    break

    def keep_block_features(self, block_table, seq, positions, features) -> None:
        """Remember the base feature at each block's last position: the carry for a prefix hit."""
        last = positions % self.block_size == self.block_size - 1
        if bool(last.any()):
            self.block_feature[block_table[seq[last], positions[last] // self.block_size]] = features[last]

    def compact_path(self, path, accepted, committed_len, block_table) -> None:
        """Move the base K/V of each accepted tree node (written at slot committed_len + node) to slot
        committed_len + depth, so the committed tokens are contiguous again."""
        depth = torch.arange(1, path.shape[1], device=path.device)
        moved = (depth[None] <= accepted[:, None]) & (path[:, 1:] != depth[None])
        if not bool(moved.any()):
            return
        seq, col = moved.nonzero(as_tuple=True)
        src = slot_mapping(block_table, seq, committed_len[seq] + path[seq, col + 1], self.block_size)
        dst = slot_mapping(block_table, seq, committed_len[seq] + col + 1, self.block_size)
        layers = self.num_base_layers
        pool = self.base_pool[:layers].view(layers, 2, -1, *self.base_pool.shape[-2:])
        pool[:, :, dst] = pool[:, :, src]

    def kv_bytes(self) -> dict:
        """Bytes of KV memory: the base's layers, what the draft holds besides them, and the draft's
        bytes per cached token (0 when it reads a base layer: its ring does not grow with length)."""
        base = self.base_pool[:self.num_base_layers]
        draft_kv = self.draft_kv
        per_token = draft_kv.numel() * draft_kv.element_size() // (draft_kv.shape[1] * self.block_size)
        if self.kv_mode == "layer":
            draft, per_token = self.spec_kv.numel() * self.spec_kv.element_size(), 0
        elif self.kv_mode == "pool":
            draft = draft_kv.numel() * draft_kv.element_size()
        else:
            draft = self.draft_pool.numel() * self.draft_pool.element_size()
        return {"base": base.numel() * base.element_size(), "draft": draft, "draft_per_token": per_token}
