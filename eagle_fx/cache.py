"""The paged KV pool: fixed-size blocks, reference counts, and a prefix cache keyed by block hashes.

A full block is identified by the hash chain of its tokens: h_i = hash(h_{i-1}, tokens of block i).
Blocks a finished sequence leaves behind are kept (reference count 0, evictable, LRU order) so a
later request whose prompt starts with the same token chain reuses them. Base and draft pools are
indexed by the same block ids, so one block id (and one hash) covers both caches.
"""
from __future__ import annotations

from collections import OrderedDict

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
