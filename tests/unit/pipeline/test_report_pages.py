"""The report's page picture (pipeline/stages/report.py): the frontend pages of base,
teacher, student and seq-KD side by side, from the eval stages' saved screenshots."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from evals.run import EvalColumn
from pipeline.stages.report import page_grid_picture


def _eval_out(root: Path, model: str, column: str, n: int, shade: float) -> dict:
    import matplotlib.pyplot as plt

    d = root / "evals" / model.replace("/", "-") / "pages" / model / column
    d.mkdir(parents=True)
    rows = []
    for i in range(n):
        png = d / f"{i:04d}.png"
        plt.imsave(png, np.full((32, 80, 3), shade, dtype=np.float32))
        rows.append({"row": i, "prompt": f"task {i}: a red box", "png": str(png) if i != 1 else None})
    (d / "index.json").write_text(json.dumps(rows))
    return {"model": model, "scores": {column: shade}, "out": str(root / "evals" / model.replace("/", "-"))}


def test_grid_of_the_four_models_and_its_report_lines(tmp_path):
    cols = [EvalColumn("math/low", "math", "low", 8), EvalColumn("frontend", "frontend", None, 8)]
    models = {"base": 0.1, "teacher/frontend": 0.9, "student": 0.8, "seq_kd": 0.7, "weight_avg": 0.2}
    evals = {m: f"eval/{m}" for m in models}
    inputs = {f"eval/{m}": _eval_out(tmp_path, m, "frontend", 6, v) for m, v in models.items()}
    lines = page_grid_picture(SimpleNamespace(inputs=inputs), evals, cols, tmp_path)
    png = tmp_path / "pages-frontend.png"
    assert png.exists() and png.stat().st_size > 1000
    assert "## Pages (frontend)" in lines and "![pages](pages-frontend.png)" in lines
    assert any("first 4 held-out tasks" in x for x in lines)


def test_no_frontend_column_or_no_pages_makes_no_picture(tmp_path):
    cols = [EvalColumn("math/low", "math", "low", 8)]
    assert page_grid_picture(SimpleNamespace(inputs={}), {"base": "eval/base"}, cols, tmp_path) == []
    # a cached eval stage from before pages were saved has no "out"
    cols = [EvalColumn("frontend", "frontend", None, 8)]
    ctx = SimpleNamespace(inputs={"eval/base": {"model": "m", "scores": {}}})
    assert page_grid_picture(ctx, {"base": "eval/base"}, cols, tmp_path) == []
    assert not list(tmp_path.glob("pages-*.png"))
