"""mopd.baselines.seq_kd with agent domains: the teacher plays each agent prompt as an
episode and the rows are token rows (prompt_ids, completion_ids, loss_mask), one per
transcript segment, laid out as the episode runner samples them; single-turn prompts in
the same call become token rows of their answer; the budget counts assistant tokens.
Without `agents` the output keeps its chat columns."""
from __future__ import annotations

import importlib
import json

import pytest

from core.agent.transcript import assistant_ids, encode_segments
from core.config import load_config
from mopd.distill.config import DistillConfig
from mopd.distill.data import Prompt
from core.rollout import Sample
from core.sft import encode_example, encode_prompt
from core.tiny import build_tiny_model

RECIPE_HARNESSES = "recipes/harnesses/agent.yaml"
S = importlib.import_module("mopd.baselines.seq_kd")   # the package exports the function seq_kd


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("seqkd_agent") / "teacher", seed=1, max_position_embeddings=1536)


def _agents(tmp_path, tok, harnesses=RECIPE_HARNESSES, max_turns=4, max_new_tokens=16, max_context_tokens=1536):
    from mopd.distill.agents import load_agents

    (tmp_path / "rows.jsonl").write_text("")
    cfg_path = tmp_path / "distill.yaml"
    cfg_path.write_text(f"""
model: {{path: {tmp_path}/student}}
data: {{datasets: [{{path: {tmp_path}/rows.jsonl}}]}}
teachers: {{agent: {{path: {tmp_path}/teacher}}, alpha: {{path: {tmp_path}/teacher}}}}
agents:
  agent: {{env: "rewards.agent:make_env", harnesses: {harnesses}, max_turns: {max_turns},
           max_context_tokens: {max_context_tokens}, max_new_tokens: {max_new_tokens}}}
rollout: {{backend: hf}}
""")
    return load_agents(load_config(DistillConfig, cfg_path), tok)


def _tasks(n, difficulty, seed=0):
    from experts.agent.data import make_dataset

    return [json.loads(t) for t in make_dataset("train", n, seed=seed, difficulty=difficulty)["task"]]


def _prompts(tok, tasks, n_alpha):
    """Agent prompts (task column) and single-turn ones, interleaved, distinct indices."""
    out = []
    for i, t in enumerate(tasks):
        out.append(Prompt(index=len(out), domain="agent", teacher_key="agent",
                          messages=[{"role": "user", "content": t["user"]}], ids=[], columns={"task": json.dumps(t)}))
        if i < n_alpha:
            msgs = [{"role": "user", "content": f"Say {i}."}]
            out.append(Prompt(index=len(out), domain="alpha", teacher_key="alpha", messages=msgs,
                              ids=encode_prompt(tok, msgs), columns={"effort": None}))
    return out


# ----------------------------------------------------------------------------- the teacher writes the oracle
class OracleTeacher:
    """Stands in for HFRollout: an agent prompt (recognized by its task's user message) gets
    the oracle's next assistant turn, any other prompt the answer "ok"."""
    scripts: dict[str, list[str]] = {}

    def __init__(self, model, tokenizer, *, batch_size):
        self.tok, self.eos_ids = tokenizer, {tokenizer.eos_token_id}
        self.turn: dict[str, int] = {}

    def generate(self, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, seeds):
        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            user = next((u for u in self.scripts if u in text), None)
            if user is None:
                ids = assistant_ids(self.tok, "ok")
            else:
                k = self.turn.get(user, 0)
                self.turn[user] = k + 1
                ids = assistant_ids(self.tok, self.scripts[user][k])
            out.append(Sample(prompt_ids=list(p), completion_ids=ids, sampler_logprobs=[0.0] * len(ids),
                              finished=True))
        return out


def test_agent_rows_are_the_oracle_transcripts_segments(tok, teacher, tmp_path, monkeypatch):
    from experts.agent.data import oracle_messages
    from rewards.agent import harness_config, make_env

    # one harness (python_terse, last_k 4): the drawn harness is known; horizon 8 needs new segments
    mix = tmp_path / "mix.yaml"
    mix.write_text("harnesses:\n  - {name: python_terse, syntax: python, system_prompt: \"Tools:\\n{tools}\\n"
                   "{syntax}\", max_description_chars: 0, context: {kind: last_k, k: 4}}\n")
    agents = _agents(tmp_path, tok, harnesses=mix, max_turns=12, max_new_tokens=32)
    hc = harness_config("python_terse")
    tasks = _tasks(3, difficulty=8)
    want = {}
    for t in tasks:
        env = make_env(hc)
        env.reset(t)
        msgs = env.messages[:1] + oracle_messages(t, hc)
        want[t["user"]] = encode_segments(tok, msgs, env.harness.apply_context)
    OracleTeacher.scripts = {t["user"]: [m["content"] for m in oracle_messages(t, hc) if m["role"] == "assistant"]
                             for t in tasks}
    monkeypatch.setattr(S, "HFRollout", OracleTeacher)
    prompts = _prompts(tok, tasks, n_alpha=3)
    teachers = {"agent": str(teacher), "alpha": str(teacher)}
    total = sum(sum(m) for rows in want.values() for _, _, m in rows) + 3 * len(assistant_ids(tok, "ok"))
    ds, tokens = S.seq_kd_dataset(iter(prompts), teachers, tok, budget_tokens=total, batch_size=1,
                                  gen_batch_size=6, progress=False, agents=agents)
    assert set(ds.column_names) == {"prompt_ids", "completion_ids", "loss_mask", "domain", "effort", "teacher"}
    assert tokens == total == sum(sum(m) for m in ds["loss_mask"])
    rows = list(zip(ds["prompt_ids"], ds["completion_ids"], ds["loss_mask"], ds["domain"]))
    expect = []
    for p in prompts:   # in prompt order; an episode's segments one after another
        if p.domain == "agent":
            expect += [(a, b, c, "agent") for a, b, c in want[json.loads(p.columns["task"])["user"]]]
        else:
            pi, ci = encode_example(tok, p.messages, [{"role": "assistant", "content": "ok"}])
            expect.append((pi, ci, [1] * len(ci), "alpha"))
    assert rows == expect
    assert sum(d == "agent" for d in ds["domain"]) > len(tasks)   # last_k made several segments per episode
    assert ds["teacher"] == [r[3] for r in rows]


def test_seq_kd_with_agents_on_a_tiny_teacher(tok, teacher, tmp_path):
    agents = _agents(tmp_path, tok)
    tasks = _tasks(4, difficulty=2, seed=1)
    prompts = _prompts(tok, tasks, n_alpha=4)
    teachers = {"agent": str(teacher), "alpha": str(teacher)}
    ds, tokens = S.seq_kd_dataset(iter(prompts), teachers, tok, budget_tokens=40, batch_size=2,
                                  max_new_tokens=8, gen_batch_size=8, progress=False, agents=agents)
    assert len(ds) % 2 == 0 and len(ds) >= 2
    assert tokens == sum(sum(m) for m in ds["loss_mask"])
    users = [t["user"] for t in tasks]
    singles = [encode_prompt(tok, p.messages) for p in prompts if p.domain == "alpha"]
    for p, c, m, d in zip(ds["prompt_ids"], ds["completion_ids"], ds["loss_mask"], ds["domain"]):
        assert len(c) == len(m) and set(m) <= {0, 1} and sum(m) > 0
        text = tok.decode(p, skip_special_tokens=False)
        if d == "agent":   # a harness's system prompt, then the task; at most max_turns turns of 16 tokens
            assert text.startswith("<|im_start|>system\n") and any(u in text for u in users)
            assert sum(m) <= 4 * 16 and len(p) + len(c) <= 1536
        else:
            # the answer's text re-tokenized (as core.sft would), EOS included, all of it trained on
            assert p in singles and m == [1] * len(c) and c[-1] == tok.eos_token_id
    assert {"agent", "alpha"} <= set(ds["domain"])


def test_without_agents_the_output_is_unchanged(tok, teacher):
    msgs = [[{"role": "user", "content": f"Say {i}."}] for i in range(4)]
    prompts = [Prompt(index=i, domain="alpha", teacher_key="alpha", messages=m, ids=[], columns={"effort": None})
               for i, m in enumerate(msgs)]
    ds, tokens = S.seq_kd_dataset(iter(prompts), {"alpha": str(teacher)}, tok, budget_tokens=1, batch_size=2,
                                  max_new_tokens=6, gen_batch_size=4, progress=False)
    assert ds.column_names == ["prompt", "completion", "domain", "effort", "teacher"]
    assert len(ds) == 2 and ds["prompt"] == msgs[:2]
    assert tokens == sum(len(encode_example(tok, p, c)[1]) for p, c in zip(ds["prompt"], ds["completion"]))
    # with agents={} as well
    ds2, tokens2 = S.seq_kd_dataset(iter(prompts), {"alpha": str(teacher)}, tok, budget_tokens=1, batch_size=2,
                                    max_new_tokens=6, gen_batch_size=4, progress=False, agents={})
    assert ds2.to_list() == ds.to_list() and tokens2 == tokens


def test_an_episode_cut_before_its_first_turn_gives_no_row(tok, teacher, tmp_path):
    """A task whose prompt leaves no room for a turn is cut before sampling: its segment has
    no assistant token, and a row without one would stop core.sft ("empty completion")."""
    from core.agent.transcript import prompt_ids
    from rewards.agent import harness_config, make_env

    mix = tmp_path / "mix.yaml"
    mix.write_text("harnesses:\n  - {name: python_terse, syntax: python, system_prompt: \"Tools:\\n{tools}\\n"
                   "{syntax}\", max_description_chars: 0}\n")
    env = make_env(harness_config("python_terse"))
    n_sys = len(prompt_ids(tok, [{"role": "system", "content": env.full_harness.system_prompt()}]))
    agents = _agents(tmp_path, tok, harnesses=mix, max_new_tokens=8, max_context_tokens=n_sys + 8)
    long, short = _tasks(2, difficulty=2)
    long["user"] += " Please" * 100   # this prompt alone is longer than the context
    prompts = _prompts(tok, [long, short], n_alpha=2)
    ds, tokens = S.seq_kd_dataset(iter(prompts), {"agent": str(teacher), "alpha": str(teacher)}, tok,
                                  budget_tokens=10, batch_size=1, max_new_tokens=8, gen_batch_size=4,
                                  progress=False, agents=agents)
    assert all(sum(m) > 0 for m in ds["loss_mask"]) and tokens == sum(sum(m) for m in ds["loss_mask"])
    assert not any("Please Please" in tok.decode(p) for p in ds["prompt_ids"])
