"""`mopd expert --config recipes/experts/<domain>/{sft,rl}.yaml --out DIR`: one stage of
a domain expert, with TRL. Also `accelerate launch -m experts.run --config ... --out DIR`.

    sft: TRL SFTTrainer on the domain's reference completions, from the base
    rl:  TRL GRPOTrainer with the domain's reward, from the SFT checkpoint

Reads top to bottom: load config, check the domain's pieces exist, build data, model
(LoRA, QAT), train, save DIR/model, score on the held-out split, log and register in
MLflow, write DIR/summary.json. A domain whose RL needs its own loop (an environment,
multi-turn tools) copies this file into experts/<domain>/ rather than adding flags here.

The domain's pieces are found by name (see experts/README.md):
    experts/<domain>/data.py   make_dataset(split, n, seed, difficulty, effort)
    rewards/<domain>.py        reward(prompts, completions, **columns)
    evals/<domain>.py          evaluate(model, n=, seed=, difficulty=, effort=, ...)
"""
from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from mopd.quant import QuantConfig
from mopd.train import LoraConfig

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- config
@dataclass
class ExpertModel:
    path: str = ""                 # HF directory or models:/ URI: the stage's starting point
    base: str = ""                 # the common base, scored for score_base ("" = model.path)
    dtype: str = "float32"
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ExpertData:
    dataset: str = "procedural"    # "procedural" (make_dataset) or a name in data.DATASETS
    n_train: int = 2000
    n_test: int = 200              # held-out rows scored at the end
    seed: int = 0
    difficulty: int = 1


@dataclass
class ExpertTrain:
    max_steps: int = 100           # optimizer steps
    lr: float = 1e-4
    batch_size: int = 16           # sft: rows per step; rl: prompts per step
    grad_accum: int = 1
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_length: int = 512          # sft: longer rows are truncated
    seed: int = 0
    logging_steps: int = 10
    num_threads: int = 0           # torch intra-op threads (0: leave torch's default)

    def validate(self):
        if self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")


@dataclass
class ExpertRL:
    num_generations: int = 8       # completions per prompt (the GRPO group)
    max_completion_length: int = 64
    temperature: float = 1.0
    beta: float = 0.0              # KL to the starting model (0: no reference model kept)
    epsilon: float = 0.2
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    use_vllm: bool = False         # CPU default: HF generate (the policy's own forward)
    reward_kwargs: dict[str, str] = field(default_factory=dict)


@dataclass
class ExpertEval:
    max_new_tokens: int = 64
    batch_size: int = 64
    score_base: bool = True
    # false: skip held-out scoring here (the RL stage scores this checkpoint instead); for a
    # domain whose scorer is trained from this very SFT checkpoint (the pipeline's chat RM)
    score: bool = True


@dataclass
class ExpertMlflow:
    experiment: str = "mopd-experts"
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite under --out
    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    register: bool = False         # register DIR/model as <domain>[-<effort>]-expert@teacher
    registered_name: str | None = None


@dataclass
class ExpertConfig:
    domain: str = ""
    stage: Literal["sft", "rl"] = "sft"
    effort: str | None = None
    model: ExpertModel = field(default_factory=ExpertModel)
    data: ExpertData = field(default_factory=ExpertData)
    train: ExpertTrain = field(default_factory=ExpertTrain)
    rl: ExpertRL = field(default_factory=ExpertRL)
    eval: ExpertEval = field(default_factory=ExpertEval)
    mlflow: ExpertMlflow = field(default_factory=ExpertMlflow)
    quant: QuantConfig = field(default_factory=QuantConfig)

    def validate(self):
        if not self.domain:
            raise ValueError("domain is required")
        if not self.model.path:
            raise ValueError("model.path is required (the base for sft, the SFT checkpoint for rl)")
        if self.stage == "rl" and self.rl.use_vllm and self.quant.enabled:
            # TRL's own vLLM weight sync sends the trainer's parameters, i.e. the full-precision
            # master weights of the fake-quantized layers: the sampler would run a different
            # model than the trainer (off-policy). HF generation samples with the trainer's
            # own fake-quantized forward, so it is on-policy by construction.
            raise ValueError("rl.use_vllm=true with quant.enabled=true is not supported yet: TRL's vLLM "
                             "weight sync would send unquantized weights; use rl.use_vllm=false")


def registered_name(domain: str, effort: str | None) -> str:
    return f"{domain}-{effort}-expert" if effort else f"{domain}-expert"


# ----------------------------------------------------------------------------- domain pieces
@dataclass
class Domain:
    name: str
    data: object                   # experts.<domain>.data
    reward: object                 # rewards.<domain>.reward
    evals: object                  # evals.<domain>


def load_domain(name: str) -> Domain:
    """The domain's data, reward and eval modules, or a clear error naming what is missing."""
    pieces = {}
    for key, mod, file in (("data", f"experts.{name}.data", f"experts/{name}/data.py"),
                           ("reward", f"rewards.{name}", f"rewards/{name}.py"),
                           ("evals", f"evals.{name}", f"evals/{name}.py")):
        try:
            pieces[key] = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and (mod == e.name or mod.startswith(e.name + ".")):
                raise ValueError(f"domain {name!r}: {file} is missing (every domain needs "
                                 f"experts/<d>/data.py, rewards/<d>.py and evals/<d>.py)") from None
            raise
    if not hasattr(pieces["reward"], "reward"):
        raise ValueError(f"domain {name!r}: rewards/{name}.py defines no `reward` function")
    for fn in ("make_dataset",):
        if not hasattr(pieces["data"], fn):
            raise ValueError(f"domain {name!r}: experts/{name}/data.py defines no `{fn}`")
    if not hasattr(pieces["evals"], "evaluate"):
        raise ValueError(f"domain {name!r}: evals/{name}.py defines no `evaluate`")
    return Domain(name, pieces["data"], pieces["reward"].reward, pieces["evals"])


def domain_reward(domain: Domain, reward_kwargs: dict):
    """The domain's reward with the recipe's settings bound, named for TRL's logs."""
    fn = domain.reward
    if reward_kwargs:
        # Only named parameters count: **columns takes dataset columns and would swallow a
        # misspelt setting silently.
        params = {n for n, p in inspect.signature(fn).parameters.items()
                  if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        unknown = [k for k in reward_kwargs if k not in params]
        if unknown:
            raise ValueError(f"rl.reward_kwargs: {unknown} are not parameters of rewards/{domain.name}.py:reward")
        fn = functools.partial(fn, **reward_kwargs)
    wrapped = functools.wraps(domain.reward)(lambda *a, **k: fn(*a, **k))
    wrapped.__name__ = f"{domain.name}_reward"
    return wrapped


def build_dataset(cfg: ExpertConfig, domain: Domain, split: str, n: int):
    data = domain.data
    if cfg.data.dataset == "procedural":
        kw = {"effort": cfg.effort} if cfg.effort else {}
        return data.make_dataset(split, n, seed=cfg.data.seed, difficulty=cfg.data.difficulty, **kw)
    loaders = getattr(data, "DATASETS", {})
    if cfg.data.dataset not in loaders:
        raise ValueError(f"data.dataset={cfg.data.dataset!r}: experts/{domain.name}/data.py offers "
                         f"'procedural' and {sorted(loaders)}")
    return loaders[cfg.data.dataset]()


def check(cfg: ExpertConfig, out: Path) -> Domain:
    """Everything that can be wrong before any model is loaded."""
    domain = load_domain(cfg.domain)
    efforts = tuple(getattr(domain.data, "EFFORTS", ()) or ())
    if efforts and cfg.effort not in efforts:
        raise ValueError(f"domain {cfg.domain!r} has efforts {list(efforts)}: set effort to one of them "
                         f"(got {cfg.effort!r})")
    if not efforts and cfg.effort:
        raise ValueError(f"domain {cfg.domain!r} has no efforts, but effort={cfg.effort!r}")
    for what, ref in (("model.path", cfg.model.path), ("model.base", cfg.model.base)):
        if ref and not ref.startswith(("models:/", "runs:/")) and not (Path(ref) / "config.json").exists():
            raise ValueError(f"{what}={ref!r} is not an HF checkpoint directory (no config.json)"
                             + (" - run the sft stage first" if cfg.stage == "rl" and what == "model.path" else ""))
    if cfg.stage == "rl":
        domain_reward(domain, cfg.rl.reward_kwargs)
        if cfg.train.batch_size * cfg.rl.num_generations < 2 or cfg.rl.num_generations < 2:
            raise ValueError("rl.num_generations must be >= 2 (GRPO compares completions within a group)")
    if (out / "summary.json").exists():
        raise ValueError(f"{out} already holds a finished expert stage (summary.json); "
                         "choose another --out or delete it")
    return domain


# ----------------------------------------------------------------------------- pieces
def _resolve(ref: str) -> str:
    if ref.startswith(("models:/", "runs:/")):
        from teachers.resolve import resolve_ref
        return str(resolve_ref(ref))
    return ref


def load_model(cfg: ExpertConfig):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _resolve(cfg.model.path)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(path)
    if cfg.model.lora.enabled:
        from peft import LoraConfig as PeftLora, get_peft_model
        lc = cfg.model.lora
        model = get_peft_model(model, PeftLora(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                               target_modules=lc.target_modules, task_type="CAUSAL_LM"))
    if cfg.quant.enabled:
        from mopd.quant import apply_qat
        apply_qat(model, cfg.quant)
    return model, tok


class _MlflowLogger:
    """A transformers callback that logs the trainer's numeric logs to the active run."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Cb(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                import mlflow
                if not state.is_world_process_zero or not logs:
                    return
                vals = {k.replace("/", "_") if k.count("/") > 1 else k: float(v) for k, v in logs.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)}
                if vals:
                    mlflow.log_metrics(vals, step=state.global_step)
        return Cb()


def train_args_common(cfg: ExpertConfig, out: Path) -> dict:
    t = cfg.train
    return dict(output_dir=str(out / "trainer"), max_steps=t.max_steps, learning_rate=t.lr,
                gradient_accumulation_steps=t.grad_accum, warmup_steps=t.warmup_steps,
                lr_scheduler_type=t.lr_schedule, weight_decay=t.weight_decay, max_grad_norm=t.grad_clip,
                seed=t.seed, data_seed=t.seed, logging_steps=t.logging_steps, save_strategy="no",
                report_to="none", use_cpu=not _has_accelerator(), bf16=False, fp16=False,
                dataloader_num_workers=0, disable_tqdm=False)


def _has_accelerator() -> bool:
    import torch
    return torch.cuda.is_available()


def train_sft(cfg: ExpertConfig, model, tok, train_ds, out: Path):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**train_args_common(cfg, out), per_device_train_batch_size=cfg.train.batch_size,
                     max_length=cfg.train.max_length, completion_only_loss=True, packing=False)
    ds = train_ds.select_columns(["prompt", "completion"])
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                         callbacks=[_MlflowLogger()])
    trainer.train()
    return trainer.model


def train_rl(cfg: ExpertConfig, domain: Domain, model, tok, train_ds, out: Path):
    from trl import GRPOConfig, GRPOTrainer

    r = cfg.rl
    args = GRPOConfig(**train_args_common(cfg, out),
                      per_device_train_batch_size=cfg.train.batch_size * r.num_generations,
                      num_generations=r.num_generations, max_completion_length=r.max_completion_length,
                      temperature=r.temperature, beta=r.beta, epsilon=r.epsilon, loss_type=r.loss_type,
                      scale_rewards=r.scale_rewards, use_vllm=r.use_vllm,
                      vllm_mode="colocate", log_completions=False, shuffle_dataset=True)
    drop = [c for c in ("completion",) if c in train_ds.column_names]
    trainer = GRPOTrainer(model=model, reward_funcs=[domain_reward(domain, r.reward_kwargs)], args=args,
                          train_dataset=train_ds.remove_columns(drop), processing_class=tok,
                          callbacks=[_MlflowLogger()])
    trainer.train()
    return trainer.model


def score(cfg: ExpertConfig, domain: Domain, model_path: str) -> float:
    kw = dict(n=cfg.data.n_test, seed=cfg.data.seed, difficulty=cfg.data.difficulty,
              max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size, **cfg.rl.reward_kwargs)
    if cfg.effort:
        kw["effort"] = cfg.effort
    if cfg.data.dataset != "procedural":
        kw["dataset"] = cfg.data.dataset
    res = domain.evals.evaluate(model_path, **kw)
    return float(res["score"] if isinstance(res, dict) else res)


def _start_mlflow(cfg: ExpertConfig, out: Path):
    import mlflow

    from mopd.tracking import experiment_id, resolve_uri

    exp_id = experiment_id(cfg.mlflow.experiment, resolve_uri(cfg.mlflow.tracking_uri, out))
    parent = os.environ.get("MOPD_PARENT_RUN_ID")
    name = cfg.mlflow.run_name or f"{registered_name(cfg.domain, cfg.effort)}-{cfg.stage}"
    tags = {**cfg.mlflow.tags, "domain": cfg.domain, "stage": cfg.stage, "effort": cfg.effort or ""}
    return mlflow, mlflow.start_run(experiment_id=exp_id, run_name=name, tags=tags,
                                    nested=bool(parent), parent_run_id=parent or None)


def register(mlflow, run_id: str, name: str) -> str:
    """Register DIR/model (logged as the run's `model` artifacts) and point `@teacher` at it."""
    client = mlflow.MlflowClient()
    try:
        client.create_registered_model(name)
    except Exception as e:  # already there: a new version of the same expert
        if "already exists" not in str(e).lower() and "RESOURCE_ALREADY_EXISTS" not in str(e):
            raise
    mv = client.create_model_version(name, source=f"runs:/{run_id}/model", run_id=run_id)
    client.set_registered_model_alias(name, "teacher", mv.version)
    return f"models:/{name}@teacher"


# ----------------------------------------------------------------------------- entry point
def run_expert(cfg: ExpertConfig, out: str | Path) -> dict:
    import torch
    from accelerate import PartialState

    from mopd.config import dump_yaml, flatten
    from mopd.train import export_model

    out = Path(out)
    domain = check(cfg, out)
    state = PartialState()
    out.mkdir(parents=True, exist_ok=True)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    t0 = time.perf_counter()
    train_ds = build_dataset(cfg, domain, "train", cfg.data.n_train)
    model, tok = load_model(cfg)

    mlflow = run = None
    if state.is_main_process:
        mlflow, run = _start_mlflow(cfg, out)
        mlflow.log_params({k: str(v)[:500] for k, v in flatten(asdict(cfg)).items()})
        (out / "config.yaml").write_text(dump_yaml(cfg))
        mlflow.log_artifact(str(out / "config.yaml"))
    _say(f"{cfg.domain}{'/' + cfg.effort if cfg.effort else ''} {cfg.stage}: {cfg.train.max_steps} steps "
         f"from {cfg.model.path} ({len(train_ds)} training rows)")
    try:
        if cfg.stage == "sft":
            model = train_sft(cfg, model, tok, train_ds, out)
        else:
            model = train_rl(cfg, domain, model, tok, train_ds, out)
        train_s = time.perf_counter() - t0
        if not state.is_main_process:
            return {}
        model_dir = out / "model"
        shutil.rmtree(model_dir, ignore_errors=True)
        export_model(model, tok, model_dir)
        shutil.rmtree(out / "trainer", ignore_errors=True)
        del model

        s = s_base = None
        if cfg.eval.score:
            _say("scoring on the held-out split")
            s = score(cfg, domain, str(model_dir))
            base_ref = cfg.model.base or (cfg.model.path if cfg.stage == "sft" else "")
            s_base = score(cfg, domain, _resolve(base_ref)) if (base_ref and cfg.eval.score_base) else None
        if cfg.stage == "sft":
            s_sft = s
        else:
            prev = Path(_resolve(cfg.model.path)).parent / "summary.json"
            s_sft = json.loads(prev.read_text()).get("score") if prev.exists() else None
            if s_sft is None and cfg.eval.score:  # the SFT stage did not score itself
                s_sft = score(cfg, domain, _resolve(cfg.model.path))
        mlflow.log_metrics({k: v for k, v in {"score": s, "score_base": s_base, "score_sft": s_sft,
                                              "train_seconds": train_s}.items() if v is not None})
        mlflow.log_artifacts(str(model_dir), "model")
        uri = None
        if cfg.mlflow.register:
            uri = register(mlflow, run.info.run_id, cfg.mlflow.registered_name or registered_name(cfg.domain, cfg.effort))
        summary = {"domain": cfg.domain, "effort": cfg.effort, "stage": cfg.stage, "score_base": s_base,
                   "score_sft": s_sft, "score": s, "checkpoint": str(model_dir.resolve()), "model_uri": uri,
                   "train_seconds": round(train_s, 1), "mlflow_run_id": run.info.run_id,
                   "tracking_uri": mlflow.get_tracking_uri()}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        mlflow.log_artifact(str(out / "summary.json"))
        _print(summary)
        return summary
    finally:
        if mlflow is not None:
            mlflow.end_run()


def _say(msg: str):
    print(f"[expert] {msg}", file=sys.stderr, flush=True)


def _print(s: dict):
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    _say(f"{s['domain']}{'/' + s['effort'] if s['effort'] else ''} {s['stage']}: base {fmt(s['score_base'])}"
         f"  sft {fmt(s['score_sft'])}  now {fmt(s['score'])}  -> {s['checkpoint']}"
         + (f"  registered {s['model_uri']}" if s["model_uri"] else ""))


def main(argv: list[str] | None = None):
    from mopd.config import ConfigError, load_config

    p = argparse.ArgumentParser(prog="mopd expert", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    a = p.parse_args(argv)
    try:
        cfg = load_config(ExpertConfig, a.config, a.overrides)
        run_expert(cfg, a.out)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
