"""bench.harness_generalization: the fixed arm trains through one harness only, the
summary's retention and its interval, and (ci) a whole run at toy size: both arms
distilled from one teacher at the same updates, every model scored on train, combo and
novel harnesses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import harness_generalization as B
from core.agent.harness import load_harnesses

REPO = Path(__file__).resolve().parents[3]


def test_fixed_arm_mix_holds_one_train_harness(tmp_path):
    mix = load_harnesses(B.fixed_mix("recipes/harnesses/coding_agent.yaml", "python_terse", tmp_path))
    assert [h.name for h in mix.harnesses] == ["python_terse"] and not mix.held_out_combo
    with pytest.raises(SystemExit, match="no train harness of that name"):
        B.fixed_mix("recipes/harnesses/coding_agent.yaml", "combo_json_fixer", tmp_path)   # a held-out one


def test_summary_retention_and_t_interval():
    cells = [{"arm": arm, "seed": s, "train": tr, "held_out_combo": co, "held_out_novel": 0.0, "tokens": 10,
              "updates": 2, "fixed_harness": fx}
             for arm, s, tr, co, fx in (("random", 0, 0.8, 0.8, 0.1), ("random", 1, 0.5, 0.4, 0.1),
                                        ("fixed", 0, 0.3, 0.5, 1.0), ("fixed", 1, 0.0, 0.0, 0.0))]
    s = B.summarize(cells, {"train": 1.0}, None)
    assert s["arms"]["random"]["retention"] == pytest.approx([1.0, 0.8])   # against the nine train harnesses
    # the fixed student against its own one harness; no success there: 0, not a division error
    assert s["arms"]["fixed"]["retention"] == [0.5, 0.0]
    m, lo, hi = s["arms"]["random"]["retention_mean_ci"]
    assert m == pytest.approx(0.9) and lo == pytest.approx(0.9 - 12.706 * 0.1) and hi == pytest.approx(0.9 + 1.2706)
    assert s["arms"]["gap_random_minus_fixed"]["retention"][0] == pytest.approx(0.65)


def test_no_seeds_scores_the_expert_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(B, "score", lambda args, path: {"train": 1.0, "held_out_combo": 0.5, "held_out_novel": 0.0,
                                                        "n": 2, "failed_call_share": 0.0})
    monkeypatch.setattr(B, "score_fixed", lambda args, path: {"fixed_harness": 0.25})
    B.main(["--base", "b", "--teacher", "t", "--out", str(tmp_path), "--seeds", "--skip-start", "--n-prompts", "4"])
    res = json.loads((tmp_path / "harness_generalization.json").read_text())
    assert res["cells"] == [] and res["expert"]["held_out_combo"] == 0.5
    assert res["expert"]["fixed_harness"] == 0.25
    assert "| expert | – | 1.000 | 0.250 | 0.500 | 0.000 | 0.500 |" in capsys.readouterr().out


@pytest.mark.ci
def test_toy_run_scores_both_arms_on_every_harness_kind(tmp_path):
    from core.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "m", seed=0, max_position_embeddings=1536)
    out = tmp_path / "out"
    argv = ["--base", str(model), "--teacher", str(model), "--out", str(out), "--seeds", "0", "--steps", "1",
            "--batch", "2", "--n-eval", "2", "--n-prompts", "8", "--max-new-tokens", "8", "--skip-start",
            "agents.coding_agent.max_turns=2", "agents.coding_agent.max_new_tokens=8"]
    B.main(argv)
    res = json.loads((out / "harness_generalization.json").read_text())
    assert {c["arm"] for c in res["cells"]} == {"random", "fixed"}
    for c in res["cells"]:
        assert c["updates"] == 1 and c["n"] == 2
        assert all(0.0 <= c[k] <= 1.0 for k in (*B.KINDS, "fixed_harness"))
    assert set(res["expert"]) >= set(B.KINDS)
    # the fixed arm's teacher episodes all went through its one harness
    from datasets import load_from_disk
    assert (out / "fixed" / "seed0" / "seq_kd" / "teacher_answers").exists()
    ds = load_from_disk(str(out / "fixed" / "seed0" / "seq_kd" / "teacher_answers"))
    from core.tiny import load_tokenizer
    tok = load_tokenizer()
    assert len(ds) == 2 and all("You can use these tools" in tok.decode(r) and "```json" in tok.decode(r)
                                for r in ds["prompt_ids"])   # json_plain, the mix's first
    B.main(argv)   # a rerun reuses every cell
    assert json.loads((out / "harness_generalization.json").read_text())["cells"] == res["cells"]
    # --share-episodes: seed 1 of each arm retrains on seed 0's expert episodes of that arm
    B.main([*argv[:argv.index("--seeds")], "--seeds", "0", "1", "--share-episodes", *argv[argv.index("--seeds") + 2:]])
    for arm in B.ARMS:
        a, b = (load_from_disk(str(out / arm / f"seed{s}" / "seq_kd" / "teacher_answers")) for s in (0, 1))
        assert a["completion_ids"] == b["completion_ids"] and a["prompt_ids"] == b["prompt_ids"]
