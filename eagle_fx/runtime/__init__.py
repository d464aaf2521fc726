"""The generate loop along its seams, one module each:

  model.py        SpeculativeModel: generate / replace / reset / warmup (wiring)
  scheduler.py    waves, request validation, stopping; per-call and per-wave state
  prefill.py      chunked base + draft prefill, both schemes
  chain_cycle.py  a chain's cycle as one function (draft steps, verify, acceptance, extend): compiled,
                  or run over the executor's graph calls
  cycle.py        a draft tree's cycle: tree verify, acceptance, the draft's extend
  proposer.py     tree drafting (the injection point for tree test oracles)
  verifier.py     greedy and rejection-sampling acceptance, chains and trees
  sampling.py     warping, sampling, a per-call Sampler
  kv_cache.py     pools, blocks, prefix cache, carried features, compaction, kv_bytes
  executor.py     graph calls from each graph's StepSignature; static buffers / CUDA graphs
  static_buffers.py  per-bucket static inputs, CUDA-graph replay
  signature.py    StepSignature: every graph input's role
  pair.py         PairSpec: what the runtime knows of the pair besides its graphs
  stats.py        vLLM's counters; the opt-in profiler
"""
from eagle_fx.runtime.model import RUNTIME_OPTIONS, SpeculativeModel
from eagle_fx.runtime.pair import PairSpec
from eagle_fx.runtime.proposer import TreeProposer
from eagle_fx.runtime.scheduler import CONFIG_EOS
from eagle_fx.runtime.stats import GenerateOutput, SpecDecodeStats

__all__ = ["CONFIG_EOS", "GenerateOutput", "PairSpec", "RUNTIME_OPTIONS", "SpecDecodeStats",
           "SpeculativeModel", "TreeProposer"]
