"""`mopd pipeline`'s config (recipes/pipeline/*.yaml): which domains, which recipes each
stage starts from, and the few settings the pipeline itself owns; and `mopd toy`'s.
Every field carries its help text (`metadata["help"]`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.config import in_range, option




@dataclass
class BaseSection:
    path: str = option(
        "a checkpoint to start from instead of training the tiny base: a local Hugging Face causal-LM folder "
        "(config.json, weights, a tokenizer with a chat template) or a models:/ reference. Every expert and the "
        "student are then this architecture, with its tokenizer and chat template; base.recipe is unused and "
        "base.overrides must be empty. '': train the tiny base from base.recipe", "")
    recipe: str = option("the common base's BaseConfig recipe (when base.path is empty)", "recipes/base/tiny.yaml")
    overrides: list[str] = option("key=value overrides for that BaseConfig", factory=list)


@dataclass
class StageOverrides:
    sft: list[str] = option("key=value overrides for the SFT ExpertConfig", factory=list)
    rl: list[str] = option("key=value overrides for the RL ExpertConfig", factory=list)


@dataclass
class ChatRMSection:
    """experts/chat/train_rm.py settings (only when chat is one of the domains)."""
    steps: int = option("reward-model training steps", 300)
    n_pairs: int = option("preference pairs to train on", 4000)
    n_heldout: int = option("held-out pairs its pairwise accuracy is measured on", 400)
    lr: float = option("learning rate", 1e-3)
    batch_size: int = option("pairs per step", 32)
    seed: int = option("seed of its data and initialization", 0)
    init: Literal["sft", "base", "random"] = option(
        "where the reward model's body starts: 'sft' (the chat expert's SFT checkpoint, as InstructGPT "
        "does: it already reads the chat format, and tells on-topic from off-topic answers far better, "
        "0.97 vs 0.67 held-out pairwise accuracy on off-topic pairs in our runs), 'base', or 'random'",
        "sft")

    def validate(self):
        for k in ("steps", "n_pairs", "n_heldout", "batch_size"):
            in_range(f"experts.chat_rm.{k}", getattr(self, k), 1)
        in_range("experts.chat_rm.lr", self.lr, 0, low_open=True)


@dataclass
class ExpertsSection:
    recipes: str = option("folder of expert recipes, <domain>/{sft,rl}[-<effort>].yaml", "recipes/experts")
    sft: list[str] = option("key=value overrides for every domain's SFT recipe", factory=list)
    rl: list[str] = option("key=value overrides for every domain's RL recipe", factory=list)
    domains: dict[str, StageOverrides] = option(
        "overrides per 'domain' or 'domain/effort', applied after the above (domain before domain/effort)",
        factory=dict)
    chat_rm: ChatRMSection = option("the chat reward model's training", factory=ChatRMSection)


@dataclass
class MopdSection:
    recipe: str = option("the MOPD stage's DistillConfig recipe", "recipes/mopd/pipeline.yaml")
    student: str = option(
        "the student's starting checkpoint: a local Hugging Face causal-LM folder or a models:/ reference, "
        "with the base's tokenizer and chat template (checked at plan time); the seq-KD and Mix-RL baselines "
        "start from it too. '': the base, as every expert", "")
    overrides: list[str] = option("key=value overrides for that DistillConfig", factory=list)
    n_prompts: int = option("train prompts per teacher key saved under DIR/data", 1000)

    def validate(self):
        if self.n_prompts < 1:
            raise ValueError("n_prompts must be >= 1")


@dataclass
class SeqKDSection:
    enabled: bool = option("train the sequence-level KD baseline", True)
    temperature: float = option("temperature of the teachers' answers: 0 = greedy, else sampled", 0.0)
    max_new_tokens: int = option("answer length; 0: the MOPD recipe's rollout.max_new_tokens", 0)
    lr: float = option("learning rate", 1e-3)
    batch_size: int = option("rows per optimizer step", 32)
    warmup_steps: int = option("linear warmup steps", 0)
    gen_batch_size: int = option("prompts per teacher generation batch", 64)
    seed: int = option("seed of its training and sampling", 0)
    match: Literal["tokens", "updates"] = option(
        "what equals the MOPD run's: tokens (the student tokens trained on; the update count follows from "
        "the answers' lengths) or updates (the optimizer steps, batch_size rows each; the tokens follow)",
        "tokens")

    def seq_kd_kwargs(self, rollout_max_new_tokens: int) -> dict:
        """mopd.baselines.seq_kd's training settings from this section (the pipeline's
        stage and bench.mopd_vs_seqkd both call it, so the two cannot drift apart)."""
        return {"lr": self.lr, "batch_size": self.batch_size, "warmup": self.warmup_steps,
                "max_new_tokens": self.max_new_tokens or rollout_max_new_tokens,
                "temperature": self.temperature, "seed": self.seed, "gen_batch_size": self.gen_batch_size}

    def validate(self):
        in_range("baselines.seq_kd.temperature", self.temperature, 0)
        in_range("baselines.seq_kd.max_new_tokens", self.max_new_tokens, 0)
        in_range("baselines.seq_kd.lr", self.lr, 0, low_open=True)
        in_range("baselines.seq_kd.batch_size", self.batch_size, 1)
        in_range("baselines.seq_kd.warmup_steps", self.warmup_steps, 0)
        in_range("baselines.seq_kd.gen_batch_size", self.gen_batch_size, 1)


@dataclass
class WeightAvgSection:
    enabled: bool = option("build the uniform weight-average baseline of the experts", True)


@dataclass
class MixRLSection:
    """Joint GRPO over every single-turn domain from the MOPD student's starting point, with
    MOPD's number of student samples. A setting left null takes the value most of the run's
    RL expert recipes use (ties: the first teacher key's); max_completion_length the longest."""
    enabled: bool = option("train the Mix-RL baseline (joint RL over all domains)", True)
    lr: float | None = option("learning rate; null: the RL recipes'", None)
    batch_size: int | None = option("prompts per GRPO step; null: the RL recipes' train.batch_size", None)
    num_generations: int | None = option("completions per prompt (the GRPO group); null: the RL recipes'", None)
    max_completion_length: int | None = option("max new tokens per completion; null: the longest of the "
                                               "RL recipes' (domains differ: math 48, the others 64)", None)
    temperature: float | None = option("sampling temperature; null: the RL recipes'", None)
    beta: float | None = option("KL to the starting model; null: the RL recipes'", None)
    loss_type: str | None = option("TRL GRPO loss_type; null: the RL recipes'", None)
    scale_rewards: str | None = option("TRL GRPO scale_rewards; null: the RL recipes'", None)
    warmup_steps: int = option("linear warmup steps", 0)
    n_samples: int = option("student samples in all; 0: as many as the MOPD stage draws (sampled batches x "
                            "prompts_per_step x samples_per_prompt)", 0)
    seed: int = option("seed of the trainer (init, sampling)", 0)

    def validate(self):
        for k in ("batch_size", "max_completion_length"):
            if getattr(self, k) is not None:
                in_range(f"baselines.mix_rl.{k}", getattr(self, k), 1)
        if self.num_generations is not None:
            in_range("baselines.mix_rl.num_generations", self.num_generations, 2)
        if self.lr is not None:
            in_range("baselines.mix_rl.lr", self.lr, 0, low_open=True)
        for k in ("temperature", "beta"):
            if getattr(self, k) is not None:
                in_range(f"baselines.mix_rl.{k}", getattr(self, k), 0)
        in_range("baselines.mix_rl.warmup_steps", self.warmup_steps, 0)
        in_range("baselines.mix_rl.n_samples", self.n_samples, 0)


@dataclass
class CascadeRLSection:
    enabled: bool = option("train the cascade-RL baseline: one GRPO phase per domain, one after another, "
                           "each from the previous one's model, MOPD's samples split evenly; the RL settings "
                           "are baselines.mix_rl's", False)
    order: list[str] = option("the domains' order; empty: the run's domain order", factory=list)


@dataclass
class WarmupMopdSection:
    """The warm-up-then-MOPD variant: seq-KD (baselines.seq_kd's settings) on the teachers'
    answers for `share` of plain MOPD's student tokens, then MOPD from that checkpoint for
    the plain run's steps left after as many tokens (pipeline/stages/warmup_mopd.py)."""
    enabled: bool = option("train MOPD after an off-policy seq-KD warm-up, with plain MOPD's student tokens "
                           "in all", True)
    share: float = option("share of plain MOPD's student tokens the seq-KD warm-up trains on", 0.2)

    def validate(self):
        if not 0 < self.share < 1:
            raise ValueError(f"baselines.warmup_mopd.share must be in (0, 1), got {self.share}")


@dataclass
class BaselinesSection:
    seq_kd: SeqKDSection = option("off-policy sequence-level KD with MOPD's student-token budget",
                                 factory=SeqKDSection)
    weight_avg: WeightAvgSection = option("uniform parameter average of the experts", factory=WeightAvgSection)
    mix_rl: MixRLSection = option("joint RL (GRPO) over all single-turn domains with MOPD's student samples",
                                  factory=MixRLSection)
    cascade_rl: CascadeRLSection = option("RL over the domains one after another", factory=CascadeRLSection)
    warmup_mopd: WarmupMopdSection = option("a seq-KD warm-up for a share of MOPD's student tokens, then MOPD for "
                                            "the rest", factory=WarmupMopdSection)
    quantize: bool = option("export the baselines through the experts' INT4 fake-quant", True)


@dataclass
class EvalSection:
    n: int = option("held-out rows per column", 200)
    n_per_domain: dict[str, int] = option("rows per 'domain' or 'domain/effort', over `n`", factory=dict)
    max_new_tokens: dict[str, int] = option(
        "answer length per 'domain' or 'domain/effort'; default: the expert recipe's eval.max_new_tokens",
        factory=dict)
    batch_size: int = option("generation batch size; 0: the expert recipe's eval.batch_size", 0)
    teachers_on_all_domains: bool = option("also score every teacher off its own domain", False)

    def validate(self):
        in_range("eval.n", self.n, 1)
        in_range("eval.batch_size", self.batch_size, 0)
        for k, v in self.n_per_domain.items():
            in_range(f"eval.n_per_domain.{k}", v, 1)
        for k, v in self.max_new_tokens.items():
            in_range(f"eval.max_new_tokens.{k}", v, 1)


@dataclass
class PipelineTrain:
    max_steps: int = option("cap on every training stage's steps (smoke runs: train.max_steps=2)", 1_000_000)

    def validate(self):
        if self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")


@dataclass
class PipelineMlflow:
    experiment: str = option("MLflow experiment of the pipeline and all its stages", "mopd-pipeline")
    tracking_uri: str | None = option("default: $MLFLOW_TRACKING_URI, else sqlite:///DIR/mlflow.db", None)


@dataclass
class PipelineConfig:
    domains: list[str] = option("domains to run: registered names (`mopd domains list`: built-in or a team's "
                                "installed package) or 'module:attribute' paths; empty: every folder under "
                                "experts.recipes", factory=list)
    jobs: int = option(
        "stages run side by side where they can (each expert stage in its own process, one thread each; "
        "the chat RM), the others (base, MOPD, baselines, evals) alone: 2 fits a 2-core laptop; on a GPU "
        "box, one per free device or core set", 2)
    base: BaseSection = option("the common base every expert and the student start from", factory=BaseSection)
    experts: ExpertsSection = option("the domain experts (the teachers)", factory=ExpertsSection)
    mopd: MopdSection = option("the MOPD student", factory=MopdSection)
    baselines: BaselinesSection = option("what MOPD is compared with", factory=BaselinesSection)
    eval: EvalSection = option("held-out evals of every model", factory=EvalSection)
    train: PipelineTrain = option("settings over every training stage", factory=PipelineTrain)
    mlflow: PipelineMlflow = option("where the pipeline's runs are logged", factory=PipelineMlflow)
    extra_seeds: list[int] = option(
        "more training seeds of MOPD, seq-KD and Mix-RL: each adds a copy of those stages and their evals with "
        "its seed (MOPD's train.seed, baselines.seq_kd.seed, baselines.mix_rl.seed) under DIR/seeds/seed<N>/; "
        "the report gives each method's mean and spread over the plain run and these ([1, 2]: three seeds)",
        factory=list)

    def validate(self):
        in_range("jobs", self.jobs, 1)
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.extra_seeds) \
                or len(set(self.extra_seeds)) != len(self.extra_seeds):
            raise ValueError(f"extra_seeds must be distinct ints >= 0, got {self.extra_seeds}")


@dataclass
class ToyConfig:
    """`mopd toy`'s settings (the toy tasks' own are core.toy_tasks.TOY_DEFAULTS)."""
    recipe: str = option("the MOPD recipe the student is distilled with", "recipes/mopd/toy.yaml")
    overrides: list[str] = option("key=value overrides for that recipe", factory=list)
    rollout_backend: Literal["vllm", "hf"] | None = option(
        "the student's sampler; default: the recipe's rollout.backend", None)
    seed: int = option("seed of the toy data, the base and the teachers (MOPD's is the recipe's train.seed)", 0)
