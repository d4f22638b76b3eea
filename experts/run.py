"""Training of one stage of a domain expert, with TRL, and its registration in MLflow.

    sft: TRL SFTTrainer on the domain's reference completions, from the base
    rl:  TRL GRPOTrainer with the domain's reward, from the SFT checkpoint

The entry point is `mopd expert --config recipes/experts/<domain>/{sft,rl}.yaml --out DIR`
(pipeline/expert.py, also `accelerate launch -m pipeline.expert ...`): it scores the
checkpoints with the domain's held-out suite (evals/<domain>.py), which this module does
not import. Here, in the order the entry point calls them: ExpertConfig, `check` (the
domain's pieces exist, before any model is loaded), `build_dataset`, `load_model` (LoRA,
QAT), `start_mlflow` and `log_config`, `train` (SFT or GRPO, then DIR/model),
`register`. A domain whose training needs its own loop (an environment, multi-turn
tools) names its trainer in its Domain object (`trainer`, or its data module's
`TRAINER`: an object with `train_sft` and `train_rl`, e.g. experts/agent_expert.py's
AgentExpert), which `train` calls instead of TRL's trainers; nothing is copied and no
flag is added here.

The domain is a core.domain.Domain found by experts/registry.py (the `mopd.domains` entry
points: built-in or a team's package, docs/experts.md); its pieces:
    data      module with make_dataset(split, n, seed, difficulty[, effort])
    reward    reward(prompts, completions, **columns)
"""
from __future__ import annotations

import functools
import inspect
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import mlflow
import torch

from experts import registry
from experts.files import load_rows
from core.agent.partial import AgentRLPartial
from core import ranks
from core.config import dump_yaml, flatten, in_range, option
from core.dryrun import DryRun, check_accelerate_config, describe_quant
from mopd.distill.config import LoraConfig
from core.export import export_model
from core.hf_dirs import hf_dir_problem
from core.models import disable_dropout
from core.quant import QuantConfig, apply_qat, quantize_once_per_generation
from core.tracking import resolve_uri, start_run, trainer_callback

REPO = Path(__file__).resolve().parents[1]




# ----------------------------------------------------------------------------- config
@dataclass
class ExpertModel:
    path: str = option("HF directory or models:/ URI: the stage's starting point (the base for sft, "
                      "the SFT checkpoint for rl)", "")
    base: str = option("the common base, scored for score_base (\"\": model.path)", "")
    dtype: str = option("float32, bfloat16 or float16 for the trained model", "float32")
    lora: LoraConfig = option("optional LoRA adapter (merged into the saved checkpoint)", factory=LoraConfig)
    keep_adapter: bool = option("with lora.enabled: also save the adapter alone (DIR/adapter) and register it "
                                "on its base (version tags base, adapter) instead of the merged DIR/model, so "
                                "MOPD serves several experts on one base from one engine (teachers.lora). "
                                "model.path may itself be such an adapter (the SFT stage's): training goes on in "
                                "it, on the same base", False)


@dataclass
class ExpertData:
    dataset: str = option("\"procedural\" (the domain's make_dataset), a name in its data.DATASETS, or \"files\" "
                         "(training rows from data.files; experts/files.py; the held-out score stays the domain's "
                         "procedural suite)", "procedural")
    files: dict[str, str] = option("with dataset files: a JSONL, JSON, parquet or CSV file or a save_to_disk folder "
                                   "per split, e.g. {train: /data/math.jsonl} (train: the rows trained on, and the "
                                   "pipeline's MOPD prompts)", factory=dict)
    columns: dict[str, str] = option("with dataset files: the domain's column name -> the file's, e.g. "
                                     "{prompt: question, answer: solution}", factory=dict)
    n_train: int = option("procedural training rows", 2000)
    n_test: int = option("held-out rows scored at the end", 200)
    seed: int = option("seed of the procedural rows (train and held-out)", 0)
    difficulty: int = option("difficulty passed to make_dataset and to the held-out suite", 1)

    def validate(self):
        in_range("data.n_train", self.n_train, 1)
        in_range("data.n_test", self.n_test, 1)
        if self.dataset == "files" and "train" not in self.files:
            raise ValueError("data.dataset=files needs data.files.train (a JSONL/parquet file or a saved dataset)")
        if self.dataset != "files" and (self.files or self.columns):
            raise ValueError(f"data.files / data.columns are read with data.dataset=files only (it is "
                             f"{self.dataset!r}): set data.dataset=files or drop them")


@dataclass
class ExpertTrain:
    max_steps: int = option("optimizer steps", 100)
    lr: float = option("peak learning rate", 1e-4)
    batch_size: int = option("sft: rows per step; rl: prompts per step", 16)
    grad_accum: int = option("gradient accumulation steps per optimizer step", 1)
    warmup_steps: int = option("linear warm-up steps to the peak learning rate", 0)
    lr_schedule: Literal["constant", "cosine", "linear"] = option("learning-rate schedule after warm-up",
                                                                   "constant")
    weight_decay: float = option("AdamW weight decay", 0.0)
    grad_clip: float = option("max gradient norm", 1.0)
    max_length: int = option("sft: longer rows are truncated to this many tokens", 512)
    seed: int = option("seed of the trainer (init of new weights, data order, sampling)", 0)
    logging_steps: int = option("log the trainer's metrics to MLflow every this many steps", 10)
    num_threads: int = option("torch intra-op threads (0: leave torch's default)", 0)
    precision: Literal["fp32", "bf16"] = option(
        "sft stages: fp32, or bf16 autocast of forward and backward (fp32 weights and AdamW state), "
        "about 1.5x faster per step on CPUs with AVX-512 bf16 / AMX. Not for rl stages: under QAT the "
        "trainer's matmuls would round the fake-quantized weights to bf16 and its sampler would not", "fp32")

    def validate(self):
        if self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        in_range("train.lr", self.lr, 0, low_open=True)
        for k in ("batch_size", "grad_accum", "max_length", "logging_steps"):
            in_range(f"train.{k}", getattr(self, k), 1)
        for k in ("warmup_steps", "weight_decay", "grad_clip", "num_threads"):
            in_range(f"train.{k}", getattr(self, k), 0)


@dataclass
class ExpertRL:
    num_generations: int = option("completions per prompt (the GRPO group)", 8)
    max_completion_length: int = option("max new tokens per sampled completion", 64)
    temperature: float = option("sampling temperature of the completions", 1.0)
    beta: float = option("KL to the starting model (0: no reference model kept)", 0.0)
    epsilon: float = option("PPO-style clipping range of the importance ratio", 0.2)
    loss_type: str = option("TRL GRPO loss_type (dapo, grpo, dr_grpo, ...)", "dapo")
    scale_rewards: str = option("TRL GRPO scale_rewards: group, batch or none", "group")
    use_vllm: bool = option("sample with TRL's colocated vLLM (false: HF generate with the policy's own "
                           "forward, the CPU default)", False)
    reward_kwargs: dict[str, str] = option("keyword settings of the domain's reward, also passed to its "
                                          "held-out suite (e.g. reward_model for chat)", factory=dict)

    def validate(self):
        in_range("rl.num_generations", self.num_generations, 1)
        in_range("rl.max_completion_length", self.max_completion_length, 1)
        in_range("rl.temperature", self.temperature, 0)
        in_range("rl.beta", self.beta, 0)
        in_range("rl.epsilon", self.epsilon, 0, low_open=True)


@dataclass
class ExpertAgent:
    harnesses: str = option("agent domains: the harness-mix YAML (train harnesses, weights, held-out "
                           "harness) episodes draw their harness from", "recipes/harnesses/agent.yaml")
    max_turns: int = option("agent domains: assistant turns per episode", 24)
    max_context_tokens: int = option("agent domains: an episode whose next turn could pass this many tokens "
                                    "is cut (and fails)", 1024)
    max_new_tokens: int = option("agent domains: new tokens per assistant turn", 48)
    perturb: float = option("agent sft: share of oracle episodes with a wrong call injected, its error "
                           "observation, then the oracle's recovery", 0.0)
    env: str = option("agent domains: 'module:function' building the episodes' environment in every stage "
                      "(the SFT's scripted episodes, the held-out eval, RL), as a MOPD recipe's "
                      "agents.<domain>.env; e.g. rewards.frontend_loop:make_screenshot_env for a "
                      "vision-language model (screenshots as image observations). \"\": the domain's default. "
                      "Only a domain whose trainer takes it (frontend_loop); others refuse it", "")
    partial: AgentRLPartial = option("agent rl: partial rollouts (off by default): a step trains the GRPO groups "
                                     "that ended and carries the others over (core/agent/grpo.py)",
                                     factory=AgentRLPartial)

    def validate(self):
        if not 0.0 <= self.perturb <= 1.0:
            raise ValueError(f"agent.perturb must lie in [0, 1], got {self.perturb}")
        if self.max_turns < 1 or self.max_new_tokens < 1 or self.max_context_tokens < 2:
            raise ValueError("agent.max_turns, agent.max_new_tokens must be >= 1 and max_context_tokens >= 2")


@dataclass
class ExpertEval:
    max_new_tokens: int = option("greedy new tokens per held-out row", 64)
    batch_size: int = option("held-out rows generated at once", 64)
    score_base: bool = option("also score the common base (model.base) for score_base", True)
    score: bool = option("score the trained checkpoint on the held-out split; false leaves it to the RL "
                        "stage (for a domain whose scorer is trained from this very SFT checkpoint, "
                        "the pipeline's chat RM)", True)

    def validate(self):
        in_range("eval.max_new_tokens", self.max_new_tokens, 1)
        in_range("eval.batch_size", self.batch_size, 1)


@dataclass
class ExpertMlflow:
    experiment: str = option("MLflow experiment name", "mopd-experts")
    tracking_uri: str | None = option("default: $MLFLOW_TRACKING_URI, else sqlite:///<out>/mlflow.db", None)
    run_name: str | None = option("default: <registered name>-<stage>", None)
    tags: dict[str, str] = option("extra run tags (domain, stage and effort are always set)", factory=dict)
    register: bool = option("register DIR/model (with model.keep_adapter: DIR/adapter, tagged with its base) as "
                            "<domain>[-<effort>]-expert and point @teacher at it", False)
    registered_name: str | None = option("registered model name (default: <domain>[-<effort>]-expert)", None)
    parent_run_id: str | None = option("nest the run under this MLflow run (the pipeline sets it)", None)


@dataclass
class ExpertConfig:
    domain: str = option("the domain: a registered name (`mopd domains list`) or a 'module:attribute' path "
                         "to a core.domain.Domain", "")
    stage: Literal["sft", "rl"] = option("sft (SFTTrainer on references) or rl (GRPOTrainer with the reward)",
                                        "sft")
    effort: str | None = option("reasoning effort, required for a domain with efforts (math: low, high)", None)
    model: ExpertModel = option("starting checkpoint, base and adapter", factory=ExpertModel)
    data: ExpertData = option("training and held-out rows", factory=ExpertData)
    train: ExpertTrain = option("optimizer and schedule (both stages)", factory=ExpertTrain)
    rl: ExpertRL = option("GRPO settings (stage rl) and the reward's settings", factory=ExpertRL)
    eval: ExpertEval = option("held-out scoring", factory=ExpertEval)
    mlflow: ExpertMlflow = option("run logging and teacher registration", factory=ExpertMlflow)
    quant: QuantConfig = option("quantization-aware training (fake-quantized forward)", factory=QuantConfig)
    agent: ExpertAgent = option("episodes of agent domains (harnesses, turns, context); other domains ignore it",
                                factory=ExpertAgent)

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
        if self.stage == "rl" and self.train.precision != "fp32":
            raise ValueError(f"train.precision={self.train.precision} is for sft stages: an rl stage samples with "
                             f"fp32 weights, and its trainer must compute what its sampler does; use "
                             f"train.precision=fp32")
        if self.model.keep_adapter and not self.model.lora.enabled:
            raise ValueError("model.keep_adapter=true needs model.lora.enabled=true (there is no adapter to keep)")
        if self.model.keep_adapter and self.quant.enabled:
            # QAT trains fake_quant(W + B @ A): no full-precision base plus adapter computes that
            raise ValueError("model.keep_adapter=true with quant.enabled=true: a QAT-trained LoRA model is "
                             "fake_quant(W + B @ A), which base + adapter cannot express; set quant.enabled=false "
                             "or keep_adapter=false (the merged, fake-quantized checkpoint)")


def registered_name(domain: str, effort: str | None) -> str:
    from teachers.registry import teacher_name   # one naming rule for `mopd expert` and `mopd teachers register`

    return teacher_name(domain, effort)


# ----------------------------------------------------------------------------- domain pieces
def domain_reward(domain: registry.LoadedDomain, reward_kwargs: dict):
    """The domain's reward with the recipe's settings bound, named for TRL's logs."""
    fn = domain.reward
    if reward_kwargs:
        # Only named parameters count: **columns takes dataset columns and would swallow a
        # misspelt setting silently.
        params = {n for n, p in inspect.signature(fn).parameters.items()
                  if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        unknown = [k for k in reward_kwargs if k not in params]
        if unknown:
            where = domain.spec.reward if domain.spec else f"{domain.name}'s reward"
            raise ValueError(f"rl.reward_kwargs: {unknown} are not parameters of {where}")
        fn = functools.partial(fn, **reward_kwargs)
    wrapped = functools.wraps(domain.reward)(lambda *a, **k: fn(*a, **k))
    wrapped.__name__ = f"{domain.name}_reward"
    return wrapped


def build_dataset(cfg: ExpertConfig, domain: registry.LoadedDomain, split: str, n: int):
    data = domain.data
    if cfg.data.dataset == "procedural":
        kw = {"effort": cfg.effort} if cfg.effort else {}
        return data.make_dataset(split, n, seed=cfg.data.seed, difficulty=cfg.data.difficulty, **kw)
    if cfg.data.dataset == "files":
        return load_rows(cfg.data.files, cfg.data.columns, split, domain=domain.name, effort=cfg.effort,
                         stage=cfg.stage, data_module=data, n=n)
    loaders = getattr(data, "DATASETS", {})
    if cfg.data.dataset not in loaders:
        raise ValueError(f"data.dataset={cfg.data.dataset!r}: {data.__name__} ({domain.name}) offers "
                         f"'procedural' and {sorted(loaders)}")
    return loaders[cfg.data.dataset]()


def check(cfg: ExpertConfig, out: Path | None, dry: DryRun | None = None) -> registry.LoadedDomain | None:
    """Everything that can be wrong before any model is loaded (the held-out suite is the
    entry point's to check), every problem at once: recorded in `dry` (`mopd expert
    --dry-run`), else raised together (one ConfigError) and the domain returned."""
    own = dry is None
    dry = DryRun("mopd expert") if own else dry
    domain = dry.check(registry.load_domain, cfg.domain)
    if domain is not None:
        dry.check(_check_effort, cfg, domain)
    for what, ref in (("model.path", cfg.model.path), ("model.base", cfg.model.base)):
        if ref:
            dry.check(_check_model_ref, cfg, what, ref, out)
    if cfg.data.dataset == "files":
        for split, f in sorted(cfg.data.files.items()):
            if not Path(f).expanduser().exists():
                dry.problem(f"data.files.{split}: {f!r} does not exist")
    if domain is not None and cfg.agent.env:
        dry.check(_check_agent_env, cfg, out)
    if domain is not None and registry.is_agent_domain(cfg.domain) and not Path(cfg.agent.harnesses).exists() \
            and not (REPO / cfg.agent.harnesses).exists():
        dry.problem(f"agent.harnesses: {cfg.agent.harnesses!r} does not exist (the harness-mix YAML)")
    # Both stages score with the reward (the held-out eval), so what it needs (a working
    # sandbox, a browser) is checked here, before any model loads.
    preflight = getattr(domain.reward, "preflight", None) if domain is not None else None
    if callable(preflight):
        dry.check(preflight, **(cfg.rl.reward_kwargs if cfg.stage == "rl" else {}))
    if cfg.stage == "rl":
        if domain is not None:
            dry.check(domain_reward, domain, cfg.rl.reward_kwargs)
        if cfg.train.batch_size * cfg.rl.num_generations < 2 or cfg.rl.num_generations < 2:
            dry.problem("rl.num_generations must be >= 2 (GRPO compares completions within a group)")
    if out is not None and (Path(out) / "summary.json").exists():
        dry.problem(f"{out} already holds a finished expert stage (summary.json); choose another --out or delete it")
    if own:
        dry.raise_if_any()
    return domain


def _check_agent_env(cfg: ExpertConfig, out: Path | None) -> None:
    """agent.env, before any model loads: the domain's trainer takes it, the factory imports,
    and it suits the model (its `preflight`: screenshots need a vision-language model); the
    RL stage's episodes carry no images yet, so an image environment there is refused."""
    from mopd.distill.agents import _import_factory   # the MOPD loop's reading of agents.<d>.env

    trainer = registry.domain_trainer(cfg.domain) if registry.is_agent_domain(cfg.domain) else None
    if not getattr(trainer, "takes_env", False):
        raise ValueError(f"agent.env={cfg.agent.env!r}: the {cfg.domain} expert's stages build their own environment "
                         f"and cannot take another (only frontend_loop's do); leave agent.env empty")
    factory = _import_factory(cfg.agent.env, "agent.env")
    if cfg.stage == "rl" and getattr(factory, "observes_images", False):
        raise ValueError(f"agent.env={cfg.agent.env!r} puts images in the episodes, but the rl stage's episodes "
                         f"(core/agent/grpo.py) pass no images to the model yet; train it with stage sft, or use "
                         f"an environment with text observations (rewards.frontend_loop:make_env) for rl")
    preflight = getattr(factory, "preflight", None)
    if callable(preflight):
        try:
            path = _check_model_ref(cfg, "model.path", cfg.model.path, out)
        except ValueError:   # model.path's own problem, named by check
            return
        try:
            preflight(model_path=path)
        except ValueError as e:
            raise ValueError(f"agent.env={cfg.agent.env!r}: {e}; or leave agent.env empty (the domain's default: "
                             f"the render report)") from None


def _check_effort(cfg: ExpertConfig, domain: registry.LoadedDomain) -> None:
    efforts = tuple(getattr(domain.data, "EFFORTS", ()) or ())
    if efforts and cfg.effort not in efforts:
        raise ValueError(f"domain {cfg.domain!r} has efforts {list(efforts)}: set effort to one of them "
                         f"(got {cfg.effort!r})")
    if not efforts and cfg.effort:
        raise ValueError(f"domain {cfg.domain!r} has no efforts, but effort={cfg.effort!r}")


def _check_model_ref(cfg: ExpertConfig, what: str, ref: str, out: Path | None) -> str:
    """The local folder of model.path / model.base (a models:/ URI looked up in the run's
    store, the one start_mlflow opens), with config.json and a tokenizer (training and its
    evals need both)."""
    if ref.startswith(("models:/", "runs:/")):
        from teachers.resolve import resolve_ref   # see resolve_model

        uri = resolve_uri(cfg.mlflow.tracking_uri, out) if out is not None else cfg.mlflow.tracking_uri
        path = str(resolve_ref(ref, tracking_uri=uri, what=what))
    else:
        path = ref
    if not (Path(path) / "config.json").exists():
        raise ValueError(f"{what}={ref!r} is not an HF checkpoint directory "
                         + ("(does not exist)" if not Path(path).exists() else "(no config.json)")
                         + (" - run the sft stage first" if cfg.stage == "rl" and what == "model.path" else ""))
    no_tokenizer = hf_dir_problem(path)
    if no_tokenizer:
        raise ValueError(f"{what}: {no_tokenizer}")
    return path


def dry_run(cfg: ExpertConfig, out: Path | None, dry: DryRun, *, accelerate_config: str = "") -> None:
    """`mopd expert --dry-run`: `check`'s problems, the accelerate config's, and what would run."""
    check(cfg, out, dry)
    try:   # a models:/ start shown as the folder it resolves to (its problem is check's to name)
        path = resolve_model(cfg.model.path)
    except ValueError:
        path = cfg.model.path
    dry.show("expert", f"{cfg.domain}{'/' + cfg.effort if cfg.effort else ''} {cfg.stage}")
    dry.show("model", f"{path}  [{cfg.model.dtype}, quant {describe_quant(cfg.quant)}, "
             f"lora {'r=%d' % cfg.model.lora.r if cfg.model.lora.enabled else 'off'}]")
    if cfg.model.base:
        dry.show("base", cfg.model.base)
    dry.show("data", f"{cfg.data.dataset}, {cfg.data.n_train} training rows, {cfg.data.n_test} held out")
    world = check_accelerate_config(accelerate_config, dry)
    dry.show("steps", f"{cfg.train.max_steps} (train.max_steps), {cfg.train.batch_size} "
             f"{'rows' if cfg.stage == 'sft' else 'prompts'} x {cfg.train.grad_accum} accumulation per process"
             + (f", {world} processes" if world > 1 else ""))
    if out is not None:
        dry.show("out", str(out))


# ----------------------------------------------------------------------------- pieces
def resolve_model(ref: str) -> str:
    """A local HF folder for a path or an MLflow URI (models:/..., runs:/...)."""
    if ref.startswith(("models:/", "runs:/")):
        # the teachers package loads its scoring backends (transformers, vLLM) on import:
        # only for an MLflow URI
        from teachers.resolve import resolve_ref

        return str(resolve_ref(ref, what="model"))
    return ref


def adapter_base(ref: str) -> str:
    """The local base folder of a LoRA adapter reference (teachers.resolve.resolve_teacher:
    the registry's `base` tag, else the adapter's base_model_name_or_path)."""
    from teachers.resolve import resolve_teacher

    return str(resolve_teacher(ref))


def lora_base_ref(cfg: ExpertConfig) -> str:
    """The base a kept adapter is on, as recorded in the registry: model.path, or, when
    model.path is itself an adapter (the SFT stage's), that adapter's base."""
    import json

    path = Path(resolve_model(cfg.model.path))
    if (path / "adapter_config.json").exists() and not (path / "config.json").exists():
        from teachers.resolve import registered_tags

        ref = registered_tags(cfg.model.path, mlflow.get_tracking_uri()).get("base") or \
            json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    else:
        ref = cfg.model.path
    return ref if ref.startswith(("models:/", "runs:/")) else str(Path(ref).resolve())


def load_model(cfg: ExpertConfig):
    # transformers/peft load in seconds: imported when a model is loaded, not with
    # ExpertConfig (recipe loading, the eval columns and the pipeline's plan import this
    # module for it alone).
    from transformers import AutoTokenizer

    from core.vision import load_model as load_checkpoint   # a vision-language checkpoint gets its own class

    path = resolve_model(cfg.model.path)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    adapter = None
    if (Path(path) / "adapter_config.json").exists() and not (Path(path) / "config.json").exists():
        if not (cfg.model.lora.enabled and cfg.model.keep_adapter):
            raise ValueError(f"model.path {cfg.model.path} is a LoRA adapter: training on in it needs "
                             f"model.lora.enabled=true and model.keep_adapter=true")
        adapter, path = path, adapter_base(cfg.model.path)
    model = load_checkpoint(path, dtype)
    tok = AutoTokenizer.from_pretrained(path)
    if adapter is not None:
        from peft import PeftModel  # only with LoRA (see above)

        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    elif cfg.model.lora.enabled:
        from peft import LoraConfig as PeftLora, get_peft_model  # only with LoRA (see above)

        lc = cfg.model.lora
        model = get_peft_model(model, PeftLora(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                               target_modules=lc.target_modules, task_type="CAUSAL_LM"))
    if cfg.quant.enabled:
        apply_qat(model, cfg.quant)
    return model, tok


def train_args_common(cfg: ExpertConfig, out: Path) -> dict:
    t = cfg.train
    return dict(output_dir=str(out / "trainer"), max_steps=t.max_steps, learning_rate=t.lr,
                gradient_accumulation_steps=t.grad_accum, warmup_steps=t.warmup_steps,
                lr_scheduler_type=t.lr_schedule, weight_decay=t.weight_decay, max_grad_norm=t.grad_clip,
                seed=t.seed, data_seed=t.seed, logging_steps=t.logging_steps, save_strategy="no",
                report_to="none", use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False,
                dataloader_num_workers=0, disable_tqdm=False)


def train_sft(cfg: ExpertConfig, model, tok, train_ds, out: Path):
    """TRL's SFTTrainer (with the LM head on completion positions only: experts/completion_sft.py)
    on the rows' prompt -> completion; returns the trained model."""
    from trl import SFTConfig  # trl loads in seconds: only when training starts

    from experts.completion_sft import completion_sft_trainer

    args = SFTConfig(**train_args_common(cfg, out),
                     per_device_train_batch_size=ranks.per_rank(cfg.train.batch_size, "train.batch_size"),
                     max_length=cfg.train.max_length, completion_only_loss=True, packing=False)
    ds = train_ds.select_columns(["prompt", "completion"])
    trainer = completion_sft_trainer(autocast_bf16=cfg.train.precision == "bf16")(
        model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[trainer_callback()])
    trainer.train()
    return trainer.model


def train_rl(cfg: ExpertConfig, domain: registry.LoadedDomain, model, tok, train_ds, out: Path):
    """TRL GRPOTrainer with the domain's reward; returns the trained model."""
    from trl import GRPOConfig, GRPOTrainer  # trl loads in seconds: only when training starts

    r = cfg.rl
    args = GRPOConfig(**train_args_common(cfg, out),
                      per_device_train_batch_size=ranks.per_rank(cfg.train.batch_size * r.num_generations,
                                                                 "train.batch_size x rl.num_generations"),
                      num_generations=r.num_generations, max_completion_length=r.max_completion_length,
                      temperature=r.temperature, beta=r.beta, epsilon=r.epsilon, loss_type=r.loss_type,
                      scale_rewards=r.scale_rewards, use_vllm=r.use_vllm,
                      vllm_mode="colocate", log_completions=False, shuffle_dataset=True)
    drop = [c for c in ("completion",) if c in train_ds.column_names]
    trainer = quantize_once_per_generation(GRPOTrainer)(
        model=model, reward_funcs=[domain_reward(domain, r.reward_kwargs)], args=args,
        train_dataset=train_ds.remove_columns(drop), processing_class=tok, callbacks=[trainer_callback()])
    trainer.train()
    return trainer.model


def train(cfg: ExpertConfig, domain: registry.LoadedDomain, model, tok, train_ds, out: Path, *,
          is_main_process: bool = True) -> Path | None:
    """The stage's training (train_sft or train_rl), then, on the main process, the
    trained model as a plain HF checkpoint in out/model (LoRA merged, QAT weights
    fake-quantized). Returns out/model on the main process, None on the others."""
    own = registry.domain_trainer(cfg.domain)  # an agent domain: its own loop (experts/agent_expert.py)
    if cfg.stage == "rl":   # GRPO's ratios and KL compare log-probs with the sampler's: no dropout (issue 44)
        disable_dropout(model)
    if cfg.stage == "sft":
        model = (own.train_sft if own else train_sft)(cfg, model, tok, train_ds, out)
    else:
        model = (own.train_rl if own else train_rl)(cfg, domain, model, tok, train_ds, out)
    if not is_main_process:
        return None
    model_dir = out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    # TRL's trainers turn on an MoE's output_router_logits (for their aux loss) in the
    # config: saved, it would make every later generate() compute a router loss that
    # breaks in cached decoding. The expert is saved as the architecture's default has it.
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text_config, "output_router_logits", False):
        text_config.output_router_logits = False
    # transformers' Trainer writes TrainingArguments.use_cache (False) into the config: saved,
    # every later HF generate() from this expert would run without a KV cache, and its config
    # would differ from an agent expert's (weight averaging compares them).
    if hasattr(text_config, "use_cache"):
        text_config.use_cache = True
    if cfg.model.keep_adapter:   # before export, which reads the (unmerged) peft model
        shutil.rmtree(out / "adapter", ignore_errors=True)
        model.save_pretrained(str(out / "adapter"))
        tok.save_pretrained(str(out / "adapter"))
    export_model(model, tok, model_dir, source=resolve_model(cfg.model.path))
    shutil.rmtree(out / "trainer", ignore_errors=True)
    return model_dir


# ----------------------------------------------------------------------------- MLflow
def start_mlflow(cfg: ExpertConfig, out: Path):
    """Start the stage's MLflow run (nested under mlflow.parent_run_id when set)."""
    name = cfg.mlflow.run_name or f"{registered_name(cfg.domain, cfg.effort)}-{cfg.stage}"
    tags = {**cfg.mlflow.tags, "domain": cfg.domain, "stage": cfg.stage, "effort": cfg.effort or ""}
    return start_run(experiment=cfg.mlflow.experiment, uri=resolve_uri(cfg.mlflow.tracking_uri, out),
                     run_name=name, tags=tags, parent_run_id=cfg.mlflow.parent_run_id)


def log_config(cfg: ExpertConfig, out: Path):
    """The config as the active run's params and as out/config.yaml (also an artifact)."""
    mlflow.log_params({k: str(v)[:500] for k, v in flatten(asdict(cfg)).items()})
    (out / "config.yaml").write_text(dump_yaml(cfg))
    mlflow.log_artifact(str(out / "config.yaml"))


def register(run_id: str, name: str, tags: dict[str, str] | None = None, artifact: str = "model",
             model_uri: str | None = None) -> str:
    """Register the run's model (`model_uri`: the model it logged with MLflow's transformers
    flavor, models:/m-...; else its plain-file `<artifact>` artifacts: `model`, or a LoRA
    expert's `adapter` with tags base and adapter) and point `@teacher` at it."""
    import getpass

    from teachers.registry import register_version

    source = model_uri or f"runs:/{run_id}/{artifact}"
    register_version(mlflow.MlflowClient(), name, source=source, run_id=run_id,
                     model_id=model_uri.split("/")[-1] if model_uri else None,
                     tags={"source": f"runs:/{run_id}/{artifact}", "registered_by": getpass.getuser(), **(tags or {})})
    return f"models:/{name}@teacher"


def say(msg: str):
    print(f"[expert] {msg}", file=sys.stderr, flush=True)
