"""SpeculativeModel: a base + EAGLE draft pair as step graphs over paged KV pools; generate,
replace, reset and warm-up. Wiring only: the work is in the runtime's other modules."""
from __future__ import annotations

import dataclasses
import threading
import time

import torch

from eagle_fx.graph_kinds import GRAPH_KINDS
from eagle_fx.multimodal import prompt_images
from eagle_fx.options import Options, lookahead
from eagle_fx.runtime.chain_cycle import ChainCycle
from eagle_fx.runtime.executor import Executor
from eagle_fx.runtime.hf_inputs import NOT_GIVEN, check_streamer, prompts_from, settings_from
from eagle_fx.runtime.kv_cache import KVCache, slot_mapping
from eagle_fx.runtime.pair import PairSpec
from eagle_fx.runtime.proposer import TreeProposer
from eagle_fx.runtime.sampling import Sampler
from eagle_fx.runtime.scheduler import CONFIG_EOS, GenerateCall, check_prompts, eos_set, new_wave, run_wave
from eagle_fx.runtime.signature import StepSignature
from eagle_fx.runtime.stats import GenerateOutput, Profiler, SpecDecodeStats

# generate's own defaults, where a call passes neither the setting nor a generation_config with it
GENERATE_DEFAULTS = dict(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=128, eos_token_id=CONFIG_EOS)
RUNTIME_OPTIONS = ("num_spec_tokens", "max_batch_size", "max_seq_len", "block_size", "prefill_chunk_size",
                   "prefix_caching", "bootstrap", "num_blocks", "static_steps", "draft_tree")


class SpeculativeModel:
    """A base + EAGLE draft pair captured as step graphs over paged KV pools.

    More prompts than `max_batch_size` are run in waves of at most `max_batch_size` sequences.
    `graphs` (the GraphModules, with their pass log) is None for a pair loaded from exported files;
    `signatures` then says what each graph takes. A chain runs its cycle as one function
    (eagle_fx.runtime.chain_cycle); a draft tree runs `proposer` (a TreeProposer, the injection
    point for tree test oracles). `forced_drafts(contexts, k) -> [A, k] token ids (-1: the draft's
    own)`, a test oracle for chains: called before each cycle with each active sequence's prompt +
    output, its tokens replace the draft's proposals (greedy only).
    """

    def __init__(self, graphs, callables: dict, options: Options, spec: PairSpec,
                 signatures: dict[str, StepSignature] | None = None, image_encoder=None, proposer=None,
                 chain_cycles: dict | None = None, forced_drafts=None):
        self.graphs, self.callables, self.options, self.spec = graphs, callables, options, spec
        self.image_encoder = image_encoder  # a vision-language base's images -> embeddings (eagle_fx.multimodal)
        self.signatures = signatures or {name: StepSignature.of_graph(name, getattr(graphs, name)) for name in callables}
        self.device, self.dtype = spec.device, spec.dtype
        self.tree = options.draft_tree  # a DraftTree (EAGLE-2) or None (a chain of num_spec_tokens)
        if self.tree is not None and "verify_tree" not in callables:
            raise ValueError("draft_tree needs the tree step graphs: pass draft_tree= to eagle_fx.compile")
        if proposer is not None and (self.tree is None or not isinstance(proposer, TreeProposer)):
            raise ValueError("proposer= takes a TreeProposer, for a model with a draft tree (a chain drafts inside "
                             "its cycle; its test oracle is forced_drafts=)")
        if forced_drafts is not None and self.tree is not None:
            raise ValueError("forced_drafts= forces a chain's drafts; for a draft tree pass proposer=TreeProposer(...)")
        self.proposer = proposer or (TreeProposer() if self.tree is not None else None)
        self.forced_drafts = forced_drafts
        self.draft_offset = 0 if options.prefill_shift else 1  # unshifted, draft slot p holds t_p
        # cache slots past the committed tokens one speculation step writes
        self.lookahead = lookahead(options)
        self.static_steps = options.static_steps if options.static_steps is not None else (
            options.backend == "triton" and not spec.vision_language)
        self.kv_cache = KVCache(spec, options, self.lookahead, scratch=self.static_steps)
        self.executor = Executor(callables, self.signatures, self.kv_cache)
        if self.static_steps:
            self.executor.use_static_buffers(graphs, options, self.device)
        bootstrap = options.bootstrap if options.bootstrap is not None else torch.zeros(spec.feature_dim)
        if tuple(bootstrap.shape) != (spec.feature_dim,):
            raise ValueError(f"bootstrap must be a [{spec.feature_dim}] feature vector (the draft's input feature "
                             f"size), got {tuple(bootstrap.shape)}")
        self.bootstrap = bootstrap.to(device=self.device, dtype=self.dtype)[None]
        # chain cycles (compiled ones included) are shared with every model replace() makes from this one
        self._chain_cycles = chain_cycles if chain_cycles is not None else {}
        self.chain_cycle = self.chain_cycle_for(options.num_spec_tokens) if self.tree is None else None
        self.speculates = options.num_spec_tokens > 0
        self._lock = threading.Lock()  # one generate at a time: the pools are this model's
        self._grammars = None  # generate(response_format=...): compiled grammars, kept across calls
        self._lock_owner: int | None = None

    def replace(self, proposer=None, forced_drafts=None, **changes) -> "SpeculativeModel":
        """A model over the same captured graphs with other runtime options (k, batch, lengths,
        draft tree) and new pools; proposer= / forced_drafts= inject test oracles (see the class)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Options)})
        if unknown:
            raise ValueError(f"replace(): unknown option(s) {unknown}; it takes {RUNTIME_OPTIONS}, proposer and "
                             "forced_drafts")
        bad = sorted(set(changes) - set(RUNTIME_OPTIONS))
        if bad:
            raise ValueError(f"replace() takes {RUNTIME_OPTIONS}; {bad} change the captured graphs: call eagle_fx.compile again")
        options = dataclasses.replace(self.options, **changes)
        options.check_for_pair(self.spec.vision_language, self.spec.rope_limit)
        if proposer is None and "draft_tree" not in changes:
            proposer = self.proposer
        if forced_drafts is None and "draft_tree" not in changes:
            forced_drafts = self.forced_drafts
        return SpeculativeModel(self.graphs, self.callables, options, self.spec, self.signatures, self.image_encoder,
                                proposer, self._chain_cycles, forced_drafts)

    def chain_cycle_for(self, num_spec_tokens: int) -> ChainCycle:
        """The chain cycle (eagle_fx.runtime.chain_cycle) of k = num_spec_tokens over this model's
        graphs (the serving engine's adaptive speculation runs several k on one model). With
        backend="inductor" (and the GraphModules at hand, no static buffers, not a vision-language
        pair) it also holds the cycle compiled as one graph. Shared with every model replace() makes."""
        compile = (self.options.backend == "inductor" and self.graphs is not None and not self.static_steps
                   and not self.spec.vision_language)
        key = (num_spec_tokens, self.options.block_size, compile)
        if key not in self._chain_cycles:
            graphs = {name: getattr(self.graphs, name) for name in ("draft_step", "verify", "draft_extend")} \
                if compile else None
            self._chain_cycles[key] = ChainCycle(graphs, self.signatures, self.spec,
                                                 num_spec_tokens, self.draft_offset,
                                                 self.options.block_size, gemm_autotune=self.options.gemm_autotune)
        return self._chain_cycles[key]

    def reset(self) -> None:
        """Empty the KV pools and the prefix cache in place (graphs, compiled code and static
        buffers stay)."""
        with self._lock:
            self.kv_cache.reset()

    @property
    def num_spec_tokens(self) -> int:
        return self.options.num_spec_tokens

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def new_stats(self) -> SpecDecodeStats:
        """Empty counters for this model's speculation (a chain of k, or a tree)."""
        if self.tree is None:
            return SpecDecodeStats(self.num_spec_tokens)
        return SpecDecodeStats(self.tree.depth, self.tree.total_tokens)

    @torch.no_grad()
    def generate(self, prompts=None, max_new_tokens: int = NOT_GIVEN, eos_token_id=NOT_GIVEN,
                 temperature: float = NOT_GIVEN, top_p: float = NOT_GIVEN, top_k: int = NOT_GIVEN,
                 seed: int | None = None, pixel_values=None,
                 image_grid_thw=None, profile: bool | str = False, *, input_ids=None, attention_mask=None,
                 do_sample: bool | None = None, generation_config=None, streamer=None, response_format=None,
                 tokenizer=None) -> GenerateOutput:
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
        placeholder tokens in order (each image is encoded once). profile=True times every
        step-graph call into .stats, a compiled chain cycle as one call ("chain_cycle");
        profile="graphs" runs the chain cycle graph by graph through the executor and times each
        step graph (both synchronise with the device on a GPU; off by default).

        As HF users pass them (eagle_fx.runtime.hf_inputs): `input_ids` (a 2-D tensor) with its
        `attention_mask` (left or right padding, dropped), a tokenizer's BatchEncoding as prompts,
        `do_sample`, `generation_config` (its sampling settings and max_new_tokens / eos apply where
        this call leaves them at their defaults; others are warned about by name), `streamer`
        (transformers' streamers, one prompt).

        Structured output: response_format (an OpenAI response_format dict, a JSON schema dict, or an
        eagle_fx.structured GrammarSpec for a regex or EBNF grammar) with the base's `tokenizer`:
        every prompt's output follows the grammar (xgrammar), drafts included, and greedy equals HF
        generate with xgrammar's logits processor (chains only; a bad grammar is an error first).

        One model runs one generate at a time: a second thread waits for the first to finish; a
        generate called from inside another (a callback) is an error."""
        me = threading.get_ident()
        if self._lock_owner == me:
            raise RuntimeError("generate() was called again from inside a running generate() on the same model; "
                               "use another model (model.replace()) for nested calls")
        prompts = prompts_from(prompts, input_ids, attention_mask, self.spec.pad_token_id)
        temperature, top_p, top_k, max_new_tokens, eos_token_id = settings_from(
            generation_config, do_sample, temperature, top_p, top_k, max_new_tokens, eos_token_id, GENERATE_DEFAULTS)
        with self._lock:
            self._lock_owner = me
            try:
                return self._generate(prompts, max_new_tokens, eos_token_id, temperature, top_p, top_k, seed,
                                      pixel_values, image_grid_thw, profile, streamer, (response_format, tokenizer))
            finally:
                self._lock_owner = None

    def generate_text(self, texts, tokenizer, **generate_kwargs) -> list[str]:
        """Text in, text out: each string tokenised by `tokenizer` (as it is, no chat template),
        generated with generate(**generate_kwargs), the new tokens decoded (special tokens skipped)."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise TypeError("generate_text takes a string or a list of strings; for token ids use generate()")
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError("generate_text needs tokenizer= (a transformers tokenizer for the base)")
        prompts = [tokenizer(t)["input_ids"] for t in texts]
        out = self.generate(prompts, **generate_kwargs)
        return [tokenizer.decode(s, skip_special_tokens=True) for s in out.sequences]

    def _generate(self, prompts, max_new_tokens, eos_token_id, temperature, top_p, top_k, seed, pixel_values,
                  image_grid_thw, profile, streamer=None, structured=(None, None)) -> GenerateOutput:
        prompts = check_prompts(prompts, max_new_tokens, self.spec.vocab_size, self.options.max_seq_len)
        check_streamer(streamer, len(prompts))
        eos = eos_set(eos_token_id, self.spec.eos)
        images = prompt_images(self.image_encoder, self.spec.image_token_id, prompts, pixel_values, image_grid_thw,
                               self.device, self.dtype)
        if structured[0] is not None and (self.tree is not None or self.spec.vision_language):
            raise ValueError("response_format runs on chains: a draft tree's nodes are not masked (compile without "
                             "draft_tree=), and a vision-language pair decodes in waves")
        if profile not in (False, True, "graphs"):
            raise ValueError(f"profile must be False, True or 'graphs' (each step graph of the cycle timed), got "
                             f"{profile!r}")
        stats = self.new_stats()
        call = GenerateCall(Sampler.for_call(temperature, top_p, top_k, seed, self.device), stats,
                            Profiler(stats, bool(profile), self.device), eos, max_new_tokens, streamer,
                            graph_by_graph=profile == "graphs")
        if streamer is not None:
            streamer.put(torch.tensor([prompts[0]]))  # as HF generate: the prompt first (skip_prompt skips it)
        started = time.perf_counter()
        sequences: list[list[int]] = []
        if self.tree is None and not self.spec.vision_language:  # a chain: continuous batching on an engine
            sequences = self._generate_on_engine(call, prompts, *structured)
        else:  # a draft tree, or a vision-language wave's image tables: waves of max_batch_size
            batch = self.options.max_batch_size
            for first in range(0, len(prompts), batch):
                wave = new_wave(self, prompts[first:first + batch], images[first:first + batch])
                sequences += run_wave(self, call, wave)
        if streamer is not None:
            streamer.end()
        stats.total_num_output_tokens = sum(len(s) for s in sequences)
        stats.wall_time_s = time.perf_counter() - started
        return GenerateOutput(sequences, stats)

    def _generate_on_engine(self, call: GenerateCall, prompts: list[list[int]], response_format=None,
                            tokenizer=None) -> list[list[int]]:
        """Every prompt on one serving engine at this model's k: more prompts than max_batch_size
        join as others finish (eagle_fx.serving.engine)."""
        from eagle_fx.serving.engine import Engine
        from eagle_fx.serving.grammars import EngineGrammars
        from eagle_fx.serving.requests import SamplingParams

        engine = Engine(self, speculation=self.num_spec_tokens, call=call, measure=False)
        if response_format is not None:  # structured output (the tokenizer for it only: no text, no stop strings)
            if self._grammars is None or self._grammars.tokenizer is not tokenizer:
                self._grammars = EngineGrammars(tokenizer, self.spec.vocab_size)
            engine.grammars = self._grammars
        params = SamplingParams(max_tokens=call.max_new_tokens, eos_token_id=tuple(sorted(call.eos)),
                                response_format=response_format)
        ids = [engine.add_request(p, params) for p in prompts]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if call.streamer is not None:
                    for t in out.new_token_ids:
                        call.streamer.put(torch.tensor([t]))
                if out.finished:
                    done[out.request_id] = out.token_ids
        return [done[i] for i in ids]

    @property
    def draft_kv(self) -> torch.Tensor:
        """The K/V the draft attends to for cached positions (kv_share=LAYER: the base layer it reads)."""
        return self.kv_cache.draft_kv

    def kv_bytes(self) -> dict:
        """Bytes of KV memory: base layers, the draft's besides them, the draft's per cached token."""
        return self.kv_cache.kv_bytes()

    def warmup(self) -> None:
        """Call every step graph once per shape class it will see (1 vs many tokens, sequences,
        logits rows), so a compiling backend does its work here and not inside a timed generate.
        Runs on scratch pools: this model's KV and prefix cache are untouched. With max_batch_size=1
        only one-sequence shapes (a model replace() makes with a larger batch compiles the others
        when it first meets them)."""
        scratch = self.replace()
        compiled_cycle = self.chain_cycle is not None and self.chain_cycle.compile
        batch = self.options.max_batch_size
        for lens in [lens for lens in ([1], [3], [1, 1], [2, 3]) if len(lens) <= batch]:
            for name in self.callables:
                if compiled_cycle and name in ("draft_step", "verify"):
                    continue  # they run inside the compiled cycle (compiled on their own when first called)
                if not self.speculates and not self.signatures[name].is_base:
                    continue  # num_spec_tokens=0: the draft never runs
                uniform = self.signatures[name].uniform_rows
                rows = [max(lens)] * len(lens) if uniform else lens  # a decode-step graph: rows alike per sequence
                for all_logits in ((False, True) if name == "base" else (GRAPH_KINDS[name].all_logits,)):
                    scratch.executor.call(name, **scratch.example_inputs(name, rows, all_logits))
        if compiled_cycle:  # the cycle graph for one sequence and for any number >= 2, 2 blocks of table
            long = dict(dtype=torch.long, device=self.device)
            kv, spec = scratch.kv_cache, self.spec
            draft_vocab = spec.vocab_size if spec.d2t is None else spec.d2t.shape[0]
            draft_hidden = spec.draft_hidden_size
            if not self.speculates:  # no draft: empty placeholders pass through the cycle
                draft_vocab = draft_hidden = 0
            for num_seqs in (1, 2)[:batch]:
                table = torch.arange(2 * kv.blocks_per_seq, **long).view(2, -1)[:num_seqs, :2] % kv.num_blocks
                scratch.chain_cycle(scratch.executor, Sampler(), torch.zeros(num_seqs, **long),
                                    torch.ones(num_seqs, **long), table, torch.zeros(num_seqs, **long),
                                    torch.zeros(num_seqs, draft_vocab, device=self.device, dtype=self.dtype),
                                    torch.zeros(num_seqs, draft_hidden, device=self.device, dtype=self.dtype))

    def example_inputs(self, name: str, lens: list[int], all_logits: bool = False) -> dict:
        """Inputs for step graph `name` on sequences of `lens` tokens at positions 0.. (zeros for
        tokens and features), on this model's pools: for warm-up and export. all_logits: logits
        at every token (a verify), else at each sequence's last token."""
        device, block_size, kv = self.device, self.options.block_size, self.kv_cache
        long = dict(dtype=torch.long, device=device)
        feature_width = self.spec.feature_width(name)
        num_seqs, num_tokens = len(lens), sum(lens)
        query_start_loc = torch.tensor([0] + list(lens), **long).cumsum(0)
        positions = torch.cat([torch.arange(n, **long) for n in lens])
        seq = torch.repeat_interleave(torch.arange(num_seqs, **long), torch.tensor(lens, **long))
        block_table = torch.arange(num_seqs * kv.blocks_per_seq, **long).view(num_seqs, -1) % kv.num_blocks
        # tree graphs: each sequence's tokens as a chain-shaped tree from slot 0 (the causal mask)
        tree = torch.zeros(num_tokens, max(lens), dtype=torch.bool, device=device)
        for s, n in enumerate(lens):
            begin = int(query_start_loc[s])
            tree[begin:begin + n, :n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        values = dict(
            input_ids=torch.zeros(1, num_tokens, **long), positions=positions[None],
            logits_indices=torch.arange(num_tokens, **long) if all_logits else query_start_loc[1:] - 1,
            features=torch.zeros(num_tokens, feature_width, device=device, dtype=self.dtype),
            carry_features=torch.zeros(num_seqs, feature_width, device=device, dtype=self.dtype),
            next_tokens=torch.zeros(num_seqs, **long), query_start_loc=query_start_loc,
            slot_mapping=slot_mapping(block_table, seq, positions, block_size), block_table=block_table,
            spec_rows=torch.arange(num_seqs, **long) % self.options.max_batch_size,
            committed_len=positions[query_start_loc[1:] - 1] + (name == "draft_prefill"),
            tree_mask=tree, tree_start=torch.zeros(num_seqs, **long),
            mm_embeds=torch.zeros(1, max(self.spec.embed_dim, 1), device=device, dtype=self.dtype),
            rope_positions=positions.expand(3, -1)[:, None].contiguous(),
            **kv.pools(self.signatures[name].is_base))
        return self.signatures[name].select(values)
