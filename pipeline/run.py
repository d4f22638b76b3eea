"""`mopd pipeline --config recipes/pipeline/tiny.yaml --out DIR`: every stage, from the
common base to the report, as one cached, resumable run (the stages: pipeline/plan.py).

Each stage is its own MLflow run, nested under one parent run for DIR (recorded in
DIR/pipeline.json and reused by a rerun against the same store); the parent's id reaches
every stage explicitly: the runner hands it to each stage, which sets it in its config's
`mlflow.parent_run_id` (subprocess stages read it from their config file).

Caching: a stage's hash covers its resolved settings (paths inside DIR written as $OUT)
and its upstream stages' hashes; DIR/stages/<stage>.json records hash, status and outputs.
A stage is reused when it finished with the same hash from the same upstream runs (every
finished stage gets a run id; a rerun upstream stage has a new one), so an edit redoes
the stages it changes and everything downstream of them, and nothing else. `--force STAGE`
(a name or a glob such as 'eval/*') redoes that stage (and so its dependents). A stage
that was killed (status "running") is redone from scratch, except `mopd`, which resumes
from its last checkpoint (train.save_every) when its hash still matches. Code changes
are not part of any hash: after editing code, --force the stages it touches.

Relative paths in the config (recipes) are read from the working directory, else from
the repository root.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import mlflow
import torch
from mlflow.entities import RunStatus
from rich.console import Console
from rich.table import Table

from evals.report import print_table
from core.config import dump_yaml, flatten, to_dict
from core.outdir import check_out_dir, check_store, hold_out_dir
from core.task_cost import cost_metrics
from core.tracking import check_store as check_tracking_store
from core.tracking import experiment_id, resolve_uri
from pipeline.config import PipelineConfig
from pipeline.estimate import describe, estimate, find_records, total
from pipeline.plan import Plan, build_plan
from pipeline.runner import StageRunner, say
from pipeline.stages.report import FILES


def run_pipeline(cfg: PipelineConfig, out: str | Path, *, force: list[str] | None = None,
                 dry_run: bool = False, config_text: str | None = None, dry=None) -> dict | None:
    """Run (or resume) the whole pipeline in `out`; returns the report (or, with
    dry_run, the plan: which stages would be reused, resumed or run; None when `dry`, a
    core.dryrun.DryRun, got problems: every one is recorded there)."""
    t_start = time.perf_counter()
    if dry is not None:
        root = dry.check(check_out_dir, out)
        if root is not None:
            dry.check(check_tracking_store, resolve_uri(cfg.mlflow.tracking_uri, root))
        if dry.problems:   # the plan resolves models:/ references in that store
            return None
        plan = build_plan(cfg, root, dry=dry)
        if plan is None:
            return None
        return _dry_run(cfg, root, plan, force)
    root = check_out_dir(out)
    # a tracking server that does not answer: said in seconds, before the plan resolves models:/ references
    check_tracking_store(resolve_uri(cfg.mlflow.tracking_uri, root))
    if dry_run:
        return _dry_run(cfg, root, build_plan(cfg, root), force)
    # one pipeline per folder: taken before anything is written (its stages, run here or
    # as subprocesses, write inside it and go through: core.outdir)
    lock = hold_out_dir(root, "mopd pipeline")  # noqa: F841 - held until this function returns
    plan = build_plan(cfg, root)     # every stage's config, checked before any stage runs
    check_store(plan.tracking_uri)
    StageRunner(root, force=force or []).check(plan.stages)
    (root / "pipeline.yaml").write_text(config_text or dump_yaml(cfg))
    client = mlflow.MlflowClient(tracking_uri=plan.tracking_uri)
    parent = _parent_run(plan, client)
    client.log_artifact(parent, str(root / "pipeline.yaml"))
    console = Console(stderr=True)
    runner = StageRunner(root, force=force or [], jobs=cfg.jobs, parent_run_id=parent, started=t_start,
                         log=lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True))
    threads = torch.get_num_threads()
    say(f"{len(plan.stages)} stages in {root}; MLflow {plan.tracking_uri}, parent run {parent}")
    for s in plan.stages:  # every stage runs with the process's thread setting, whatever the last one did
        s.fn = _with_threads(s.fn, threads)
    ok = False
    try:
        runner.run(plan.stages)
        ok = True
    finally:
        wall = time.perf_counter() - t_start
        try:
            client.log_metric(parent, "wall_seconds", wall)
            for name, secs in runner.seconds.items():
                client.log_metric(parent, f"stage_seconds/{name}", secs)
            client.set_terminated(parent, RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED))
        except Exception as e:  # the store being unreachable must not hide the stage's own error
            say(f"could not update the parent MLflow run: {e}")
    report = json.loads((root / "report.json").read_text())
    _log_report(client, parent, report, root)
    _print_stages(runner, wall)
    print_table(report, title=f"{root.name}: held-out scores (greedy)")
    return report


def _dry_run(cfg: PipelineConfig, root: Path, plan: Plan, force: list[str] | None) -> dict:
    """The plan printed: which stages would be reused, resumed or run, with estimates."""
    rows = StageRunner(root, force=force or []).plan(plan.stages)
    shows = {s.name: s.shows for s in plan.stages}
    _print_plan(rows, shows)
    est = estimate(rows, find_records(root))
    Console(stderr=True, soft_wrap=True).print("\n".join(describe(est, cfg.jobs)), highlight=False, markup=False)
    return {"plan": [{"stage": s, "hash": h, "action": a, **shows[s], "estimate_s": e["estimate_s"]}
                     for (s, h, a), e in zip(rows, est)], "estimated_total": total(est)}


def _parent_run(plan: Plan, client: mlflow.MlflowClient) -> str:
    """The parent run's id: the run recorded in DIR/pipeline.json when it is in this
    tracking store, else a new one."""
    exp_id = experiment_id(plan.cfg.mlflow.experiment, plan.tracking_uri)
    state_file = plan.root / "pipeline.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    run_id = None
    if state.get("tracking_uri") == plan.tracking_uri and state.get("parent_run_id"):
        try:
            r = client.get_run(state["parent_run_id"])
            if r.info.lifecycle_stage == "active":
                run_id = r.info.run_id
                client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        except Exception:
            run_id = None
    if run_id is None:
        run_id = client.create_run(exp_id, run_name=f"pipeline-{plan.root.name}", tags={"stage": "pipeline"}).info.run_id
        for k, v in flatten(to_dict(plan.cfg)).items():
            client.log_param(run_id, k, str(v)[:500])
    state.update({"tracking_uri": plan.tracking_uri, "parent_run_id": run_id, "experiment_id": exp_id})
    state_file.write_text(json.dumps(state, indent=1))
    return run_id


def _log_report(client: mlflow.MlflowClient, parent: str, report: dict, root: Path):
    """The report's scores, retention, means and costs per task as the parent run's metrics,
    its files as artifacts."""
    for m, row in report["scores"].items():
        for d, v in row.items():
            if v is not None:
                client.log_metric(parent, f"score/{m}/{d}", v)
    for d, v in report["retention"].items():
        if v is not None:
            client.log_metric(parent, f"retention/{d}", v)
    for m, v in (report.get("means") or {}).items():
        if v is not None:
            client.log_metric(parent, f"mean/{m}", v["mean"])
    for m, row in (report.get("cost") or {}).items():   # tokens_mean/<model>/<column>, tokens_p90/..., turns_...
        for k, v in cost_metrics({f"{m}/{d}": c for d, c in row.items()}).items():
            client.log_metric(parent, k, v)
    for f in FILES:
        if (root / f).exists():
            client.log_artifact(parent, str(root / f))


def _with_threads(fn, threads: int):
    def wrapped(ctx):
        try:
            return fn(ctx)
        finally:
            torch.set_num_threads(threads)
    return wrapped


def _print_plan(rows, shows: dict[str, dict]):
    """The stages, then what each trains or scores: its effective model, dtype, quant and
    (MOPD) teachers, as the stage will run them (lines, so long paths stay whole)."""
    t = Table(title="pipeline plan")
    for c in ("stage", "hash", "action"):
        t.add_column(c)
    for s, h, a in rows:
        t.add_row(s, h, {"cached": "reuse", "resume": "resume", "run": "run"}[a])
    console = Console(stderr=True, soft_wrap=True)
    console.print(t)
    for s, _, _ in rows:
        d = shows.get(s, {})
        if d.get("model"):
            more = [x for x in (d.get("note"), d.get("dtype"), d.get("quant") and f"quant {d['quant']}") if x]
            console.print(f"{s}: {d['model']}" + (f"  [{', '.join(more)}]" if more else ""), highlight=False,
                          markup=False)
        for k, v in (d.get("teachers") or {}).items():
            console.print(f"    teacher {k}: {v}", highlight=False, markup=False)


def _print_stages(runner: StageRunner, wall: float):
    t = Table(title=f"pipeline stages ({wall:.0f} s wall)")
    for c in ("stage", "status", "seconds"):
        t.add_column(c)
    for name, secs in runner.seconds.items():
        t.add_row(name, runner.status.get(name, "-"), f"{secs:.1f}")
    Console(stderr=True).print(t)
