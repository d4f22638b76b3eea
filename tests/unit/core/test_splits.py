"""core/splits.py: the train/test split every procedural domain draws from. Its values are
pinned: a change here would silently move tasks between every domain's splits (and leak
held-out tasks into trained experts' data)."""
from core.splits import split_of


def test_split_is_pinned_and_about_the_fraction():
    keys = [f"key {i}" for i in range(200)]
    assert [k for k in keys if split_of(k, 0.1) == "test"][:5] == ["key 4", "key 6", "key 30", "key 35", "key 36"]
    share = sum(split_of(f"key {i}", 0.1) == "test" for i in range(20_000)) / 20_000
    assert abs(share - 0.1) < 0.01


def test_every_domain_uses_the_one_split():
    from experts.registry import data_module
    from core import toy_tasks
    for d in ("chat", "code", "frontend", "instruction_following", "kernel", "math", "tool_use"):
        m = data_module(d)
        assert m._split_of("key 4") == split_of("key 4", m.TEST_FRACTION) == "test", d
    assert toy_tasks._split_of("key 30") == "test"
