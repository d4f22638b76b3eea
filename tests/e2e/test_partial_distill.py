"""End to end: partial rollouts in `mopd.distill.loop.run` (issue #17 part 4), on tiny
models with the HF sampler. An agent domain whose tasks take one or three user turns,
with `partial: {min_finished: 0.25}` and loss.max_staleness=0: steps stop once a quarter
of their episodes ended, the rest carry over and continue with the next step's weights.
The run reports carried episodes, token ages and the stale share, trains, and a resume
with episodes in flight drops them visibly (a log line and a metric) and is deterministic."""
from __future__ import annotations

import json
import math
import shutil
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from core.agent.env import ToolEnv
from core.agent.harness import ToolSpec
from core.config import load_config
from mopd.distill.config import DistillConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENV_REF = f"{__name__}:make_env"


class TurnsBackend:
    """A task ends after `user_turns` answers without a tool call (each earlier answer gets
    a next user message); success when the last answer names the counter (never, here)."""

    def tools(self):
        return {"total": ToolSpec("total", "The counter's value.", {"type": "object", "properties": {}})}

    def reset(self, task):
        self.task, self.turn = task, 0
        return task["user"]

    def call(self, call):
        return "0"

    def end_turn(self, final_text):
        self.turn += 1
        return f"and now step {self.turn}" if self.turn < self.task["user_turns"] else None

    def finish(self, final_text):
        ok = "0" in final_text
        return {"success": ok, "reward": float(ok)}


def make_env(harness_cfg, memory=None):
    return ToolEnv(TurnsBackend(), harness_cfg, memory)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, scale_lm_head):
    from core.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("partial_rollouts")
    student = scale_lm_head(build_tiny_model(root / "student", seed=0), 3.0)
    teacher = scale_lm_head(build_tiny_model(root / "teacher", seed=0), 6.0)
    rows = [{"prompt": [{"role": "user", "content": f"task {i}"}], "domain": "agent",
             "task": json.dumps({"id": f"task-{i}", "user": f"task {i}", "user_turns": 1 if i % 4 == 0 else 3})}
            for i in range(8)]
    rows += [{"prompt": [{"role": "user", "content": f"say something about {i}"}], "domain": "alpha"}
             for i in range(4)]
    data = root / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    harnesses = root / "harnesses.yaml"
    harnesses.write_text("harnesses:\n  - {name: json_all, syntax: json}\n")
    cfg = root / "run.yaml"
    cfg.write_text(f"""
model: {{path: {student}}}
data:
  datasets: [{{path: {data}}}]
  mix: {{agent: 2.0, alpha: 1.0}}
  max_prompt_tokens: 64
teachers:
  agent: {{path: {teacher}}}
  alpha: {{path: {teacher}}}
agents:
  agent: {{env: "{ENV_REF}", harnesses: {harnesses}, max_turns: 3, max_context_tokens: 400, max_new_tokens: 10,
           partial: {{enabled: true, min_finished: 0.25}}}}
rollout: {{backend: hf, max_new_tokens: 8}}
loss: {{max_staleness: 0}}
train: {{max_steps: 5, prompts_per_step: 6, lr: 3.0e-4, save_every: 2}}
mlflow: {{experiment: test, log_model: false}}
""")
    return {"root": root, "student": student, "cfg": cfg}


def _go(setup, out, *overrides, callbacks=None):
    from mopd.distill.loop import run

    os.environ.pop("MLFLOW_TRACKING_URI", None)   # each run's own store under its --out
    return run(load_config(DistillConfig, setup["cfg"], list(overrides)), out, progress=False,
               callbacks=callbacks)["history"]


def test_partial_rollouts_carry_episodes_over_and_train(setup, tmp_path):
    out = tmp_path / "run"
    hist = _go(setup, out)
    assert len(hist) == 5
    for h in hist:
        assert h["agent/carried_over/agent"] >= 0
        if "agent/token_age_mean/agent" in h:
            ages = [h[f"agent/token_age/agent/age_{k}"] for k in ("0", "1", "2", "3plus")]
            assert sum(ages) == pytest.approx(1.0)
            # max_staleness=0: every token sampled before the weights it trains with is masked
            assert h["agent/stale_masked_share/agent"] == pytest.approx(1.0 - ages[0])
            assert math.isfinite(h["reverse_kl/agent"])
    # episodes were carried over and trained later, their early tokens masked as stale
    assert any(h["agent/carried_over/agent"] > 0 for h in hist)
    assert any(h.get("agent/token_age/agent/age_1", 0) > 0 for h in hist)
    assert any(h.get("agent/stale_masked_share/agent", 0) > 0 for h in hist)
    before = load_file(str(setup["student"] / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the checkpoints record how many episodes were in flight when they were written
    state = json.loads((out / "checkpoints" / "step_5" / "trainer_state.json").read_text())
    assert state["in_flight"] == {"agent": int(hist[-1]["agent/carried_over/agent"])}


def test_resume_with_episodes_in_flight_drops_them_visibly_and_is_deterministic(setup, tmp_path, capfd):
    out = tmp_path / "run"

    def sigterm_at_3(step, m):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit) as e:
        _go(setup, out, callbacks=[sigterm_at_3])
    assert e.value.code == 128 + signal.SIGTERM
    ckpt = out / "checkpoints" / "step_3"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    carried = int(state["history"][-1]["agent/carried_over/agent"])
    assert carried > 0, "the test needs episodes in flight at the checkpoint"
    assert state["in_flight"] == {"agent": carried}
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    capfd.readouterr()
    a = _go(setup, out, "train.resume=true")
    err = capfd.readouterr().err
    assert f"{carried} agent episode(s) in flight at the checkpoint are dropped" in err
    b = _go(setup, copy, "train.resume=true")
    assert [h["step"] for h in a] == [1, 2, 3, 4, 5]
    # the first resumed step says how many episodes were lost; later ones do not repeat it
    assert a[3]["agent/dropped_in_flight/agent"] == carried
    assert not any("agent/dropped_in_flight/agent" in h for h in a[:3] + a[4:])
    # two resumes from the same checkpoint agree exactly (the pool starts empty in both)
    keys = sorted(k for k in a[3] if k.startswith(("agent/", "reverse_kl/", "loss", "is/")))
    assert [[h.get(k) for k in keys] for h in a[3:]] == [[h.get(k) for k in keys] for h in b[3:]]
    wa, wb = load_file(str(out / "final" / "model.safetensors")), load_file(str(copy / "final" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
