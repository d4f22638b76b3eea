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
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import datasets
import mlflow

from experts.registry import all_domains, data_module
from core import exitcodes
from core.config import ConfigError, in_range, load_config, option
from core.outdir import hold_out_dir
from core.sft import sft
from core.tiny import build_tiny_model
from core.tracking import resolve_uri, start_run




@dataclass
class BaseModelSize:
    hidden_size: int = option("width of the tiny Qwen2 (hidden_size / num_heads must be 64)", 256)
    num_layers: int = option("transformer layers", 4)
    num_heads: int = option("attention heads: head_dim = hidden_size / num_heads must be 64 for vLLM CPU", 4)
    intermediate_size: int = option("MLP width (0: 4 x hidden_size)", 0)
    max_positions: int = option("max_position_embeddings: the longest sequence the base (and every model "
                                "trained from it) takes; agent episodes need ~1000-1300", 512)

    def validate(self):
        for k in ("hidden_size", "num_layers", "num_heads", "max_positions"):
            in_range(f"model.{k}", getattr(self, k), 1)
        in_range("model.intermediate_size", self.intermediate_size, 0)


@dataclass
class BaseData:
    domains: list[str] = option("domains whose pretrain_rows make the mix (empty: every domain under "
                               "recipes/experts/)", factory=list)
    rows_per_domain: int = option("pretrain_rows drawn from each domain", 4000)
    seed: int = option("seed of the rows and of their shuffle", 0)

    def validate(self):
        in_range("data.rows_per_domain", self.rows_per_domain, 1)


@dataclass
class BaseTrain:
    max_steps: int = option("optimizer steps", 600)
    lr: float = option("peak learning rate", 3e-3)
    batch_size: int = option("rows per optimizer step", 64)
    warmup_steps: int = option("linear warm-up steps to the peak learning rate", 30)
    seed: int = option("seed of the random init and of the row order", 0)
    num_threads: int = option("torch intra-op threads (0: torch's default)", 0)
    precision: Literal["fp32", "bf16"] = option(
        "fp32, or bf16 autocast of forward and backward (fp32 weights and optimizer state): about 1.3-1.5x "
        "faster on CPUs with AVX-512 bf16 / AMX", "fp32")

    def validate(self):
        in_range("train.max_steps", self.max_steps, 1)
        in_range("train.lr", self.lr, 0, low_open=True)
        in_range("train.batch_size", self.batch_size, 1)
        in_range("train.warmup_steps", self.warmup_steps, 0)
        in_range("train.num_threads", self.num_threads, 0)


@dataclass
class BaseMlflow:
    experiment: str = option("MLflow experiment name", "mopd-experts")
    tracking_uri: str | None = option("default: $MLFLOW_TRACKING_URI, else sqlite:///<out>/mlflow.db", None)
    parent_run_id: str | None = option("nest the run under this MLflow run (the pipeline sets it)", None)


@dataclass
class BaseConfig:
    model: BaseModelSize = option("size of the random-init tiny Qwen2", factory=BaseModelSize)
    data: BaseData = option("the pretraining mix", factory=BaseData)
    train: BaseTrain = option("pretraining with core.sft.sft", factory=BaseTrain)
    mlflow: BaseMlflow = option("where the run is logged", factory=BaseMlflow)

    def validate(self):
        if self.model.hidden_size % self.model.num_heads or self.model.hidden_size // self.model.num_heads != 64:
            raise ValueError(f"model: hidden_size/num_heads must be 64 (vLLM's CPU attention needs "
                             f"head_dim 64), got {self.model.hidden_size}/{self.model.num_heads}")


def pretrain_mix(domains: list[str], rows_per_domain: int, seed: int):
    parts = []
    for d in domains:
        mod = data_module(d)
        if not hasattr(mod, "pretrain_rows"):
            raise ValueError(f"base: domain {d!r}: its data module {mod.__name__} defines no pretrain_rows(n, seed)")
        ds = mod.pretrain_rows(rows_per_domain, seed=seed)
        parts.append(ds.select_columns(["prompt", "completion"]))
    if not parts:
        raise ValueError("base: no domains to pretrain on (recipes/experts/ is empty and data.domains unset)")
    return datasets.concatenate_datasets(parts).shuffle(seed=seed)


def build_base(cfg: BaseConfig, out: str | Path) -> dict:
    """Pretrain the tiny base on the domains' mix -> out/model; returns the summary it writes."""
    out = Path(out)
    domains = cfg.data.domains or all_domains()
    ds = pretrain_mix(domains, cfg.data.rows_per_domain, cfg.data.seed)  # errors before any work
    lock = hold_out_dir(out, "mopd base")  # noqa: F841 - one writer per --out, held until this returns
    t0 = time.perf_counter()
    sizes = dict(hidden_size=cfg.model.hidden_size, num_layers=cfg.model.num_layers,
                 num_heads=cfg.model.num_heads, max_position_embeddings=cfg.model.max_positions)
    if cfg.model.intermediate_size:
        sizes["intermediate_size"] = cfg.model.intermediate_size
    init = out / "init"
    build_tiny_model(init, seed=cfg.train.seed, **sizes)

    print(f"[base] pretraining a tiny Qwen2 {sizes} on {len(ds)} rows from {domains}", file=sys.stderr)
    with start_run(experiment=cfg.mlflow.experiment, uri=resolve_uri(cfg.mlflow.tracking_uri, out),
                   run_name="base", tags={"stage": "base", "domain": "all"},
                   parent_run_id=cfg.mlflow.parent_run_id) as run:
        mlflow.log_params({"domains": ",".join(domains), **{f"model.{k}": v for k, v in sizes.items()},
                           **{f"train.{k}": v for k, v in asdict(cfg.train).items()},
                           "data.rows_per_domain": cfg.data.rows_per_domain})
        model_dir = out / "model"
        shutil.rmtree(model_dir, ignore_errors=True)
        sft(str(init), ds, str(model_dir), steps=cfg.train.max_steps, lr=cfg.train.lr,
            batch_size=cfg.train.batch_size, seed=cfg.train.seed, warmup=cfg.train.warmup_steps,
            num_threads=cfg.train.num_threads or None, precision=cfg.train.precision)
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
    p = argparse.ArgumentParser(prog="mopd base", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    try:
        build_base(load_config(BaseConfig, a.config, a.overrides), a.out)
    except (exitcodes.Unreachable, ConfigError, ValueError) as e:   # expected: one line and its documented code
        sys.exit(exitcodes.report(e, "mopd base"))


if __name__ == "__main__":
    main()
