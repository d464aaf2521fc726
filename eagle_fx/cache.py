"""The paged KV pool: one tensor per model, fixed-size blocks, a free list, slot mapping."""
from __future__ import annotations

import torch


class PoolExhausted(RuntimeError):
    pass


def new_kv_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device) -> torch.Tensor:
    """[layers, 2 (k, v), blocks, block_size, kv_heads, head_dim], zero-filled."""
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


class BlockAllocator:
    """Hands out block ids; `blocks_for(n)` blocks hold positions 0..n-1 of one sequence."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(
                f"KV pool exhausted: {n} blocks wanted, {len(self._free)} of {self.num_blocks} free; "
                "raise max_seq_len or max_batch_size at compile time, or send fewer/shorter prompts"
            )
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def block_table_tensor(rows: list[list[int]], device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def slot_mapping(block_table: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of each token: its sequence's block for the position, times block_size, plus the offset."""
    return block_table[seq_index, positions // block_size] * block_size + positions % block_size
