"""The pipeline's report: what MOPD buys over the baselines, per domain.

    build_report(eval_json, history, out, ...) -> report dict, and writes
        out/report.json   scores, retention, token budgets, timings, MLflow ids
        out/report.md     the same as tables, with the two plots
        out/retention.png score / teacher score per domain: student beside base and baselines
        out/kl_curves.png per-domain reverse KL over MOPD steps
        out/budgets.png   mean score against FLOPs and against wall-clock, one marker per method
                          (with `budgets`)
        out/cost.png      score against completion tokens per task, per model, per effort
                          (evals/report_cost.py)

Model names in eval.json: "base", "student", "warmup_mopd" (a seq-KD warm-up, then MOPD),
"seq_kd", "weight_avg", "mix_rl", "cascade_rl" (warmup_mopd and the RL ones shown only
when scored), and one
"teacher/<column>" per teacher, scored on its own column ("teacher" = each domain's own
expert on its own domain). A plain "teacher" model, scored on every column, also works.

report.json:
    {"domains": [...], "scores": {"base": {d: x}, "teacher": {d: x}, "student": {d: x},
     "seq_kd": {d: x}, "weight_avg": {d: x}}, "retention": {d: student/teacher},
     "retention_all": {model: {d: model/teacher}}, "student_tokens": {"mopd": n, "seq_kd": n},
     "eval_rows": {d: rows scored}, "means": {model: {"mean": x, "se": standard error}},
     "stage_seconds": {stage: s}, "wall_seconds": s,
     "budgets": {model: {"student_tokens", "student_samples", "teacher_tokens_generated",
                         "teacher_tokens_scored", "flops", "flops_terms", "params", "seconds",
                         "teacher_seconds"}} (mopd.baselines.budget; {} when not given),
     "mlflow": {"tracking_uri": ..., "parent_run_id": ...},
     "columns": {d: {"domain", "effort"}},
     "cost": {model: {d: {"tokens": {"mean", "p90"}, "n"[, "turns", "tool_calls"]} | null}} (eval.json's),
     "effort_cost": {domain: {"efforts": [...], "models": {model: {"tokens": {effort: mean},
                     "p90": {effort: p90}, "rises": low < high}}}}}
A score or ratio that does not exist (a model not evaluated, a teacher scoring 0) is null.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evals.report_cost import collect_cost, column_keys, cost_lines, effort_summary, plot_cost

MODELS = ("base", "teacher", "student", "warmup_mopd", "seq_kd", "weight_avg", "mix_rl", "cascade_rl")
# rows shown only when the run has them (disabled by default, or added later)
OPTIONAL = ("warmup_mopd", "mix_rl", "cascade_rl")
# the models compared with the teachers: the student, its variants and every baseline
COMPARED = ("student", "warmup_mopd", "seq_kd", "weight_avg", "mix_rl", "cascade_rl")
LABELS = {"base": "base", "teacher": "teacher (own domain)", "student": "MOPD student",
          "warmup_mopd": "seq-KD warm-up, then MOPD",
          "seq_kd": "seq-KD (off-policy)", "weight_avg": "weight average", "mix_rl": "Mix-RL (joint GRPO)",
          "cascade_rl": "cascade RL"}
COLORS = {"base": "#9e9e9e", "student": "#1f77b4", "warmup_mopd": "#17becf", "seq_kd": "#ff7f0e", "weight_avg": "#2ca02c",
          "mix_rl": "#d62728", "cascade_rl": "#9467bd"}


def _load(x):
    if x is None or isinstance(x, (dict, list)):
        return x
    return json.loads(Path(x).read_text())


def _num(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def collect_scores(ev: dict) -> tuple[list[str], dict[str, dict[str, float | None]]]:
    """(domains, {model: {domain: score}}) for the report's five rows from eval.json."""
    domains = list(ev["domains"])
    raw = ev["scores"]
    scores: dict[str, dict[str, float | None]] = {}
    for m in MODELS:
        row = {}
        for d in domains:
            if m == "teacher":
                v = raw.get(f"teacher/{d}", {}).get(d, raw.get("teacher", {}).get(d))
            else:
                v = raw.get(m, {}).get(d)
            row[d] = _num(v)
        scores[m] = row
    return domains, scores


HARNESS_KINDS = ("held_out_combo", "held_out_novel")   # evals/run.py HELD_OUT_KINDS


def harness_scores(ev: dict, domains: list[str]) -> dict[str, dict[str, dict[str, float | None]]]:
    """{domain: {model: {"train", "held_out_combo", "held_out_novel"}}} for each agent
    domain whose eval.json scores have held-out harness columns ("<domain>/<kind>")."""
    raw = ev["scores"]
    out: dict = {}
    for d in domains:
        rows = {}
        for m in MODELS:
            src = raw.get(f"teacher/{d}", raw.get("teacher", {})) if m == "teacher" else raw.get(m, {})
            if any(f"{d}/{k}" in src for k in HARNESS_KINDS):
                rows[m] = {"train": _num(src.get(d)), **{k: _num(src.get(f"{d}/{k}")) for k in HARNESS_KINDS}}
        if rows:
            out[d] = rows
    return out


def harness_lines(r: dict) -> list[str]:
    """The report's held-out harness section: train harnesses against new combinations of
    seen modules and against unseen names and syntax, per agent domain."""
    lines: list[str] = []
    for d, rows in (r.get("harnesses") or {}).items():
        lines += ["", f"## Held-out harnesses: {d}", "",
                  "train: the recipe's train harnesses; combo: seen module values in combinations training "
                  "never drew; novel: unseen tool names and syntax. Retention = combo / train.", "",
                  "| model | train | held_out_combo | held_out_novel | combo / train |", "|---|---:|---:|---:|---:|"]
        for m, v in rows.items():
            ret = v["held_out_combo"] / v["train"] if v["train"] and v["held_out_combo"] is not None else None
            lines.append(f"| {LABELS[m]} | {_f(v['train'])} | {_f(v['held_out_combo'])} | {_f(v['held_out_novel'])} "
                         f"| {_f(ret, '{:.2f}')} |")
    return lines


def retention(scores: dict, model: str, domains: list[str]) -> dict[str, float | None]:
    out = {}
    for d in domains:
        s, t = scores[model].get(d), scores["teacher"].get(d)
        out[d] = (s / t) if (s is not None and t) else None
    return out


def means(scores: dict, domains: list[str], rows: dict[str, int]) -> dict[str, dict | None]:
    """{model: {"mean", "se"}}: the mean over columns and its standard error from the rows
    each column scored. Each score is a mean of per-row rewards in [0, 1], whose variance
    is at most p(1 - p); the columns are independent samples. None if a column is missing."""
    out: dict[str, dict | None] = {}
    for m, row in scores.items():
        vals = [row.get(d) for d in domains]
        if not vals or any(v is None for v in vals):
            out[m] = None
            continue
        mean = sum(vals) / len(vals)
        se = None
        if rows and all(rows.get(d) for d in domains):
            se = math.sqrt(sum(max(v * (1 - v), 0.0) / rows[d] for v, d in zip(vals, domains))) / len(vals)
        out[m] = {"mean": mean, "se": se}
    return out


def seed_summary(ev: dict, domains: list[str], seeds: dict[str, list[str]]) -> dict:
    """Each method's spread over its training seeds (pipeline `extra_seeds`): {method:
    {"models", "means" (each run's mean over the columns), "mean", "std" (sample std of
    those means), "by_domain": {column: {"mean", "std"}}}}, and under "paired" the student's
    mean minus each other method's, seed by seed (the same prompt stream per seed), with
    their mean and min. A run missing a column is left out of its method (and named)."""
    raw = ev.get("scores") or {}
    out: dict = {}
    for method, models in seeds.items():
        rows, kept, missing = [], [], []
        for m in models:
            r = [_num((raw.get(m) or {}).get(d)) for d in domains]
            if r and all(v is not None for v in r):
                rows.append(r)
                kept.append(m)
            else:
                missing.append(m)
        if not rows:
            continue
        per = [sum(r) / len(r) for r in rows]
        out[method] = {"models": kept, "missing": missing, "means": per, "mean": statistics.fmean(per),
                       "std": statistics.stdev(per) if len(per) > 1 else None,
                       "by_domain": {d: {"mean": statistics.fmean(col),
                                         "std": statistics.stdev(col) if len(col) > 1 else None}
                                     for d, col in zip(domains, zip(*rows))}}
    paired = {}
    st = out.get("student")
    for method, o in out.items():
        if method == "student" or st is None or st["missing"] or o["missing"]:
            continue
        diffs = [a - b for a, b in zip(st["means"], o["means"])]
        paired[method] = {"diffs": diffs, "mean": statistics.fmean(diffs), "min": min(diffs)}
    if paired:
        out["paired"] = paired
    return out


def tokens_from_history(history: list[dict]) -> int:
    """Student completion tokens MOPD trained on: per step, the loop logs
    tokens_per_s/update = tokens / max(time/update_s, 1e-9); a `tokens` key wins if present."""
    return int(round(sum(_step_tokens(h) for h in history)))


def _step_tokens(h: dict) -> float:
    if "tokens" in h:
        return h["tokens"]
    if "tokens_per_s/update" in h and "time/update_s" in h:
        return h["tokens_per_s/update"] * max(h["time/update_s"], 1e-9)
    return 0.0


def on_policy_tokens_from_history(history: list[dict]) -> int:
    """Of those tokens, the ones in the student's own samples: a run with teacher-forced
    reference rows (rollout.on_policy_fraction < 1 or a ramp) logs `tokens/on_policy` per
    step; a step without it trained on its own samples only. None when a step had
    teacher-forced rows but predates that metric (off_policy_frac > 0 alone): unknown."""
    if any(h.get("off_policy_frac", 0.0) > 0 and "tokens/on_policy" not in h for h in history):
        return None
    return int(round(sum(h.get("tokens/on_policy", _step_tokens(h)) for h in history)))


def kl_series(history: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = {}
    for i, h in enumerate(history):
        for k, v in h.items():
            if k.startswith("reverse_kl/") and v is not None:
                xs, ys = series.setdefault(k[len("reverse_kl/"):], ([], []))
                xs.append(int(h.get("step", i + 1)))
                ys.append(float(v))
    return dict(sorted(series.items()))


# ----------------------------------------------------------------------------- plots
def _plt():
    # matplotlib loads in about a second and needs its headless backend chosen before
    # pyplot is imported: only when a plot is drawn.
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # only the plots need it, and it is slow to import
    return plt


def plot_retention(report: dict, path: Path) -> Path:
    plt = _plt()
    domains = report["domains"]
    rows = [m for m in ("base", *COMPARED)
            if any(v is not None for v in report["retention_all"].get(m, {}).values())]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(domains) + 2), 3.8), dpi=110)
    width = 0.8 / max(1, len(rows))
    for j, m in enumerate(rows):
        vals = [report["retention_all"][m].get(d) for d in domains]
        xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(domains))]
        ax.bar(xs, [v if v is not None else 0.0 for v in vals], width, label=LABELS[m], color=COLORS[m])
        for x, v in zip(xs, vals):
            if v is None:
                ax.text(x, 0.01, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(domains)))
    ax.set_xticklabels(domains, rotation=30 if len(domains) > 4 else 0, ha="right" if len(domains) > 4 else "center")
    ax.set_ylabel("score / teacher score")
    ax.set_title("Retention of each domain's teacher")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def plot_kl(history: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=110)
    series = kl_series(history)
    for d, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=d)
    if not series:
        ax.text(0.5, 0.5, "no MOPD history", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("MOPD step")
    ax.set_ylabel("reverse KL (per token)")
    ax.set_title("Student-teacher reverse KL per domain")
    if series:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def budget_points(report: dict) -> list[dict]:
    """[{model, label, score, flops, seconds, ...}] of every method with a budget and a mean
    score (the mean over the domains' columns): the points of the budgets plot."""
    pts = []
    for m, b in (report.get("budgets") or {}).items():
        mean = ((report.get("means") or {}).get(m) or {}).get("mean")
        if mean is None:
            continue
        pts.append({"model": m, "label": LABELS.get(m, m), "score": mean, "flops": b.get("flops"),
                    "seconds": b.get("seconds"), "teacher_seconds": b.get("teacher_seconds")})
    return pts


def plot_budgets(report: dict, path: Path) -> Path:
    """Mean score against FLOPs and against the stage's wall-clock, one marker per method;
    the base (no training) and the teachers' mean as horizontal lines."""
    plt = _plt()
    pts = budget_points(report)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    refs = [(m, ls) for m, ls in (("base", ":"), ("teacher", "--"))
            if ((report.get("means") or {}).get(m) or {}).get("mean") is not None]
    for ax, key, xlabel in ((axes[0], "flops", "FLOPs (estimate from the model shapes)"),
                            (axes[1], "seconds", "wall-clock of the method's stage (s)")):
        shown = [p for p in pts if p[key] is not None]
        for p in shown:
            ax.scatter([p[key]], [p["score"]], s=50, color=COLORS.get(p["model"], "#333333"), label=p["label"],
                       zorder=3)
            ax.annotate(p["label"], (p[key], p["score"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        for m, ls in refs:
            ax.axhline(report["means"][m]["mean"], color="black", lw=0.8, ls=ls, label=LABELS[m])
        if not shown:
            ax.text(0.5, 0.5, "no budgets", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("mean held-out score over domains")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 3))
        ax.xaxis.get_offset_text().set_fontsize(7)
        top = max([p[key] for p in shown] or [0.0])
        ax.set_xlim(left=0, right=top * 1.25 if top > 0 else 1.0)   # room for the labels right of the markers
    axes[0].set_title("score vs compute", fontsize=9)
    axes[1].set_title("score vs wall-clock", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[1].legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- report
def build_report(eval_json, history, out: str | Path, *, student_tokens: dict | None = None,
                 stage_seconds: dict | None = None, wall_seconds: float | None = None,
                 mlflow: dict | None = None, extra: dict | None = None, budgets: dict | None = None,
                 seeds: dict[str, list[str]] | None = None) -> dict:
    """Write report.json, report.md, retention.png and kl_curves.png (and budgets.png with
    `budgets`: {model: mopd.baselines.budget's dict with `seconds`}) to `out`.
    `eval_json` and `history` are dicts/lists or paths to their JSON files."""
    ev = _load(eval_json)
    hist = _load(history) or []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    domains, scores = collect_scores(ev)
    tokens = {"mopd": tokens_from_history(hist) if hist else None, "seq_kd": None}
    tokens.update(student_tokens or {})
    rows = {d: int(v["n"]) for d, v in (ev.get("settings") or {}).items() if isinstance(v, dict) and v.get("n")}
    report = {
        "domains": domains,
        "scores": scores,
        "eval_rows": rows,
        "means": means(scores, domains, rows),
        "retention": retention(scores, "student", domains),
        "retention_all": {m: retention(scores, m, domains) for m in ("base", *COMPARED)},
        "student_tokens": tokens,
        "stage_seconds": {k: round(float(v), 1) for k, v in (stage_seconds or {}).items()},
        "wall_seconds": None if wall_seconds is None else round(float(wall_seconds), 1),
        "mlflow": {"tracking_uri": None, "parent_run_id": None, **(mlflow or {})},
        "mopd_steps": len(hist),
        "mopd_on_policy_tokens": on_policy_tokens_from_history(hist) if hist else None,
        "budgets": budgets or {},
        "seeds": seed_summary(ev, domains, seeds) if seeds else {},
        "harnesses": harness_scores(ev, domains),
        **(extra or {}),
    }
    kl = kl_series(hist)
    report["reverse_kl"] = {d: {"first": ys[0], "last": ys[-1]} for d, (_, ys) in kl.items()}
    report["columns"] = column_keys(ev)
    report["cost"] = collect_cost(ev, MODELS)
    report["effort_cost"] = effort_summary(report["columns"], report["cost"], shown_models(report))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_retention(report, out / "retention.png")
    if any(c for row in report["cost"].values() for c in row.values()):   # else report.md says none were recorded
        plot_cost(report, out / "cost.png", shown_models(report), LABELS, {**COLORS, "teacher": "#000000"})
    plot_kl(hist, out / "kl_curves.png")
    if budgets:
        plot_budgets(report, out / "budgets.png")
    (out / "report.md").write_text(render_markdown(report))
    return report


def _f(v, fmt="{:.3f}"):
    return "–" if v is None else fmt.format(v)


def shown_models(r: dict) -> list[str]:
    """The score table's rows: every model, an optional one (OPTIONAL) only when scored."""
    return [m for m in MODELS if m not in OPTIONAL
            or any(v is not None for v in r["scores"].get(m, {}).values())]


def budget_lines(r: dict, mm: dict) -> list[str]:
    """The budgets table (method x budget) of report.md, with the FLOPs formula."""
    b = r.get("budgets") or {}
    if not b:
        return []
    lines = ["## Budgets per method", "",
             "| method | mean score | student samples | student tokens | teacher tokens generated | "
             "teacher tokens scored | FLOPs | stage wall-clock (s) | + expert stages (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in [x for x in COMPARED if x in b]:
        x = b[m]
        lines.append(f"| {LABELS.get(m, m)} | {_f((mm.get(m) or {}).get('mean'))} | "
                     f"{_f(x.get('student_samples'), '{:,}')} | {_f(x.get('student_tokens'), '{:,}')} | "
                     f"{_f(x.get('teacher_tokens_generated'), '{:,}')} | "
                     f"{_f(x.get('teacher_tokens_scored'), '{:,}')} | "
                     f"{_f(x.get('flops'), '{:.3g}')} | {_f(x.get('seconds'), '{:.0f}')} | "
                     f"{_f(x.get('teacher_seconds'), '{:.0f}')} |")
    p = next(iter(b.values())).get("params") or {}
    lines += ["", "FLOPs estimate (Kaplan et al. 2020): 2·N per token of a forward (sampling, a teacher's scoring or "
              "generation, RL's reference model), 6·N per token of a training update; N = the parameters in matrix "
              "products (embedding tables left out, a tied head counted once"
              + (f"; student N = {p['student']:,}" if p.get("student") else "")
              + (f", teacher N = {p['teacher']:,}" if p.get("teacher") else "") + "). Prompt tokens and the "
              "attention term are left out, and so are the experts' own training, the chat reward model's "
              "forwards and MOPD's re-scoring of teacher-corrected rows. *+ expert stages*: the wall-clock of the "
              "stages the method needs before it (every expert and the chat RM for MOPD, seq-KD and the average; "
              "the chat RM alone for RL).", ""]
    sk = b.get("seq_kd") or {}
    if sk.get("matched"):
        what = "optimizer updates" if sk["matched"] == "updates" else "student tokens"
        lines += [f"seq-KD is matched to MOPD's {what} (baselines.seq_kd.match: {sk['matched']}): "
                  f"{_f(sk.get('updates'), '{:,}')} optimizer updates against MOPD's "
                  f"{_f((b.get('student') or {}).get('updates'), '{:,}')}, "
                  f"{_f(sk.get('student_tokens'), '{:,}')} student tokens against MOPD's "
                  f"{_f((b.get('student') or {}).get('student_tokens'), '{:,}')}.", ""]
    w = (b.get("warmup_mopd") or {}).get("match")
    if w:
        lines += [f"seq-KD warm-up, then MOPD: {w['warmup_tokens']:,} student tokens of seq-KD (share "
                  f"{w['share']:.0%} asked, {w['warmup_share_actual']:.0%} trained), then MOPD from that checkpoint for "
                  f"{w['mopd_steps']} of plain MOPD's {w['plain_mopd_steps']} steps ({w['mopd_tokens']:,} tokens): "
                  f"{w['total_tokens']:,} in all against plain MOPD's {w['target_tokens']:,} "
                  f"({w['relative_error']:+.1%}). Its teacher tokens generated are the warm-up's, scored the MOPD "
                  "part's; its wall-clock is both stages'.", ""]
    skipped = r.get("rl_skipped_domains") or []
    if skipped:
        lines += [f"Mix-RL / cascade RL leave out the agent domains {skipped} (multi-turn episodes): their columns "
                  "score a model never trained on them, and their samples are matched to MOPD's total.", ""]
    lines += ["![score against budgets](budgets.png)", ""]
    return lines


def seed_lines(r: dict) -> list[str]:
    """The training-seeds section of report.md (pipeline `extra_seeds`), [] without one."""
    sd = {k: v for k, v in (r.get("seeds") or {}).items() if k != "paired"}
    if not sd:
        return []
    d = r["domains"]
    lines = ["", "## Training seeds", "",
             "Each method's mean over the columns, over its runs with different training seeds (the plain run "
             "first); ± is the sample standard deviation over the runs.", "",
             "| method | runs | mean ± std | each run | " + " | ".join(d) + " |",
             "|---|---:|---:|---|" + "---:|" * len(d)]
    for m, o in sd.items():
        pm = " ± " + _f(o["std"]) if o["std"] is not None else ""
        cols = [_f(o["by_domain"][x]["mean"]) + (" ± " + _f(o["by_domain"][x]["std"])
                                                 if o["by_domain"][x]["std"] is not None else "") for x in d]
        lines.append(f"| {LABELS.get(m, m)} | {len(o['means'])} | {_f(o['mean'])}{pm} | "
                     + ", ".join(_f(v) for v in o["means"]) + " | " + " | ".join(cols) + " |")
        if o.get("missing"):
            lines.append(f"| ({LABELS.get(m, m)}: runs without every column, left out: {', '.join(o['missing'])}) |")
    for m, p in (r.get("seeds") or {}).get("paired", {}).items():
        lines.append(f"\nMOPD student − {LABELS.get(m, m)}, seed by seed: "
                     + ", ".join(f"{v:+.3f}" for v in p["diffs"]) + f" (mean {p['mean']:+.3f}, min {p['min']:+.3f}).")
    return lines


def render_markdown(r: dict) -> str:
    d = r["domains"]
    lines = ["# MOPD pipeline report", ""]
    lines += ["Held-out scores (greedy). *teacher* is each domain's own expert on its own domain; "
              "retention is a model's score divided by the teacher's.", ""]
    lines += ["| model | " + " | ".join(d) + " | mean |", "|---|" + "---:|" * (len(d) + 1)]
    mm = r.get("means") or means(r["scores"], d, r.get("eval_rows") or {})
    for m in shown_models(r):
        vals = [r["scores"][m].get(x) for x in d]
        mean = (mm.get(m) or {}).get("mean")
        lines.append(f"| {LABELS[m]} | " + " | ".join(_f(v) for v in vals) + f" | {_f(mean)} |")
    rows = r.get("eval_rows") or {}
    if rows:
        lines += ["", "Held-out rows per column: " + ", ".join(f"{x} {rows[x]}" for x in d if x in rows) + "."]
    st, sk = mm.get("student"), mm.get("seq_kd")
    if st and sk and st.get("se") is not None and sk.get("se") is not None:
        diff, se = st["mean"] - sk["mean"], math.sqrt(st["se"] ** 2 + sk["se"] ** 2)
        lines.append(f"MOPD student mean − seq-KD mean: {diff:+.3f} (standard error ≤ {se:.3f} from the "
                     f"eval rows alone; training seeds add their own spread).")
    lines += seed_lines(r)
    lines += harness_lines(r)
    lines += ["", "## Retention (score / teacher score)", ""]
    lines += ["| model | " + " | ".join(d) + " |", "|---|" + "---:|" * len(d)]
    for m in [x for x in shown_models(r) if x in COMPARED] + ["base"]:
        lines.append(f"| {LABELS[m]} | " + " | ".join(_f(r["retention_all"][m].get(x), "{:.2f}") for x in d) + " |")
    lines += ["", "![retention](retention.png)", ""]
    lines += cost_lines(r, shown_models(r), LABELS)
    tok = r["student_tokens"]
    lines += ["## Budget", "",
              f"- student completion tokens trained on: MOPD {_f(tok.get('mopd'), '{:,}')}, "
              f"seq-KD {_f(tok.get('seq_kd'), '{:,}')}",
              f"- MOPD steps: {r.get('mopd_steps', '–')}"]
    on, tot = r.get("mopd_on_policy_tokens"), tok.get("mopd")
    if on is not None and tot and on < tot:
        lines.append(f"- of MOPD's tokens, the student's own samples: {on:,} ({on / tot:.0%}); the rest are "
                     f"teacher-forced rows on the data's reference answers (`rollout.on_policy_fraction`, "
                     f"`rollout.on_policy_ramp_steps`)")
    if r.get("reverse_kl"):
        lines += [f"- reverse KL {k}: {v['first']:.4f} → {v['last']:.4f}" for k, v in r["reverse_kl"].items()]
    lines += ["", "![reverse KL](kl_curves.png)", ""]
    lines += budget_lines(r, mm)
    if r["stage_seconds"]:
        lines += ["## Stages", "", "| stage | seconds |", "|---|---:|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in r["stage_seconds"].items()]
        lines.append("")
    if r.get("wall_seconds") is not None:
        lines.append(f"Wall time of this invocation: {r['wall_seconds']:.1f} s.")
    ml = r["mlflow"]
    lines += ["", f"MLflow: `{ml.get('tracking_uri')}`, parent run `{ml.get('parent_run_id')}`.", ""]
    return "\n".join(lines)


def print_table(report: dict, title: str | None = None):
    """The score table (rich): one row per model, one column per domain, plus retention."""
    d = report["domains"]
    t = Table(title=title or "held-out scores (greedy); retention = student / teacher")
    t.add_column("model")
    for x in d:
        t.add_column(x, justify="right")
    for m in shown_models(report):
        t.add_row(LABELS[m], *[_f(report["scores"][m].get(x)) for x in d])
    t.add_section()
    for m in [x for x in shown_models(report) if x in COMPARED]:
        t.add_row(f"retention: {m}", *[_f(report["retention_all"][m].get(x), "{:.2f}") for x in d])
    Console(stderr=True).print(t)
    tok = report["student_tokens"]
    Console(stderr=True).print(f"student tokens: MOPD {_f(tok.get('mopd'), '{:,}')}, "
                               f"seq-KD {_f(tok.get('seq_kd'), '{:,}')}")
