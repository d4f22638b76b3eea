"""`mopd toy --out DIR`: the whole idea on a laptop CPU in about ten minutes.

1. data:     `reverse` and `rotate` prompts (train and held-out test) saved as HF datasets
2. base:     a random-init tiny Qwen2 pretrained on generic chat data (can't do either task)
3. teachers: one SFT expert per task, fine-tuned from the base
4. mopd:     recipes/mopd/toy.yaml: the base, as student, samples on-policy (vLLM) and
             learns both tasks from the per-token log-probs of its domain's teacher
5. eval:     greedy held-out scores of base, teachers and student -> DIR/summary.json

Base and teachers are reused when DIR already holds them with the same settings (a
hash of the settings is stored beside each), so iterating on the MOPD recipe is quick;
the MOPD stage always starts fresh in DIR/student.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY_RECIPE = REPO / "recipes" / "mopd" / "toy.yaml"


def _say(msg: str):
    print(f"[toy] {msg}", file=sys.stderr, flush=True)


def _cached(dir_: Path, settings: dict) -> bool:
    marker = dir_ / ".mopd_stage.json"
    return marker.exists() and json.loads(marker.read_text()).get("hash") == _hash(settings)


def _mark(dir_: Path, settings: dict, extra: dict | None = None):
    (dir_ / ".mopd_stage.json").write_text(json.dumps({"hash": _hash(settings), **(extra or {})}))


def _hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_toy(out: str | Path, overrides: list[str] | None = None, rollout_backend: str = "vllm",
            seed: int = 0) -> dict:
    import mlflow

    from mopd.config import load_config
    from mopd.evaluate import evaluate
    from mopd.sft import sft
    from mopd.tiny import build_tiny_model
    from mopd.toy_tasks import DOMAINS, REWARDS, TOY_DEFAULTS, make_dataset, make_pretrain_dataset, sft_rows
    from mopd.train import DistillConfig, run

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    D = TOY_DEFAULTS
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}

    # The MOPD config is loaded (and so checked) before any training happens.
    data_dir = out / "data"
    ov = [f"model.path={out / 'base'}",
          "data.datasets=" + json.dumps([{"path": str(data_dir / d / "train")} for d in DOMAINS]),
          *[f"teachers.{d}.path={out / 'teachers' / d}" for d in DOMAINS],
          f"rollout.backend={rollout_backend}", f"train.seed={seed}",
          f"mlflow.tracking_uri=sqlite:///{out}/mlflow.db",
          *(overrides or [])]
    cfg = load_config(DistillConfig, TOY_RECIPE, ov)
    from mopd.tracking import experiment_id, resolve_uri
    cfg.mlflow.tracking_uri = resolve_uri(cfg.mlflow.tracking_uri, out)
    exp_id = experiment_id(cfg.mlflow.experiment, cfg.mlflow.tracking_uri)
    parent = mlflow.start_run(experiment_id=exp_id, run_name=f"toy-{out.name}", tags={"stage": "toy"})

    # 1. data
    t0 = time.perf_counter()
    n_train, n_test = D["teacher_sft"]["reverse"]["n"], D["eval"]["n_test"]
    tests = {}
    for d in DOMAINS:
        diff = D["difficulty"][d]
        settings = {"domain": d, "n": n_train, "n_test": n_test, "seed": seed, "difficulty": diff}
        if not _cached(data_dir / d, settings):
            shutil.rmtree(data_dir / d, ignore_errors=True)
            make_dataset(d, "train", n_train, seed=seed, difficulty=diff).save_to_disk(str(data_dir / d / "train"))
            make_dataset(d, "test", n_test, seed=seed, difficulty=diff).save_to_disk(str(data_dir / d / "test"))
            _mark(data_dir / d, settings)
        import datasets
        tests[d] = datasets.load_from_disk(str(data_dir / d / "test"))
    seconds["data"] = time.perf_counter() - t0

    def stage_run(name: str, params: dict):
        return mlflow.start_run(experiment_id=exp_id, run_name=name, nested=True,
                                tags={"stage": name.split("-")[0], "domain": params.get("domain", "all")})

    # 2. base
    t0 = time.perf_counter()
    base = out / "base"
    bset = {"model": D["model"], "pretrain": D["pretrain"], "seed": seed}
    if not _cached(base, bset):
        _say("building the tiny base model (random init + generic chat pretraining)")
        shutil.rmtree(base, ignore_errors=True)
        init = out / "init"
        build_tiny_model(init, seed=seed, **D["model"])
        p = D["pretrain"]
        with stage_run("base", {}):
            mlflow.log_params({f"pretrain.{k}": v for k, v in p.items()})
            sft(str(init), make_pretrain_dataset(p["n"], seed=seed), str(base), steps=p["steps"],
                lr=p["lr"], batch_size=p["batch_size"], seed=seed, warmup=p["warmup"],
                num_threads=p.get("num_threads", 1))
        _mark(base, bset)
        shutil.rmtree(init, ignore_errors=True)
    else:
        _say("base: reusing " + str(base))
    seconds["base"] = time.perf_counter() - t0

    # 3. teachers
    t0 = time.perf_counter()
    for d in DOMAINS:
        tdir = out / "teachers" / d
        ts = D["teacher_sft"][d]
        # With quant.enabled in the MOPD recipe, the teachers are trained with the same
        # fake-quantization from SFT onward (and saved as the weights their forward used).
        quant = cfg.quant if cfg.quant.enabled else None
        tset = {"base": bset, "sft": ts, "difficulty": D["difficulty"][d], "seed": seed,
                "quant": None if quant is None else vars(quant)}
        if _cached(tdir, tset):
            _say(f"teacher {d}: reusing {tdir}")
            continue
        _say(f"training the {d!r} teacher (SFT from the base)")
        shutil.rmtree(tdir, ignore_errors=True)
        with stage_run(f"teacher-{d}", {"domain": d}):
            mlflow.log_params({f"sft.{k}": v for k, v in ts.items()})
            sft(str(base), sft_rows(d, "train", ts["n"], seed=seed, difficulty=D["difficulty"][d]),
                str(tdir), steps=ts["steps"], lr=ts["lr"], batch_size=ts["batch_size"], seed=seed,
                warmup=ts["warmup"], num_threads=ts.get("num_threads", 1), quant=quant)
        _mark(tdir, tset)
    seconds["teachers"] = time.perf_counter() - t0

    # 4. MOPD
    t0 = time.perf_counter()
    student_dir = out / "student"
    shutil.rmtree(student_dir, ignore_errors=True)
    _say(f"MOPD: distilling both teachers into the base ({cfg.train.max_steps} steps, "
         f"{cfg.rollout.backend} sampling)")
    os.environ["MOPD_PARENT_RUN_ID"] = parent.info.run_id
    try:
        result = run(cfg, student_dir)
    finally:
        os.environ.pop("MOPD_PARENT_RUN_ID", None)
    mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    seconds["mopd"] = time.perf_counter() - t0

    # 5. evals
    t0 = time.perf_counter()
    ev = D["eval"]
    hist = result["history"]
    summary = {"rollout_backend": cfg.rollout.backend, "steps": len(hist), "domains": {}}
    models = {"base": base, "student": Path(result["final"])}
    for d in DOMAINS:
        def score(path):
            return float(evaluate(str(path), tests[d], REWARDS[d], max_new_tokens=ev["max_new_tokens"],
                                  batch_size=ev["batch_size"]))
        kls = [h[f"reverse_kl/{d}"] for h in hist if f"reverse_kl/{d}" in h]
        summary["domains"][d] = {
            "reverse_kl_first": sum(kls[:5]) / max(1, len(kls[:5])),
            "reverse_kl_last": sum(kls[-5:]) / max(1, len(kls[-5:])),
            "base_score": score(models["base"]),
            "teacher_score": score(out / "teachers" / d),
            "student_score": score(models["student"]),
        }
    seconds["eval"] = time.perf_counter() - t0
    summary["stage_seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    summary["mlflow"] = {"tracking_uri": cfg.mlflow.tracking_uri, "parent_run_id": parent.info.run_id,
                         "mopd_run_id": result["mlflow_run_id"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for d, s in summary["domains"].items():
        mlflow.log_metrics({f"{k}/{d}": v for k, v in s.items()})
    mlflow.log_artifact(str(out / "summary.json"))
    mlflow.end_run()
    _print_summary(summary)
    return summary


def _print_summary(summary: dict):
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"mopd toy: {summary['steps']} MOPD steps, {summary['wall_seconds']:.0f} s")
    for c in ("domain", "base", "teacher", "student", "student/teacher", "reverse KL first -> last"):
        t.add_column(c)
    for d, s in summary["domains"].items():
        ret = s["student_score"] / s["teacher_score"] if s["teacher_score"] else float("nan")
        t.add_row(d, f"{s['base_score']:.2f}", f"{s['teacher_score']:.2f}", f"{s['student_score']:.2f}",
                  f"{ret:.2f}", f"{s['reverse_kl_first']:.3f} -> {s['reverse_kl_last']:.3f}")
    Console(stderr=True).print(t)
