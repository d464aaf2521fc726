"""Which keys a query sees: the causal (and sliding-window) rule, and a draft tree's."""
from __future__ import annotations

import torch
from torch import Tensor


def visible_keys(q_pos: Tensor, num_keys: int, sliding_window: int, first_key: int | Tensor = 0) -> Tensor:
    """Bool mask [..., num_keys]: key position first_key + j is visible to a query at position p (q_pos [...]).
    first_key may be a 0-d tensor (a chunk index inside a compiled loop)."""
    dist = q_pos[..., None] - (torch.arange(num_keys, device=q_pos.device) + first_key)
    mask = dist >= 0
    if sliding_window > 0:
        mask &= dist < sliding_window
    return mask


def tree_visible_keys(q_pos: Tensor, tree_rows: Tensor, tree_start: Tensor, num_keys: int,
                      sliding_window: int, first_key: int | Tensor = 0) -> Tensor:
    """Bool mask [B, P, num_keys] for B sequences of P tree queries at positions q_pos [B, P]: keys
    (at positions first_key + j) below tree_start [B] by position (and window), then the W tree
    slots from tree_start that each query's row of tree_rows [B, P, W] marks. A row marks the
    query's ancestors and itself, which in slot order sit at depths 0, 1, ..., so its j-th marked
    slot is at position tree_start + j: the sliding window applies to them by that position."""
    width = tree_rows.shape[-1]
    key = torch.arange(num_keys, device=q_pos.device) + first_key
    start = tree_start[:, None, None]
    past = visible_keys(q_pos, num_keys, sliding_window, first_key) & (key < start)
    slot = key - start  # [B, 1, S]: the tree slot a key is, when 0 <= slot < W
    in_tree = (slot >= 0) & (slot < width)
    index = slot.clamp(0, width - 1).expand(-1, q_pos.shape[1], -1)
    tree = tree_rows.bool()
    marked = tree.gather(2, index) & in_tree
    if sliding_window > 0:
        slot_pos = start + tree.long().cumsum(2) - 1  # [B, P, W]
        marked &= q_pos[..., None] - slot_pos.gather(2, index) < sliding_window
    return past | marked
