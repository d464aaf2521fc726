"""ShareGPT is read record by record; a cut-off tail never crashes the reader."""
import json

from eagle_fx.data import first_user_prompts, is_held_out, iter_records, load_conversations, split


def _records(n):
    return [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(n)]


def test_truncated_array_keeps_complete_records(tmp_path):
    text = json.dumps(_records(5), indent=2)
    cut = text[: text.index('"c4"') + 10]  # mid-way through the 5th record
    assert [r["id"] for r in iter_records(cut)] == ["c0", "c1", "c2", "c3"]
    assert [r["id"] for r in iter_records(text)] == ["c0", "c1", "c2", "c3", "c4"]
    assert list(iter_records("")) == [] and list(iter_records("[")) == []
    f = tmp_path / "sg.json"
    f.write_text(cut)
    convs = load_conversations(f)
    assert [c["turns"] for c in convs][0] == [("user", "q0"), ("assistant", "a0")]
    assert first_user_prompts(convs) == ["q0", "q1", "q2", "q3"]


def test_packaged_sharegpt_is_cut_and_read():
    convs = load_conversations()
    assert 17000 < len(convs) < 18000  # ~17.6k complete records, broken tail dropped
    train, held = split(convs)
    assert len(held) + len(train) == len(convs)
    assert 0.03 < len(held) / len(convs) < 0.08
    assert all(is_held_out(c["id"]) for c in held) and not any(is_held_out(c["id"]) for c in train)
