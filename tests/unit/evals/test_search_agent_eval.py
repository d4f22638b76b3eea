"""evals/search_agent.py: greedy held-out episodes through the train harnesses and, beside
them, the held-out harness; a policy that reads what each harness shows it (context
policies included) solves every hop count, a random tiny model solves nothing; the eval
column carries the recipe's episode settings."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from evals import agent as agent_eval  # its run_tasks plays every agent domain's episodes
from evals import search_agent as E
from evals.run import EvalColumn, _eval_kwargs, column_from_config, columns_for, evaluate_model
from experts.run import ExpertConfig
from core.agent.harness import ToolCall, load_harnesses
from core.config import load_config
from core.rollout.base import Sample
from core.tiny import build_tiny_model, load_tokenizer
from rewards.search_agent import HARNESSES, make_env

REPO = Path(__file__).resolve().parents[3]
MIX = load_harnesses(HARNESSES)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("search_eval") / "m", seed=0, max_position_embeddings=1536)


class ReadingPolicy:
    """A rollout that plays each episode from what the model would see, its decoded prompt:
    search the name in the question, open the first hit, answer when the page states the
    attribute asked, else search the name the page links to. `skip_open` makes it answer
    from the search results instead (it never sees a fact, so it must fail)."""

    def __init__(self, tok, skip_open: bool = False):
        self.tok, self.skip_open = tok, skip_open
        # each harness's system prompt -> its Harness (renders calls in its syntax and names)
        envs = [make_env(h) for h in MIX.harnesses + MIX.held_out_combo + MIX.held_out]
        self.harnesses = {e.harness.system_prompt(): e.harness for e in envs}
        self.seen: set[str] = set()

    def _act(self, text: str) -> str:
        msgs = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", text, re.S)
        harness = self.harnesses[msgs[0][1]]
        self.seen.add(harness.name)
        attr, start = re.search(r'What is the (\w+) for "([^"]+)"', msgs[1][1]).groups()
        role, last = msgs[-1]
        if role == "user":
            return harness.render([ToolCall("search", {"query": start})])
        if re.match(r"([^:\n]+): \1 is a ", last):   # search results, the first hit the name's own page
            if self.skip_open:
                return last.split(": ", 1)[1]
            return harness.render([ToolCall("open", {"doc_id": last.split(":", 1)[0]})])
        fact = re.search(rf'The {attr} of .+? is "([^"]+)"', last)
        if fact:
            return fact.group(1)
        link = re.search(r'(?:works at|is based in|is in) "([^"]+)"', last)
        return harness.render([ToolCall("search", {"query": link.group(1)})]) if link else "lost"

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds):
        out = []
        for p in prompts:
            ids = self.tok.encode(self._act(self.tok.decode(p, skip_special_tokens=False)),
                                  add_special_tokens=False)[:max_new_tokens]
            ids.append(self.tok.eos_token_id)
            out.append(Sample(prompt_ids=list(p), completion_ids=ids, sampler_logprobs=[-1.0] * len(ids),
                              finished=True))
        return out


@pytest.mark.parametrize("hops", [1, 2, 4])
def test_a_policy_that_reads_solves_every_harness(monkeypatch, hops):
    tok = load_tokenizer()
    policy = ReadingPolicy(tok)
    monkeypatch.setattr(agent_eval, "HFRollout", lambda model, tokenizer, batch_size: policy)
    res = E.evaluate(None, n=6, difficulty=hops, tokenizer=tok)
    assert policy.seen == {h.name for h in MIX.harnesses + MIX.held_out_combo + MIX.held_out}   # context policies included
    assert res["n"] == 6 and res["score"] == 1.0 and res["held_out"] == 1.0 and res["held_out_combo"] == 1.0
    for stats in (res["train_harness"], res["held_out_combo_harness"], res["held_out_harness"]):
        assert stats["turns"] == 2 * hops + 1 and stats["failed_call_share"] == 0.0 and stats["cut"] == 0.0
    # one turn short of the episode: nothing is answered
    short = E.evaluate(None, n=6, difficulty=hops, tokenizer=tok, max_turns=2 * hops, held_out=False)
    assert short["score"] == 0.0 and short["train_harness"]["cut"] == 1.0


def test_answering_from_the_search_results_fails(monkeypatch):
    tok = load_tokenizer()
    monkeypatch.setattr(agent_eval, "HFRollout", lambda model, tokenizer, batch_size: ReadingPolicy(tokenizer, skip_open=True))
    res = E.evaluate(None, n=6, difficulty=1, tokenizer=tok)
    assert res["score"] == 0.0 and res["held_out"] == 0.0 and res["held_out_combo"] == 0.0
    assert res["train_harness"]["turns"] == 2.0


def test_evaluate_on_a_tiny_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    res = E.evaluate(model, n=3, difficulty=1, max_turns=2, max_new_tokens=8, tokenizer=load_tokenizer())
    assert res["domain"] == "search_agent" and res["n"] == 3
    for stats in (res["train_harness"], res["held_out_harness"]):
        assert stats["n"] == 3 and 1.0 <= stats["turns"] <= 2.0
    # a random model does not answer a 1-hop question in 2 turns (search, open and the answer take 3)
    assert res["score"] == 0.0 and res["held_out"] == 0.0
    no_ho = E.evaluate(model, n=3, difficulty=1, max_turns=2, max_new_tokens=8, tokenizer=load_tokenizer(),
                       held_out=False)
    assert no_ho["held_out"] is None and no_ho["train_harness"] == res["train_harness"]   # greedy: the same


def test_evaluate_rejects_what_it_cannot_score(model_dir):
    with pytest.raises(ValueError, match="efforts"):
        E.evaluate(str(model_dir), n=1, effort="high")
    with pytest.raises(ValueError, match="procedural"):
        E.evaluate(str(model_dir), n=1, dataset="hotpotqa")
    with pytest.raises(ValueError, match="unknown settings"):
        E.evaluate(str(model_dir), n=1, reward_model="x")


def test_column_carries_the_recipe_episode_settings():
    rcfg = load_config(ExpertConfig, REPO / "recipes" / "experts" / "search_agent" / "rl.yaml",
                       ["agent.max_turns=5", "agent.max_context_tokens=900"])
    col = column_from_config("search_agent", rcfg, n=7)
    assert col.domain == "search_agent" and col.n == 7 and col.difficulty == rcfg.data.difficulty
    assert col.episode == {"harnesses": rcfg.agent.harnesses, "max_turns": 5, "max_context_tokens": 900}
    kw = _eval_kwargs(col)
    assert set(kw) <= set(inspect.signature(E.evaluate).parameters)
    assert kw["harnesses"].endswith("harnesses/search_agent.yaml")


def test_evaluate_model_scores_the_column_and_its_held_out_harness(model_dir):
    col, = columns_for(["search_agent"], n=2, max_new_tokens={"search_agent": 8}, recipe_overrides={
        "search_agent": ["agent.max_turns=2", "data.difficulty=1"]})
    assert isinstance(col, EvalColumn) and col.episode["max_turns"] == 2
    scores = evaluate_model(str(model_dir), [col], progress=False)
    assert set(scores) == {"search_agent", "search_agent/held_out_combo", "search_agent/held_out_novel"}
    assert all(0.0 <= v <= 1.0 for v in scores.values())
