"""The report's cost part (evals/report_cost.py through evals.report.build_report): the
score-against-tokens table has a row per (column, model) with the cost columns, the
picture is a real PNG linked from report.md, and the effort table says whether low < high
holds for the teachers and the student; costs that were not recorded show as "–"."""
from __future__ import annotations

import json

from evals.report import build_report

DOMAINS = ["math/low", "math/high", "agent"]


def _c(mean, p90, n=8, **agent):
    return {"tokens": {"mean": mean, "p90": p90}, "n": n, **agent}


EVAL = {
    "domains": DOMAINS,
    "settings": {"math/low": {"domain": "math", "effort": "low", "n": 8},
                 "math/high": {"domain": "math", "effort": "high", "n": 8},
                 "agent": {"domain": "agent", "effort": None, "n": 8}},
    "scores": {"base": {"math/low": 0.0, "math/high": 0.0, "agent": 0.0},
               "student": {"math/low": 0.5, "math/high": 0.6, "agent": 0.25},
               "seq_kd": {"math/low": 0.4, "math/high": 0.5, "agent": 0.125},
               "teacher/math/low": {"math/low": 0.75}, "teacher/math/high": {"math/high": 0.875},
               "teacher/agent": {"agent": 0.5}},
    "cost": {"base": {"math/low": _c(12.0, 12), "math/high": _c(48.0, 48),
                      "agent": _c(90.0, 120, turns={"mean": 4.0, "p90": 6}, tool_calls={"mean": 2.5, "p90": 4})},
             # the student uses more tokens at low than at high: the table must say "no"
             "student": {"math/low": _c(30.0, 40), "math/high": _c(20.0, 25),
                         "agent": _c(60.0, 70, turns={"mean": 3.0, "p90": 4}, tool_calls={"mean": 1.5, "p90": 2})},
             # seq_kd's eval stage is from before costs were recorded: no entry
             "teacher/math/low": {"math/low": _c(8.5, 10)}, "teacher/math/high": {"math/high": _c(22.0, 31)},
             "teacher/agent": {"agent": _c(50.0, 64, turns={"mean": 2.5, "p90": 3},
                                           tool_calls={"mean": 1.25, "p90": 2})}},
}


def test_cost_table_picture_and_effort_line(tmp_path):
    rep = build_report(EVAL, [], tmp_path)
    png = tmp_path / "cost.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rep["cost"]["teacher"]["math/high"]["tokens"]["p90"] == 31
    assert rep["cost"]["seq_kd"] == {"math/low": None, "math/high": None, "agent": None}
    eff = rep["effort_cost"]["math"]
    assert eff["efforts"] == ["low", "high"]
    assert eff["models"]["teacher"] == {"tokens": {"low": 8.5, "high": 22.0}, "p90": {"low": 10, "high": 31},
                                        "rises": True}
    assert eff["models"]["student"]["rises"] is False and eff["models"]["base"]["rises"] is True
    assert "seq_kd" not in eff["models"]   # nothing recorded: no row, not a row of zeros

    md = (tmp_path / "report.md").read_text()
    assert "![score against tokens per task](cost.png)" in md
    header = next(line for line in md.splitlines() if line.startswith("| column | model | score |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells == ["column", "model", "score", "tokens/task mean", "tokens/task p90", "turns/episode mean",
                     "turns/episode p90", "tool calls/episode mean", "tool calls/episode p90"]
    rows = [line for line in md.splitlines() if line.startswith("| math/high |") or line.startswith("| agent |")]
    assert "| math/high | teacher (own domain) | 0.875 | 22.0 | 31 | – | – | – | – |" in rows
    assert "| agent | MOPD student | 0.250 | 60.0 | 70 | 3.0 | 4 | 1.5 | 2 |" in rows
    assert "| agent | seq-KD (off-policy) | 0.125 | – | – | – | – | – | – |" in rows   # scored, cost unknown
    assert "| model | low mean | low p90 | high mean | high p90 | rises |" in md
    assert "| teacher (own domain) | 8.5 | 10 | 22.0 | 31 | yes |" in md
    assert "| MOPD student | 30.0 | 40 | 20.0 | 25 | **no** |" in md
    assert "low < high in tokens per task holds for the teachers: yes; for the MOPD student: **no**." in md
    assert json.loads((tmp_path / "report.json").read_text())["effort_cost"] == rep["effort_cost"]


def test_report_without_costs_says_so(tmp_path):
    old = {k: v for k, v in EVAL.items() if k != "cost"}
    rep = build_report(old, [], tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "No costs recorded" in md and "--force eval/<model>" in md
    assert rep["effort_cost"]["math"]["models"] == {}
    assert not (tmp_path / "cost.png").exists() and "cost.png" not in md
