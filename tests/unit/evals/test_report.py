"""The report renders from a small eval.json and MOPD history: both plots are real PNGs,
report.json has the agreed schema, and the token count comes from the history."""
from __future__ import annotations

import json
import math

import pytest

from evals.report import build_report, collect_scores, on_policy_tokens_from_history, tokens_from_history

DOMAINS = ["math/low", "math/high", "code"]

EVAL = {
    "domains": DOMAINS,
    "models": {"base": "/m/base", "student": "/m/student", "seq_kd": "/m/seq_kd", "weight_avg": "/m/avg",
               "teacher/math/low": "/m/tl", "teacher/math/high": "/m/th", "teacher/code": "/m/tc"},
    "scores": {
        "base": {"math/low": 0.0, "math/high": 0.05, "code": 0.0},
        "student": {"math/low": 0.6, "math/high": 0.4, "code": 0.3},
        "seq_kd": {"math/low": 0.5, "math/high": 0.2, "code": 0.25},
        "weight_avg": {"math/low": 0.1, "math/high": 0.1, "code": 0.0},
        "teacher/math/low": {"math/low": 0.8},
        "teacher/math/high": {"math/high": 0.5},
        "teacher/code": {"code": 0.0},          # a teacher scoring 0: retention is null, not inf
    },
}

HISTORY = [{"step": s, "reverse_kl/math": 1.0 / s, "reverse_kl/code": 2.0 / s,
            "tokens_per_s/update": 100.0 / 0.5, "time/update_s": 0.5} for s in range(1, 11)]


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_files_and_schema(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps(EVAL))
    (tmp_path / "history.json").write_text(json.dumps(HISTORY))
    rep = build_report(tmp_path / "eval.json", tmp_path / "history.json", tmp_path / "out",
                       student_tokens={"seq_kd": 990}, stage_seconds={"base": 1.5, "mopd": 20.0},
                       wall_seconds=30.0, mlflow={"tracking_uri": "sqlite:///x.db", "parent_run_id": "abc"})
    out = tmp_path / "out"
    for name in ("retention.png", "kl_curves.png"):
        p = out / name
        assert p.exists() and _is_png(p), name
        from PIL import Image
        with Image.open(p) as im:
            im.verify()
        import matplotlib.image as mpimg
        arr = mpimg.imread(str(p))
        assert arr.ndim == 3 and arr.shape[0] > 100 and arr.shape[1] > 100

    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(rep))
    assert set(on_disk) >= {"domains", "scores", "retention", "student_tokens", "stage_seconds",
                            "wall_seconds", "mlflow"}
    assert on_disk["domains"] == DOMAINS
    assert set(on_disk["scores"]) == {"base", "teacher", "student", "warmup_mopd", "seq_kd", "weight_avg", "mix_rl",
                                      "cascade_rl"}
    assert on_disk["budgets"] == {} and not (out / "budgets.png").exists()
    for row in on_disk["scores"].values():
        assert set(row) == set(DOMAINS)
    assert on_disk["scores"]["teacher"] == {"math/low": 0.8, "math/high": 0.5, "code": 0.0}
    assert on_disk["retention"]["math/low"] == pytest.approx(0.75)
    assert on_disk["retention"]["math/high"] == pytest.approx(0.8)
    assert on_disk["retention"]["code"] is None
    assert on_disk["retention_all"]["seq_kd"]["math/low"] == pytest.approx(0.625)
    assert on_disk["student_tokens"] == {"mopd": 1000, "seq_kd": 990}
    assert on_disk["stage_seconds"] == {"base": 1.5, "mopd": 20.0}
    assert on_disk["wall_seconds"] == 30.0
    assert on_disk["mlflow"] == {"tracking_uri": "sqlite:///x.db", "parent_run_id": "abc"}
    assert on_disk["reverse_kl"]["code"] == {"first": 2.0, "last": 0.2}

    md = (out / "report.md").read_text()
    assert "retention.png" in md and "kl_curves.png" in md and "math/high" in md
    # the RL baselines, not in this eval.json, get no row; no budgets, no budgets table
    assert "Mix-RL" not in md and "cascade RL" not in md and "## Budgets per method" not in md


def test_means_and_their_standard_error(tmp_path):
    ev = {"domains": ["a", "b"], "settings": {"a": {"n": 100}, "b": {"n": 400}},
          "scores": {"teacher": {"a": 1.0, "b": 1.0}, "student": {"a": 0.5, "b": 0.9},
                     "seq_kd": {"a": 0.6, "b": 0.7}, "base": {"a": 0.0, "b": None}}}
    rep = build_report(ev, [], tmp_path)
    assert rep["eval_rows"] == {"a": 100, "b": 400}
    st = rep["means"]["student"]
    assert st["mean"] == pytest.approx(0.7)
    assert st["se"] == pytest.approx(math.sqrt(0.25 / 100 + 0.09 / 400) / 2)
    assert rep["means"]["base"] is None      # a missing column: no mean
    md = (tmp_path / "report.md").read_text()
    assert "Held-out rows per column: a 100, b 400." in md
    assert "MOPD student mean − seq-KD mean: +0.050" in md


def test_missing_models_and_empty_history(tmp_path):
    """A run without baselines or MOPD steps still renders (nulls, a placeholder plot)."""
    ev = {"domains": ["chat"], "scores": {"base": {"chat": 0.1}, "teacher": {"chat": 0.9},
                                          "student": {"chat": 0.45}}}
    rep = build_report(ev, [], tmp_path)
    assert rep["scores"]["seq_kd"] == {"chat": None}
    assert rep["retention"] == {"chat": pytest.approx(0.5)}
    assert rep["student_tokens"]["mopd"] is None
    assert _is_png(tmp_path / "retention.png") and _is_png(tmp_path / "kl_curves.png")


def test_collect_scores_prefers_own_teacher():
    ev = {"domains": ["a"], "scores": {"teacher/a": {"a": 0.7}, "teacher": {"a": 0.1}}}
    assert collect_scores(ev)[1]["teacher"] == {"a": 0.7}


def test_tokens_from_history():
    assert tokens_from_history([{"tokens_per_s/update": 10 / 0.3, "time/update_s": 0.3}] * 3) == 30
    assert tokens_from_history([{"tokens": 7}, {"tokens": 5}]) == 12


def test_on_policy_share_of_a_ramped_run(tmp_path):
    """A run with teacher-forced reference rows logs tokens/on_policy; the report says what
    share of MOPD's tokens were the student's own samples. Steps without it are all its own."""
    hist = [{"step": 1, "tokens": 100.0, "tokens/on_policy": 0.0},
            {"step": 2, "tokens": 100.0, "tokens/on_policy": 50.0},
            {"step": 3, "tokens": 100.0}]
    assert on_policy_tokens_from_history(hist) == 150
    # a history from before the metric: teacher-forced rows, share unknown (not "all own")
    assert on_policy_tokens_from_history([{"tokens": 100.0, "off_policy_frac": 0.5}]) is None
    (tmp_path / "eval.json").write_text(json.dumps(EVAL))
    rep = build_report(tmp_path / "eval.json", hist, tmp_path / "out")
    assert rep["student_tokens"]["mopd"] == 300 and rep["mopd_on_policy_tokens"] == 150
    assert "the student's own samples: 150 (50%)" in (tmp_path / "out" / "report.md").read_text()
    rep = build_report(tmp_path / "eval.json", HISTORY, tmp_path / "out2")
    assert rep["mopd_on_policy_tokens"] == rep["student_tokens"]["mopd"]
    assert "own samples" not in (tmp_path / "out2" / "report.md").read_text()


def _budgets():
    from mopd.baselines.budget import mopd_budget, no_training_budget, rl_budget, seq_kd_budget

    n = 1000
    return {"student": {**mopd_budget(n_student=n, n_teacher=2 * n, tokens=1000, samples=40), "seconds": 20.0,
                        "teacher_seconds": 100.0},
            "seq_kd": {**seq_kd_budget(n_student=n, n_teacher=2 * n, tokens=990, rows=32), "seconds": 30.0,
                       "teacher_seconds": 100.0},
            "weight_avg": {**no_training_budget(n), "seconds": 1.0, "teacher_seconds": 100.0},
            "mix_rl": {**rl_budget(n_student=n, tokens=1200, samples=40), "seconds": 50.0, "teacher_seconds": 0.0}}


def test_budgets_table_and_plot(tmp_path):
    """Every method with a budget gets a row (its mean score, tokens, FLOPs, wall-clock) and a
    marker in budgets.png; the Mix-RL scores get their own row in the score table."""
    ev = json.loads(json.dumps(EVAL))
    ev["scores"]["mix_rl"] = {"math/low": 0.3, "math/high": 0.1, "code": 0.2}
    rep = build_report(ev, HISTORY, tmp_path, budgets=_budgets(), extra={"rl_skipped_domains": ["agent"]})
    assert rep["scores"]["mix_rl"]["code"] == 0.2 and rep["means"]["mix_rl"]["mean"] == pytest.approx(0.2)
    assert rep["budgets"]["mix_rl"]["flops"] == 8 * 1000 * 1200
    p = tmp_path / "budgets.png"
    assert p.exists() and _is_png(p)
    md = (tmp_path / "report.md").read_text()
    table = md[md.index("## Budgets per method"):]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines() if line.startswith("| ") and "method" not in line}
    assert list(rows) == ["MOPD student", "seq-KD (off-policy)", "weight average", "Mix-RL (joint GRPO)"]
    # mean score, samples, student tokens, teacher generated, teacher scored, FLOPs, seconds, + experts
    assert rows["MOPD student"] == ["0.433", "40", "1,000", "0", "1,000", "1.2e+07", "20", "100"]
    assert rows["seq-KD (off-policy)"] == ["0.317", "32", "990", "990", "0", "9.9e+06", "30", "100"]
    assert rows["weight average"][2:6] == ["0", "0", "0", "0"]
    assert rows["Mix-RL (joint GRPO)"] == ["0.200", "40", "1,200", "0", "0", "9.6e+06", "50", "0"]
    assert "2·N per token of a forward" in md and "6·N per token of a training update" in md
    assert "](budgets.png)" in md and "['agent']" in md
    assert "| Mix-RL (joint GRPO) | 0.300 | 0.100 | 0.200 | 0.200 |" in md


def test_budget_points_skip_a_method_without_a_score(tmp_path):
    from evals.report import budget_points

    rep = build_report(EVAL, HISTORY, tmp_path, budgets=_budgets())   # mix_rl has a budget but no scores
    pts = {p["model"]: p for p in budget_points(rep)}
    assert set(pts) == {"student", "seq_kd", "weight_avg"}
    assert pts["student"]["flops"] == 2 * 1000 * 1000 + 2 * 2000 * 1000 + 6 * 1000 * 1000
    assert pts["seq_kd"]["seconds"] == 30.0


def test_warmup_then_mopd_row_sits_beside_plain_mopd_with_its_token_match(tmp_path):
    """The variant gets a score row right after the MOPD student, a budgets row (the warm-up's
    teacher-generated tokens beside the MOPD part's scored ones) and a line on how its
    student tokens match plain MOPD's."""
    from mopd.baselines.budget import mopd_budget, seq_kd_budget
    from pipeline.stages.warmup_mopd import combine

    n = 1000
    ev = json.loads(json.dumps(EVAL))
    ev["scores"]["warmup_mopd"] = {"math/low": 0.7, "math/high": 0.4, "code": 0.4}
    both = combine(seq_kd_budget(n_student=n, n_teacher=2 * n, tokens=210, rows=8),
                   mopd_budget(n_student=n, n_teacher=2 * n, tokens=800, samples=30))
    match = {"target_tokens": 1000, "warmup_tokens": 210, "mopd_tokens": 800, "mopd_tokens_planned": 790,
             "total_tokens": 1010, "mopd_steps": 8, "plain_mopd_steps": 10, "share": 0.2,
             "warmup_share_actual": 0.2079, "relative_error": 0.01}
    budgets = {**_budgets(), "warmup_mopd": {**both, "seconds": 25.0, "teacher_seconds": 100.0, "match": match}}
    build_report(ev, HISTORY, tmp_path, budgets=budgets)
    md = (tmp_path / "report.md").read_text()
    scores = [line.split("|")[1].strip() for line in md[:md.index("## Retention")].splitlines()
              if line.startswith("| ") and "model" not in line]
    assert scores[scores.index("MOPD student") + 1] == "seq-KD warm-up, then MOPD"
    assert "| seq-KD warm-up, then MOPD | 0.700 | 0.400 | 0.400 | 0.500 |" in md
    table = md[md.index("## Budgets per method"):]
    row = next(line for line in table.splitlines() if line.startswith("| seq-KD warm-up, then MOPD |"))
    # samples 8 + 30, tokens 210 + 800, generated 210, scored 800, FLOPs both parts', 25 s
    flops = 2 * 2 * n * 210 + 6 * n * 210 + 2 * n * 800 + 2 * 2 * n * 800 + 6 * n * 800
    assert [c.strip() for c in row.split("|")[2:-1]] == ["0.500", "38", "1,010", "210", "800", f"{flops:.3g}",
                                                          "25", "100"]
    assert "then MOPD from that checkpoint for 8 of plain MOPD's 10 steps" in md and "(+1.0%)" in md


def test_report_shows_both_held_out_harness_kinds_of_an_agent_domain(tmp_path):
    ev = {"domains": ["code", "coding_agent"], "models": {},
          "scores": {"student": {"code": 0.3, "coding_agent": 0.8, "coding_agent/held_out_combo": 0.6,
                                 "coding_agent/held_out_novel": 0.0},
                     "teacher/coding_agent": {"coding_agent": 1.0, "coding_agent/held_out_combo": 0.9,
                                              "coding_agent/held_out_novel": 0.0}}}
    rep = build_report(ev, [], tmp_path)
    assert list(rep["harnesses"]) == ["coding_agent"]   # code has no harnesses
    assert rep["harnesses"]["coding_agent"]["student"] == {"train": 0.8, "held_out_combo": 0.6,
                                                          "held_out_novel": 0.0}
    md = (tmp_path / "report.md").read_text()
    assert "## Held-out harnesses: coding_agent" in md
    assert "| MOPD student | 0.800 | 0.600 | 0.000 | 0.75 |" in md
    assert "| teacher (own domain) | 1.000 | 0.900 | 0.000 | 0.90 |" in md
