"""Train an EAGLE-1 / EAGLE-3 draft for any Hugging Face base on ShareGPT (`eagle-fx train-draft`).

Alignment (the shifted reference scheme, as eagle_fx.capture captures the draft prefill before
drop_prefill_shift): draft row i sees token t_{i+1} with base feature f_i at position i and predicts
t_{i+2}. Loss per unrolled step:

    EAGLE-1: smooth_l1(out_i, f_{i+1}) + 0.1 * CE(lm_head(out_i), p_base(. | t_0..t_{i+1}))
    EAGLE-3: CE(lm_head(norm(out_i)), p_base(...))   (EAGLE-3 has no feature target)

p_base is the base's own next-token distribution (soft cross-entropy). A second unrolled step
feeds the draft's own output back as the feature (what chain drafting does at inference), so the
draft also learns to continue from its own features. Features get a little uniform noise, as in
EAGLE. A KV-sharing draft (kv_share=LAYER) attends over base layer LAYER's K/V for the committed
positions and over its own k/v for the unrolled (speculated) ones, as at inference. Checkpoints are written in the SafeAILab layout that `load_draft` reads, plus
`train_state.pt` (optimizer, step, data position) for `--resume`.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from eagle_fx.drafts import Draft, Eagle1Draft, load_draft, new_draft, save_draft
from eagle_fx.model_inputs import select_features
from eagle_fx.kv_share import resolve_layer


def render(tokenizer, turns: list[tuple[str, str]], add_generation_prompt: bool = False) -> str:
    """A conversation as text, with the tokenizer's chat template when it has one."""
    messages = [{"role": r, "content": t} for r, t in turns]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{r}: {t}\n" for r, t in turns)
    return text + ("assistant: " if add_generation_prompt else "")


def pack_tokens(tokenizer, conversations: list[dict], seq_len: int, max_tokens: int | None = None,
                progress: bool = True) -> torch.Tensor:
    """Tokenise conversations back to back and cut them into [N, seq_len] rows."""
    ids: list[int] = []
    for c in tqdm(conversations, desc="tokenise", disable=not progress, unit="conv"):
        ids.extend(tokenizer(render(tokenizer, c["turns"]), add_special_tokens=False)["input_ids"])
        if max_tokens and len(ids) >= max_tokens:
            break
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"not enough text for one {seq_len}-token row ({len(ids)} tokens)")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def base_features(base, draft: Draft, ids: torch.Tensor):
    """(features [B,S,F], base logits [B,S,V], base layer K/V or None) with the draft's feature
    definition; the K/V ([B,KVH,S,D] each, after RoPE) of the layer a sharing draft reads."""
    layer = draft.kv_share_layer
    out = base(input_ids=ids, output_hidden_states=True, use_cache=layer is not None)
    kv = None
    if layer is not None:
        cached = out.cache.layers[layer]
        kv = cached.keys, cached.values
        if kv[0].shape[-2] != ids.shape[1]:
            raise ValueError(f"base layer {layer} keeps {kv[0].shape[-2]} of {ids.shape[1]} positions in its cache "
                             "(a sliding-window layer); train with --seq-len within its window or share another layer")
    return select_features(out.hidden_states, draft.aux_layer_ids), out.logits, kv


def shared_attention(base_kv, own_kv: list):
    """Attention of a KV-sharing draft in training (eagle_fx.kv_share), as an `attend` hook.

    Row i (token t_{i+1}, at step j of the unroll) attends base keys 0..i (the committed positions
    at inference) and its own keys of steps 0..j (the speculated positions): the k/v each earlier
    unrolled step made for row i, then this step's. `own_kv` collects each step's (k, v).
    """
    kb, vb = base_kv

    def attend(q, k, v, scale):
        own_kv.append((k, v))
        L, S = q.shape[-2], kb.shape[-2]
        rep = q.shape[1] // kb.shape[1]
        kb_, vb_ = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
        s_base = (q @ kb_.transpose(-1, -2)) * scale  # [B,H,L,S]
        visible = torch.arange(S, device=q.device)[None, :] <= torch.arange(L, device=q.device)[:, None]
        s_base = s_base.masked_fill(~visible, float("-inf"))
        ko = torch.stack([kk[:, :, :L] for kk, _ in own_kv], dim=-2).repeat_interleave(rep, 1)  # [B,H,L,j+1,D]
        vo = torch.stack([vv[:, :, :L] for _, vv in own_kv], dim=-2).repeat_interleave(rep, 1)
        s_own = (q.unsqueeze(-2) * ko).sum(-1) * scale  # [B,H,L,j+1]
        p = torch.cat([s_base, s_own], dim=-1).float().softmax(-1).to(q.dtype)
        return p[..., :S] @ vb_ + (p[..., S:].unsqueeze(-1) * vo).sum(-2)

    return attend


def unroll(draft: Draft, ids: torch.Tensor, hidden: torch.Tensor, base_kv=None, steps: int = 2):
    """Yield (step, out [B, L, H]) for each unrolled step: rows i of step j see token t_{i+1+j}; step 0
    takes `hidden` (the projected base features f_i), later steps the previous step's outputs.
    A sharing draft (base_kv given) sits at the base's positions and reads base keys 0..i."""
    B, S = ids.shape
    own_kv: list = []
    # a sharing draft's row for t_{i+1} sits at the base's position of t_{i+1} (unshifted), so its
    # queries line up with the base keys it reads; otherwise only relative positions matter
    pos0 = 1 if base_kv is not None else 0
    for step in range(steps):
        L = S - 1 - step
        if L < 2:
            return
        pos = torch.arange(pos0 + step, pos0 + step + L, device=ids.device).expand(B, L)
        attend = shared_attention(base_kv, own_kv) if base_kv is not None else None
        out = draft.body(ids[:, 1 + step:], pos, hidden[:, :L], attend)
        yield step, out
        hidden = out[:, :-1]  # the draft's own output becomes the next feature (no fc)


def draft_loss(base, draft: Draft, ids: torch.Tensor, noise: float = 0.05, unroll_steps: int = 2) -> tuple[torch.Tensor, dict]:
    """The EAGLE loss of `draft` on token rows `ids`. A bf16/fp16 base trains an fp32 draft (master
    weights) whose forward runs under autocast to the base's dtype, as it will run beside it."""
    base_dtype = next(base.parameters()).dtype
    with torch.autocast(ids.device.type, dtype=base_dtype, enabled=base_dtype in (torch.bfloat16, torch.float16)):
        return _draft_loss(base, draft, ids, noise, unroll_steps)


def _draft_loss(base, draft: Draft, ids: torch.Tensor, noise: float, unroll_steps: int) -> tuple[torch.Tensor, dict]:
    with torch.no_grad():
        feats, base_logits, base_kv = base_features(base, draft, ids)
        probs = base_logits.float().softmax(-1)
    S = ids.shape[1]
    eagle1 = isinstance(draft, Eagle1Draft)
    lm_head = base.get_output_embeddings()
    f_in = feats[:, :-1]
    if noise:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * noise * feats.float().std()
    total, metrics = 0.0, {}
    for step, out in unroll(draft, ids, draft.project(f_in), base_kv, unroll_steps):
        logits = draft.logits(out[:, :-1], lm_head).float()
        target = probs[:, 1 + step:S - 1]  # distribution of t_{i+2+step}
        if draft.d2t is not None and draft.draft_vocab_size != target.shape[-1]:  # EAGLE-3, a pruned vocab
            target = target[..., (torch.arange(draft.draft_vocab_size, device=ids.device) + draft.d2t)]
            target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
        ce = -(target * logits.log_softmax(-1)).sum(-1).mean()
        if eagle1:
            reg = F.smooth_l1_loss(out[:, :-1].float(), feats[:, 1 + step:S - 1].float())
            loss = reg + 0.1 * ce
            metrics[f"reg{step}"] = reg.item()
        else:
            loss = ce
        weight = 1.0 if step == 0 else 0.5
        total = total + weight * loss
        with torch.no_grad():
            pred = draft.to_target(logits.argmax(-1))
            metrics[f"acc{step}"] = (pred == base_logits[:, 1 + step:S - 1].argmax(-1)).float().mean().item()
    return total, metrics


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train_draft(base, rows: torch.Tensor, out_dir, method: str = "eagle", steps: int = 1000,
                minutes: float | None = None, batch_size: int = 8, lr: float = 3e-3, warmup: int = 50,
                checkpoint_every: int = 200, resume: bool = False, seed: int = 0, progress: bool = True,
                draft: Draft | None = None, kv_share: int | None = None) -> Draft:
    """Train a draft on packed token rows [N, S]; write checkpoints to out_dir; return the draft.

    kv_share=LAYER trains a draft that attends over base layer LAYER's K/V (eagle_fx.kv_share).
    The draft trains on the base's device in fp32 (master weights), its forward under autocast to a
    bf16/fp16 base's dtype; checkpoints are fp32 (load_draft casts to the base's dtype)."""
    out_dir = Path(out_dir)
    base.eval()
    for p in base.parameters():
        p.requires_grad_(False)
    state_file = out_dir / "train_state.pt"
    start = 0
    if resume and state_file.exists():
        draft = load_draft(out_dir, base, dtype=torch.float32)
        if draft.method != method:
            raise ValueError(f"--resume: {out_dir} holds an {draft.method} draft, not {method}")
        if kv_share is not None and draft.kv_share_layer != resolve_layer(base, kv_share):
            raise ValueError(f"--resume: {out_dir} holds a draft sharing base layer {draft.kv_share_layer}, not {kv_share}")
        state = torch.load(state_file, map_location="cpu", weights_only=False)
        start = state["step"]
    elif draft is None:
        draft = new_draft(base, method, seed=seed, kv_share=kv_share)
        state = None
    else:
        state = None
    draft.to(device=next(base.parameters()).device, dtype=torch.float32).train()
    if not draft.shares_base_embeddings:  # a shared embedding is the base's, frozen above
        draft.embed_tokens.weight.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    g = random.Random(seed)
    order = list(range(rows.shape[0]))
    g.shuffle(order)
    deadline = time.monotonic() + 60 * minutes if minutes else None
    bar = tqdm(total=steps, initial=start, desc=f"train {method}", disable=not progress, unit="step")
    step = start
    while step < steps:
        if deadline is not None and time.monotonic() > deadline:
            break
        idx = [order[(step * batch_size + j) % len(order)] for j in range(batch_size)]
        batch = rows[idx].to(next(base.parameters()).device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss, m = draft_loss(base, draft, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", **{k: f"{v:.2f}" for k, v in m.items() if k.startswith("acc")})
        if step % checkpoint_every == 0 and step < steps:
            _checkpoint(draft, opt, step, out_dir)
    bar.close()
    _checkpoint(draft, opt, step, out_dir)
    return draft.eval()


def _checkpoint(draft, opt, step, out_dir: Path) -> None:
    save_draft(draft, out_dir, include_embeddings=False)
    tmp = out_dir / "train_state.pt.tmp"
    torch.save({"step": step, "optimizer": opt.state_dict()}, tmp)
    tmp.replace(out_dir / "train_state.pt")
