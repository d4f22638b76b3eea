"""Fingerprints of the MOPD loop: hashes of the final weights and of the metric history
(wall-clock keys left out) of short tiny-model runs through `mopd.distill.run`, to show a
refactor of the loop computes exactly what it computed before (issue #34 item 2).

    PYTHONPATH=$PWD python -m bench.loop_fingerprint --out /tmp/fp --json fp.json

Arms (HF sampler, 12 steps, 8 prompts per step, two domains):
  sync          kl=full, 2 minibatches, task rewards and half the rows off-policy (references)
  async         rollout.async_steps=true
  sync_resume   the sync arm stopped by SIGTERM after step 5, then train.resume=true
  async_resume  the async arm stopped after step 5, resumed
  partial       an agent domain with partial rollouts (episodes carried over), stopped
                after step 5 (episodes in flight dropped), resumed
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TIMING = ("time/", "tokens_per_s/", "async/overlap_s")
# the agent environment of the partial-rollouts e2e test (tasks of one or three user turns)
ENV_REF = "test_partial_distill:make_env"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))


def reward(prompts, completions, **cols):
    """A task reward that depends on the text: its length mod 3."""
    return [float(len(c) % 3) for c in completions]


def _scaled(path: Path, factor: float) -> Path:
    from safetensors.torch import save_file
    w = load_file(str(path / "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"] * factor
    save_file(w, str(path / "model.safetensors"))
    return path


def build(root: Path) -> dict[str, Path]:
    """The tiny models, data and two recipes (two plain domains; an agent domain)."""
    from core.tiny import build_tiny_model

    student = _scaled(build_tiny_model(root / "student", seed=0), 3.0)
    ta = _scaled(build_tiny_model(root / "teacher_a", seed=0), 6.0)
    tb = _scaled(build_tiny_model(root / "teacher_b", seed=0), 1.5)
    rows = [{"prompt": [{"role": "user", "content": f"say something about {i} {d}"}], "domain": d,
             "completion": [{"role": "assistant", "content": f"the answer is {i}"}]}
            for i, d in ((i, ("alpha", "beta")[(i + 1) % 2]) for i in range(40))]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    plain = root / "plain.yaml"
    plain.write_text(f"""
model: {{path: {student}}}
data: {{datasets: [{{path: {root / 'prompts.jsonl'}}}], mix: {{alpha: 1.0, beta: 1.0}}}}
teachers: {{alpha: {{path: {ta}}}, beta: {{path: {tb}}}}}
rewards: {{alpha: "bench.loop_fingerprint:reward", beta: "bench.loop_fingerprint:reward"}}
rollout: {{backend: hf, max_new_tokens: 8}}
loss: {{kl: full, max_staleness: 1}}
train: {{max_steps: 12, prompts_per_step: 8, lr: 3.0e-3, save_every: 4}}
mlflow: {{experiment: fingerprint, log_model: false}}
""")
    arows = [{"prompt": [{"role": "user", "content": f"task {i}"}], "domain": "agent",
              "task": json.dumps({"id": f"task-{i}", "user": f"task {i}", "user_turns": 1 if i % 4 == 0 else 3})}
             for i in range(8)]
    arows += [{"prompt": [{"role": "user", "content": f"say something about {i}"}], "domain": "alpha"}
              for i in range(4)]
    (root / "agent_rows.jsonl").write_text("\n".join(json.dumps(r) for r in arows))
    (root / "harnesses.yaml").write_text("harnesses:\n  - {name: json_all, syntax: json}\n")
    agent = root / "agent.yaml"
    agent.write_text(f"""
model: {{path: {student}}}
data: {{datasets: [{{path: {root / 'agent_rows.jsonl'}}}], mix: {{agent: 2.0, alpha: 1.0}}, max_prompt_tokens: 64}}
teachers: {{agent: {{path: {ta}}}, alpha: {{path: {ta}}}}}
agents:
  agent: {{env: "{ENV_REF}", harnesses: {root / 'harnesses.yaml'}, max_turns: 3, max_context_tokens: 400,
           max_new_tokens: 10, partial: {{enabled: true, min_finished: 0.25}}}}
rollout: {{backend: hf, max_new_tokens: 8}}
loss: {{max_staleness: 0}}
train: {{max_steps: 12, prompts_per_step: 6, lr: 3.0e-4, save_every: 4}}
mlflow: {{experiment: fingerprint, log_model: false}}
""")
    return {"plain": plain, "agent": agent}


def _run(cfg_path: Path, out: Path, overrides: list[str], stop_at: int | None = None):
    from core.config import load_config
    from mopd.distill import DistillConfig, run

    def stop(step, m):
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = load_config(DistillConfig, str(cfg_path), overrides)
    try:
        return run(cfg, out, progress=False, callbacks=[stop] if stop_at else None)["history"]
    except SystemExit as e:
        if stop_at is None or e.code != 128 + signal.SIGTERM:
            raise
        return None


def fingerprint(out: Path, hist: list[dict]) -> dict:
    w = load_file(str(out / "final" / "model.safetensors"))
    hw = hashlib.sha256()
    for k in sorted(w):
        hw.update(k.encode())
        hw.update(w[k].contiguous().view(torch.uint8).numpy().tobytes())
    values = [{k: v for k, v in sorted(h.items()) if not k.startswith(TIMING)} for h in hist]
    hm = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
    return {"weights_sha256": hw.hexdigest(), "metrics_sha256": hm, "steps": len(hist),
            "last_loss": hist[-1]["loss"]}


ARMS = {
    "sync": ("plain", ["train.minibatches=2", "loss.task_reward_alpha=0.5", "rollout.on_policy_fraction=0.5"]),
    "async": ("plain", ["rollout.async_steps=true"]),
    "sync_resume": ("plain", ["train.minibatches=2", "loss.task_reward_alpha=0.5",
                              "rollout.on_policy_fraction=0.5"]),
    "async_resume": ("plain", ["rollout.async_steps=true"]),
    "partial": ("agent", []),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="a new folder for the models and runs")
    ap.add_argument("--json", help="write the fingerprints here")
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args(argv)
    os.environ.pop("MLFLOW_TRACKING_URI", None)   # each run's own store under its --out
    torch.set_num_threads(1)
    root = Path(args.out)
    recipes = build(root / "setup")
    res = {}
    for arm in args.arms.split(","):
        recipe, over = ARMS[arm]
        out = root / arm
        if arm.endswith("_resume") or arm == "partial":
            assert _run(recipes[recipe], out, over, stop_at=5) is None
            hist = _run(recipes[recipe], out, over + ["train.resume=true"])
        else:
            hist = _run(recipes[recipe], out, over)
        res[arm] = fingerprint(out, hist)
        print(arm, json.dumps(res[arm]), file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
