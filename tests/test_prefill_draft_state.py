"""The draft's state after a prefill, what the first cycle's d_1 is drawn from, against the draft run
uncached over the whole sequence (eagle_fx.drafts: body + logits, no KV cache).

Unshifted scheme: draft slot p holds (t_p, f_{p-1}), f_{-1} the bootstrap feature, so after a prompt
t_0..t_{n-1} and the sampled t_n the draft's logits are its output at slot n over t_0..t_n with
features bootstrap, f_0..f_{n-1} (the base's features, taken from the runtime's own base-prefill
calls). The runtime gets there in its draft-prefill call (the sampled token rides in the prompt's
last chunk); the oracle is the formula. Whole and chunked prefill (chunks that end some sequences and
not others), two prompts in one wave, eagle and eagle3."""
import pytest
import torch

import eagle_fx
from conftest import make_prompts, tiny_base, tiny_draft


def _observed_prefill(model, prompts):
    """generate(max_new_tokens=1) with an observer: (each prompt's base features by position
    [n, F], the draft-prefill output row at each prompt's position n, the sampled tokens)."""
    features = [dict() for _ in prompts]
    states = {}

    def observe(graph, inputs, out):
        positions = inputs["positions"].reshape(-1).tolist()
        ids = inputs["input_ids"].reshape(-1).tolist()
        if graph == "base":
            bounds = inputs["query_start_loc"].tolist()
            for a, b in zip(bounds, bounds[1:]):
                begin, end = positions[a], positions[b - 1] + 1
                s = next(i for i, p in enumerate(prompts) if p[begin:end] == ids[a:b] and end <= len(p))
                for row in range(a, b):
                    features[s][positions[row]] = out[1][row]
        elif graph == "draft_prefill":
            for row, index in enumerate(inputs["logits_indices"].tolist()):
                for s, p in enumerate(prompts):
                    if positions[index] == len(p):
                        states[s] = out[0][row]

    model.executor.add_observer(observe)
    out = model.generate(prompts, max_new_tokens=1, eos_token_id=None)
    return ([torch.stack([f[p] for p in range(len(prompt))]) for f, prompt in zip(features, prompts)], states,
            [seq[0] for seq in out.sequences])


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_draft_state_after_prefill_is_the_uncached_drafts_output_at_the_sampled_token(method, chunk):
    base, draft = tiny_base("llama"), tiny_draft("llama", method)
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, prefill_chunk_size=chunk)
    prompts = make_prompts(2, seed=3, lengths=(5, 12))
    features, states, sampled = _observed_prefill(model, prompts)
    assert sorted(states) == [0, 1], "the draft-prefill calls gave no output at the sampled token's slot"
    bootstrap = torch.zeros(1, draft.feature_dim)
    with torch.no_grad():
        for s, prompt in enumerate(prompts):
            n = len(prompt)
            ids = torch.tensor([prompt + [sampled[s]]])
            hidden = draft.project(torch.cat([bootstrap, features[s]]))[None]  # slot p: f_{p-1}
            want = draft.logits(draft.body(ids, torch.arange(n + 1)[None], hidden), base.lm_head)[0, -1]
            torch.testing.assert_close(states[s], want, atol=1e-4, rtol=1e-4)
