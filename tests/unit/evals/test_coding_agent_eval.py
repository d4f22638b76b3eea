"""evals/coding_agent.py: greedy episodes on held-out tasks through the train harnesses and
the held-out harness. A policy that writes the oracle's calls scores 1 through the real
runner, sandbox and hidden tests; a random tiny model scores 0; every workspace is gone
afterwards, cut episodes included."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from evals import agent as agent_eval  # its run_tasks plays every agent domain's episodes
from evals import coding_agent as E
from experts.coding_agent import data as D
from core.agent.harness import Harness, load_harnesses
from core.rollout.base import Sample
from core.tiny import build_tiny_model, load_tokenizer
from rewards.coding_agent import TOOLS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _no_workspaces_left() -> bool:
    return not list(Path(tempfile.gettempdir()).glob(f"mopd-ws-{os.getpid()}-*/ep-*"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("coding_agent_eval") / "m", seed=0, max_position_embeddings=1536)


class OraclePolicy:
    """A stand-in for HFRollout that writes, for each live episode, the oracle's next call
    in the one harness of the mix (the task is found by its user text)."""

    def __init__(self, tokenizer, tasks, harness_cfg, stop_after: int | None = None):
        self.tok = tokenizer
        self.harness = Harness(harness_cfg, dict(TOOLS))
        self.by_user = {t["user"]: D.oracle_calls(t) for t in tasks}
        self.stop_after = stop_after

    def __call__(self, *args, **kwargs):
        return self

    def generate(self, prompts, max_new_tokens, **kw):
        out = []
        for ids in prompts:
            text = self.tok.decode(ids, skip_special_tokens=False)
            turn = text.count("<|im_start|>assistant\n") - 1
            calls = next(c for u, c in self.by_user.items() if u in text)
            never_submits = self.stop_after is not None and turn >= self.stop_after
            call = calls[0] if never_submits else calls[turn]   # run_tests again and again
            new = self.tok(self.harness.render([call]), add_special_tokens=False)["input_ids"]
            new = new + [self.tok.convert_tokens_to_ids("<|im_end|>")]
            out.append(Sample(prompt_ids=list(ids), completion_ids=new, sampler_logprobs=[0.0] * len(new),
                              finished=True))
        return out


def _one_harness(tmp_path, name="json_plain") -> str:
    mix = yaml.safe_load((Path(D.HARNESSES)).read_text())
    mix["harnesses"] = [h for h in mix["harnesses"] if h["name"] == name]
    mix["weights"] = [1.0]
    mix.pop("held_out_combo")   # combinations of the other train harnesses' modules: not of this one
    p = tmp_path / "one.yaml"
    p.write_text(yaml.safe_dump(mix))
    return str(p)


def test_the_oracle_policy_scores_one_and_a_policy_that_never_submits_zero(tmp_path, monkeypatch, model_dir):
    harnesses = _one_harness(tmp_path)
    tok = load_tokenizer()
    tasks = [json.loads(t) for t in D.make_dataset("test", 3, seed=0, difficulty=2)["task"]]
    cfg = load_harnesses(harnesses).harnesses[0]
    monkeypatch.setattr(agent_eval, "HFRollout", OraclePolicy(tok, tasks, cfg))
    res = E.evaluate(torch.nn.Linear(1, 1), tokenizer=tok, n=3, difficulty=2, harnesses=harnesses, max_turns=8,
                     held_out=False, max_new_tokens=200)
    assert res["score"] == 1.0 and res["train_harness"]["env_errors"] == 0.0 and res["held_out"] is None
    assert _no_workspaces_left()
    monkeypatch.setattr(agent_eval, "HFRollout", OraclePolicy(tok, tasks, cfg, stop_after=0))
    res = E.evaluate(torch.nn.Linear(1, 1), tokenizer=tok, n=3, difficulty=2, harnesses=harnesses, max_turns=3,
                     held_out=False, max_new_tokens=200)
    assert res["score"] == 0.0 and res["train_harness"]["cut"] == 1.0
    assert _no_workspaces_left()   # cut episodes never reached done: closed by the eval


def test_evaluate_on_a_tiny_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    res = E.evaluate(model, n=2, difficulty=1, max_turns=2, max_new_tokens=8, tokenizer=load_tokenizer())
    assert res["domain"] == "coding_agent" and res["n"] == 2
    assert res["score"] == 0.0 and res["held_out"] == 0.0   # a random model does not fix and submit in 2 turns
    for stats in (res["train_harness"], res["held_out_harness"]):
        assert stats["n"] == 2 and 1.0 <= stats["turns"] <= 2.0
    assert _no_workspaces_left()


def test_evaluate_rejects_what_it_cannot_score(model_dir):
    with pytest.raises(ValueError, match="efforts"):
        E.evaluate(str(model_dir), n=1, effort="high")
    with pytest.raises(ValueError, match="dataset"):
        E.evaluate(str(model_dir), n=1, dataset="bfcl_multi_turn")
    with pytest.raises(ValueError, match="unknown settings"):
        E.evaluate(str(model_dir), n=1, reward_model="x")
