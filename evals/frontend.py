"""Held-out eval of the `frontend` domain: greedy pages for the procedural test split,
rendered and scored by rewards/frontend.py (mean fraction of spec checks met), with a
screenshot of every scored page when `screenshots_dir` is given, and `page_grid`, the
picture of pages side by side (rows = tasks, columns = models) for the pipeline report."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from experts.frontend.data import DATASETS, DOMAIN, make_dataset
from core.evaluate import evaluate as _evaluate
from rewards.frontend import reward

# Budget of new tokens: references are <= ~90 tokens at difficulty 1, <= ~140 at 2,
# <= ~190 above (the tokenizer splits HTML finely).
MAX_NEW_TOKENS = {1: 128, 2: 192}
MAX_NEW_TOKENS_HARD = 256
INDEX = "index.json"


def evaluate(model, *, n: int = 200, seed: int = 0, difficulty: int = 1,
             effort: str | None = None, dataset: str = "procedural",
             max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             screenshots_dir: str | Path | None = None, **reward_kwargs) -> dict:
    """Greedy, deterministic held-out score of `model` (an HF model or a checkpoint path)
    on `n` test tasks. reward_kwargs go to the reward (timeout_s, max_pages, executable).
    With `screenshots_dir`, the top 800x320 px of every page is saved there as <row>.png and
    DIR/index.json lists {row, family, prompt, page, score, png} (png None for a page
    that never loaded). Returns {"domain", "effort", "dataset", "n", "score"}."""
    if effort is not None:
        raise ValueError(f"evals.frontend: the domain has no reasoning efforts; got effort={effort!r}")
    if dataset != "procedural" and dataset not in DATASETS:
        raise ValueError(f"evals.frontend: unknown dataset {dataset!r}; expected 'procedural'")
    ds = make_dataset("test", n, seed=seed, difficulty=difficulty)
    shots = None
    if screenshots_dir is not None:
        out = Path(screenshots_dir)
        out.mkdir(parents=True, exist_ok=True)
        shots = [str(out / f"{i:04d}.png") for i in range(len(ds))]
        for p in shots:   # a page that does not load this time must not show last run's picture
            Path(p).unlink(missing_ok=True)
        ds = ds.add_column("screenshot", shots)
    fn = functools.partial(reward, **reward_kwargs) if reward_kwargs else reward
    budget = max_new_tokens or MAX_NEW_TOKENS.get(difficulty, MAX_NEW_TOKENS_HARD)
    score, pages, scores = _evaluate(model, ds, fn, max_new_tokens=budget, batch_size=batch_size,
                                     tokenizer=tokenizer, return_completions=True)
    if shots is not None:
        index = [{"row": i, "family": ds[i]["family"], "prompt": ds[i]["prompt"][-1]["content"], "page": pages[i],
                  "score": scores[i], "png": shots[i] if Path(shots[i]).exists() else None}
                 for i in range(len(ds))]
        (Path(screenshots_dir) / INDEX).write_text(json.dumps(index, indent=1))
    return {"domain": DOMAIN, "effort": None, "dataset": dataset, "n": len(ds), "score": float(score)}


def page_grid(columns: dict[str, list[str | Path | None]], out_png: str | Path,
              titles: list[str] | None = None, *, cell_inches: float = 4.0) -> Path:
    """One image of pages side by side: a column per model (e.g. base, teacher, student,
    seq-KD: the dict's order), a row per task (`titles[i]` labels row i, e.g. the spec).
    Each list holds the PNG paths of that model's pages in task order; a None or missing
    file is drawn as "no page" (the page did not load). Returns `out_png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    if not columns:
        raise ValueError("page_grid: no columns")
    lengths = {name: len(paths) for name, paths in columns.items()}
    n_rows = max(lengths.values())
    if n_rows == 0 or len(set(lengths.values())) != 1:
        raise ValueError(f"page_grid: every column needs the same number (> 0) of pages, got {lengths}")
    if titles is not None and len(titles) != n_rows:
        raise ValueError(f"page_grid: {len(titles)} titles for {n_rows} rows")
    names = list(columns)
    fig, axes = plt.subplots(n_rows, len(names), figsize=(cell_inches * (len(names) + 0.6), cell_inches * 0.45 * n_rows),
                             squeeze=False)
    for r in range(n_rows):
        for c, name in enumerate(names):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            p = columns[name][r]
            if p is not None and Path(p).is_file():
                ax.imshow(mpimg.imread(str(p)))
            else:
                ax.text(0.5, 0.5, "no page", ha="center", va="center", fontsize=10, color="gray",
                        transform=ax.transAxes)
            if r == 0:
                ax.set_title(name, fontsize=11)
            if c == 0 and titles is not None:
                ax.set_ylabel("\n".join(_wrap(titles[r], 40)[:4]), rotation=0, ha="right", va="center", fontsize=8)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")   # the row labels sit left of the axes: keep them whole
    plt.close(fig)
    return out


def _wrap(text: str, width: int) -> list[str]:
    lines, cur = [], ""
    for w in str(text).split():
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    return lines + ([cur] if cur else [])
