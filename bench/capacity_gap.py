"""MOPD against seq-KD with a capacity gap: a teacher 4-8x the student's parameters (same
tokenizer), each arm scored at several checkpoints along its run, over seeds, with 95%
bands and a paired bootstrap CI of the MOPD - seq-KD gap at each budget (issue 36, items 5-6).

Short answers (`--task math`: the math domain, effort low, "Answer: N"):

    mopd base --config recipes/base/tiny.yaml --out runs/base128 'data.domains=[math]'
    mopd expert --config recipes/experts/math/sft-low.yaml --out runs/math-teacher model.path=runs/base128/model
    mopd base --config recipes/base/tiny.yaml --out runs/base64 model.hidden_size=64 model.num_heads=1 \
        'data.domains=[math]'
    python -m bench.capacity_gap prepare --task math --out runs/bench/cg --student runs/base64/model \
        --teacher runs/math-teacher/model
    python -m bench.capacity_gap arms --out runs/bench/cg --seed 0 --arms mopd,seqkd_tok   # and 1, 2
    python -m bench.capacity_gap arms --out runs/bench/cg --seed 0 --arms seqkd_upd        # beside it
    python -m bench.capacity_gap report --out runs/bench/cg            # curves, CIs, result.json

The toy `reverse` (`--task reverse`, the default; core.toy_tasks) builds its own student:

    mopd toy --out runs/toy                                             # the toy's base and teachers
    python -m bench.capacity_gap prepare --out runs/bench/cgr --teacher runs/toy/teachers/reverse

Each task's setting (SETTINGS) was pre-registered on docs/results/2026-12-05-capacity-gap.md.
Per seed, three arms start from the same student base:

    mopd         recipes/mopd/toy.yaml's loss (or `--estimator`, `--set KEY=VALUE`), on-policy,
                 hf sampling, a checkpoint every 1/5 (math: 1/10) of its steps
    seqkd_tok    seq-KD (SFT on the teacher's greedy answers) with MOPD's student tokens
    seqkd_upd    seq-KD with MOPD's optimizer updates (same batch size)

seq-KD saves its checkpoints at the same fractions of its run as MOPD's. Every checkpoint is
scored greedy on the same held-out rows, so arms are paired by seed and by row. A benchmark,
not a test (the statistics: bench/stats.py, tests/unit/bench/test_bench_stats.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from bench.stats import bootstrap_mean_ci, paired_gap_ci

ARMS = ("mopd", "seqkd_tok", "seqkd_upd")
# One setting per task, each pre-registered on docs/results/2026-12-05-capacity-gap.md before
# its scored runs. `prepare --task` picks one and records it in DIR/data/setting.json, which
# `arms` and `report` read.
SETTINGS = {
    # 05:21 UTC: the toy `reverse` (core.toy_tasks), exact match
    "reverse": {
        "domain": "reverse",
        "difficulty": 2,                       # lists of 3-5 distinct words (the teacher was trained on 3-4)
        "student": {"hidden_size": 64, "num_layers": 2, "num_heads": 1},
        # The teacher is `mopd toy`'s reverse teacher (TOY_DEFAULTS: 128 x 2, the toy base
        # fine-tuned 300 steps on the task), passed as `prepare --teacher DIR`: 4.0x the student's
        # non-embedding parameters, 2.7x its total (the 2,048-row embeddings dominate both).
        "teacher": "mopd toy: DIR/teachers/reverse",
        "pretrain": {"n": 20_000, "steps": 400, "lr": 3e-3, "batch_size": 64, "warmup": 20},
        "n_train": 20_000, "n_test": 300, "eval_max_new_tokens": 12, "max_prompt_tokens": 64,
        "mopd": {"steps": 15, "prompts_per_step": 32, "lr": 2e-3, "max_new_tokens": 16},   # a checkpoint every steps/5
        "seqkd": {"lr": 2e-3, "batch_size": 32, "warmup": 0},
    },
    # 08:12 UTC: short answers, the `math` domain (experts.math.data, effort low: "Answer: N"),
    # the final-number reward (rewards.math). The student and teacher come from `mopd base`
    # and `mopd expert` (passed as `prepare --student DIR --teacher DIR`).
    "math": {
        "domain": "math", "effort": "low",
        "difficulty": 1,
        "student": "mopd base --config recipes/base/tiny.yaml model.hidden_size=64 model.num_heads=1 "
                   "'data.domains=[math]'",
        "teacher": "mopd base (128 x 2) then mopd expert --config recipes/experts/math/sft-low.yaml",
        "n_train": 20_000, "n_test": 400, "eval_max_new_tokens": 12, "max_prompt_tokens": 128,
        # a pilot (5 updates, idle cores) took ~0.5 s per update of 32 prompts: 500 updates,
        # a checkpoint every 50 (10 + the base) fit three seeds by the deadline
        "mopd": {"steps": 500, "prompts_per_step": 32, "lr": 2e-3, "max_new_tokens": 12, "checkpoints": 10},
        "seqkd": {"lr": 2e-3, "batch_size": 32, "warmup": 0},
    },
}


def task_of(root: Path) -> str:
    """The task `prepare` set up in root (folders from before `--task` existed are `reverse`)."""
    f = Path(root) / "data" / "setting.json"
    return json.loads(f.read_text()).get("task", "reverse") if f.exists() else "reverse"


def _reward(task: str):
    if task == "math":
        from rewards.math import reward
        return reward
    from core.toy_tasks import REWARDS
    return REWARDS[SETTINGS[task]["domain"]]


def _dataset(task: str, split: str, n: int):
    s = SETTINGS[task]
    if task == "math":
        from experts.math.data import make_dataset
        return make_dataset(split, n, seed=0, difficulty=s["difficulty"], effort=s["effort"])
    from core.toy_tasks import make_dataset
    return make_dataset(s["domain"], split, n, seed=0, difficulty=s["difficulty"])


def _say(msg: str) -> None:
    print(f"[capacity_gap] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- statistics

def interpolate_rows(xs, rows_KN, x):
    """Per-row linear interpolation of a curve (checkpoints at xs, K x rows scores) at x;
    None outside [xs[0], xs[-1]]. Used to read seq-KD at MOPD's token counts."""
    import numpy as np
    xs = np.asarray(xs, dtype=float)
    r = np.asarray(rows_KN, dtype=float)
    if x < xs[0] - 1e-9 or x > xs[-1] + 1e-9:
        return None
    j = int(np.searchsorted(xs, x))
    if j == 0 or abs(xs[j - 1] - x) < 1e-9:
        return r[max(0, j - 1) if j > 0 else 0]
    if j >= len(xs):
        return r[-1]
    w = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    return (1 - w) * r[j - 1] + w * r[j]


def tokens_to_reach(xs, means, target):
    """The smallest budget at which a mean curve reaches `target` (linear between
    checkpoints), or None if it never does."""
    prev = None
    for x, m in zip(xs, means):
        if m >= target:
            if prev is None:
                return float(x)
            px, pm = prev
            return float(px + (target - pm) / (m - pm) * (x - px)) if m > pm else float(x)
        prev = (x, m)
    return None


# ---------------------------------------------------------------------------- stages

def _params(path) -> dict:
    from core.standins import num_parameters
    c = json.loads((Path(path) / "config.json").read_text())
    total = num_parameters(path)
    emb = c["vocab_size"] * c["hidden_size"] * (1 if c.get("tie_word_embeddings") else 2)
    return {"total": total, "non_embedding": total - emb}


def prepare(out: Path, n_threads: int = 1, teacher_from: str = "", task: str = "reverse",
            student_from: str = "") -> dict:
    """Data, student base and teacher (each skipped when already there)."""
    from core.evaluate import evaluate
    from core.sft import sft
    from core.tiny import build_tiny_model
    from core.toy_tasks import make_pretrain_dataset
    if task not in SETTINGS:
        raise SystemExit(f"[capacity_gap] unknown task {task!r}; expected one of {sorted(SETTINGS)}")
    s = SETTINGS[task]
    base, teacher = out / "student_base", out / "teacher"
    # what is missing is said before any data or model is built
    if not (base / "config.json").exists() and not student_from and not isinstance(s["student"], dict):
        raise SystemExit(f"[capacity_gap] no student for task {task}: pass --student DIR (built by: {s['student']})")
    if not (teacher / "config.json").exists() and not teacher_from:
        raise SystemExit(f"[capacity_gap] no teacher for task {task}: pass --teacher DIR ({s['teacher']})")
    for what, path in (("--student", student_from), ("--teacher", teacher_from)):
        if path and not (Path(path) / "config.json").exists():
            raise SystemExit(f"[capacity_gap] {what} {path} is not a model folder (no config.json)")
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    want = {"difficulty": s["difficulty"], "n_train": s["n_train"], "n_test": s["n_test"]}
    if task != "reverse":
        want["task"] = task
    if (data / "test").exists():
        # data left by another setting is the mistake this bench once made (docs/results/2026-12-05-capacity-gap.md)
        have = json.loads((data / "setting.json").read_text()) if (data / "setting.json").exists() else None
        if have != want:
            raise SystemExit(f"[capacity_gap] {data} holds data for {have}, not {want}: use a new --out")
    else:
        _dataset(task, "train", s["n_train"]).save_to_disk(str(data / "train"))
        _dataset(task, "test", s["n_test"]).save_to_disk(str(data / "test"))
        (data / "setting.json").write_text(json.dumps(want))
    times = {}
    if not (base / "config.json").exists() and student_from:
        shutil.copytree(student_from, base)
    elif not (base / "config.json").exists():
        # pretrained on the toy's generic chat data: it answers a reverse request with a
        # random order of the words, as the toy's base does
        p = s["pretrain"]
        t0 = time.perf_counter()
        build_tiny_model(out / "student_init", seed=0, **s["student"])
        sft(str(out / "student_init"), make_pretrain_dataset(p["n"], seed=0), str(base), steps=p["steps"],
            lr=p["lr"], batch_size=p["batch_size"], warmup=p["warmup"], seed=0, num_threads=n_threads, progress=False)
        times["student_s"] = round(time.perf_counter() - t0, 1)
        _say(f"student base: {times['student_s']} s")
    if not (teacher / "config.json").exists():
        shutil.copytree(teacher_from, teacher)
    import datasets
    test = datasets.load_from_disk(str(data / "test"))
    info = {"task": task, "setting": s, "times": times,
            "params": {"student": _params(out / "student_base"), "teacher": _params(teacher)}}
    for k in ("total", "non_embedding"):
        info["params"][f"ratio_{k}"] = round(info["params"]["teacher"][k] / info["params"]["student"][k], 2)
    for name, path in (("student_base", out / "student_base"), ("teacher", teacher)):
        info[f"{name}_score"] = float(evaluate(str(path), test, _reward(task),
                                               max_new_tokens=s["eval_max_new_tokens"], batch_size=100))
    (out / "prep.json").write_text(json.dumps(info, indent=2))
    _say(json.dumps({k: v for k, v in info.items() if k != "setting"}))
    return info


def mopd_config(out: Path, seed: int, estimator: str = "", steps: int | None = None, task: str = "reverse",
                extra: tuple[str, ...] = ()):
    """recipes/mopd/toy.yaml pointed at this bench's student base, teacher and data."""
    import dataclasses
    from core.config import checked, load_config
    from mopd.distill import DistillConfig
    from mopd.distill.config import DatasetSpec, TeacherSpec
    from pipeline.stages.common import find
    s = SETTINGS[task]
    m, domain = s["mopd"], s["domain"]
    recipe = find("recipes/mopd/toy.yaml")
    ov = ["rollout.backend=hf", f"rollout.max_new_tokens={m['max_new_tokens']}",
          f"train.max_steps={steps or m['steps']}", f"train.prompts_per_step={m['prompts_per_step']}",
          f"train.save_every={max(1, (steps or m['steps']) // m.get('checkpoints', 5))}", "train.keep_checkpoints=1000", f"train.lr={m['lr']}",
          f"train.seed={seed}", "mlflow.log_model=false", f"data.max_prompt_tokens={s['max_prompt_tokens']}",
          f"mlflow.tracking_uri=sqlite:///{(out / 'mlflow.db').resolve()}"]
    if estimator:
        ov.append(f"loss.estimator={estimator}")
    ov += list(extra)
    c = load_config(DistillConfig, str(recipe), ov)
    c = dataclasses.replace(
        c, model=dataclasses.replace(c.model, path=str(out.parent.parent / "student_base")),
        data=dataclasses.replace(c.data, datasets=[DatasetSpec(path=str(out.parent.parent / "data" / "train"))],
                                 mix={domain: 1.0}),
        teachers={domain: TeacherSpec(path=str(out.parent.parent / "teacher"), backend="hf")})
    return checked(c, str(recipe))


def _score(path, test, task: str = "reverse") -> list[float]:
    from core.evaluate import evaluate
    _, _, scores = evaluate(str(path), test, _reward(task), max_new_tokens=SETTINGS[task]["eval_max_new_tokens"],
                            batch_size=100, return_completions=True)
    return [float(x) for x in scores]


def run_seed(root: Path, seed: int, estimator: str = "", steps: int | None = None,
             arms: tuple[str, ...] = ARMS, budget_tokens: int = 0, extra: tuple[str, ...] = ()) -> dict:
    """One seed's arms, each scored at its checkpoints -> root/seed<k>/curves.json."""
    import datasets
    from transformers import AutoTokenizer
    from mopd.baselines import mopd_prompt_stream, seq_kd
    from mopd.distill import run
    out = root / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    test = datasets.load_from_disk(str(root / "data" / "test"))
    curves_path = out / "curves.json"
    curves = {}
    task = task_of(root)
    cfg = mopd_config(out / "mopd", seed, estimator, steps, task, extra)
    domain = SETTINGS[task]["domain"]
    n_steps, every = cfg.train.max_steps, cfg.train.save_every
    base_scores = _score(root / "student_base", test, task)
    ks = sorted(set(range(every, n_steps, every)) | {n_steps})
    if "mopd" in arms:
        t0 = time.perf_counter()
        res = run(cfg, out / "mopd")
        cum = [0]
        for h in res["history"]:
            cum.append(cum[-1] + int(h["tokens"]))
        pts = [{"updates": 0, "tokens": 0, "scores": base_scores}]
        for k in ks:
            path = res["final"] if k == n_steps else out / "mopd" / "checkpoints" / f"step_{k}" / "model"
            pts.append({"updates": k, "tokens": cum[k], "scores": _score(path, test, task)})
        curves["mopd"] = {"points": pts, "seconds": round(time.perf_counter() - t0, 1),
                          "estimator": estimator or "toy", "overrides": list(extra)}
        curves_path.write_text(json.dumps(curves))
        _say(f"seed {seed} mopd: {curves['mopd']['seconds']} s, final {sum(pts[-1]['scores']) / len(test):.3f}")
    elif "seqkd_tok" in arms:
        # seq-KD at matched tokens needs the MOPD run's token count: from the seed's finished
        # MOPD curve, or (to run beside MOPD) a budget at least as large, `budget_tokens`;
        # the equal-token gaps read its curve at MOPD's token counts either way
        cum = [0, budget_tokens or json.loads(curves_path.read_text())["mopd"]["points"][-1]["tokens"]]
    else:
        cum = [0, 1]
    fracs = tuple(k / n_steps for k in ks[:-1])
    sk = SETTINGS[task]["seqkd"]
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    for arm, match in (("seqkd_tok", "tokens"), ("seqkd_upd", "updates")):
        if arm not in arms:
            continue
        t0 = time.perf_counter()
        d = out / arm
        s = seq_kd(cfg.model.path, {domain: cfg.teachers[domain].path}, mopd_prompt_stream(cfg, tok), d,
                   budget_tokens=cum[-1], lr=sk["lr"], batch_size=sk["batch_size"], warmup=sk["warmup"],
                   max_new_tokens=SETTINGS[task]["eval_max_new_tokens"], seed=seed, match=match, budget_updates=n_steps,
                   save_fractions=fracs, progress=False)
        log = json.loads((d / "sft_log.json").read_text())
        at = {int(k): v for k, v in log.get("checkpoint_tokens", {}).items()}
        pts = [{"updates": 0, "tokens": 0, "scores": base_scores}]
        for k in sorted(at):
            if k < s["steps"]:
                pts.append({"updates": k, "tokens": at[k], "scores": _score(d / "checkpoints" / f"step_{k}", test, task)})
        pts.append({"updates": s["steps"], "tokens": log["tokens"], "scores": _score(d / "model", test, task)})
        curves[arm] = {"points": pts, "seconds": round(time.perf_counter() - t0, 1), "match": match}
        if "mopd" in arms:
            curves_path.write_text(json.dumps(curves))
        else:   # a separate process may be writing curves.json
            (out / f"{arm}.json").write_text(json.dumps({arm: curves[arm]}))
        _say(f"seed {seed} {arm}: {curves[arm]['seconds']} s, {s['steps']} updates, {log['tokens']} tokens, "
             f"final {sum(pts[-1]['scores']) / len(test):.3f}")
    return curves


def summarize(runs: list[dict], n_boot: int = 2000) -> dict:
    """The curves of each arm over seeds (runs: one curves.json per seed, arms paired by
    checkpoint index) with 95% bands, the paired MOPD - seq-KD gap at each MOPD checkpoint
    at equal updates (seqkd_upd, same step) and equal tokens (seqkd_tok read per row at
    MOPD's token count, linear between its checkpoints), and the two win conditions."""
    import numpy as np
    if not runs:
        raise ValueError("summarize: no seeds")
    # an arm is summarized over the seeds that finished it; a gap over the seeds that finished both
    arms = [a for a in ARMS if any(a in r for r in runs)]
    out: dict = {"seeds": len(runs), "arms": {}, "gaps": {}, "seeds_per_arm": {}}
    for a in arms:
        have = [r for r in runs if a in r]
        out["seeds_per_arm"][a] = len(have)
        K = min(len(r[a]["points"]) for r in have)
        pts = []
        for i in range(K):
            M = np.array([r[a]["points"][i]["scores"] for r in have])
            mean, lo, hi = bootstrap_mean_ci(M, n_boot=n_boot, seed=i)
            pts.append({"tokens": float(np.mean([r[a]["points"][i]["tokens"] for r in have])),
                        "updates": float(np.mean([r[a]["points"][i]["updates"] for r in have])),
                        "mean": mean, "lo": lo, "hi": hi,
                        "per_seed": [float(np.mean(r[a]["points"][i]["scores"])) for r in have]})
        out["arms"][a] = pts
    if "mopd" not in arms:
        return out
    for other, key in (("seqkd_upd", "updates"), ("seqkd_tok", "tokens")):
        both = [r for r in runs if "mopd" in r and other in r]
        if not both:
            continue
        mp = [r["mopd"]["points"] for r in both]
        K = min(len(p) for p in mp)
        rows = []
        for i in range(1, K):
            A, B = [], []
            for r, p in zip(both, mp):
                op = r[other]["points"]
                xs = [q[key] for q in op]
                x = min(p[i][key], xs[-1])   # seq-KD's rows round its last budget a little below MOPD's
                A.append(p[i]["scores"])
                B.append(interpolate_rows(xs, [q["scores"] for q in op], x))
            gap, lo, hi = paired_gap_ci(A, B, n_boot=n_boot, seed=100 + i)
            rows.append({key: float(np.mean([p[i][key] for p in mp])), "gap": gap, "lo": lo, "hi": hi,
                         "seeds": len(both)})
        out["gaps"][f"equal_{key}"] = rows
    win_a = all(g[-1]["gap"] >= 0.05 and g[-1]["lo"] > 0 for g in out["gaps"].values()) and len(out["gaps"]) == 2
    cond = {"a_final_gap_ge_0.05_ci_above_0_both_budgets": bool(win_a)}
    if "seqkd_tok" in arms:
        sk = out["arms"]["seqkd_tok"]
        m = out["arms"]["mopd"]
        reach = tokens_to_reach([q["tokens"] for q in m], [q["mean"] for q in m], sk[-1]["mean"])
        cond["b_seqkd_final_score"] = sk[-1]["mean"]
        cond["b_seqkd_final_tokens"] = sk[-1]["tokens"]
        cond["b_mopd_tokens_to_reach"] = reach
        # a seq-KD run that ends where it started gives a target every curve meets at 0 tokens
        cond["b_seqkd_improves_on_base"] = bool(sk[-1]["mean"] > sk[0]["mean"])
        cond["b_mopd_reaches_with_half_tokens"] = bool(cond["b_seqkd_improves_on_base"] and reach is not None
                                                       and reach <= 0.5 * sk[-1]["tokens"])
    out["conditions"] = cond
    return out


def plot(summary: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    for key, name in (("tokens", "score_vs_tokens.png"), ("updates", "score_vs_updates.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for a, pts in summary["arms"].items():
            x = [p[key] for p in pts]
            ax.plot(x, [p["mean"] for p in pts], marker="o", label=a)
            ax.fill_between(x, [p["lo"] for p in pts], [p["hi"] for p in pts], alpha=0.2)
        ax.set_xlabel(f"student {key}" if key == "tokens" else "optimizer updates")
        ax.set_ylabel("held-out exact match")
        ax.set_title(f"score vs {key} ({summary['seeds']} seeds, 95% bootstrap bands)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(str(out / name))
    return files


def tables(summary: dict) -> str:
    """The result as markdown: each arm's curve, then the paired gaps."""
    lines = ["| arm | checkpoint | student tokens | updates | mean (95% CI) | per seed |", "|---|---:|---:|---:|---|---|"]
    for a, pts in summary["arms"].items():
        for i, q in enumerate(pts):
            lines.append(f"| {a} | {i} | {q['tokens']:.0f} | {q['updates']:.0f} | {q['mean']:.3f} "
                         f"({q['lo']:.3f}, {q['hi']:.3f}) | {' / '.join(f'{x:.3f}' for x in q['per_seed'])} |")
    lines += ["", "| budget | at | MOPD − seq-KD | 95% CI | seeds |", "|---|---:|---:|---|---:|"]
    for k, rows in summary["gaps"].items():
        key = k.split("_", 1)[1]
        for r in rows:
            lines.append(f"| equal {key} | {r[key]:.0f} | {r['gap']:+.3f} | ({r['lo']:+.3f}, {r['hi']:+.3f}) "
                         f"| {r['seeds']} |")
    return "\n".join(lines) + "\n"


def report(root: Path, n_boot: int = 2000) -> dict:
    runs = []
    for d in sorted(root.glob("seed*")):
        r = json.loads((d / "curves.json").read_text()) if (d / "curves.json").exists() else {}
        for arm in ARMS:   # arms run on their own (`arms --arms`) write seed*/<arm>.json
            if (d / f"{arm}.json").exists():
                r.update(json.loads((d / f"{arm}.json").read_text()))
        runs.append(r)
    summary = summarize(runs, n_boot=n_boot)
    prep = root / "prep.json"
    if prep.exists():
        summary["prep"] = {k: v for k, v in json.loads(prep.read_text()).items() if k != "setting"}
    summary["seconds"] = {a: [r[a]["seconds"] for r in runs if a in r] for a in ARMS}
    summary["plots"] = plot(summary, root)
    (root / "result.json").write_text(json.dumps(summary, indent=1))
    (root / "tables.md").write_text(tables(summary))
    for a, pts in summary["arms"].items():
        print(a, " | ".join(f"{p['tokens']:.0f}t/{p['updates']:.0f}u {p['mean']:.3f} [{p['lo']:.3f},{p['hi']:.3f}]"
                            for p in pts))
    for k, rows in summary["gaps"].items():
        print(k, " | ".join(f"{list(r.values())[0]:.0f}: {r['gap']:+.3f} [{r['lo']:+.3f},{r['hi']:+.3f}]" for r in rows))
    print(json.dumps(summary.get("conditions")))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--teacher", default="", help="the teacher to copy in (mopd toy's DIR/teachers/reverse)")
    p.add_argument("--task", default="reverse", choices=sorted(SETTINGS), help="which pre-registered setting")
    p.add_argument("--student", default="", help="the student base to copy in (task math: built by `mopd base`)")
    p = sub.add_parser("arms")
    p.add_argument("--out", required=True, help="a folder `prepare` wrote")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--estimator", default="", help="loss.estimator for MOPD (default: the toy recipe's loss)")
    p.add_argument("--steps", type=int, default=None, help="MOPD steps (default: the task's SETTINGS)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more overrides of the MOPD recipe (repeatable), e.g. loss.task_reward_alpha=1.0")
    p.add_argument("--budget-tokens", type=int, default=0,
                   help="seqkd_tok run without MOPD: its token budget (>= the MOPD run's)")
    p.add_argument("--arms", default=",".join(ARMS), help="which arms (seqkd_upd can run beside mopd; "
                   "seqkd_tok alone needs the seed's finished mopd)")
    p = sub.add_parser("report")
    p.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "report":
        report(Path(args.out))
    elif args.cmd == "prepare":
        prepare(Path(args.out), args.threads, args.teacher, args.task, args.student)
    elif args.cmd == "arms":
        if not (Path(args.out) / "teacher" / "config.json").exists():
            print(f"[capacity_gap] {args.out} has no teacher: run `prepare` first", file=sys.stderr)
            return 2
        run_seed(Path(args.out), args.seed, args.estimator, args.steps, tuple(args.arms.split(",")), args.budget_tokens,
                 tuple(args.set))
    return 0


if __name__ == "__main__":
    sys.exit(main())
