"""End to end: `python -m bench.horizon` on tiny models, one horizon and one seed, a few
MOPD steps and a handful of held-out episodes: MOPD on the agent domain's episodes, seq-KD
on the teacher's episodes with the same student-written token budget, both evaluated,
the table and the plot written. Checks the plumbing and the budget matching, not scores
(tiny random models solve nothing)."""
from __future__ import annotations

import json

import pytest

from bench import horizon
from core.tiny import build_tiny_model

pytestmark = pytest.mark.ci


def test_horizon_bench_runs_one_cell(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    base = build_tiny_model(tmp_path / "base", seed=0, max_position_embeddings=1536)
    teacher = build_tiny_model(tmp_path / "teacher", seed=1, max_position_embeddings=1536)
    out = tmp_path / "out"
    horizon.main(["--base", str(base), "--teacher", str(teacher), "--out", str(out), "--horizons", "2",
                  "--seeds", "0", "--n-eval", "4", "--n-prompts", "16", "--steps", "2", "--seq-kd-batch", "2",
                  "train.prompts_per_step=4", "agents.agent.max_turns=2", "agents.agent.max_new_tokens=8",
                  "quant.enabled=false"])
    res = json.loads((out / "horizon.json").read_text())
    (cell,) = res["cells"]
    assert cell["horizon"] == 2 and cell["seed"] == 0
    m, s = cell["mopd"], cell["seq_kd"]
    assert m["tokens"] > 0 and m["n"] == 4 and s["n"] == 4
    # seq-KD trains on as many assistant tokens as MOPD's student wrote, to a batch's worth
    assert abs(s["tokens"] - m["tokens"]) <= 2 * 2 * 8 * 2
    assert m["flops"] > 0 and s["flops"] > 0
    assert (out / "horizon.md").read_text().count("\n") == 3
    assert (out / "gap_vs_horizon.png").exists()
    # the student's starting point is scored on the same episodes, beside the teacher
    assert res["start"]["2"]["n"] == 4 and res["teacher"]["2"]["n"] == 4
    # a rerun reuses the finished cell (--student names the same starting checkpoint)
    horizon.main(["--student", str(base), "--teacher", str(teacher), "--out", str(out), "--horizons", "2",
                  "--seeds", "0", "--n-eval", "4", "--n-prompts", "16", "--steps", "2", "--seq-kd-batch", "2",
                  "train.prompts_per_step=4", "agents.agent.max_turns=2", "agents.agent.max_new_tokens=8",
                  "quant.enabled=false"])
    assert json.loads((out / "horizon.json").read_text())["cells"] == res["cells"]
    # a folder holding only a cell's MOPD arm (mopd.json) trains and scores only seq-KD
    cell_dir = out / "h2" / "seed0"
    assert json.loads((cell_dir / "mopd.json").read_text()) == res["cells"][0]["mopd"]
    (cell_dir / "cell.json").unlink()
    import mopd.distill

    monkeypatch.setattr(mopd.distill, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("MOPD rerun")))
    horizon.main(["--student", str(base), "--teacher", str(teacher), "--out", str(out), "--horizons", "2",
                  "--seeds", "0", "--n-eval", "4", "--n-prompts", "16", "--steps", "2", "--seq-kd-batch", "2",
                  "--seq-kd-lr", "3e-4", "train.prompts_per_step=4", "agents.agent.max_turns=2",
                  "agents.agent.max_new_tokens=8", "quant.enabled=false"])
    again = json.loads((out / "horizon.json").read_text())["cells"][0]
    assert again["mopd"] == res["cells"][0]["mopd"] and again["seq_kd"]["n"] == 4


def test_horizon_bench_on_coding_agent_episodes(tmp_path, monkeypatch):
    """`--domain coding_agent`: the cell's prompts, episodes and evals are the domain's own
    (each episode in a sandboxed workspace), its teacher keyed by the domain, and the
    transcript-token count read from that domain's metric."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    base = build_tiny_model(tmp_path / "base", seed=0, max_position_embeddings=1536)
    teacher = build_tiny_model(tmp_path / "teacher", seed=1, max_position_embeddings=1536)
    out = tmp_path / "out"
    horizon.main(["--domain", "coding_agent", "--base", str(base), "--teacher", str(teacher), "--out", str(out),
                  "--horizons", "1", "--seeds", "0", "--n-eval", "2", "--n-prompts", "8", "--steps", "1",
                  "--seq-kd-batch", "2", "train.prompts_per_step=2", "agents.coding_agent.max_turns=2",
                  "agents.coding_agent.max_new_tokens=8", "quant.enabled=false"])
    res = json.loads((out / "horizon.json").read_text())
    (cell,) = res["cells"]
    assert cell["horizon"] == 1 and cell["mopd"]["tokens"] > 0 and cell["seq_kd"]["n"] == 2
    from datasets import load_from_disk

    assert set(load_from_disk(str(out / "data" / "h1"))["domain"]) == {"coding_agent"}
    assert res["teacher"]["1"]["n"] == 2
