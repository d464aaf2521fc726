"""The bundled pair with its base sharded over the processes of torchrun (tensor parallelism).

    torchrun --nproc-per-node 2 examples/tensor_parallel.py        # CPU: gloo; GPUs: nccl, one per rank

Every rank compiles the pair with tensor_parallel=WORLD (its shard of the base, the whole draft)
and decodes the same held-out ShareGPT prompts; rank 0 also decodes them in one process without
sharding and with HF greedy generate, and prints whether the outputs agree, and the KV pool bytes
per rank against the unsharded model's.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def main(argv=None) -> bool:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run me under torchrun: torchrun --nproc-per-node 2 examples/tensor_parallel.py")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    dist.init_process_group("nccl" if device is not None else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        import eagle_fx
        from eagle_fx.bench.prompts import load_prompts
        from eagle_fx.bundled import BUNDLED, load_pair

        tokenizer, base, draft = load_pair(BUNDLED / "base", BUNDLED / "eagle")
        if device is not None:
            base, draft = base.to(device), draft.to(device)
        prompts = load_prompts(argparse.Namespace(dataset_name="sharegpt", dataset_path=None, seed=0,
                                                  num_prompts=args.num_prompts, max_prompt_len=128),
                               tokenizer, base.config.vocab_size)
        options = dict(num_spec_tokens=args.num_spec_tokens, max_batch_size=len(prompts), max_seq_len=256)
        tp = eagle_fx.compile(base, draft, tensor_parallel=world, **options)
        out = tp.generate(prompts, max_new_tokens=args.max_new_tokens, eos_token_id=None)
        kv_tp = tp.kv_bytes()
        gathered = [None] * world
        dist.all_gather_object(gathered, out.sequences)
        same_on_ranks = all(g == out.sequences for g in gathered)
        ok = same_on_ranks
        if rank == 0:
            single = eagle_fx.compile(base, draft, **options)
            ref = single.generate(prompts, max_new_tokens=args.max_new_tokens, eos_token_id=None)
            hf = []
            for p in prompts:
                ids = torch.tensor([p], device=device)
                with torch.no_grad():
                    hf.append(base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
            kv_single = single.kv_bytes()
            ok = same_on_ranks and out.sequences == ref.sequences == hf
            print(f"tensor parallel over {world} ranks ({dist.get_backend()}), {len(prompts)} prompts x "
                  f"{args.max_new_tokens} tokens, k={args.num_spec_tokens}")
            print(f"every rank decoded the same tokens: {same_on_ranks}")
            print(f"tp greedy == single: {out.sequences == ref.sequences}")
            print(f"tp greedy == HF greedy: {out.sequences == hf}")
            print(f"mean acceptance length: tp {out.stats.mean_acceptance_length:.2f}, "
                  f"single {ref.stats.mean_acceptance_length:.2f}")
            print(f"base KV pool bytes per rank: {kv_tp['base']:,} (single process: {kv_single['base']:,}, "
                  f"{kv_tp['base'] / kv_single['base']:.2f}x); the draft's own pool, replicated: {kv_tp['draft']:,}")
        dist.barrier()
        return ok
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    ok = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: a gloo rank whose process group is already destroyed can still
    # abort there ("terminate called without an active exception") after all its work succeeded
    os._exit(0 if ok else 1)
