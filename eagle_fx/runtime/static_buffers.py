"""Decode steps and prefills over static buffers, replayed as CUDA graphs on a GPU.

The draft's one-token step and the base's (k+1)-token verify have the same shape every step
except for the number of live sequences A. `StaticStep` pads A up to a bucket (powers of two up
to max_batch_size) and keeps, per bucket, one set of input buffers that every call copies into:

  per-token inputs  [A * rows] -> [bucket * rows]  padding rows: token 0, feature 0, positions
                                                   0..rows-1 in the scratch block
  per-sequence      [A]        -> [bucket]         padding sequences: the scratch block table row,
                                                   the scratch ring row, committed 0
  query_start_loc, logits_indices                  fixed: arange over the bucket
  pools (kv_pool, spec_kv, draft_kv_pool)          passed as they are (persistent tensors)

Padding sequences only write the scratch block (one block past the allocator's) and the scratch
ring row, which nothing real reads. On CUDA each bucket's call is captured once into a
torch.cuda.CUDAGraph and replayed (its outputs are static too: the caller gets views of them,
valid until the next call of the same bucket). On the CPU the same buffers are used and the
graph is simply called: the discipline is the same, without capture. `StaticPrefill` does the
same for the prefill graphs, bucketed by batch and by token count.
"""
from __future__ import annotations

import torch

from eagle_fx.runtime.signature import StepSignature


def buckets(max_batch_size: int) -> list[int]:
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


class CudaGraphReplay:
    """Per bucket, one CUDA graph of the step over its static buffers (captured on first use)."""

    def __init__(self, fn, signature: StepSignature, scratch_block: int, block_size: int, scratch_ring_row: int,
                 capture: bool):
        self.fn, self.signature = fn, signature
        self.names = list(signature.inputs)
        self.per_token, self.per_seq = signature.names("token"), signature.names("seq")
        self.pool_inputs = signature.names("pool")
        unsupported = [n for n in signature.names("wave") + ("rope_positions", "tree_mask") if signature.takes(n)]
        if unsupported:
            raise ValueError(f"static buffers do not pad {unsupported} (step graph {signature.graph!r})")
        self.scratch_block, self.block_size, self.scratch_ring_row = scratch_block, block_size, scratch_ring_row
        self.capture = capture
        self.static: dict = {}  # bucket -> input buffers
        self.graphs: dict = {}  # bucket -> (CUDAGraph, static outputs)
        self.pool = None  # one CUDA graph memory pool for every bucket (outputs are used before the next call)

    def _replay(self, bucket, args: dict):
        if bucket not in self.graphs:
            device = next(v.device for v in args.values() if isinstance(v, torch.Tensor))
            with torch.cuda.device(device):
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    self.fn(**args)  # warm-up outside capture (allocator, autotuning)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    outs = self.fn(**args)
            self.graphs[bucket] = (graph, outs)
        graph, outs = self.graphs[bucket]
        graph.replay()
        return outs

    def _run(self, bucket, inputs: dict, bufs: dict):
        args = {n: (inputs[n] if n in self.pool_inputs else bufs[n]) for n in self.names}
        return self._replay(bucket, args) if self.capture else self.fn(**args)


class StaticStep(CudaGraphReplay):
    """One step graph at a fixed number of rows per sequence, over per-bucket static buffers."""

    def __init__(self, fn, signature: StepSignature, rows: int, max_batch_size: int, scratch_block: int,
                 block_size: int, scratch_ring_row: int, capture: bool):
        super().__init__(fn, signature, scratch_block, block_size, scratch_ring_row, capture)
        self.rows = rows
        self.buckets = buckets(max_batch_size)
        if rows > block_size:
            raise ValueError(f"a static step of {rows} rows per sequence needs block_size >= {rows}")

    def bucket_for(self, n_seq: int) -> int:
        for b in self.buckets:
            if b >= n_seq:
                return b
        raise ValueError(f"{n_seq} sequences > max_batch_size {self.buckets[-1]}")

    def _buffers(self, bucket: int, inputs: dict) -> dict:
        if bucket in self.static:
            return self.static[bucket]
        r, T = self.rows, bucket * self.rows
        bufs = {}
        for name in self.names:
            x = inputs[name]
            if name in self.pool_inputs:
                continue
            if name in self.per_token:
                shape = (1, T) if name in ("input_ids", "positions") else (T, *x.shape[1:])
                bufs[name] = torch.zeros(shape, dtype=x.dtype, device=x.device)
            elif name in self.per_seq:
                bufs[name] = torch.zeros((bucket, *x.shape[1:]), dtype=x.dtype, device=x.device)
            elif name == "query_start_loc":
                bufs[name] = torch.arange(bucket + 1, dtype=x.dtype, device=x.device) * r
            elif name == "logits_indices":
                bufs[name] = torch.arange(T, dtype=x.dtype, device=x.device)
            else:
                raise ValueError(f"StaticStep: no padding rule for graph input {name!r}")
        # what padding rows and sequences hold, to restore the tail after each call's copy
        pad = {}
        if "positions" in bufs:
            pad["positions"] = (torch.arange(T, device=bufs["positions"].device) % r)[None]
        if "slot_mapping" in bufs:
            pad["slot_mapping"] = self.scratch_block * self.block_size + torch.arange(T, device=bufs["slot_mapping"].device) % r
        if "block_table" in bufs:
            pad["block_table"] = torch.full_like(bufs["block_table"], self.scratch_block)
        if "spec_rows" in bufs:
            pad["spec_rows"] = torch.full_like(bufs["spec_rows"], self.scratch_ring_row)
        bufs["_pad"] = pad
        self.static[bucket] = bufs
        return bufs

    def __call__(self, n_seq: int, **inputs):
        bucket = self.bucket_for(n_seq)
        bufs = self._buffers(bucket, inputs)
        n_tok = n_seq * self.rows
        for name, buf in bufs.items():
            if name == "_pad" or name in ("query_start_loc", "logits_indices"):
                continue
            src = inputs[name]
            if name in self.per_token:
                real = n_tok
                if name in ("input_ids", "positions"):
                    buf[:, :real].copy_(src)
                else:
                    buf[:real].copy_(src)
            else:
                real = n_seq
                buf[:real].copy_(src)
            pad = bufs["_pad"].get(name)
            if name in ("input_ids", "positions"):
                buf[:, real:].copy_(pad[:, real:]) if pad is not None else buf[:, real:].zero_()
            else:
                buf[real:].copy_(pad[real:]) if pad is not None else buf[real:].zero_()
        outs = self._run(bucket, inputs, bufs)
        return tuple(o[:n_tok] for o in outs)


class StaticPrefill(CudaGraphReplay):
    """A prefill graph (base or draft) over static buffers, bucketed by batch and token count.

    B ragged sequences of T tokens in all become Bb + 1 sequences of Tb tokens (Bb the batch
    bucket, Tb the power of two >= T + Bb - B + 1, at least 16): the Bb - B filler sequences hold
    one token each and one last padding sequence the rest, all at positions 0.. in the scratch
    block. Every sequence keeps at least one token, so per-sequence index_puts (the carried
    feature of the unshifted draft prefill) never collide. `outputs` names, per graph output,
    whether it has a row per logits index ("seqs") or per token ("tokens").
    """

    def __init__(self, fn, signature: StepSignature, outputs: tuple[str, ...], max_batch_size: int, max_tokens: int,
                 scratch_block: int, block_size: int, scratch_ring_row: int, capture: bool):
        super().__init__(fn, signature, scratch_block, block_size, scratch_ring_row, capture)
        self.outputs = outputs
        self.batch_buckets = buckets(max_batch_size)
        self.max_tokens = max(16, 1 << (max_tokens - 1).bit_length())

    def bucket_for(self, n_seq: int, n_tok: int) -> tuple[int, int]:
        bb = next(b for b in self.batch_buckets if b >= n_seq)
        tb = max(16, 1 << (n_tok + bb - n_seq).bit_length())  # >= n_tok + fillers + 1
        return bb, tb

    def __call__(self, **inputs):
        qsl = inputs["query_start_loc"]
        n_seq, n_tok = qsl.shape[0] - 1, inputs["positions"].shape[1]
        bb, tb = self.bucket_for(n_seq, n_tok)
        if tb > self.max_tokens:  # longer than any bucket: run as is
            return self.fn(**{n: inputs[n] for n in self.names})
        bufs = self._buffers(bb, tb, inputs)
        dev = qsl.device
        fillers = bb - n_seq
        # padding layout: fillers of one token, then the last padding sequence
        pad_lens = torch.ones(fillers + 1, dtype=torch.long, device=dev)
        pad_lens[-1] = tb - n_tok - fillers
        pad_pos = torch.arange(tb - n_tok, device=dev) - torch.repeat_interleave(
            torch.cumsum(pad_lens, 0) - pad_lens, pad_lens)
        if "block_table" in bufs:  # stay within the block-table row (all scratch block): wrap positions
            pad_pos = pad_pos % (bufs["block_table"].shape[1] * self.block_size)
        for name, buf in bufs.items():
            src = inputs[name]
            if name in ("input_ids", "positions"):
                buf[:, :n_tok].copy_(src)
                buf[:, n_tok:].copy_(pad_pos[None]) if name == "positions" else buf[:, n_tok:].zero_()
            elif name in ("features", "slot_mapping"):
                buf[:n_tok].copy_(src)
                if name == "slot_mapping":
                    buf[n_tok:].copy_(self.scratch_block * self.block_size + pad_pos % self.block_size)
                else:
                    buf[n_tok:].zero_()
            elif name == "query_start_loc":
                buf[:n_seq + 1].copy_(src)
                buf[n_seq + 1:].copy_(n_tok + torch.cumsum(pad_lens, 0))
            elif name == "logits_indices":
                buf[:n_seq].copy_(src)
                buf[n_seq:].copy_(n_tok + torch.cumsum(pad_lens, 0) - 1)
            else:  # per sequence
                buf[:n_seq].copy_(src)
                fill = {"block_table": self.scratch_block, "spec_rows": self.scratch_ring_row,
                        "committed_len": 1 << 30}.get(name, 0)  # padding: all committed, nothing to write
                buf[n_seq:].fill_(fill)
        outs = self._run((bb, tb), inputs, bufs)
        return tuple(o[:n_seq] if kind == "seqs" else o[:n_tok] for o, kind in zip(outs, self.outputs))

    def _buffers(self, bb: int, tb: int, inputs: dict) -> dict:
        key = (bb, tb)
        if key not in self.static:
            bufs = {}
            for name in self.names:
                if name in self.pool_inputs:
                    continue
                x = inputs[name]
                if name in ("input_ids", "positions"):
                    shape = (1, tb)
                elif name in ("features", "slot_mapping"):
                    shape = (tb, *x.shape[1:])
                elif name == "query_start_loc":
                    shape = (bb + 2,)
                else:  # per sequence, and logits_indices (one per sequence)
                    shape = (bb + 1, *x.shape[1:])
                bufs[name] = torch.zeros(shape, dtype=x.dtype, device=x.device)
            self.static[key] = bufs
        return self.static[key]
