"""eagle_fx.graph_kinds against the graphs a capture makes: the table says what each graph is, the
graphs say it too (which model's layers, the width of the feature input, device-side attention)."""
import torch

from conftest import tiny_base, tiny_draft
from eagle_fx.capture import capture
from eagle_fx.graph_kinds import GRAPH_KINDS, FeatureInput
from eagle_fx.pipeline import CapturePlan
from eagle_fx.runtime.pair import PairSpec

ATTENTION = (torch.ops.eagle_fx.cached_attention.default, torch.ops.eagle_fx.tree_cached_attention.default,
             torch.ops.eagle_fx.shared_cached_attention.default)


def test_the_table_says_what_the_captured_graphs_are():
    base, draft = tiny_base("llama"), tiny_draft("llama", "eagle3")
    graphs = capture(base, draft, CapturePlan(draft_kv="pool", tree=True))
    spec = PairSpec.from_pair(base, draft, draft_kv="pool")
    assert graphs.names() == tuple(GRAPH_KINDS)
    widths = {FeatureInput.NONE: None, FeatureInput.BASE_FEATURE: draft.feature_dim,
              FeatureInput.DRAFT_HIDDEN: draft.config.hidden_size}
    assert draft.feature_dim != draft.config.hidden_size  # EAGLE-3: the two feature widths differ
    for name, kind in GRAPH_KINDS.items():
        gm = getattr(graphs, name)
        attention = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION]
        layers = base.config.num_hidden_layers if kind.reads_base else draft.config.num_hidden_layers
        assert len(attention) == layers, name
        device_side = [n.target == torch.ops.eagle_fx.tree_cached_attention.default
                       or n.kwargs.get("uniform_queries", False) for n in attention]
        assert device_side == [kind.uniform_rows] * layers, name
        assert all(n.target == torch.ops.eagle_fx.tree_cached_attention.default for n in attention) == kind.tree, name
        features = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "features"), None)
        width = None if features is None else features.meta["val"].shape[-1]
        assert width == widths[kind.feature_input], name
        assert spec.feature_width(name) == (width or 0), name
