"""The report's cost part: score against what a task cost, per model and column (per
effort where a domain has efforts), from eval.json's "cost" (evals/run.py, core.task_cost).

    collect_cost(ev, models)   -> {model: {column: cost | None}} ("teacher": each column's own expert)
    column_keys(ev)            -> {column: {"domain", "effort"}}
    effort_summary(...)        -> per domain with efforts: each model's mean and p90 tokens per
                                  task at each effort and whether the mean rises with the effort
    cost_lines(report, ...)    -> report.md's section (table, picture link, effort table)
    plot_cost(report, path)    -> cost.png: score against mean tokens per task, one panel per domain

A cost that was not recorded (an eval stage cached from before costs were recorded, a
suite decoding outside core.rollout.greedy_texts) is null and shown as "–", never as zero.
"""
from __future__ import annotations

from pathlib import Path

KINDS = (("tokens", "tokens/task"), ("turns", "turns/episode"), ("tool_calls", "tool calls/episode"))
EFFORT_MARKERS = ("o", "^", "s", "D", "v")


def collect_cost(ev: dict, models: tuple[str, ...]) -> dict[str, dict[str, dict | None]]:
    """{model: {column: cost | None}} for the report's rows; "teacher" is each column's
    own expert ("teacher/<column>"), or a plain "teacher" scored on every column."""
    raw = ev.get("cost") or {}
    out = {}
    for m in models:
        row = {}
        for d in ev["domains"]:
            if m == "teacher":
                c = (raw.get(f"teacher/{d}") or {}).get(d, (raw.get("teacher") or {}).get(d))
            else:
                c = (raw.get(m) or {}).get(d)
            row[d] = c
        out[m] = row
    return out


def _stat(cost: dict | None, kind: str, which: str):
    s = (cost or {}).get(kind)
    return None if not s else s.get(which)


def _mean(cost: dict | None, kind: str = "tokens"):
    return _stat(cost, kind, "mean")


def column_keys(ev: dict) -> dict[str, dict]:
    """{column: {"domain", "effort"}} from eval.json's settings; a column without them is
    read as "<domain>/<effort>" or "<domain>"."""
    settings = ev.get("settings") or {}
    out = {}
    for col in ev["domains"]:
        s = settings.get(col) or {}
        dom, _, eff = col.partition("/")
        out[col] = {"domain": s.get("domain", dom), "effort": s.get("effort", eff or None) if s else (eff or None)}
    return out


def efforts_by_domain(columns: dict[str, dict]) -> dict[str, list[tuple[str, str]]]:
    """{domain: [(effort, column), ...]} of the domains scored at several efforts, in
    column order (the registry's effort order: low before high)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for col, k in columns.items():
        if k["effort"]:
            out.setdefault(k["domain"], []).append((k["effort"], col))
    return {d: v for d, v in out.items() if len(v) > 1}


def effort_summary(columns: dict[str, dict], cost: dict[str, dict], models: list[str]) -> dict:
    """{domain: {"efforts": [...], "models": {model: {"tokens": {effort: mean}, "p90": {effort:
    p90}, "rises": bool | None}}}}: "rises" is whether each effort's mean tokens per task is
    below the next one's (low < high), None when an effort's cost is missing."""
    out = {}
    for dom, pairs in efforts_by_domain(columns).items():
        rows = {}
        for m in models:
            toks = {eff: _mean(cost.get(m, {}).get(col)) for eff, col in pairs}
            if all(v is None for v in toks.values()):
                continue
            vals = list(toks.values())
            rises = None if any(v is None for v in vals) else all(a < b for a, b in zip(vals, vals[1:]))
            p90 = {eff: _stat(cost.get(m, {}).get(col), "tokens", "p90") for eff, col in pairs}
            rows[m] = {"tokens": toks, "p90": p90, "rises": rises}
        out[dom] = {"efforts": [e for e, _ in pairs], "models": rows}
    return out


def _f(v, fmt="{:.1f}"):
    return "–" if v is None else fmt.format(v)


def _yes(v):
    return "–" if v is None else ("yes" if v else "**no**")


def cost_lines(r: dict, models: list[str], labels: dict[str, str]) -> list[str]:
    """report.md's cost section: one row per (column, model) with the score and the cost,
    the picture, then each effort domain's tokens per effort and whether low < high holds."""
    cost = r.get("cost") or {}
    if not any(c for row in cost.values() for c in row.values()):
        return ["## Cost per task", "", "No costs recorded (eval stages from before they were recorded: "
                "`--force eval/<model>` re-scores one).", ""]
    d = r["domains"]
    kinds = [k for k in KINDS if any((c or {}).get(k[0]) for row in cost.values() for c in row.values())]
    lines = ["## Score against cost per task", "",
             "Greedy held-out score beside what a task cost: completion tokens per task (the model's own "
             "tokens, in the tokenizer's ids, up to and including its EOS; prompt and padding left out), and for "
             "agent episodes turns and tool calls per episode; mean and 90th percentile (nearest rank).", "",
             "| column | model | score | " + " | ".join(f"{h} mean | {h} p90" for _, h in kinds) + " |",
             "|---|---|---:|" + "---:|---:|" * len(kinds)]
    for col in d:
        for m in models:
            c, s = cost.get(m, {}).get(col), r["scores"].get(m, {}).get(col)
            if c is None and s is None:
                continue
            cells = [f"{_f(_stat(c, k, 'mean'))} | {_f(_stat(c, k, 'p90'), '{:g}')}" for k, _ in kinds]
            lines.append(f"| {col} | {labels.get(m, m)} | {_f(s, '{:.3f}')} | " + " | ".join(cells) + " |")
    lines += ["", "![score against tokens per task](cost.png)", ""]
    for dom, e in (r.get("effort_cost") or {}).items():
        effs = e["efforts"]
        lines += [f"### Effort behaviour: {dom}", "",
                  f"Completion tokens per task at each effort, mean and p90; *rises* is whether "
                  f"the means' {' < '.join(effs)} holds.", "",
                  "| model | " + " | ".join(f"{x} mean | {x} p90" for x in effs) + " | rises |",
                  "|---|" + "---:|---:|" * len(effs) + "---|"]
        for m, row in e["models"].items():
            p90 = row.get("p90") or {}   # a report.json from before p90 was kept has none
            lines.append(f"| {labels.get(m, m)} | "
                         + " | ".join(f"{_f(row['tokens'][x])} | {_f(p90.get(x), '{:g}')}" for x in effs)
                         + f" | {_yes(row['rises'])} |")
        t, s = e["models"].get("teacher", {}), e["models"].get("student", {})
        lines += ["", f"{' < '.join(effs)} in tokens per task holds for the teachers: {_yes(t.get('rises'))}; "
                      f"for the MOPD student: {_yes(s.get('rises'))}.", ""]
    return lines


def plot_cost(r: dict, path: Path, models: list[str], labels: dict[str, str], colors: dict[str, str]) -> Path:
    """Score against mean completion tokens per task, one panel per domain; a domain's
    efforts are marker shapes, one model's efforts joined by a line; a thin bar reaches
    from the mean to the p90."""
    from evals.report import _plt   # matplotlib only when drawing

    plt = _plt()
    cost = r.get("cost") or {}
    keys = r.get("columns") or {}
    groups: dict[str, list[str]] = {}
    for col in r["domains"]:
        groups.setdefault((keys.get(col) or {}).get("domain") or col.split("/")[0], []).append(col)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups) + 2.2, 3.8), dpi=110, squeeze=False)
    for ax, (dom, cols) in zip(axes[0], groups.items()):
        drawn = False
        for m in models:
            pts = []
            for j, col in enumerate(cols):
                c, s = (cost.get(m) or {}).get(col), r["scores"].get(m, {}).get(col)
                t = (c or {}).get("tokens")
                if t and s is not None:
                    pts.append((t["mean"], t["p90"], s, EFFORT_MARKERS[j % len(EFFORT_MARKERS)]))
            if not pts:
                continue
            color = colors.get(m, "#000000")
            if len(pts) > 1:
                ax.plot([p[0] for p in pts], [p[2] for p in pts], color=color, lw=0.8, alpha=0.6)
            for x, p90, y, mk in pts:
                ax.plot([x, p90], [y, y], color=color, lw=0.6, alpha=0.5)
                ax.scatter([x], [y], marker=mk, s=45, color=color, zorder=3)
            ax.scatter([], [], marker="o", color=color, label=labels.get(m, m))
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no costs recorded", ha="center", va="center", transform=ax.transAxes)
        eff = [(keys.get(c) or {}).get("effort") or c for c in cols] if len(cols) > 1 else []
        ax.set_title(dom + (" (" + ", ".join(f"{e}: {EFFORT_MARKERS[j % 5]}" for j, e in enumerate(eff)) + ")"
                            if eff else ""), fontsize=9)
        ax.set_xlabel("completion tokens per task (mean; bar to p90)", fontsize=8)
        ax.set_ylabel("held-out score", fontsize=8)
        # scores lie in [0, 1]: the whole range, so a panel near 0 does not look like a spread
        ax.set_ylim(-0.03, 1.03)
        right = max([(_stat((cost.get(m) or {}).get(c), "tokens", "p90") or 0) for m in models for c in cols] or [0])
        ax.set_xlim(0, right * 1.08 if right else 1.0)
    handles, labs = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:   # a model scored on another panel only (a teacher) still gets its entry
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labs:
                handles.append(h)
                labs.append(lab)
    if handles:
        axes[0][-1].legend(handles, labs, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Score against tokens per task", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
