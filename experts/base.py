"""`mopd base --config recipes/base/tiny.yaml --out DIR`: the common tiny base model.

Every domain expert starts from this one checkpoint (that is what makes their tokenizers,
vocabularies and chat templates match, so one student can learn from all of them). It is
a random-init tiny Qwen2 pretrained on the mix of every domain's `pretrain_rows`: the
chat format, each domain's prompt shapes and vocabulary, and answers of the right form
that do not solve the task, so the base scores ~0 on every domain and an expert has to
learn its skill. DIR/model is the checkpoint; DIR/summary.json records the settings.
"""
from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def expert_domains() -> list[str]:
    """Domains with a recipe folder under recipes/experts/ (what the pipeline trains)."""
    root = REPO / "recipes" / "experts"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


@dataclass
class BaseModelSize:
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4             # head_dim = hidden_size / num_heads must be 64 for vLLM CPU
    intermediate_size: int = 0     # 0: 4 x hidden_size


@dataclass
class BaseData:
    domains: list[str] = field(default_factory=list)   # empty: every domain under recipes/experts/
    rows_per_domain: int = 4000
    seed: int = 0


@dataclass
class BaseTrain:
    max_steps: int = 600
    lr: float = 3e-3
    batch_size: int = 64
    warmup_steps: int = 30
    seed: int = 0
    num_threads: int = 0           # 0: torch's default


@dataclass
class BaseMlflow:
    experiment: str = "mopd-experts"
    tracking_uri: str | None = None


@dataclass
class BaseConfig:
    model: BaseModelSize = field(default_factory=BaseModelSize)
    data: BaseData = field(default_factory=BaseData)
    train: BaseTrain = field(default_factory=BaseTrain)
    mlflow: BaseMlflow = field(default_factory=BaseMlflow)

    def validate(self):
        if self.model.hidden_size % self.model.num_heads or self.model.hidden_size // self.model.num_heads != 64:
            raise ValueError(f"model: hidden_size/num_heads must be 64 (vLLM's CPU attention needs "
                             f"head_dim 64), got {self.model.hidden_size}/{self.model.num_heads}")


def pretrain_mix(domains: list[str], rows_per_domain: int, seed: int):
    import datasets

    parts = []
    for d in domains:
        try:
            mod = importlib.import_module(f"experts.{d}.data")
        except ModuleNotFoundError:
            raise ValueError(f"base: domain {d!r} has no experts/{d}/data.py") from None
        if not hasattr(mod, "pretrain_rows"):
            raise ValueError(f"base: experts/{d}/data.py defines no pretrain_rows(n, seed)")
        ds = mod.pretrain_rows(rows_per_domain, seed=seed)
        parts.append(ds.select_columns(["prompt", "completion"]))
    if not parts:
        raise ValueError("base: no domains to pretrain on (recipes/experts/ is empty and data.domains unset)")
    return datasets.concatenate_datasets(parts).shuffle(seed=seed)


def build_base(cfg: BaseConfig, out: str | Path) -> dict:
    import mlflow

    from mopd.sft import sft
    from mopd.tiny import build_tiny_model

    out = Path(out)
    domains = cfg.data.domains or expert_domains()
    ds = pretrain_mix(domains, cfg.data.rows_per_domain, cfg.data.seed)  # errors before any work
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sizes = dict(hidden_size=cfg.model.hidden_size, num_layers=cfg.model.num_layers,
                 num_heads=cfg.model.num_heads)
    if cfg.model.intermediate_size:
        sizes["intermediate_size"] = cfg.model.intermediate_size
    init = out / "init"
    build_tiny_model(init, seed=cfg.train.seed, **sizes)

    import os

    from mopd.tracking import experiment_id, resolve_uri

    exp_id = experiment_id(cfg.mlflow.experiment, resolve_uri(cfg.mlflow.tracking_uri, out))
    parent = os.environ.get("MOPD_PARENT_RUN_ID")
    print(f"[base] pretraining a tiny Qwen2 {sizes} on {len(ds)} rows from {domains}", file=sys.stderr)
    with mlflow.start_run(experiment_id=exp_id, run_name="base", tags={"stage": "base", "domain": "all"},
                          nested=bool(parent), parent_run_id=parent or None) as run:
        mlflow.log_params({"domains": ",".join(domains), **{f"model.{k}": v for k, v in sizes.items()},
                           **{f"train.{k}": v for k, v in asdict(cfg.train).items()},
                           "data.rows_per_domain": cfg.data.rows_per_domain})
        model_dir = out / "model"
        shutil.rmtree(model_dir, ignore_errors=True)
        sft(str(init), ds, str(model_dir), steps=cfg.train.max_steps, lr=cfg.train.lr,
            batch_size=cfg.train.batch_size, seed=cfg.train.seed, warmup=cfg.train.warmup_steps,
            num_threads=cfg.train.num_threads or None)
        log = json.loads((model_dir / "sft_log.json").read_text())
        for i, loss in enumerate(log.get("losses", [])):
            mlflow.log_metric("loss", loss, step=i)
        summary = {"checkpoint": str(model_dir.resolve()), "domains": domains, "model": sizes,
                   "train_seconds": round(time.perf_counter() - t0, 1), "mlflow_run_id": run.info.run_id}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        mlflow.log_artifact(str(out / "summary.json"))
    shutil.rmtree(init, ignore_errors=True)
    return summary


def main(argv: list[str] | None = None):
    from mopd.config import ConfigError, load_config

    p = argparse.ArgumentParser(prog="mopd base", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    try:
        build_base(load_config(BaseConfig, a.config, a.overrides), a.out)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
