"""A paged KV layout for op tests: sequences with `lens_before` cached tokens and `per_seq` new
query rows each, in a pool of 2 layers, drawn from one generator (pool, then the block table; the
caller draws its q, k, v after, in the layout it wants)."""
import torch


def paged_layout(lens_before, per_seq, kv_heads, head_dim, block_size, blocks_per_seq, g: torch.Generator):
    """(pool, block_table, slots, positions [1, total], query_start_loc, total rows)."""
    n_seq = len(lens_before)
    pool = torch.randn(2, 2, n_seq * blocks_per_seq + 1, block_size, kv_heads, head_dim, generator=g)
    table = torch.randperm(n_seq * blocks_per_seq, generator=g).view(n_seq, blocks_per_seq)
    pos = torch.cat([torch.arange(n, n + per_seq) for n in lens_before])
    seq = torch.arange(n_seq).repeat_interleave(per_seq)
    slots = table[seq, pos // block_size] * block_size + pos % block_size
    return pool, table, slots, pos[None], torch.arange(n_seq + 1) * per_seq, n_seq * per_seq
