"""MOPD against seq-KD on agent episodes, by horizon: where on-policy distillation must win.

    python -m bench.horizon --pipeline runs/pipeline --out runs/horizon
    python -m bench.horizon --base B --teacher T --out OUT --horizons 2 4 8 16 --seeds 0 1 2 --n-eval 500
    python -m bench.horizon --domain coding_agent --base B --teacher T --out OUT --horizons 1 3

`--domain` is one of the multi-turn domains: `agent` (the horizon H is the number of
dependent calls of a task), `coding_agent` (H is `data.difficulty`: bugs and files) or
`search_agent` (H is the number of hops). For each H and each seed:
  - MOPD: `recipes/mopd/<domain>.yaml`, the student starting from the base (or from
    `--student`: a warm start, e.g. a partly trained SFT checkpoint of the expert, when a
    student from the base would need the expert's whole budget to leave 0.0), the domain's
    expert as teacher, prompts of horizon H, train.seed = seed;
  - seq-KD: SFT of the same starting model on the teacher's greedy episodes of the same prompts
    (MOPD's prompt stream replayed) with as many assistant-written tokens as MOPD's
    student wrote (mopd.baselines.seq_kd_agent);
  - both scored on the same `--n-eval` held-out episodes of horizon H (greedy, train
    harnesses): success rate, the share of episodes with at least one failed call, the
    recovery rate after the first failed call. The teacher is scored once per horizon.

Budgets both ways: student-written tokens (matched), and compute as FLOPs estimated from
the parameter count N: sampling and scoring 2·N per token, an update 6·N per trained
token (teacher forward passes over whole transcripts for MOPD, teacher generation for
seq-KD). Wall-clock seconds are recorded too (noisy here: compare within one run).

A cell's results are kept (OUT/h<H>/seed<s>/cell.json; its MOPD arm also in mopd.json):
a rerun skips finished cells, and a folder holding only a cell's mopd.json (copied from
another run) trains and scores only seq-KD, e.g. to try another --seq-kd-lr against the
same MOPD runs.

Writes OUT/horizon.json, OUT/horizon.md and OUT/gap_vs_horizon.png. A benchmark, not a
test: it takes hours on a laptop CPU at the defaults (use --steps, --n-eval to shrink).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _say(msg: str):
    print(f"[horizon] {msg}", file=sys.stderr, flush=True)


def n_params(path: str) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


# domain -> (its data module, its eval module, the default horizons); a domain's episodes
# are played by its eval's run_tasks, in its own environment
DOMAINS = {"agent": ("experts.agent.data", "evals.agent", [2, 4, 8, 16]),
           "coding_agent": ("experts.coding_agent.data", "evals.coding_agent", [1, 2, 3, 4, 5]),
           "search_agent": ("experts.search_agent.data", "evals.search_agent", [1, 2, 3, 4])}


def _module(domain: str, which: int):
    import importlib

    return importlib.import_module(DOMAINS[domain][which])


def mopd_config(recipe: Path, domain: str, base: str, teacher: str, data: Path, seed: int, steps: int | None,
                overrides: list[str]):
    from core.config import checked, load_config
    from mopd.distill import DistillConfig
    from mopd.distill.config import DatasetSpec, TeacherSpec

    c = load_config(DistillConfig, recipe, overrides)
    backend = next(iter(c.teachers.values())).backend
    c = dataclasses.replace(
        c, model=dataclasses.replace(c.model, path=base),
        data=dataclasses.replace(c.data, datasets=[DatasetSpec(path=str(data))], mix={}),
        teachers={domain: TeacherSpec(path=teacher, backend=backend)},
        train=dataclasses.replace(c.train, seed=seed, max_steps=steps or c.train.max_steps, save_every=0),
        mlflow=dataclasses.replace(c.mlflow, log_model=False, tracking_uri=f"sqlite:///{data.parent.parent}/mlflow.db"))
    return checked(c, str(recipe))


def evaluate(domain: str, path: str, tasks: list[dict], harnesses, agent_cfg, seed: int) -> dict:
    import random

    from evals.agent import episode_stats
    from core.evaluate import load_model

    model, tok = load_model(path)
    rng = random.Random(seed)
    hs = [harnesses.sample(rng) for _ in tasks]
    eps = _module(domain, 1).run_tasks(model, tok, tasks, hs, max_new_tokens=agent_cfg.max_new_tokens,
                                       max_turns=agent_cfg.max_turns, max_context_tokens=agent_cfg.max_context_tokens)
    return episode_stats(eps)


def run_cell(args, H: int, seed: int, base: str, teacher: str, tasks: list[dict], N: int) -> dict:
    """MOPD and seq-KD at horizon H with one seed; both evaluated."""
    from transformers import AutoTokenizer

    from evals.report import tokens_from_history
    from core.agent.harness import load_harnesses
    from mopd.baselines import mopd_prompt_stream, seq_kd
    from mopd.distill import run as distill
    from mopd.distill.agents import load_agents

    out = Path(args.out) / f"h{H}" / f"seed{seed}"
    data = Path(args.out) / "data" / f"h{H}"
    d = args.domain
    if not data.exists():
        _module(d, 0).make_dataset("train", args.n_prompts, seed=0, difficulty=H).save_to_disk(str(data))
    cfg = mopd_config(REPO / args.recipe, d, base, teacher, data, seed, args.steps, args.mopd_overrides)
    a = cfg.agents[d]
    cell: dict = {"horizon": H, "seed": seed}
    res_path = out / "cell.json"
    if res_path.exists():
        return json.loads(res_path.read_text())
    mopd_path = out / "mopd.json"   # a cell's MOPD arm, kept: a rerun (e.g. another seq-KD lr) reuses it
    if mopd_path.exists():
        cell["mopd"] = json.loads(mopd_path.read_text())
        tokens = cell["mopd"]["tokens"]
        updates = cell["mopd"].get("updates", cfg.train.max_steps)
    else:
        t0 = time.perf_counter()
        res = distill(cfg, out / "mopd", progress=True)
        mopd_s = time.perf_counter() - t0
        tokens = tokens_from_history(res["history"])
        updates = len(res["history"])   # optimizer steps (seq-KD's budget with --seq-kd-match updates)
        # The teacher reads every transcript token (prompt, observations, student turns), not
        # only the student's; a history without the metric would undercount, so it is required.
        metric = f"agent/transcript_tokens/{d}"
        scored = sum(h[metric] for h in res["history"] if metric in h)
        if scored == 0:
            raise RuntimeError(f"bench.horizon: the MOPD history has no {metric}; "
                               "the FLOPs of teacher scoring cannot be estimated")
        cell["mopd"] = {"tokens": tokens, "updates": updates, "seconds": round(mopd_s, 1),
                        "flops": 2 * N * tokens + 2 * N * scored + 6 * N * tokens,
                        **evaluate(d, res["final"], tasks, load_harnesses(a.harnesses), a, 1)}
        out.mkdir(parents=True, exist_ok=True)
        mopd_path.write_text(json.dumps(cell["mopd"], indent=1))
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(base)
    sk = seq_kd(base, {d: teacher}, mopd_prompt_stream(cfg, tok), out / "seq_kd", budget_tokens=tokens,
                lr=args.seq_kd_lr, batch_size=args.seq_kd_batch, warmup=5, max_new_tokens=a.max_new_tokens,
                temperature=0.0, seed=seed, quant=cfg.quant, agents=load_agents(cfg, tok),
                match=args.seq_kd_match, budget_updates=updates)
    sk_s = time.perf_counter() - t0
    gen_tokens = sk["tokens"]   # the teacher generated the assistant tokens the student trains on
    cell["seq_kd"] = {"tokens": sk["tokens"], "updates": sk["steps"], "matched": sk["match"], "seconds": round(sk_s, 1),
                      "flops": 2 * N * gen_tokens * 2 + 6 * N * sk["tokens"],
                      **evaluate(d, sk["checkpoint"], tasks, load_harnesses(a.harnesses), a, 1)}
    out.mkdir(parents=True, exist_ok=True)
    res_path.write_text(json.dumps(cell, indent=1))
    _say(f"H={H} seed={seed}: MOPD {cell['mopd']['success']:.3f}  seq-KD {cell['seq_kd']['success']:.3f}  "
         f"(seq-KD matched to MOPD's {sk['match']}: {sk['tokens']:,} vs {tokens:,} student tokens, "
         f"{sk['steps']} vs {updates} updates)")
    return cell


def summarize(cells: list[dict], teacher: dict[int, dict], start: dict[int, dict] | None = None) -> dict:
    rows = []
    for H in sorted({c["horizon"] for c in cells}):
        cs = [c for c in cells if c["horizon"] == H]
        gaps = [c["mopd"]["success"] - c["seq_kd"]["success"] for c in cs]

        def mean(m, k):
            vals = [c[m][k] for c in cs if c[m].get(k) is not None]
            return statistics.fmean(vals) if vals else None
        rows.append({"horizon": H, "seeds": [c["seed"] for c in cs], "teacher": teacher.get(H, {}).get("success"),
                     "start": (start or {}).get(H, {}).get("success"),
                     **{f"{m}_{k}": mean(m, k) for m in ("mopd", "seq_kd")
                        for k in ("success", "failed_call_share", "recovery_rate", "tokens", "flops", "seconds")},
                     "gap": statistics.fmean(gaps), "gap_min": min(gaps), "gaps": gaps})
    return {"rows": rows}


def write_report(out: Path, summary: dict):
    lines = ["| H | teacher | student at start | MOPD | seq-KD | gap (mean, min over seeds) | failed-call share M / S | "
             "recovery M / S | student tokens | FLOPs M / S |", "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for r in summary["rows"]:
        lines.append(f"| {r['horizon']} | {f(r['teacher'])} | {f(r.get('start'))} | {f(r['mopd_success'])} | {f(r['seq_kd_success'])} | "
                     f"{r['gap']:+.3f}, {r['gap_min']:+.3f} | {f(r['mopd_failed_call_share'])} / "
                     f"{f(r['seq_kd_failed_call_share'])} | {f(r['mopd_recovery_rate'])} / "
                     f"{f(r['seq_kd_recovery_rate'])} | {f(r['mopd_tokens'], 0)} | "
                     f"{r['mopd_flops']:.2e} / {r['seq_kd_flops']:.2e} |")
    (out / "horizon.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("matplotlib missing: no plot")
        return
    hs = [r["horizon"] for r in summary["rows"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(hs, [r["gap"] for r in summary["rows"]], "o-", label="MOPD - seq-KD (mean over seeds)")
    for r in summary["rows"]:
        ax.scatter([r["horizon"]] * len(r["gaps"]), r["gaps"], s=10, color="gray")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("horizon (dependent calls)")
    ax.set_ylabel("success-rate gap")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "gap_vs_horizon.png", dpi=120)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="bench.horizon", description=__doc__.split("\n\n")[0])
    ap.add_argument("--domain", choices=sorted(DOMAINS), default="agent")
    ap.add_argument("--pipeline", help="a pipeline run: its base/model and experts/<domain>/rl/model")
    ap.add_argument("--base")
    ap.add_argument("--teacher")
    ap.add_argument("--student", help="the student's starting checkpoint, for both methods (default: --base)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", help="the MOPD recipe (default: recipes/mopd/<domain>.yaml)")
    ap.add_argument("--horizons", type=int, nargs="+", help="default: every horizon of the domain")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n-eval", type=int, default=500)
    ap.add_argument("--n-prompts", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=None, help="MOPD steps (default: the recipe's)")
    ap.add_argument("--seq-kd-lr", type=float, default=1e-3)
    ap.add_argument("--seq-kd-batch", type=int, default=16)
    ap.add_argument("--seq-kd-match", choices=["tokens", "updates"], default="tokens",
                    help="seq-KD's budget equals MOPD's student tokens (default) or its optimizer updates")
    ap.add_argument("mopd_overrides", nargs="*", help="key=value overrides of the MOPD recipe")
    args = ap.parse_args(argv)
    args.recipe = args.recipe or f"recipes/mopd/{args.domain}.yaml"
    args.horizons = args.horizons or DOMAINS[args.domain][2]
    if args.pipeline:
        args.base = args.base or str(Path(args.pipeline) / "base" / "model")
        args.teacher = args.teacher or str(Path(args.pipeline) / "experts" / args.domain / "rl" / "model")
    if not ((args.base or args.student) and args.teacher):
        ap.error("give --pipeline DIR, or --base (or --student) and --teacher")
    args.base = args.student or args.base
    for what, p in (("--student" if args.student else "--base", args.base), ("--teacher", args.teacher)):
        if not (Path(p) / "config.json").exists():
            ap.error(f"{what} {p} is not an HF checkpoint (no config.json)")
    import random

    from core.agent.harness import load_harnesses
    from core.config import load_config
    from mopd.distill import DistillConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    N = n_params(args.base)
    recipe_cfg = load_config(DistillConfig, REPO / args.recipe, args.mopd_overrides)
    if args.domain not in recipe_cfg.agents:
        ap.error(f"{args.recipe} has no agents.{args.domain} section (the episode settings of --domain)")
    a = recipe_cfg.agents[args.domain]
    cells, teacher, start = [], {}, {}
    for H in args.horizons:
        tasks = [json.loads(t) for t in
                 _module(args.domain, 0).make_dataset("test", args.n_eval, seed=0, difficulty=H)["task"]]
        # the teacher and the student's starting point, scored once per horizon
        for name, path, into in (("teacher", args.teacher, teacher), ("start", args.base, start)):
            p = out / f"h{H}" / f"{name}.json"
            if p.exists():
                into[H] = json.loads(p.read_text())
            else:
                into[H] = evaluate(args.domain, path, tasks, load_harnesses(a.harnesses), a, 1)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(json.dumps(into[H]))
            _say(f"H={H}: {name} success {into[H]['success']:.3f}")
        for seed in args.seeds:
            cells.append(run_cell(args, H, seed, args.base, args.teacher, tasks, N))
            summary = summarize(cells, teacher, start)
            (out / "horizon.json").write_text(json.dumps({"cells": cells, "teacher": teacher, "start": start,
                                                          **summary}, indent=1))
            write_report(out, summary)
    random.seed(0)
    print((out / "horizon.md").read_text())


if __name__ == "__main__":
    main()
