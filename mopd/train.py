"""The MOPD loop: on-policy samples from the student, scored token by token by the
teacher of each prompt's domain, trained with an importance-corrected policy gradient.

    accelerate launch -m mopd.train --config recipes/mopd/toy.yaml --out runs/toy [key=value ...]
    mopd distill --config recipes/mopd/toy.yaml --out runs/toy

Reads top to bottom: config -> checks (data, teachers) -> models -> loop -> final save.
Every rank samples its own shard of the global batch with its own colocated sampler;
the gradient is averaged by DDP/FSDP, so the update does not depend on how many
processes share the batch.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from mopd.config import ConfigError, dump_yaml, flatten, load_config, to_dict
from mopd import loss as L
from mopd.quant import QuantConfig, apply_qat, quantized_state_dict


# ----------------------------------------------------------------------------- config
@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])


@dataclass
class ModelConfig:
    path: str = ""                 # the student's starting checkpoint (HF directory)
    dtype: str = "float32"
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self):
        if not self.path:
            raise ValueError("model.path is required (the student's starting checkpoint)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class DatasetSpec:
    path: str                      # save_to_disk directory, or a .jsonl/.json/.parquet file
    split: str = "train"


@dataclass
class DataConfig:
    datasets: list[DatasetSpec] = field(default_factory=list)
    mix: dict[str, float] = field(default_factory=dict)   # domain -> weight; empty: uniform
    prompt_column: str = "prompt"
    max_prompt_tokens: int = 256


@dataclass
class TeacherSpec:
    path: str                      # HF directory or models:/<name>@teacher
    backend: Literal["hf", "vllm"] = "hf"


@dataclass
class DomainRollout:
    """One domain's own sampling settings (rollout.by_domain); unset keys take rollout's."""
    temperature: float | None = None
    top_p: float | None = None
    correct_below: float | None = None
    correct_rounds: int | None = None
    on_policy_fraction: float | None = None
    on_policy_ramp_steps: int | None = None


@dataclass
class RolloutConfig:
    backend: Literal["vllm", "hf"] = "vllm"
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    samples_per_prompt: int = 1
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 512
    enforce_eager: bool = False    # True: engine starts in seconds, samples ~2x slower
    # Fraction of each batch's prompts the student answers itself (TRL GKD's `lmbda`). The
    # rest train on the dataset's `completion` column instead (off-policy, teacher-forced),
    # still against the teacher's whole distribution at every position. 1.0: purely
    # on-policy. Below 1 needs loss.kl=full and a `completion` column in every dataset.
    on_policy_fraction: float = 1.0
    # > 0: the fraction ramps linearly from 0 at step 0 to on_policy_fraction at this step (a
    # student that starts far from its teachers first learns from teacher-forced rows, then
    # from its own samples once they are mostly right)
    on_policy_ramp_steps: int = 0
    # > 0: teacher-corrected samples, after Speculative KD (Xu et al., 2024). The first token
    # of a student sample that its teacher gives less than this probability (and that is not
    # the teacher's own top token) is replaced by the teacher's top token, and the student
    # samples the rest again from there; at most `correct_rounds` such fixes per row. A student
    # far from its teachers otherwise spends every token after its first wrong one (a wrong
    # digit of an answer, a miscopied value) learning to continue a wrong answer. Every other
    # token is still the student's own sample. Needs loss.kl=full (the teacher's whole
    # distribution at each position).
    correct_below: float = 0.0
    correct_rounds: int = 2
    # Per-domain sampling settings over the ones above, e.g. {math: {temperature: 0.5}} or
    # {math: {on_policy_ramp_steps: 1000}}: each team's rollouts were tuned for its own
    # domain, and one setting rarely suits all (measured on the pipeline: math retention rose
    # at temperature 0.5, and with a ramp, where tool_use fell).
    by_domain: dict[str, DomainRollout] = field(default_factory=dict)

    def for_domain(self, domain: str) -> "RolloutConfig":
        """The settings the rows of `domain` are sampled (and corrected) with."""
        o = self.by_domain.get(domain)
        if o is None:
            return self
        return dataclasses.replace(self, by_domain={},
                                   **{k: v for k, v in dataclasses.asdict(o).items() if v is not None})

    @property
    def any_correction(self) -> bool:
        return self.correct_below > 0 or any(o.correct_below for o in self.by_domain.values())

    def validate(self):
        for d in self.by_domain:
            try:
                self.for_domain(d).validate()
            except ValueError as e:
                raise ValueError(f"by_domain.{d}: {e}") from None
        if not 0.0 <= self.on_policy_fraction <= 1.0:
            raise ValueError(f"rollout.on_policy_fraction must be in [0, 1], got {self.on_policy_fraction}")
        if self.on_policy_ramp_steps < 0:
            raise ValueError(f"rollout.on_policy_ramp_steps must be >= 0, got {self.on_policy_ramp_steps}")
        if not 0.0 <= self.correct_below < 1.0:
            raise ValueError(f"rollout.correct_below is a teacher probability in [0, 1) (0 = off), "
                             f"got {self.correct_below}")
        if self.correct_rounds < 1:
            raise ValueError(f"rollout.correct_rounds must be >= 1, got {self.correct_rounds}")

    @property
    def uses_references(self) -> bool:
        """Rows under these settings (by_domain aside) may train on the dataset's completions
        instead of the student's samples."""
        return self.on_policy_fraction < 1.0 or self.on_policy_ramp_steps > 0

    @property
    def any_references(self) -> bool:
        """uses_references for some domain: the top-level settings or a by_domain one."""
        return self.uses_references or any(self.for_domain(d).uses_references for d in self.by_domain)

    def on_policy_fraction_at(self, step: int) -> float:
        if self.on_policy_ramp_steps <= 0:
            return self.on_policy_fraction
        return self.on_policy_fraction * min(1.0, step / self.on_policy_ramp_steps)


@dataclass
class LossConfig:
    discount: float = 0.0          # gamma: 0 = per-token reward, 1 = undiscounted return
    task_reward_alpha: float = 0.0  # advantage += alpha * task reward of the domain
    is_truncation: float = 2.0     # C in min(rho, C)
    is_mask_low: float = 0.5       # tokens with rho outside [low, high] are dropped
    is_mask_high: float = 2.0
    max_staleness: int = 1         # optimizer steps a sampled batch may lag the weights
    # "domain_mean": subtract each domain's mean advantage over the batch's tokens (a
    # control variate: same expected gradient, far less variance when the student starts
    # far from its teachers and every sampled token has a large negative reward).
    baseline: Literal["none", "domain_mean"] = "domain_mean"
    # How the per-token reverse KL is estimated at each position the student sampled:
    #   "sampled": the dense reward r_t = log p_T(y_t) - log p_S(y_t) on the sampled
    #              token, trained with the policy-gradient loss above (any teacher backend);
    #   "full":    the exact KL(p_S || p_T) over the whole vocabulary at that position, its
    #              gradient the expectation of the sampled one (no next-token noise). Needs
    #              the teachers' full distributions: teacher backend "hf" only.
    # Both are on-policy: the positions are the student's own samples.
    kl: Literal["sampled", "full"] = "sampled"
    # With kl=full, which divergence at each sampled position (TRL's DistillationConfig.beta):
    # 1.0 reverse KL (the objective, mode-seeking), 0.0 forward KL (mass-covering,
    # full-strength gradient on tokens the student still finds unlikely), in between the
    # generalized JSD. The positions are the student's samples whatever beta is.
    beta: float = 1.0
    # With kl=full, the teacher distribution the student is trained toward is the teacher's at
    # this temperature (log softmax(log p_T / t)); below 1 it is sharper than the teacher.
    # Greedy-scored tasks need the student's top token to be the teacher's; a small student
    # that also has to match the spread of high-entropy teachers (chat) spends capacity on it.
    # The KL metrics are always against the teacher itself.
    teacher_temperature: float = 1.0

    def validate(self):
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {self.discount}")
        if not 0 < self.is_mask_low <= 1.0 <= self.is_mask_high:
            raise ValueError("need 0 < is_mask_low <= 1 <= is_mask_high")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"loss.beta must be in [0, 1] (1 reverse KL, 0 forward KL), got {self.beta}")
        if self.teacher_temperature <= 0:
            raise ValueError(f"loss.teacher_temperature must be > 0, got {self.teacher_temperature}")
        if self.teacher_temperature != 1.0 and self.kl != "full":
            raise ValueError(f"loss.teacher_temperature={self.teacher_temperature} reshapes the teacher's whole "
                             f"next-token distribution: it needs loss.kl=full")
        if self.beta != 1.0 and self.kl != "full":
            raise ValueError(f"loss.beta={self.beta} picks the divergence over the whole vocabulary: it needs "
                             f"loss.kl=full (kl=sampled estimates the reverse KL on the sampled token only)")


@dataclass
class TrainConfig:
    max_steps: int = 100           # optimizer steps
    prompts_per_step: int = 32     # global, across processes, per sampled batch
    minibatches: int = 1           # optimizer steps per sampled batch (later ones are stale)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    # AdamW's betas (torch's defaults). beta2 is how many steps the per-weight gradient scale
    # remembers (~1 / (1 - beta2)): with 0.999, the large gradients of the first steps, when the
    # student is far from its teachers, keep every later step small for ~1000 steps; 0.95 (the
    # SFT stages' and seq-KD's setting) follows the shrinking gradients within ~20 steps.
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    # cosine / linear decay ends at lr * this (the SFT stages and seq-KD decay to 0.1)
    lr_min_ratio: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 0            # 0: only the final checkpoint
    keep_checkpoints: int = 2
    resume: bool = False

    def validate(self):
        if self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if self.prompts_per_step < 1 or self.minibatches < 1:
            raise ValueError("prompts_per_step and minibatches must be >= 1")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"train.lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}")
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"train.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")


@dataclass
class MlflowConfig:
    experiment: str = "mopd"
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite under --out
    run_name: str | None = None
    log_model: bool = True
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class DistillConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    teachers: dict[str, TeacherSpec] = field(default_factory=dict)  # "domain" or "domain/effort"
    rewards: dict[str, str] = field(default_factory=dict)   # domain -> "module:function"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)

    def validate(self):
        if self.train.minibatches - 1 > self.loss.max_staleness:
            raise ValueError(f"train.minibatches={self.train.minibatches} trains the last minibatch "
                             f"{self.train.minibatches - 1} steps after sampling, above "
                             f"loss.max_staleness={self.loss.max_staleness}")
        if self.train.prompts_per_step % self.train.minibatches:
            raise ValueError("train.prompts_per_step must be divisible by train.minibatches")
        if not self.data.datasets:
            raise ValueError("data.datasets is empty: give at least one prompt dataset")
        if not self.teachers:
            raise ValueError("teachers is empty: map each domain to a teacher checkpoint")
        if self.rollout.any_references and self.loss.kl != "full":
            raise ValueError(f"rollout.on_policy_fraction={self.rollout.on_policy_fraction} (ramp "
                             f"{self.rollout.on_policy_ramp_steps} steps, or a by_domain one) trains some rows on "
                             f"dataset completions, which the sampled-token policy gradient cannot use (they are "
                             f"not the student's samples): set loss.kl=full")
        if self.rollout.any_correction and self.loss.kl != "full":
            raise ValueError(f"rollout.correct_below={self.rollout.correct_below} (or a by_domain one) checks "
                             f"each sampled token against the teacher's whole next-token distribution: "
                             f"set loss.kl=full")
        if self.loss.kl == "full":
            bad = sorted(k for k, t in self.teachers.items() if t.backend != "hf")
            if bad:
                raise ValueError(f"loss.kl=full needs each teacher's whole next-token distribution, which "
                                 f"only the hf backend returns; teachers {bad} use vllm (prompt_logprobs "
                                 f"gives top-k only): set their backend to hf or use loss.kl=sampled")


# ----------------------------------------------------------------------------- data
@dataclass
class Prompt:
    index: int                    # position in the pooled prompt table
    domain: str
    teacher_key: str
    messages: list[dict]
    ids: list[int]
    columns: dict[str, Any]
    reference_ids: list[int] | None = None   # the dataset completion + EOS (rollout.on_policy_fraction < 1)


def _load_rows(spec: DatasetSpec):
    import datasets

    p = Path(spec.path)
    if not p.exists():
        raise ConfigError(f"data.datasets: {spec.path!r} does not exist")
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if spec.split not in ds:
                raise ConfigError(f"{spec.path}: no split {spec.split!r} (has {list(ds)})")
            ds = ds[spec.split]
        return ds
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(p.suffix)
    if kind is None:
        raise ConfigError(f"{spec.path}: unsupported data file type {p.suffix!r}")
    return datasets.load_dataset(kind, data_files=str(p), split="train")


def teacher_key_for(domain: str, effort: str | None, teachers: dict) -> str | None:
    if effort and f"{domain}/{effort}" in teachers:
        return f"{domain}/{effort}"
    return domain if domain in teachers else None


def load_prompts(cfg: DistillConfig, tokenizer) -> dict[str, list[Prompt]]:
    """All prompts grouped by domain, tokenized with the student's chat template.
    Every problem with the rows is reported here, before any model is loaded."""
    by_domain: dict[str, list[Prompt]] = {}
    rollout_for: dict[str, RolloutConfig] = {}   # each domain's settings, resolved once
    too_long = 0
    idx = 0
    for spec in cfg.data.datasets:
        ds = _load_rows(spec)
        cols = ds.column_names
        for needed in (cfg.data.prompt_column, "domain"):
            if needed not in cols:
                raise ConfigError(f"{spec.path}: rows have no {needed!r} column (columns: {cols}); "
                                  "every prompt row needs a 'domain' to route it to its teacher")
        for i, row in enumerate(ds):
            domain, effort = row["domain"], row.get("effort")
            if not domain or not isinstance(domain, str):
                raise ConfigError(f"{spec.path} row {i}: empty or non-string 'domain' ({domain!r})")
            msgs = row[cfg.data.prompt_column]
            if isinstance(msgs, str):
                msgs = [{"role": "user", "content": msgs}]
            if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m
                                                          and "content" in m for m in msgs)):
                raise ConfigError(f"{spec.path} row {i}: {cfg.data.prompt_column!r} must be a string "
                                  "or a list of {role, content} messages")
            key = teacher_key_for(domain, effort, cfg.teachers)
            if key is None:
                want = f"{domain!r}" + (f" (or {domain}/{effort})" if effort else "")
                raise ConfigError(f"{spec.path} row {i}: no teacher for domain {want}; "
                                  f"teachers has {sorted(cfg.teachers)}")
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            if len(ids) > cfg.data.max_prompt_tokens:
                too_long += 1
                continue
            extra = {k: v for k, v in row.items() if k not in (cfg.data.prompt_column,)}
            ref = None
            if domain not in rollout_for:
                rollout_for[domain] = cfg.rollout.for_domain(domain)
            rdom = rollout_for[domain]
            if rdom.uses_references:
                from mopd.sft import encode_example
                if not row.get("completion"):
                    raise ConfigError(f"{spec.path} row {i}: rollout.on_policy_fraction="
                                      f"{rdom.on_policy_fraction} (ramp {rdom.on_policy_ramp_steps} steps) for "
                                      f"domain {domain!r} needs a non-empty 'completion' column "
                                      f"(columns: {cols})")
                ref = encode_example(tokenizer, msgs, row["completion"])[1][:cfg.rollout.max_new_tokens]
            by_domain.setdefault(domain, []).append(Prompt(idx, domain, key, msgs, ids, extra, ref))
            idx += 1
    if too_long:
        print(f"[mopd] skipped {too_long} prompts longer than data.max_prompt_tokens="
              f"{cfg.data.max_prompt_tokens}", file=sys.stderr)
    if not by_domain:
        raise ConfigError("no usable prompts in data.datasets")
    mix = cfg.data.mix or {d: 1.0 for d in by_domain}
    for d in mix:
        if d not in by_domain:
            raise ConfigError(f"data.mix names domain {d!r}, which no dataset row has "
                              f"(domains in data: {sorted(by_domain)})")
    for d in by_domain:
        if d not in mix:
            raise ConfigError(f"domain {d!r} is in the data but not in data.mix; give it a weight "
                              "(0 to leave it out)")
    for d in cfg.rewards:
        if d not in by_domain:
            raise ConfigError(f"rewards names domain {d!r}, which no dataset row has")
    for d in cfg.rollout.by_domain:
        if d not in by_domain:
            raise ConfigError(f"rollout.by_domain names domain {d!r}, which no dataset row has "
                              f"(domains in data: {sorted(by_domain)})")
    if cfg.loss.task_reward_alpha > 0:
        missing = [d for d in by_domain if mix[d] > 0 and d not in cfg.rewards]
        if missing:
            raise ConfigError(f"loss.task_reward_alpha > 0 but no reward function for domains "
                              f"{missing}: add them under rewards (domain: module:function)")
    return by_domain


class PromptSampler:
    """Draws each step's global batch by the domain mix, without replacement within an
    epoch of each domain; its state (cursors, epochs) is the data position saved in
    checkpoints."""

    def __init__(self, by_domain: dict[str, list[Prompt]], mix: dict[str, float], seed: int):
        self.domains = sorted(d for d in by_domain if mix.get(d, 1.0) > 0)
        w = np.array([mix.get(d, 1.0) for d in self.domains], dtype=np.float64)
        self.weights = w / w.sum()
        self.by_domain, self.seed = by_domain, seed
        self.cursor = {d: 0 for d in self.domains}
        self.epoch = {d: 0 for d in self.domains}

    def _perm(self, d: str) -> np.ndarray:
        h = int(hashlib.sha256(f"{self.seed}/{d}/{self.epoch[d]}".encode()).hexdigest()[:8], 16)
        return np.random.default_rng(h).permutation(len(self.by_domain[d]))

    def next_batch(self, step: int, n: int) -> list[Prompt]:
        rng = np.random.default_rng([self.seed, step])
        picks = rng.choice(len(self.domains), size=n, p=self.weights)
        out = []
        for k in picks:
            d = self.domains[k]
            if self.cursor[d] >= len(self.by_domain[d]):
                self.cursor[d], self.epoch[d] = 0, self.epoch[d] + 1
            out.append(self.by_domain[d][int(self._perm(d)[self.cursor[d]])])
            self.cursor[d] += 1
        return out

    def state_dict(self):
        return {"cursor": dict(self.cursor), "epoch": dict(self.epoch)}

    def load_state_dict(self, s):
        self.cursor.update(s["cursor"])
        self.epoch.update(s["epoch"])


def load_reward_fn(ref: str):
    import importlib

    mod, _, fn = ref.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rewards: cannot import {ref!r} ({e}); use 'package.module:function'") from None


# ----------------------------------------------------------------------------- models
def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_student(cfg: DistillConfig):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=_dtype(cfg.model.dtype))
    if cfg.model.lora.enabled:
        from peft import LoraConfig as PeftLora, get_peft_model

        lc = cfg.model.lora
        model = get_peft_model(model, PeftLora(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                               target_modules=lc.target_modules, task_type="CAUSAL_LM"))
    # LoRA first, then QAT: the merged weight W + BA is what gets fake-quantized.
    apply_qat(model, cfg.quant)
    return model


def sampler_weights(model) -> list[tuple[str, torch.Tensor]]:
    """Exactly the weights the trainer's forward uses, under HF names: LoRA merged in
    (without touching the model: a merge/unmerge round trip would not restore the base
    bit for bit) and, with QAT on, fake-quantized. So the sampler is on-policy by
    construction."""
    out = []
    for k, v in quantized_state_dict(model).items():
        if hasattr(v, "full_tensor"):  # FSDP2 DTensor shard: every rank's sampler needs it whole
            v = v.full_tensor()
        out.append((k, v.detach()))
    return out


def completion_logprobs(model, batch: dict[str, torch.Tensor], full: bool = False):
    """log p(y_t | prefix) for the completion tokens, [B, T_completion]; with `full`, also
    the whole log-softmax at those positions, [B, T_completion, V]."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out.logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    logsm = torch.log_softmax(logits, dim=-1)
    lp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # Completion token t sits at input position P_i + t; its log-prob at logits position P_i + t - 1.
    idx = batch["completion_start"].unsqueeze(1) - 1 + torch.arange(batch["mask"].shape[1]).unsqueeze(0)
    idx = idx.clamp(max=lp.shape[1] - 1)
    lp_BT = lp.gather(1, idx) * batch["mask"]
    if not full:
        return lp_BT
    V = logsm.shape[-1]
    return lp_BT, logsm.gather(1, idx.unsqueeze(-1).expand(-1, -1, V))


def _pad_full(rows: list[torch.Tensor], T: int, V: int) -> torch.Tensor:
    """Teacher full log-prob rows [len_i, V'] -> [B, T, V]; padding positions are
    masked out of the loss, extra vocabulary columns (V > V') get -inf (p_T = 0)."""
    out = torch.zeros((len(rows), T, V))
    for i, r in enumerate(rows):
        if r is None or not len(r):
            continue
        n, v = r.shape
        out[i, :n, :min(v, V)] = r[:, :V]
        if v < V:
            out[i, :n, v:] = -1e9
    return out


def collate(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
            extra: dict[str, list[list[float]]]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion ids; completion-aligned [B, T] tensors for the rest."""
    B = len(prompts)
    L_ = max(len(p) + len(c) for p, c in zip(prompts, completions))
    T = max(1, max(len(c) for c in completions))
    ids = torch.full((B, L_), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L_), dtype=torch.long)
    mask = torch.zeros((B, T))
    start = torch.zeros(B, dtype=torch.long)
    out = {k: torch.zeros((B, T)) for k in extra}
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq = p + c
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        mask[i, :len(c)] = 1
        start[i] = len(p)
        for k, vals in extra.items():
            if len(c):
                out[k][i, :len(c)] = torch.as_tensor(vals[i], dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attn, "mask": mask, "completion_start": start, **out}


# ----------------------------------------------------------------------------- teachers
def score_rows(teachers: dict, rows: list[Prompt], samples: list, idx, full: bool,
               teacher_lp: list, teacher_full: list) -> None:
    """Fill teacher_lp[i] (sampled-token log-probs) and, with `full`, teacher_full[i] (the
    whole log-distribution, [len, V]) for each i in idx, each row scored by its own teacher."""
    idx = list(idx)
    for key, teacher in teachers.items():
        sel = [i for i in idx if rows[i].teacher_key == key]
        if not sel:
            continue
        if full:
            fulls = teacher.score_full([rows[i].ids for i in sel], [samples[i].completion_ids for i in sel])
            for i, f in zip(sel, fulls):
                teacher_full[i] = f
                ids = torch.tensor(samples[i].completion_ids, dtype=torch.long)
                teacher_lp[i] = f.gather(-1, ids[:, None]).squeeze(-1).tolist() if len(ids) else []
            continue
        for i, sc in zip(sel, teacher.score([rows[i].ids for i in sel], [samples[i].completion_ids for i in sel])):
            teacher_lp[i] = sc.tolist()


def first_to_correct(teacher_full_TV: torch.Tensor, completion_ids: list[int], below: float) -> int | None:
    """Position of the first sampled token that the teacher gives probability < `below` and
    that is not the teacher's own top token there; None if there is none."""
    if below <= 0 or not completion_ids or teacher_full_TV is None or not len(teacher_full_TV):
        return None
    T, V = teacher_full_TV.shape
    ids = torch.tensor(completion_ids[:T], dtype=torch.long)
    lp = torch.full((len(ids),), float("-inf"))
    known = ids < V          # a token outside the teacher's vocabulary has p_T = 0
    lp[known] = teacher_full_TV[torch.arange(len(ids))[known], ids[known]]
    bad = ((lp < math.log(below)) & (ids != teacher_full_TV[:len(ids)].argmax(-1))).nonzero()
    return int(bad[0]) if len(bad) else None


def _group(idx, key) -> dict:
    """Indices grouped by key(i), each group in the order of `idx`."""
    out: dict = {}
    for i in idx:
        out.setdefault(key(i), []).append(i)
    return out


def _correction_key(r: RolloutConfig) -> tuple:
    return (r.correct_below, r.correct_rounds, r.temperature, r.top_p)


def correct_samples(rollout, teachers: dict, rows: list[Prompt], samples: list, idx: list[int], r: RolloutConfig,
                    seeds: list[int], eos_ids: set[int], teacher_lp: list, teacher_full: list) -> list[int]:
    """Teacher-corrected rollouts (rollout.correct_below): in each round, every row of `idx`
    whose sample has a token to correct is cut there, gets the teacher's top token, and the
    student samples the rest again (same length budget). The inserted tokens get sampler
    log-prob NaN, which the loss reads as "not the sampler's" (importance weight 1). The
    rows' teacher scores are kept current. Returns the number of teacher tokens per row."""
    from mopd.rollout import Sample

    n_fixed = [0] * len(rows)
    todo = list(idx)
    for rnd in range(r.correct_rounds):
        fix = {i: t for i in todo
               if (t := first_to_correct(teacher_full[i], samples[i].completion_ids, r.correct_below)) is not None}
        if not fix:
            break
        regen = []
        for i, t in fix.items():
            s = samples[i]
            tok = int(teacher_full[i][t].argmax())
            samples[i] = Sample(prompt_ids=s.prompt_ids, completion_ids=s.completion_ids[:t] + [tok],
                                sampler_logprobs=s.sampler_logprobs[:t] + [float("nan")], finished=tok in eos_ids)
            n_fixed[i] += 1
            if not samples[i].finished and t + 1 < r.max_new_tokens:
                regen.append(i)
        if regen:
            budget = [r.max_new_tokens - len(samples[i].completion_ids) for i in regen]
            cont = rollout.generate([rows[i].ids + samples[i].completion_ids for i in regen],
                                    max_new_tokens=max(budget), temperature=r.temperature, top_p=r.top_p,
                                    seeds=[seeds[i] + 7_919 * (rnd + 1) for i in regen])
            for i, b, c in zip(regen, budget, cont):
                s = samples[i]
                samples[i] = Sample(prompt_ids=s.prompt_ids, completion_ids=s.completion_ids + c.completion_ids[:b],
                                    sampler_logprobs=s.sampler_logprobs + c.sampler_logprobs[:b],
                                    finished=c.finished and len(c.completion_ids) <= b)
        score_rows(teachers, rows, samples, fix, True, teacher_lp, teacher_full)
        todo = list(fix)
    return n_fixed


# ----------------------------------------------------------------------------- mlflow
def tracking_uri(cfg: DistillConfig, out: Path) -> str:
    from mopd.tracking import resolve_uri
    return resolve_uri(cfg.mlflow.tracking_uri, out)


def start_mlflow(cfg: DistillConfig, out: Path, run_id: str | None, tags: dict[str, str]):
    import mlflow

    from mopd.tracking import experiment_id

    exp_id = experiment_id(cfg.mlflow.experiment, tracking_uri(cfg, out))
    parent = os.environ.get("MOPD_PARENT_RUN_ID")
    if run_id:
        run = mlflow.start_run(run_id=run_id)
    else:
        run = mlflow.start_run(experiment_id=exp_id, run_name=cfg.mlflow.run_name or out.name,
                               tags={**cfg.mlflow.tags, **tags}, nested=bool(parent),
                               parent_run_id=parent or None)
    return mlflow, run


# ----------------------------------------------------------------------------- checkpoints
def latest_checkpoint(out: Path) -> Path | None:
    ckpts = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    ckpts = [c for c in ckpts if (c / "DONE").exists()]
    return ckpts[-1] if ckpts else None


def save_checkpoint(accelerator, model, tokenizer, out: Path, step: int, extra: dict, keep: int):
    """HF-format model + accelerate state (optimizer, scheduler, RNG) + data position,
    written to a temporary folder and renamed, so a kill mid-save loses nothing."""
    final = out / "checkpoints" / f"step_{step}"
    tmp = out / "checkpoints" / f".tmp_step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"), safe_serialization=True)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(str(tmp / "model"), state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(str(tmp / "model"))
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **extra}, indent=1))
        (tmp / "DONE").write_text("ok")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        ckpts = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        for old in ckpts[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


# ----------------------------------------------------------------------------- the loop
def _seed_for(seed: int, step: int, idx: int, k: int) -> int:
    return int(hashlib.sha256(f"{seed}/{step}/{idx}/{k}".encode()).hexdigest()[:8], 16)


def _lr_lambda(cfg: TrainConfig):
    def f(step):
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        frac = min(max(frac, 0.0), 1.0)
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_schedule == "cosine" else 1.0 - frac
        return cfg.lr_min_ratio + (1.0 - cfg.lr_min_ratio) * decay
    return f


def run(cfg: DistillConfig, out: str | Path, progress: bool = True) -> dict:
    """Run (or resume) a distillation; returns the per-step metric history."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from teachers.resolve import TeacherError, check_fit, resolve_ref

    out = Path(out)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    global_batch = cfg.train.prompts_per_step
    if global_batch % world:
        raise ConfigError(f"train.prompts_per_step={global_batch} is not divisible by the "
                          f"{world} processes")

    if main:
        print(f"[mopd] {world} process(es), {accelerator.distributed_type.value}, "
              f"{global_batch} prompts per step ({global_batch // world} per rank)", file=sys.stderr)

    # --- checks that need no model: data rows, routing, teachers' tokenizers
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    by_domain = load_prompts(cfg, tokenizer)
    used_keys = sorted({p.teacher_key for ps in by_domain.values() for p in ps})
    teacher_paths: dict[str, Path] = {}
    for key in used_keys:
        spec = cfg.teachers[key]
        try:
            path = resolve_ref(spec.path)
        except TeacherError as e:
            raise TeacherError(f"teacher for {key!r}: {e}") from None
        fit = check_fit(tokenizer, path)
        if not fit.ok:
            raise TeacherError(f"teacher for {key!r} ({spec.path}) does not fit the student "
                               f"{cfg.model.path}: " + "; ".join(fit.problems))
        teacher_paths[key] = path
    reward_fns = {d: load_reward_fn(r) for d, r in cfg.rewards.items()}
    domains = sorted(by_domain)

    ckpt = latest_checkpoint(out) if cfg.train.resume else None
    if main:
        out.mkdir(parents=True, exist_ok=True)
        if not cfg.train.resume and latest_checkpoint(out) is not None:
            raise ConfigError(f"{out} already holds checkpoints; pass train.resume=true to continue "
                              "that run, or choose a new --out")
        (out / "config.yaml").write_text(dump_yaml(cfg))
    accelerator.wait_for_everyone()

    # --- models
    set_seed(cfg.train.seed)
    model = build_student(cfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.train.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                      betas=tuple(cfg.train.adam_betas))
    else:
        optimizer = torch.optim.SGD(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg.train))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    sampler = PromptSampler(by_domain, cfg.data.mix, cfg.train.seed)
    start_step, run_id, history = 0, None, []
    if ckpt is not None:
        accelerator.load_state(str(ckpt / "state"))
        st = json.loads((ckpt / "trainer_state.json").read_text())
        start_step, run_id = st["step"], st.get("mlflow_run_id")
        sampler.load_state_dict(st["data"])
        history = st.get("history", [])
        if main:
            print(f"[mopd] resuming from {ckpt} at step {start_step}", file=sys.stderr)

    from mopd.rollout import Sample, _eos_ids, make_rollout
    from teachers.scoring import make_teacher

    unwrapped = accelerator.unwrap_model(model)
    r = cfg.rollout
    if r.backend == "vllm":
        rollout = make_rollout("vllm", model_path=cfg.model.path, dtype=cfg.model.dtype,
                               seed=cfg.train.seed, max_model_len=r.max_model_len,
                               kv_cache_gb=r.kv_cache_gb, gpu_memory_utilization=r.gpu_memory_utilization,
                               enforce_eager=r.enforce_eager)
    else:
        rollout = make_rollout("hf", model=unwrapped, tokenizer=tokenizer)
    rollout.sync_weights(sampler_weights(unwrapped))
    eos_ids = _eos_ids(tokenizer, getattr(unwrapped, "generation_config", None))
    teachers = {}
    for k, p in teacher_paths.items():
        kw = {"enforce_eager": r.enforce_eager, "kv_cache_gb": r.kv_cache_gb,
              "max_model_len": r.max_model_len} if cfg.teachers[k].backend == "vllm" else {}
        teachers[k] = make_teacher(cfg.teachers[k].backend, str(p), dtype=cfg.model.dtype, **kw)

    mlflow = None
    if main:
        mlflow, mrun = start_mlflow(cfg, out, run_id, {"stage": "mopd", "domains": ",".join(domains)})
        run_id = mrun.info.run_id
        if ckpt is None:
            flat = {k: (json.dumps(v) if isinstance(v, (list, dict)) else v)
                    for k, v in flatten(to_dict(cfg)).items()}
            mlflow.log_params({k: str(v)[:6000] for k, v in flat.items()})
            mlflow.log_artifact(str(out / "config.yaml"))
    crash_at = int(os.environ.get("MOPD_TEST_CRASH_AT_STEP", "0"))

    # --- loop: one sampled batch feeds `minibatches` optimizer steps
    mb_per_batch = cfg.train.minibatches
    local_n = global_batch // world
    step = start_step
    bar = tqdm(total=cfg.train.max_steps, initial=start_step, disable=not (main and progress),
               desc="mopd", dynamic_ncols=True)
    full_kl = cfg.loss.kl == "full"
    rd = {d: r.for_domain(d) for d in domains}   # each domain's own sampling settings
    while step < cfg.train.max_steps:
        batch_prompts = sampler.next_batch(step, global_batch)
        mine = batch_prompts[rank * local_n:(rank + 1) * local_n]
        n = r.samples_per_prompt
        rows = [p for p in mine for _ in range(n)]
        seeds = [_seed_for(cfg.train.seed, step, p.index, k) for p in mine for k in range(n)]

        # Off-policy rows (on_policy_fraction < 1 or a ramp, top-level or the row's domain's
        # by_domain one) take the dataset's completion; the choice is a seeded function of
        # (seed, step, prompt, sample), so reruns and ranks agree.
        off = [rd[p.domain].uses_references and _seed_for(cfg.train.seed + 7919, step, p.index, k) % 10_000
               >= rd[p.domain].on_policy_fraction_at(step) * 10_000 for p in mine for k in range(n)]
        on_idx = [i for i, o in enumerate(off) if not o]
        t0 = time.perf_counter()
        samples: list[Sample] = [None] * len(rows)  # type: ignore
        # one sampler call per distinct (temperature, top_p); one call when no domain has its own
        for (temp, top_p), idx in _group(on_idx, lambda i: (rd[rows[i].domain].temperature,
                                                           rd[rows[i].domain].top_p)).items():
            for i, smp in zip(idx, rollout.generate([rows[i].ids for i in idx], max_new_tokens=r.max_new_tokens,
                                                    temperature=temp, top_p=top_p,
                                                    seeds=[seeds[i] for i in idx])):
                samples[i] = smp
        gen = [samples[i] for i in on_idx]
        t_sample = time.perf_counter() - t0
        for i, o in enumerate(off):
            if o:  # sampler log-probs are filled with the trainer's below: importance weight 1
                ref = rows[i].reference_ids
                samples[i] = Sample(prompt_ids=list(rows[i].ids), completion_ids=list(ref),
                                    sampler_logprobs=[0.0] * len(ref), finished=True)
        n_gen = sum(len(s.completion_ids) for s in gen)

        t0 = time.perf_counter()
        teacher_lp: list[list[float]] = [None] * len(rows)  # type: ignore
        teacher_full: list[torch.Tensor] = [None] * len(rows)  # type: ignore  # loss.kl=full
        score_rows(teachers, rows, samples, range(len(rows)), full_kl, teacher_lp, teacher_full)
        t_teacher = time.perf_counter() - t0
        n_fixed, t_correct = [0] * len(rows), 0.0
        if r.any_correction and on_idx:
            t0 = time.perf_counter()
            for idx in _group(on_idx, lambda i: _correction_key(rd[rows[i].domain])).values():
                rc = rd[rows[idx[0]].domain]
                if rc.correct_below > 0:
                    fixed = correct_samples(rollout, teachers, rows, samples, idx, rc, seeds, eos_ids,
                                            teacher_lp, teacher_full)
                    for i in idx:
                        n_fixed[i] = fixed[i]
            t_correct = time.perf_counter() - t0

        task_reward = torch.zeros(len(rows))
        if cfg.loss.task_reward_alpha > 0:
            texts = tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
            for d, fn in reward_fns.items():
                sel = [i for i, p in enumerate(rows) if p.domain == d]
                if not sel:
                    continue
                cols = {c: [rows[i].columns.get(c) for i in sel] for c in rows[sel[0]].columns}
                vals = fn(prompts=[rows[i].messages for i in sel], completions=[texts[i] for i in sel], **cols)
                for i, v in zip(sel, vals):
                    if v is None:
                        raise ValueError(f"reward {cfg.rewards[d]} returned None for a {d!r} row")
                    task_reward[i] = float(v)

        # Minibatches are contiguous slices of the local shard, so the k-th minibatch of
        # every rank comes from the k-th slice of the global batch, as in one process.
        mb_local = len(rows) // mb_per_batch
        t_update, n_upd = 0.0, 0
        for mb in range(mb_per_batch):
            if step >= cfg.train.max_steps:
                break
            if crash_at and step == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)  # test hook: a real hard kill
            staleness = mb
            if staleness > cfg.loss.max_staleness:
                raise RuntimeError(f"batch is {staleness} steps stale (> max_staleness)")
            sl = slice(mb * mb_local, (mb + 1) * mb_local)
            sub = list(range(len(rows)))[sl]
            t0 = time.perf_counter()
            batch = collate([rows[i].ids for i in sub], [samples[i].completion_ids for i in sub],
                            tokenizer.pad_token_id,
                            {"sampler_lp": [samples[i].sampler_logprobs for i in sub],
                             "teacher_lp": [teacher_lp[i] for i in sub]})
            mask = batch["mask"]
            n_tok = torch.tensor([mask.sum().item()])
            n_tok_global = accelerator.reduce(n_tok.clone(), reduction="sum").item()
            if full_kl:
                trainer_lp, trainer_full = completion_logprobs(model, batch, full=True)
                teacher_raw_BTV = _pad_full([teacher_full[i] for i in sub], mask.shape[1], trainer_full.shape[-1])
                teacher_full_BTV = L.sharpen(teacher_raw_BTV, cfg.loss.teacher_temperature)
            else:
                trainer_lp = completion_logprobs(model, batch)
            off_B = torch.tensor([off[i] for i in sub], dtype=torch.bool)
            if off_B.any():  # teacher-forced rows: no sampler, no importance correction
                batch["sampler_lp"][off_B] = trainer_lp.detach()[off_B]
            ins_BT = torch.isnan(batch["sampler_lp"])   # tokens the teacher inserted (correct_below)
            if ins_BT.any():
                batch["sampler_lp"] = torch.where(ins_BT, trainer_lp.detach(), batch["sampler_lp"])
            rew = L.token_rewards(batch["teacher_lp"], trainer_lp, mask)
            # With loss.kl=full the KL term is exact and the advantages carry only the task reward.
            adv = L.discounted_returns(rew, mask, cfg.loss.discount) if not full_kl else torch.zeros_like(rew)
            if cfg.loss.task_reward_alpha > 0:
                adv = adv + cfg.loss.task_reward_alpha * task_reward[sl].unsqueeze(1) * mask
            if cfg.loss.baseline == "domain_mean":
                # Per-domain token mean over the global minibatch, so ranks agree.
                dom_ids = torch.tensor([domains.index(rows[i].domain) for i in sub])
                onehot_BD = torch.nn.functional.one_hot(dom_ids, len(domains)).float()
                sums = torch.stack([(adv * mask).sum(1) @ onehot_BD, mask.sum(1) @ onehot_BD])
                sums = accelerator.reduce(sums, reduction="sum")
                mean_D = sums[0] / sums[1].clamp(min=1)
                adv = L.subtract_baseline(adv, mask, (onehot_BD @ mean_D))
            isw = L.importance_weights(trainer_lp, batch["sampler_lp"], mask, cfg.loss.is_truncation,
                                       cfg.loss.is_mask_low, cfg.loss.is_mask_high)
            loss = L.policy_gradient_loss(trainer_lp, adv, isw.weights_BT, n_tok_global) * world
            # The logged reverse KL per token: exact over the vocabulary when the teacher's whole
            # distribution is at hand (the one-sample estimate -rew is biased once samples are
            # drawn below temperature 1 or corrected), against the teacher itself.
            kl_log_BT = -rew.detach()
            if full_kl:
                kl_BT = L.full_divergence(trainer_full, teacher_full_BTV, mask, cfg.loss.beta)
                loss = loss + L.full_kl_loss(kl_BT, isw.weights_BT, n_tok_global) * world
                # the loss term is already that KL when it is the reverse KL to the unsharpened teacher
                kl_log_BT = (kl_BT.detach() if cfg.loss.beta == 1.0 and teacher_full_BTV is teacher_raw_BTV
                             else L.full_reverse_kl(trainer_full.detach(), teacher_raw_BTV, mask))
            accelerator.backward(loss)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.train.grad_clip) \
                if cfg.train.grad_clip > 0 else torch.tensor(0.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            t_update += time.perf_counter() - t0
            n_upd += int(n_tok.item())
            step += 1

            # --- metrics: per-domain sums reduced over ranks, then divided
            sub_dom = [rows[i].domain for i in sub]
            stats = []
            for d in domains:
                dm = torch.tensor([x == d for x in sub_dom], dtype=torch.float32).unsqueeze(1) * mask
                tok = dm.sum()
                seqs = torch.tensor(float(sum(x == d for x in sub_dom)))
                dm_on = dm * (~off_B).float().unsqueeze(1) * (~ins_BT).float()  # the student's own tokens only
                on_d = torch.tensor([x == d and not off[i] for x, i in zip(sub_dom, sub)], dtype=torch.float32)
                fixed_d = torch.tensor([float(n_fixed[i] > 0) for i in sub]) * on_d
                mm = L.mismatch_stats(trainer_lp, batch["sampler_lp"], dm_on)
                stats.append(torch.stack([
                    tok, seqs, (kl_log_BT * dm_on).sum(), mm["abs_sum"], mm["k3_sum"],
                    (isw.ratio_BT * dm).sum(), ((1 - isw.keep_BT) * dm).sum(),
                    ((isw.ratio_BT > cfg.loss.is_truncation).float() * dm).sum(),
                    (task_reward[sl] * torch.tensor([x == d for x in sub_dom], dtype=torch.float32)).sum(),
                    dm_on.sum(), on_d.sum(), fixed_d.sum(),
                ]))
                stats.append(torch.stack([mm["abs_max"], ((isw.ratio_BT * dm).max() if tok > 0 else torch.tensor(0.)),
                                          *[torch.zeros(())] * 10]))
            S = torch.stack(stats).detach().float()
            sums = accelerator.reduce(S[0::2].clone(), reduction="sum")
            maxes = S[1::2].clone()
            if world > 1:
                torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX)
            loss_g = accelerator.reduce(loss.detach().reshape(1) / world, reduction="sum").item()
            m: dict[str, float] = {"loss": loss_g, "lr": scheduler.get_last_lr()[0],
                                   "grad_norm": float(grad_norm), "staleness": staleness}
            for j, d in enumerate(domains):
                tok, seqs = sums[j, 0].item(), sums[j, 1].item()
                if tok == 0:
                    continue
                tok_on = sums[j, 9].item()   # KL and sampler mismatch: on-policy rows only
                if tok_on > 0:
                    m[f"reverse_kl/{d}"] = sums[j, 2].item() / tok_on
                    m[f"mismatch/abs_mean/{d}"] = sums[j, 3].item() / tok_on
                    m[f"mismatch/abs_max/{d}"] = maxes[j, 0].item()
                    m[f"mismatch/k3/{d}"] = sums[j, 4].item() / tok_on
                m[f"is/ratio_mean/{d}"] = sums[j, 5].item() / tok
                m[f"is/ratio_max/{d}"] = maxes[j, 1].item()
                m[f"is/masked_frac/{d}"] = sums[j, 6].item() / tok
                m[f"is/truncated_frac/{d}"] = sums[j, 7].item() / tok
                m[f"response_len/{d}"] = tok / max(seqs, 1)
                if cfg.loss.task_reward_alpha > 0:
                    m[f"task_reward/{d}"] = sums[j, 8].item() / max(seqs, 1)
                if rd[d].correct_below > 0 and sums[j, 10].item() > 0:
                    # share of the student's samples that needed at least one teacher token
                    m[f"corrected_frac/{d}"] = sums[j, 11].item() / sums[j, 10].item()
            if mb == 0:
                tot = accelerator.reduce(torch.tensor([float(n_gen), t_sample, t_teacher, t_correct]),
                                         reduction="sum")
                m["time/sample_s"] = tot[1].item() / world
                m["time/teacher_s"] = tot[2].item() / world
                if r.any_correction:   # re-sampling and re-scoring the corrected rows
                    m["time/correct_s"] = tot[3].item() / world
                m["tokens_per_s/sample"] = tot[0].item() / max(tot[1].item() / world, 1e-9)
                m["tokens_per_s/teacher"] = tot[0].item() / max(tot[2].item() / world, 1e-9)
            m["time/update_s"] = t_update
            m["tokens_per_s/update"] = n_tok_global / max(t_update, 1e-9)
            m["tokens"] = float(n_tok_global)  # student tokens trained on this step (all ranks)
            if r.any_references:  # over the global minibatch, like every other metric
                n_off = accelerator.reduce(torch.tensor([float(off_B.sum()), float(len(off_B)),
                                                         float((mask * (~off_B).float().unsqueeze(1)).sum())]),
                                           reduction="sum")
                m["off_policy_frac"] = n_off[0].item() / max(n_off[1].item(), 1.0)
                m["tokens/on_policy"] = n_off[2].item()   # of `tokens`, those in the student's own samples
            history.append({"step": step, **m})
            if main:
                mlflow.log_metrics(m, step=step)
                kls = {d: m.get(f"reverse_kl/{d}") for d in domains}
                bar.set_postfix({f"kl/{d}": f"{v:.3f}" for d, v in kls.items() if v is not None})
                bar.update(1)
            t_update, n_upd = 0.0, 0
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < cfg.train.max_steps:
                save_checkpoint(accelerator, model, tokenizer, out, step,
                                {"data": sampler.state_dict(), "mlflow_run_id": run_id, "history": history},
                                cfg.train.keep_checkpoints)
        # New weights go into the sampler in memory after every update of the batch.
        rollout.sync_weights(sampler_weights(accelerator.unwrap_model(model)))
    bar.close()

    # --- final save: HF checkpoint (LoRA merged) + MLflow artifacts
    save_checkpoint(accelerator, model, tokenizer, out, step,
                    {"data": sampler.state_dict(), "mlflow_run_id": run_id, "history": history},
                    cfg.train.keep_checkpoints)
    final_dir = out / "final"
    if main:
        shutil.rmtree(final_dir, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        export_model(unwrapped, tokenizer, final_dir)
        (out / "history.json").write_text(json.dumps(history))
        if cfg.mlflow.log_model:
            mlflow.log_artifacts(str(final_dir), "model")
        mlflow.end_run()
        print_table(history, domains)
    accelerator.wait_for_everyone()
    rollout.close()
    for t in teachers.values():
        t.close()
    return {"history": history, "final": str(final_dir), "mlflow_run_id": run_id, "domains": domains}


def export_model(model, tokenizer, out_dir: Path):
    """Plain HF checkpoint of what the student is: LoRA merged and, with QAT, the
    fake-quantized weights (those are the weights it was trained to use); loads with
    AutoModelForCausalLM and vLLM like any other checkpoint."""
    from transformers import AutoModelForCausalLM

    sd = quantized_state_dict(model)
    base = model.get_base_model() if getattr(model, "peft_config", None) is not None else model
    plain = AutoModelForCausalLM.from_config(base.config, dtype=next(base.parameters()).dtype)
    plain.load_state_dict(sd, strict=True)
    plain.save_pretrained(str(out_dir), safe_serialization=True)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def print_table(history: list[dict], domains: list[str]):
    from rich.console import Console
    from rich.table import Table

    if not history:
        return
    k = min(5, len(history))
    t = Table(title=f"MOPD: {len(history)} steps")
    for c in ("domain", "reverse KL first", "reverse KL last", "|Δ log p| sampler/trainer", "resp len"):
        t.add_column(c)
    for d in domains:
        f = [h[f"reverse_kl/{d}"] for h in history[:k] if f"reverse_kl/{d}" in h]
        l_ = [h[f"reverse_kl/{d}"] for h in history[-k:] if f"reverse_kl/{d}" in h]
        mm = [h[f"mismatch/abs_mean/{d}"] for h in history[-k:] if f"mismatch/abs_mean/{d}" in h]
        ln = [h[f"response_len/{d}"] for h in history[-k:] if f"response_len/{d}" in h]
        avg = lambda x: f"{sum(x) / len(x):.4f}" if x else "-"
        t.add_row(d, avg(f), avg(l_), avg(mm), avg(ln))
    Console(stderr=True).print(t)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="mopd.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. train.max_steps=10")
    args = ap.parse_args(argv)
    cfg = load_config(DistillConfig, args.config, args.overrides)
    run(cfg, args.out)


if __name__ == "__main__":
    main()
