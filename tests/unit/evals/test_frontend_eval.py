"""evals/frontend.py: the held-out eval saves a screenshot of every scored page with an
index, `mopd eval` (evals/run.py) hands it a folder under its --out, and page_grid draws
pages side by side (rows = tasks, columns = models)."""
from __future__ import annotations

import json

import matplotlib.image as mpimg
import pytest

from evals import frontend as F
from evals.run import EvalColumn, evaluate_model
from core.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("frontend_eval") / "m", seed=0)


def test_eval_saves_a_screenshot_of_every_page(model_dir, tmp_path):
    res = F.evaluate(str(model_dir), n=3, max_new_tokens=12, batch_size=3, screenshots_dir=tmp_path / "shots")
    assert res["domain"] == "frontend" and res["n"] == 3 and 0.0 <= res["score"] <= 1.0
    index = json.loads((tmp_path / "shots" / F.INDEX).read_text())
    assert [e["row"] for e in index] == [0, 1, 2]
    assert res["score"] == pytest.approx(sum(e["score"] for e in index) / 3)
    for e in index:   # random tokens are still a page that loads: every one has its picture
        assert e["png"] and e["png"].endswith(f"{e['row']:04d}.png") and e["prompt"] and "page" in e
        img = mpimg.imread(e["png"])
        assert img.shape[:2] == (320, 800)


def test_mopd_eval_passes_a_screenshot_folder(model_dir, tmp_path):
    col = EvalColumn(name="frontend", domain="frontend", effort=None, n=2, max_new_tokens=8, batch_size=2)
    scores = evaluate_model(str(model_dir), [col], progress=False, label="base", out_dir=tmp_path)
    assert set(scores) == {"frontend"}
    index = json.loads((tmp_path / "pages" / "base" / "frontend" / F.INDEX).read_text())
    assert len(index) == 2


def test_page_grid(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs = []
    for i, color in enumerate(("red", "blue", "green")):
        p = tmp_path / f"{i}.png"
        fig = plt.figure(figsize=(2, 1.5))
        fig.patch.set_facecolor(color)
        fig.savefig(p, facecolor=color)
        plt.close(fig)
        pngs.append(str(p))
    cols = {"base": [None, pngs[0], str(tmp_path / "missing.png")], "teacher": pngs,
            "student": pngs[::-1], "seq-KD": pngs}
    out = F.page_grid(cols, tmp_path / "grid" / "pages.png", titles=["a row #r", "a box #a", "a card #c"])
    img = mpimg.imread(out)
    h, w = img.shape[:2]
    assert w > h > 0   # 4 columns wider than 3 rows tall
    with pytest.raises(ValueError, match="same number"):
        F.page_grid({"a": pngs, "b": pngs[:2]}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="titles"):
        F.page_grid({"a": pngs}, tmp_path / "x.png", titles=["one"])
