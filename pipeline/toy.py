"""`mopd toy --out DIR`: the whole idea on a laptop CPU in about ten minutes, as a small
pipeline on the same stage runner as `mopd pipeline`.

    data            `reverse` and `rotate` prompts (train and held-out test) -> DIR/data/<task>/{train,test}
    base            a random-init tiny Qwen2 pretrained on generic chat data (can't do either task) -> DIR/base
    teacher/<task>  one SFT expert per task, fine-tuned from the base -> DIR/teachers/<task>
    mopd            recipes/mopd/toy.yaml: the base, as student, samples on-policy (vLLM) and
                    learns both tasks from the per-token log-probs of its task's teacher -> DIR/student
    eval            greedy held-out scores of base, teachers and student -> DIR/summary.json

Data, base and teachers are reused when DIR already holds them with the same settings
(DIR/stages/<stage>.json), so iterating on the MOPD recipe is quick; the MOPD stage and
the evals always run afresh. The tasks' settings are core.toy_tasks.TOY_DEFAULTS.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import datasets
import mlflow
from rich.console import Console
from rich.table import Table

from core.config import ConfigError, checked, load_config
from mopd.distill import DistillConfig, run as distill
from mopd.distill.config import DatasetSpec, TeacherSpec
from mopd.distill.data import load_reward_fn
from core.evaluate import evaluate
from core.outdir import check_out_dir, check_store, hold_out_dir
from core.sft import sft
from core.tiny import build_tiny_model, tiny_config
from core.toy_tasks import DOMAINS, REWARDS, TOY_DEFAULTS, make_dataset, make_pretrain_dataset, sft_rows
from core.tracking import resolve_uri, start_run
from pipeline.config import ToyConfig
from pipeline.runner import Stage, StageContext, StageRunner
from pipeline.stages.common import find, settings, with_parent

D = TOY_DEFAULTS


def _say(msg: str):
    print(f"[toy] {msg}", file=sys.stderr, flush=True)


def mopd_config(cfg: ToyConfig, out: Path) -> DistillConfig:
    """The MOPD recipe pointed at the base, data and teachers the toy's stages write."""
    recipe = find(cfg.recipe)
    c = load_config(DistillConfig, recipe, list(cfg.overrides))
    teachers = {d: TeacherSpec(path=str(out / "teachers" / d),
                               backend=c.teachers[d].backend if d in c.teachers else "hf") for d in DOMAINS}
    c = dataclasses.replace(
        c, model=dataclasses.replace(c.model, path=str(out / "base")),
        data=dataclasses.replace(c.data, datasets=[DatasetSpec(path=str(out / "data" / d / "train")) for d in DOMAINS]),
        teachers={**c.teachers, **teachers},
        rollout=dataclasses.replace(c.rollout, backend=cfg.rollout_backend or c.rollout.backend),
        mlflow=dataclasses.replace(c.mlflow, tracking_uri=resolve_uri(c.mlflow.tracking_uri, out)))
    c = checked(c, str(recipe))
    check_toy_overrides(c, str(recipe))
    return c


def check_toy_overrides(c: DistillConfig, source: str) -> None:
    """What the MOPD run would otherwise find only after the data, base and teachers were
    built: domain names outside the toy's tasks, reward functions that do not import, and
    prompt + completion beyond the base's positions or the engines' max_model_len."""
    for where, names in (("data.mix", c.data.mix), ("rewards", c.rewards), ("reward_kwargs", c.reward_kwargs),
                         ("agents", c.agents), ("rollout.by_domain", c.rollout.by_domain), ("teachers", c.teachers)):
        bad = sorted(d for d in names if d.split("/")[0] not in DOMAINS)
        if bad:
            raise ConfigError(f"{source}: {where} names {bad}, which are not toy tasks (the toy's domains: "
                              f"{list(DOMAINS)})")
    if c.data.mix:
        missing = [d for d in DOMAINS if d not in c.data.mix]
        if missing:
            raise ConfigError(f"{source}: data.mix has no weight for {missing} (0 leaves a task out)")
    for d, ref in c.rewards.items():
        load_reward_fn(ref, c.reward_kwargs.get(d))
    positions = D["model"].get("max_position_embeddings",
                               inspect.signature(tiny_config).parameters["max_position_embeddings"].default)
    try:
        c.check_context(list(DOMAINS), positions=positions, model="the toy's base")
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def stages(cfg: ToyConfig, out: Path, mopd: DistillConfig) -> list[Stage]:
    seed = cfg.seed
    n_train, n_test = D["teacher_sft"]["reverse"]["n"], D["eval"]["n_test"]
    data = {"n": n_train, "n_test": n_test, "seed": seed, "difficulty": D["difficulty"]}
    base = {"model": D["model"], "pretrain": D["pretrain"], "seed": seed}
    # With quant.enabled in the MOPD recipe, the teachers are trained with the same
    # fake-quantization from SFT onward (and saved as the weights their forward used).
    quant = mopd.quant if mopd.quant.enabled else None
    teachers = [f"teacher/{d}" for d in DOMAINS]
    return [
        Stage("data", data, partial(run_data, settings=data), out=out / "data"),
        Stage("base", base, partial(run_base, settings=base, mopd=mopd), out=out / "base"),
        *[Stage(f"teacher/{d}", {"sft": D["teacher_sft"][d], "difficulty": D["difficulty"][d], "seed": seed,
                                 "quant": None if quant is None else dataclasses.asdict(quant)},
                partial(run_teacher, domain=d, seed=seed, quant=quant, mopd=mopd), deps=["base"],
                out=out / "teachers" / d) for d in DOMAINS],
        Stage("mopd", settings(mopd), partial(run_mopd, cfg=mopd), deps=["data", "base", *teachers],
              out=out / "student", always=True),
        Stage("eval", None, partial(run_eval, root=out), deps=["data", "base", *teachers, "mopd"], always=True),
    ]


def _stage_run(ctx: StageContext, mopd: DistillConfig, domain: str = "all"):
    return start_run(experiment=mopd.mlflow.experiment, uri=mopd.mlflow.tracking_uri, run_name=ctx.name.replace("/", "-"),
                     tags={"stage": ctx.name.split("/")[0], "domain": domain}, parent_run_id=ctx.parent_run_id)


def run_data(ctx: StageContext, settings: dict) -> dict:
    s = settings
    for d in DOMAINS:
        diff = s["difficulty"][d]
        make_dataset(d, "train", s["n"], seed=s["seed"], difficulty=diff).save_to_disk(str(ctx.out / d / "train"))
        make_dataset(d, "test", s["n_test"], seed=s["seed"], difficulty=diff).save_to_disk(str(ctx.out / d / "test"))
    return {"paths": {d: str(ctx.out / d) for d in DOMAINS}}


def run_base(ctx: StageContext, settings: dict, mopd: DistillConfig) -> dict:
    _say("building the tiny base model (random init + generic chat pretraining)")
    seed, p = settings["seed"], settings["pretrain"]
    init = ctx.out.parent / "init"
    build_tiny_model(init, seed=seed, **settings["model"])
    with _stage_run(ctx, mopd):
        mlflow.log_params({f"pretrain.{k}": v for k, v in p.items()})
        sft(str(init), make_pretrain_dataset(p["n"], seed=seed), str(ctx.out), steps=p["steps"],
            lr=p["lr"], batch_size=p["batch_size"], seed=seed, warmup=p["warmup"],
            num_threads=p.get("num_threads", 1))
    shutil.rmtree(init, ignore_errors=True)
    return {"checkpoint": str(ctx.out)}


def run_teacher(ctx: StageContext, domain: str, seed: int, quant, mopd: DistillConfig) -> dict:
    _say(f"training the {domain!r} teacher (SFT from the base)")
    ts = D["teacher_sft"][domain]
    with _stage_run(ctx, mopd, domain=domain):
        mlflow.log_params({f"sft.{k}": v for k, v in ts.items()})
        sft(ctx.inputs["base"]["checkpoint"],
            sft_rows(domain, "train", ts["n"], seed=seed, difficulty=D["difficulty"][domain]),
            str(ctx.out), steps=ts["steps"], lr=ts["lr"], batch_size=ts["batch_size"], seed=seed,
            warmup=ts["warmup"], num_threads=ts.get("num_threads", 1), quant=quant)
    return {"checkpoint": str(ctx.out)}


def run_mopd(ctx: StageContext, cfg: DistillConfig) -> dict:
    _say(f"MOPD: distilling both teachers into the base ({cfg.train.max_steps} steps, "
         f"{cfg.rollout.backend} sampling)")
    res = distill(with_parent(cfg, ctx.parent_run_id), ctx.out)
    mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    return {"final": res["final"], "mlflow_run_id": res["mlflow_run_id"], "history": str(ctx.out / "history.json")}


def run_eval(ctx: StageContext, root: Path) -> dict:
    ev = D["eval"]
    hist = json.loads(Path(ctx.inputs["mopd"]["history"]).read_text())
    out = {"steps": len(hist), "domains": {}}
    for d in DOMAINS:
        test = datasets.load_from_disk(str(Path(ctx.inputs["data"]["paths"][d]) / "test"))

        def score(path):
            return float(evaluate(str(path), test, REWARDS[d], max_new_tokens=ev["max_new_tokens"],
                                  batch_size=ev["batch_size"]))
        kls = [h[f"reverse_kl/{d}"] for h in hist if f"reverse_kl/{d}" in h]
        out["domains"][d] = {
            "reverse_kl_first": sum(kls[:5]) / max(1, len(kls[:5])),
            "reverse_kl_last": sum(kls[-5:]) / max(1, len(kls[-5:])),
            "base_score": score(ctx.inputs["base"]["checkpoint"]),
            "teacher_score": score(ctx.inputs[f"teacher/{d}"]["checkpoint"]),
            "student_score": score(ctx.inputs["mopd"]["final"]),
        }
    return out


def run_toy(cfg: ToyConfig, out: str | Path) -> dict:
    """Every toy stage in `out` (reusing data, base and teachers when unchanged); returns
    the summary it writes to out/summary.json."""
    t_start = time.perf_counter()
    out = check_out_dir(out)
    mopd = mopd_config(cfg, out)   # loaded (and so checked) before anything is written or trained
    lock = hold_out_dir(out, "mopd toy")  # noqa: F841 - one writer per --out, held until this returns
    check_store(mopd.mlflow.tracking_uri)
    toy_stages = stages(cfg, out, mopd)
    parent = start_run(experiment=mopd.mlflow.experiment, uri=mopd.mlflow.tracking_uri, run_name=f"toy-{out.name}",
                       tags={"stage": "toy"})
    runner = StageRunner(out, parent_run_id=parent.info.run_id, started=t_start)
    try:
        outputs = runner.run(toy_stages)
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    secs = {k: 0.0 if runner.status.get(k) == "cached" else v for k, v in runner.seconds.items()}
    summary = {"rollout_backend": mopd.rollout.backend, "steps": outputs["eval"]["steps"],
               "domains": outputs["eval"]["domains"],
               "stage_seconds": {"data": round(secs["data"], 1), "base": round(secs["base"], 1),
                                 "teachers": round(sum(secs[f"teacher/{d}"] for d in DOMAINS), 1),
                                 "mopd": round(secs["mopd"], 1), "eval": round(secs["eval"], 1)},
               "wall_seconds": round(time.perf_counter() - t_start, 1),
               "mlflow": {"tracking_uri": mopd.mlflow.tracking_uri, "parent_run_id": parent.info.run_id,
                          "mopd_run_id": outputs["mopd"]["mlflow_run_id"]}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for d, s in summary["domains"].items():
        mlflow.log_metrics({f"{k}/{d}": v for k, v in s.items()})
    mlflow.log_artifact(str(out / "summary.json"))
    mlflow.end_run()
    _print_summary(summary)
    return summary


def _print_summary(summary: dict):
    t = Table(title=f"mopd toy: {summary['steps']} MOPD steps, {summary['wall_seconds']:.0f} s")
    for c in ("domain", "base", "teacher", "student", "student/teacher", "reverse KL first -> last"):
        t.add_column(c)
    for d, s in summary["domains"].items():
        ret = s["student_score"] / s["teacher_score"] if s["teacher_score"] else float("nan")
        t.add_row(d, f"{s['base_score']:.2f}", f"{s['teacher_score']:.2f}", f"{s['student_score']:.2f}",
                  f"{ret:.2f}", f"{s['reverse_kl_first']:.3f} -> {s['reverse_kl_last']:.3f}")
    Console(stderr=True).print(t)
