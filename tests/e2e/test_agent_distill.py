"""End to end: `mopd.distill.loop.run` with an agent domain (multi-turn episodes against a
ToolEnv) beside a single-turn domain, on tiny models with the HF sampler. The environment
is test-local (referenced as `<this module>:make_env`): a small counter backend whose tasks
have several user turns, one task whose setup raises, so the run must survive it."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from core.agent.env import ToolEnv
from core.agent.harness import ToolSpec
from core.config import ConfigError, load_config
from mopd.distill.config import DistillConfig

ENV_REF = f"{__name__}:make_env"


class CounterBackend:
    """Tools bump(n) and total(); a task has `user_turns` user messages, one after each
    answer without a call; success when the final answer names the total."""

    def tools(self):
        return {"bump": ToolSpec("bump", "Add n to the counter.", {
                    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
                "total": ToolSpec("total", "The counter's value.", {"type": "object", "properties": {}})}

    def reset(self, task):
        if task.get("broken"):
            raise RuntimeError(f"cannot set up task {task['id']}")
        self.task, self.total, self.turn = task, 0, 0
        return task["user"]

    def call(self, call):
        if call.name == "bump":
            self.total += call.args["n"]
        return str(self.total)

    def end_turn(self, final_text):
        self.turn += 1
        return f"and now step {self.turn}" if self.turn < self.task["user_turns"] else None

    def finish(self, final_text):
        ok = str(self.total) in final_text
        return {"success": ok, "reward": float(ok)}


def make_env(harness_cfg, memory=None):
    return ToolEnv(CounterBackend(), harness_cfg, memory)


def const_reward(prompts, completions, **kw):
    return [0.5] * len(completions)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, scale_lm_head):
    from core.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("agent_distill")
    student = scale_lm_head(build_tiny_model(root / "student", seed=0), 3.0)
    teacher = scale_lm_head(build_tiny_model(root / "teacher", seed=0), 6.0)
    rows = []
    for i in range(6):
        task = {"id": f"count-{i}", "family": "count", "user": f"count to {i}", "user_turns": 1 + i % 4,
                "broken": i == 5}
        rows.append({"prompt": [{"role": "user", "content": task["user"]}], "domain": "agent",
                     "task": json.dumps(task)})
    for i in range(6):
        rows.append({"prompt": [{"role": "user", "content": f"say something about {i}"}], "domain": "alpha"})
    data = root / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    harnesses = root / "harnesses.yaml"
    harnesses.write_text("""
harnesses:
  - {name: json_all, syntax: json}
  - {name: python_last1, syntax: python, context: {kind: last_k, k: 1}}
held_out:
  - {name: xml_renamed, syntax: xml, rename: {bump: add_to}}
""")
    cfg = root / "run.yaml"
    cfg.write_text(f"""
model: {{path: {student}}}
data:
  datasets: [{{path: {data}}}]
  mix: {{agent: 1.0, alpha: 1.0}}
  max_prompt_tokens: 64
teachers:
  agent: {{path: {teacher}}}
  alpha: {{path: {teacher}}}
agents:
  agent: {{env: "{ENV_REF}", harnesses: {harnesses}, max_turns: 3, max_context_tokens: 400, max_new_tokens: 12}}
rewards: {{alpha: "{__name__}:const_reward"}}
rollout: {{backend: hf, max_new_tokens: 8}}
loss: {{kl: full, task_reward_alpha: 0.1}}
train: {{max_steps: 8, prompts_per_step: 12, lr: 3.0e-4}}
mlflow: {{experiment: test, log_model: false}}
""")
    return {"root": root, "student": student, "cfg": cfg, "harnesses": harnesses, "data": data}


def test_agent_domain_trains_beside_a_single_turn_one(setup, tmp_path, capsys):
    from mopd.distill.loop import run

    out = tmp_path / "run"
    res = run(load_config(DistillConfig, setup["cfg"]), out, progress=False)
    hist = res["history"]
    assert len(hist) == 8 and all(h["tokens"] > 0 for h in hist)
    for h in hist:
        assert 1.0 <= h["agent/turns/agent"] <= 3.0 and h["agent/tokens_per_episode/agent"] > 0
        for k in ("agent/success/agent", "agent/failed_calls/agent", "agent/reward/agent", "agent/env_errors/agent",
                  "agent/cut/agent"):
            assert 0.0 <= h[k] <= 1.0, k
        for k in ("reverse_kl/agent/turn_0", "reverse_kl/agent/turn_1", "reverse_kl/agent/turn_2",
                  "reverse_kl/agent", "reverse_kl/alpha", "task_reward/agent", "task_reward/alpha"):
            assert math.isfinite(h[k]), k
        assert "reverse_kl/alpha/turn_0" not in h   # single-turn domains keep their keys
        # the HF sampler is the trainer itself: no mismatch on the student's tokens
        assert h["mismatch/abs_mean/agent"] < 1e-4
    # the broken task fails at setup whenever it is drawn (logged with its id), the run goes on;
    # tasks with 4 user turns outlast max_turns=3
    assert any(h["agent/env_errors/agent"] > 0 for h in hist) and "'count-5'" in capsys.readouterr().err
    assert any(h["agent/cut/agent"] > 0 for h in hist)
    for d in ("agent", "alpha"):   # the student moves toward its teacher on both domains
        kl = [h[f"reverse_kl/{d}"] for h in hist]
        assert sum(kl[-2:]) / 2 < sum(kl[:2]) / 2, (d, kl)
    before = load_file(str(setup["student"] / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_rerun_is_identical(setup, tmp_path):
    """Harness per episode and every turn's sample are seeded: two runs agree exactly."""
    from mopd.distill.loop import run

    cfg = load_config(DistillConfig, setup["cfg"], ["train.max_steps=2"])
    a = run(cfg, tmp_path / "a", progress=False)["history"]
    b = run(cfg, tmp_path / "b", progress=False)["history"]
    keys = [k for k in a[0] if k.startswith(("agent/", "reverse_kl/", "loss", "tokens"))
            and not k.startswith("tokens_per_s")]
    assert [[h[k] for k in keys] for h in a] == [[h[k] for k in keys] for h in b]


# ----------------------------------------------------------------------------- bad input
def _check_error(setup, tmp_path, overrides, needle, harnesses=None, rows=None):
    from mopd.distill.loop import run

    if harnesses is not None:
        p = tmp_path / "h.yaml"
        p.write_text(harnesses)
        overrides = [*overrides, f"agents.agent.harnesses={p}"]
    if rows is not None:
        p = tmp_path / "rows.jsonl"
        p.write_text("\n".join(json.dumps(r) for r in rows))
        overrides = [*overrides, f"data.datasets=[{{path: {p}}}]", "data.mix={agent: 1.0}", "rewards={}"]
    out = tmp_path / "bad"
    with pytest.raises(ConfigError, match=needle):
        run(load_config(DistillConfig, setup["cfg"], overrides), out, progress=False)
    assert not (out / "checkpoints").exists()


def test_harness_naming_a_missing_tool_is_a_config_error(setup, tmp_path):
    _check_error(setup, tmp_path, [], "harness 'bad'.*'reset_counter'",
                 harnesses="harnesses:\n  - {name: bad, tools: [bump, reset_counter]}\n")


def test_held_out_harness_is_checked_too(setup, tmp_path):
    _check_error(setup, tmp_path, [], "harness 'renamed'",
                 harnesses="harnesses:\n  - {name: ok}\nheld_out:\n  - {name: renamed, rename: {nothere: x}}\n")


def test_env_factory_must_import(setup, tmp_path):
    _check_error(setup, tmp_path, ["agents.agent.env=nowhere.mod:make_env"], "agents.agent.env.*nowhere")


def test_agent_rows_need_a_task(setup, tmp_path):
    _check_error(setup, tmp_path, [], "no 'task' column",
                 rows=[{"prompt": "hi", "domain": "agent"}])
    _check_error(setup, tmp_path, [], "not valid JSON",
                 rows=[{"prompt": "hi", "domain": "agent", "task": "{oops"}])


def test_system_prompt_must_leave_room_for_a_turn(setup, tmp_path):
    _check_error(setup, tmp_path, ["agents.agent.max_context_tokens=40", "agents.agent.max_new_tokens=12"],
                 "system prompt is .* tokens")


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.by_domain={agent: {correct_below: 0.1}}"], "correct_below.*not supported for agent"),
    (["rollout.by_domain={agent: {on_policy_fraction: 0.5}}"], "on-policy only"),
    (["rollout.backend=vllm", "rollout.max_model_len=256"], "max_context_tokens=400 is above"),
    (["agents.agent.max_new_tokens=500"], "must be above max_new_tokens"),
])
def test_unsupported_agent_settings(setup, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(DistillConfig, setup["cfg"], overrides)
