"""Does a student distilled through many harnesses hold up on harnesses it never saw?

    python -m bench.harness_generalization --base B --teacher T --out OUT --seeds 0 1 2

Two students of one agent domain (default coding_agent) from the same start, the same
expert, the same prompts, the same number of updates:
  - random: harnesses drawn per episode from the domain's train set (`--harnesses`,
    default recipes/harnesses/<domain>.yaml);
  - fixed: every episode through one train harness (`--fixed`, default the first).
Each student, the expert and the start are scored on the same held-out tasks through the
train harnesses (one drawn per task), the held_out_combo harnesses (seen module values,
combinations training never drew) and the held_out_novel ones (unseen names and syntax),
by the domain's own eval (evals/<domain>.py evaluate). Retention = combo / train success,
per seed, with a 95% t interval over seeds.

`--method seq_kd` (default) distills with mopd.baselines.seq_kd: SFT on the expert's greedy
episodes of the MOPD recipe's prompt stream, `--steps` updates of `--batch` rows (on
coding episodes it moved a student where MOPD at the same budget did not:
docs/results/2026-12-03-coding-search-agent-experts.md); `--method mopd` runs the MOPD
loop (recipes/mopd/<domain>.yaml) for `--steps` steps instead. A cell's result is kept
(OUT/<arm>/seed<s>/cell.json) and a rerun skips it. `--share-episodes` (seq_kd): the seeds after
the first retrain on the first seed's episodes of their arm instead of asking the expert again. Writes OUT/harness_generalization.json
and .md. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

from bench.horizon import DOMAINS, REPO, _module, mopd_config
from bench.stats import t_interval

ARMS = ("random", "fixed")
KINDS = ("train", "held_out_combo", "held_out_novel")


def _say(msg: str):
    print(f"[harness_generalization] {msg}", file=sys.stderr, flush=True)


def fixed_mix(harnesses: str, name: str | None, out: Path) -> Path:
    """A mix file whose only harness is `name` (default the first) of `harnesses`: the fixed
    arm's training set (every model is scored through the domain's own mix)."""
    data = yaml.safe_load((REPO / harnesses if not Path(harnesses).exists() else Path(harnesses)).read_text())
    train = data["harnesses"]
    pick = [h for h in train if h["name"] == name] if name else train[:1]
    if not pick:
        raise SystemExit(f"--fixed {name!r}: no train harness of that name in {harnesses} "
                         f"({', '.join(h['name'] for h in train)})")
    data = {"harnesses": pick}
    path = out / "fixed_harness.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def score(args, path: str) -> dict:
    """The domain's eval of `path`: train, held_out_combo and held_out_novel success, and
    the success through the fixed arm's one harness (`fixed_harness`)."""
    res = _module(args.domain, 1).evaluate(path, harnesses=args.harnesses, **_eval_kw(args))
    return {"train": res["score"], "held_out_combo": res["held_out_combo"], "held_out_novel": res["held_out_novel"],
            "n": res["n"], "failed_call_share": res["train_harness"]["failed_call_share"],
            **score_fixed(args, path)}


def score_fixed(args, path: str) -> dict:
    """Success through the fixed arm's harness alone: the fixed student's own training
    harness, against which its held_out_combo is read (its `train` column, a harness drawn
    from all nine per task, is mostly harnesses it never trained through)."""
    res = _module(args.domain, 1).evaluate(path, harnesses=str(args.fixed_mix), held_out=False, **_eval_kw(args))
    return {"fixed_harness": res["score"]}


def _eval_kw(args) -> dict:
    """The eval settings every scoring shares: the same tasks, greedy, at the same lengths."""
    return dict(n=args.n_eval, seed=args.eval_seed, max_new_tokens=args.max_new_tokens,
                max_context_tokens=args.max_context_tokens)


def distill_arm(args, arm: str, seed: int, mix: str, data: Path) -> dict:
    """One student: `args.method` from --base with the teacher, episodes through `mix`."""
    from transformers import AutoTokenizer

    from evals.report import tokens_from_history
    from mopd.baselines import mopd_prompt_stream, seq_kd
    from mopd.distill import run as distill
    from mopd.distill.agents import load_agents

    out = Path(args.out) / arm / f"seed{seed}"
    d = args.domain
    cfg = mopd_config(REPO / args.recipe, d, args.base, args.teacher, data, seed, args.steps,
                      [f"agents.{d}.harnesses={mix}", *args.overrides])
    t0 = time.perf_counter()
    if args.method == "mopd":
        res = distill(cfg, out / "mopd", progress=True)
        ckpt, tokens, updates = res["final"], tokens_from_history(res["history"]), len(res["history"])
    else:
        tok = AutoTokenizer.from_pretrained(args.base)
        # --share-episodes: later seeds retrain on the first seed's expert episodes of this arm
        first = Path(args.out) / arm / f"seed{args.seeds[0]}" / "seq_kd" / "teacher_answers"
        answers = first if args.share_episodes and seed != args.seeds[0] else None
        sk = seq_kd(args.base, {d: args.teacher}, mopd_prompt_stream(cfg, tok), out / "seq_kd", budget_tokens=1,
                    lr=args.lr, batch_size=args.batch, warmup=5, max_new_tokens=cfg.agents[d].max_new_tokens,
                    temperature=0.0, seed=seed, quant=None, agents=load_agents(cfg, tok), match="updates",
                    budget_updates=args.steps, num_threads=args.threads, answers=answers)
        ckpt, tokens, updates = sk["checkpoint"], sk["tokens"], sk["steps"]
    return {"arm": arm, "seed": seed, "checkpoint": str(ckpt), "tokens": tokens, "updates": updates,
            "train_seconds": round(time.perf_counter() - t0, 1)}


def own(cell: dict) -> float | None:
    """A student's success through the harnesses it trained through: the nine train harnesses
    (one drawn per task) for the random arm, the one fixed harness for the fixed arm."""
    return cell.get("fixed_harness") if cell.get("arm") == "fixed" else cell["train"]


def retention(cell: dict) -> float:
    """held_out_combo / the student's own train-harness success (0 where that is 0)."""
    o = own(cell)
    return cell["held_out_combo"] / o if o else 0.0


def summarize(cells: list[dict], expert: dict, start: dict | None) -> dict:
    rows = {}
    for arm in ARMS:
        cs = [c for c in cells if c["arm"] == arm]
        if not cs:
            continue
        ret = [retention(c) for c in cs]
        rows[arm] = {"seeds": [c["seed"] for c in cs], "retention": ret,
                     "retention_mean_ci": t_interval(ret),
                     **{k: t_interval([c[k] for c in cs]) for k in KINDS},
                     "fixed_harness": t_interval([c.get("fixed_harness") or 0.0 for c in cs]),
                     "tokens": statistics.fmean(c["tokens"] for c in cs),
                     "updates": statistics.fmean(c["updates"] for c in cs)}
    if "random" in rows and "fixed" in rows and rows["random"]["seeds"] == rows["fixed"]["seeds"]:
        gaps = [a - b for a, b in zip(rows["random"]["retention"], rows["fixed"]["retention"])]
        rows["gap_random_minus_fixed"] = {"retention": t_interval(gaps)}
    return {"expert": expert, "start": start, "arms": rows}


def write_report(out: Path, cells: list[dict], summary: dict):
    f = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    ci = lambda t: f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]"  # noqa: E731
    lines = ["| model | seed | train (9 harnesses) | fixed harness | held_out_combo | held_out_novel | "
             "retention (combo / own train) | tokens | updates |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("expert", "start"):
        s = summary.get(name)
        if s:
            lines.append(f"| {name} | – | {f(s['train'])} | {f(s.get('fixed_harness'))} | {f(s['held_out_combo'])} | "
                         f"{f(s['held_out_novel'])} | {f(retention(s) if s['train'] else None)} | – | – |")
    for c in cells:
        lines.append(f"| {c['arm']} | {c['seed']} | {f(c['train'])} | {f(c.get('fixed_harness'))} | "
                     f"{f(c['held_out_combo'])} | {f(c['held_out_novel'])} | {f(retention(c) if own(c) else None)} | "
                     f"{c['tokens']:,} | {c['updates']} |")
    lines += ["", "| arm | train (9 harnesses) | fixed harness | held_out_combo | held_out_novel | "
              "retention (combo / own train) |", "|---|---|---|---|---|---|"]
    for arm, r in summary["arms"].items():
        if arm in ARMS:
            lines.append(f"| {arm} | {ci(r['train'])} | {ci(r['fixed_harness'])} | {ci(r['held_out_combo'])} | "
                         f"{ci(r['held_out_novel'])} | {ci(r['retention_mean_ci'])} |")
    g = summary["arms"].get("gap_random_minus_fixed")
    if g:
        lines.append(f"\nRetention gap, random - fixed (paired by seed): {ci(g['retention'])}")
    lines.append("\nMeans with 95% t intervals over seeds. Own train: the nine train harnesses for the random arm "
                 "(and the expert), the fixed harness for the fixed arm.")
    (out / "harness_generalization.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="bench.harness_generalization", description=__doc__.split("\n\n")[0])
    ap.add_argument("--domain", choices=sorted(DOMAINS), default="coding_agent")
    ap.add_argument("--base", required=True, help="both students' start (an HF checkpoint)")
    ap.add_argument("--teacher", required=True, help="the domain's expert")
    ap.add_argument("--out", required=True)
    ap.add_argument("--harnesses", help="the train / held-out mix (default recipes/harnesses/<domain>.yaml)")
    ap.add_argument("--fixed", help="the fixed arm's train harness (default: the mix's first)")
    ap.add_argument("--recipe", help="the MOPD recipe the episode settings and prompts come from "
                    "(default recipes/mopd/<domain>.yaml)")
    ap.add_argument("--method", choices=["seq_kd", "mopd"], default="seq_kd")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2],
                    help="students' seeds; none (`--seeds` alone): score the expert (and the start) only")
    ap.add_argument("--steps", type=int, default=60, help="updates per student")
    ap.add_argument("--batch", type=int, default=16, help="seq-KD rows per update")
    ap.add_argument("--lr", type=float, default=2e-3, help="seq-KD learning rate")
    ap.add_argument("--share-episodes", action="store_true",
                    help="seq_kd: seeds after the first train on the first seed's expert episodes of their arm "
                         "(the same rows in their own order), so a seed varies the student's training, not the "
                         "expert's data; generating the episodes is most of a cell's time")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-prompts", type=int, default=2000)
    ap.add_argument("--difficulty", type=int, default=1)
    ap.add_argument("--n-eval", type=int, default=60, help="held-out tasks per harness kind")
    ap.add_argument("--eval-seed", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    # the expert recipe's agent.max_context_tokens: the pipeline's base has 1024 positions
    ap.add_argument("--max-context-tokens", type=int, default=1024)
    ap.add_argument("--skip-start", action="store_true", help="do not score the students' start")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the MOPD recipe")
    args = ap.parse_args(argv)
    args.recipe = args.recipe or f"recipes/mopd/{args.domain}.yaml"
    args.harnesses = args.harnesses or f"recipes/harnesses/{args.domain}.yaml"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    if not data.exists():
        _module(args.domain, 0).make_dataset("train", args.n_prompts, seed=0,
                                             difficulty=args.difficulty).save_to_disk(str(data))
    mixes = {"random": args.harnesses, "fixed": str(fixed_mix(args.harnesses, args.fixed, out))}
    args.fixed_mix = mixes["fixed"]

    def with_fixed(path: Path, res: dict, model: str) -> dict:
        """A result kept from before `fixed_harness` was scored gets it now."""
        if "fixed_harness" not in res:
            res.update(score_fixed(args, model))
            path.write_text(json.dumps(res, indent=1))
        return res

    def cached(path: Path, make) -> dict:
        if path.exists():
            return json.loads(path.read_text())
        res = make()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
        return res

    expert = with_fixed(out / "expert.json", cached(out / "expert.json", lambda: score(args, args.teacher)),
                        args.teacher)
    _say(f"expert: {expert}")
    start = None if args.skip_start else with_fixed(out / "start.json",
                                                     cached(out / "start.json", lambda: score(args, args.base)),
                                                     args.base)
    cells = []
    for seed in args.seeds:
        for arm in args.arms:
            def make(arm=arm, seed=seed):
                cell = distill_arm(args, arm, seed, mixes[arm], data)
                t0 = time.perf_counter()
                cell.update(score(args, cell["checkpoint"]), eval_seconds=0.0)
                cell["eval_seconds"] = round(time.perf_counter() - t0, 1)
                return cell
            cell_path = out / arm / f"seed{seed}" / "cell.json"
            cells.append(cached(cell_path, make))
            with_fixed(cell_path, cells[-1], cells[-1]["checkpoint"])
            c = cells[-1]
            _say(f"{arm} seed {seed}: train {c['train']:.3f} combo {c['held_out_combo']:.3f} "
                 f"novel {c['held_out_novel']:.3f} ({c['train_seconds']} s training, {c['eval_seconds']} s eval)")
            report(out, cells, expert, start, args)
    report(out, cells, expert, start, args)
    print((out / "harness_generalization.md").read_text())


def report(out: Path, cells: list[dict], expert: dict, start: dict | None, args):
    summary = summarize(cells, expert, start)
    (out / "harness_generalization.json").write_text(json.dumps({"cells": cells, **summary, "args": vars(args)},
                                                                indent=1))
    write_report(out, cells, summary)


if __name__ == "__main__":
    main()
