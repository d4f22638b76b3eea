"""bench/fp4_qat_domains.py on fake run folders: the table and JSON come from the stages'
summaries and the cached PTQ scores and mismatch (no training, no engine); the PTQ
checkpoint it writes holds exactly the quantized weights the sampler and the export get."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import fp4_qat_domains as bench
from core.config import dump_yaml, load_config
from experts.run import ExpertConfig

REPO = Path(__file__).resolve().parents[3]
QAT = {"bf16": 0.80, "int4": 0.70, "nvfp4": 0.75, "mxfp4": 0.60}
PTQ = {"int4": 0.50, "nvfp4": 0.78, "mxfp4": 0.40}


def fake_runs(root: Path, qat: dict = QAT, ptq: dict = PTQ, seed: int = 0) -> Path:
    cfg = load_config(ExpertConfig, REPO / "recipes/experts/math/sft-low.yaml", ["data.n_test=100", f"train.seed={seed}"])
    for fmt, s in qat.items():
        d = root / "math-low" / fmt
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(dump_yaml(cfg))
        (d / "summary.json").write_text(json.dumps({"score": s}))
    for fmt, s in ptq.items():
        d = root / "math-low" / f"ptq_{fmt}"
        d.mkdir(parents=True)
        (d / "score.json").write_text(json.dumps({"score": s, "n": 100}))
    m = {"abs_mean": 1e-7, "abs_max": 1e-6, "k3": 1e-12, "tokens": 10}
    mm = {"floor": m, **{f"{f}/{k}": dict(m, abs_mean=2e-2 if k == "ptq" else 1e-7)
                         for f in bench.FORMATS for k in ("qat", "ptq")}}
    (root / "mismatch.json").write_text(json.dumps({"math-low": mm}))
    return root


def test_table_and_json_from_the_runs(tmp_path):
    runs = fake_runs(tmp_path / "runs")
    res = bench.main([str(runs), "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text())["keys"] == ["math-low"]
    sc = res["scores"]["math-low"]
    assert sc["bf16"]["score"] == 0.80
    for fmt in bench.FORMATS:
        assert (sc[fmt]["qat"], sc[fmt]["ptq"]) == (QAT[fmt], PTQ[fmt])
    assert sc["nvfp4"]["se_qat"] == pytest.approx((0.75 * 0.25 / 100) ** 0.5)
    rows = {ln.split("|")[2].strip(): ln for ln in res["table"].splitlines()[2:]}
    assert "+0.200" in rows["int4"] and "-0.030" in rows["nvfp4"]   # QAT - PTQ, signed
    assert "2.0e-02" in rows["mxfp4"] and "(floor)" in rows["bf16 (none)"]


def test_missing_runs_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="bf16/summary.json"):
        bench.main([str(tmp_path / "empty"), "--no-mismatch"])


def test_ptq_checkpoint_is_the_quantized_weights(tmp_path, tiny_student_dir, fmt="nvfp4"):
    from core.models import build_student
    from core.quant import quantized_state_dict

    cfg = load_config(ExpertConfig, REPO / "recipes/experts/math/sft-low.yaml")
    q = bench.quant_of(cfg, fmt)
    assert (q.enabled, q.format) == (True, fmt)
    out = bench.write_ptq(tiny_student_dir, q, tmp_path / "ptq")
    want = quantized_state_dict(build_student(str(tiny_student_dir), quant=q))
    got = build_student(str(out)).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the NVFP4 fused groups (q/k/v, gate/up) share one global scale: checked through the
    # same quantized_state_dict; not the unquantized weights: the PTQ arm is quantized
    plain = build_student(str(tiny_student_dir)).state_dict()
    assert not torch.equal(got["model.layers.0.mlp.down_proj.weight"], plain["model.layers.0.mlp.down_proj.weight"])


def _rows_as_recorded(cfg, model: Path) -> list[float]:
    """Stand-in for scoring a checkpoint: 0/1 rows whose mean is the score its arm recorded."""
    rec = model.parent / ("summary.json" if model.parent.name in QAT else "score.json")
    k = round(json.loads(rec.read_text())["score"] * cfg.data.n_test)
    return [1.0] * k + [0.0] * (cfg.data.n_test - k)


def test_pool_over_seeds_per_row(tmp_path, monkeypatch):
    s0 = fake_runs(tmp_path / "s0")
    s1 = fake_runs(tmp_path / "s1", qat={**QAT, "int4": 0.60, "nvfp4": 0.65}, seed=1)
    monkeypatch.setattr(bench, "row_scores", _rows_as_recorded)
    res = bench.main([str(s1), "--no-mismatch", "--pool", str(s0), "--rows-cache", str(tmp_path / "rows")])
    p = res["pooled"]["math-low"]
    assert p["seeds"] == [0, 1]   # in seed order, whichever folder is RUNS
    g = p["qat_minus_ptq"]["int4"]
    assert g["per_seed"] == pytest.approx([0.20, 0.10]) and g["mean"] == pytest.approx(0.15)
    assert g["t95"][0] < 0.15 < g["t95"][1] and g["boot95"][0] <= 0.15 <= g["boot95"][1]
    assert p["between_formats"]["int4 - nvfp4"]["per_seed"] == pytest.approx([0.20 - -0.03, 0.10 - -0.13])
    assert "int4 - mxfp4" in res["table"] and "seed 0 | seed 1" in res["table"]
    # the per-row scores are cached outside the runs folders (another seed's may be read-only)
    assert len(list((tmp_path / "rows").glob("*.json"))) == 2 and not list(s0.rglob("*rows*"))


def test_pool_refuses_rows_that_are_not_the_recorded_score(tmp_path, monkeypatch):
    s0, s1 = fake_runs(tmp_path / "s0"), fake_runs(tmp_path / "s1", seed=1)
    monkeypatch.setattr(bench, "row_scores", lambda cfg, model: [1.0] * cfg.data.n_test)
    with pytest.raises(SystemExit, match="not the recorded score"):
        bench.main([str(s1), "--no-mismatch", "--pool", str(s0), "--rows-cache", str(tmp_path / "rows")])
    with pytest.raises(SystemExit, match="--rows-cache"):
        bench.main([str(s1), "--no-mismatch", "--pool", str(s0)])
