"""The MOPD recipe: one dataclass tree, loaded from YAML (`core.config.load_config`).

Every field carries its help text (`metadata["help"]`); `mopd distill --help-config`
prints them and `python scripts/config_reference.py` writes docs/config-reference.md
from them, so the reference cannot drift from the code.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from core.config import option
from core.quant_config import QuantConfig


def _finite(name: str, v: float) -> float:
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v}")
    return v


def _at_least(name: str, v: int, low: int) -> None:
    if v < low:
        raise ValueError(f"{name} must be >= {low}, got {v}")


@dataclass
class LoraConfig:
    enabled: bool = option("train a LoRA adapter instead of the full weights", False)
    r: int = option("LoRA rank", 16)
    alpha: int = option("LoRA alpha (scale = alpha / r)", 32)
    dropout: float = option("dropout on the LoRA branch (MOPD turns it off, with the checkpoint's own, unless "
                            "model.dropout=true; so does the experts' GRPO)", 0.0)
    target_modules: list[str] = option(
        "module names that get an adapter",
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def validate(self):
        _at_least("model.lora.r", self.r, 1)
        _at_least("model.lora.alpha", self.alpha, 1)
        if not 0.0 <= _finite("model.lora.dropout", self.dropout) < 1.0:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class ModelConfig:
    path: str = option("the student's starting checkpoint (HF directory)", "")
    dtype: str = option("float32, bfloat16 or float16, for the student, its sampler and the teachers", "float32")
    lora: LoraConfig = option("optional LoRA adapter (the merged weight is what QAT quantizes)", factory=LoraConfig)
    dropout: bool = option(
        "keep the checkpoint's dropout (attention_dropout, ...) and model.lora.dropout in the trainer's forward. "
        "Off by default: the sampler never drops units, so with dropout on the trainer's log-probs of the "
        "samples are not the sampler's (importance weights off 1, tokens masked as off-policy); a warning "
        "says so when it is on", False)
    gradient_checkpointing: bool = option(
        "recompute each decoder layer's activations in the backward pass instead of keeping them: the "
        "activations held for backward drop from every layer's to about one layer's, for about one more "
        "forward of compute. The update is the same (bench/grad_checkpointing.py measures the memory)", False)

    def validate(self):
        if not self.path:
            raise ValueError("model.path is required (the student's starting checkpoint)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class DatasetSpec:
    path: str = option("a save_to_disk directory, or a .jsonl/.json/.parquet/.csv file")
    split: str = option("the split to read from a DatasetDict directory", "train")


@dataclass
class DataConfig:
    datasets: list[DatasetSpec] = option("prompt datasets; rows need a chat `prompt` and a `domain` column "
                                        "(optionally `effort`, and `completion` for teacher-forced rows)",
                                        factory=list)
    mix: dict[str, float] = option("domain -> sampling weight of its prompts; empty: uniform; 0 leaves a "
                                  "domain out", factory=dict)
    prompt_column: str = option("the column holding the prompt (a string or a list of messages)", "prompt")
    max_prompt_tokens: int = option("longer prompts (after the chat template) are skipped", 256)

    def validate(self):
        _at_least("data.max_prompt_tokens", self.max_prompt_tokens, 1)
        for d, w in self.mix.items():
            if not math.isfinite(w) or w < 0:
                raise ValueError(f"data.mix.{d}={w}: a weight must be a finite number >= 0 (0 leaves the "
                                 "domain out)")
        if self.mix and sum(self.mix.values()) <= 0:
            raise ValueError(f"data.mix gives every domain weight 0 ({self.mix}): at least one must be > 0")


@dataclass
class TeacherSpec:
    path: str = option("the teacher: an HF directory or an MLflow model URI (models:/<name>@teacher); with "
                       "backend server optional (the model `mopd teachers serve` starts, and the student's fit "
                       "is also checked against its files)", "")
    backend: Literal["hf", "vllm", "server"] = option(
        "hf: in-process forward (full distributions); vllm: a colocated engine's prompt_logprobs; server: a "
        "vLLM OpenAI-compatible server's prompt_logprobs over HTTP (vllm and server: sampled-token log-probs, "
        "so loss.kl=sampled, unless top_k > 0)", "hf")
    adapter: str = option("a LoRA adapter (peft folder or models:/ URI) on the base `path`; teachers whose "
                          "adapters share a base and backend are served by one model/engine, one adapter per "
                          "domain (backend server: `mopd teachers serve` starts one server of the base with "
                          "--enable-lora, each adapter a LoRA module named by its `model`). Empty: `path` is a "
                          "full model, or a registered LoRA expert whose base is read from the registry", "")
    urls: list[str] = option("backend server: base URLs of servers of this teacher (http://host:8000); "
                             "requests go to the one that answered last, the others are its fail-over",
                             factory=list)
    model: str = option("backend server: the served model name (vllm serve --served-model-name, or a LoRA "
                        "module's name)", "")
    timeout_s: float = option("backend server: seconds one request may take before it counts as failed", 60.0)
    max_retries: int = option("backend server: rounds over every URL after the first, with backoff, before "
                              "the run stops naming the teacher and its URLs", 3)
    backoff_s: float = option("backend server: wait before retry round r is backoff_s * 2**(r-1)", 1.0)
    concurrency: int = option("backend server: requests in flight at once per teacher", 4)
    batch_size: int = option("backend server: sequences per request", 16)
    top_k: int = option(
        "backend server or vllm: > 0 asks the server or engine for its k most likely tokens at each position "
        "(prompt_logprobs=k) and uses them, renormalized, as the teacher's distribution, so loss.kl=full and "
        "rollout.correct_below work with it: the divergence is taken over those tokens (the student "
        "renormalized on them); 0: sampled-token log-probs only (loss.kl=sampled)", 0)

    def validate(self):
        _at_least("top_k", self.top_k, 0)
        if self.top_k and self.backend == "hf":
            raise ValueError("top_k is for backends server and vllm (top-k prompt_logprobs); backend hf returns "
                             "whole distributions already")
        if self.top_k and self.backend == "vllm" and self.adapter:
            raise ValueError("top_k with a LoRA adapter on backend vllm is not supported (the engine's LoRA "
                             "scoring returns sampled-token log-probs only): merge the adapter into its base "
                             "(teachers.lora.merge_adapter) or use backend hf")
        if self.backend != "server":
            if not self.path:
                raise ValueError(f"path is required with backend {self.backend} (an HF directory or models:/ URI)")
            if self.urls or self.model:
                raise ValueError(f"urls / model are for backend server; this teacher's backend is {self.backend}")
            if self.adapter and self.adapter == self.path:
                raise ValueError(f"adapter and path are both {self.adapter!r}: path is the base model the "
                                 f"adapter was trained on")
            return
        if self.adapter and not self.path:
            raise ValueError("a server teacher with an adapter needs path: the base model `mopd teachers serve` "
                             "starts with --enable-lora (the adapter is its LoRA module named `model`)")
        if not self.model:
            raise ValueError("backend server needs model: the name the server serves the teacher under")
        for u in self.urls:
            if not (u.startswith(("http://", "https://")) and len(u.split("://", 1)[1].strip("/")) > 0):
                raise ValueError(f"urls: {u!r} is not an http(s)://host:port URL")
        if not _finite("timeout_s", self.timeout_s) > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not _finite("backoff_s", self.backoff_s) >= 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")
        _at_least("max_retries", self.max_retries, 0)
        _at_least("concurrency", self.concurrency, 1)
        _at_least("batch_size", self.batch_size, 1)


@dataclass
class SamplerServer:
    urls: list[str] = option(
        "the vLLM sampler server(s) for rollout.backend=server (`mopd teachers serve` starts one and writes "
        "this override); trainer rank r samples from urls[r % len(urls)]", factory=list)
    transfer: Literal["gloo", "nccl"] = option(
        "how the trainer's weights reach the server: gloo (this project's `mopd_gloo` backend; CPU and GPU) "
        "or nccl (vLLM's; GPU servers)", "gloo")
    group_host: str = option("the trainer's address as the server reaches it (empty: the interface that "
                             "routes to the server)", "")
    group_port: int = option("first port of the weight-transfer rendezvous (one per server, upward)", 51216)
    timeout_s: float = option("seconds a request or a weight push may take before it is an error", 300.0)
    max_retries: int = option("retries of a failed sampling request (connection errors, 5xx), with backoff", 3)
    concurrency: int = option("sampling requests in flight at once, per trainer rank", 32)

    def validate(self):
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"rollout.server.urls: {u!r} is not an http(s) URL")
        if not 0 < self.group_port < 65536:
            raise ValueError(f"rollout.server.group_port must be a port number, got {self.group_port}")
        if not _finite("rollout.server.timeout_s", self.timeout_s) > 0:
            raise ValueError(f"rollout.server.timeout_s must be > 0, got {self.timeout_s}")
        _at_least("rollout.server.max_retries", self.max_retries, 0)
        _at_least("rollout.server.concurrency", self.concurrency, 1)


@dataclass
class DomainRollout:
    """One domain's own sampling settings (rollout.by_domain); unset keys take rollout's."""
    temperature: float | None = option("this domain's sampling temperature", None)
    top_p: float | None = option("this domain's nucleus sampling threshold", None)
    correct_below: float | None = option("this domain's teacher-correction threshold", None)
    correct_rounds: int | None = option("this domain's correction rounds per sample", None)
    on_policy_fraction: float | None = option("this domain's share of on-policy rows", None)
    on_policy_ramp_steps: int | None = option("this domain's ramp of the on-policy share", None)


@dataclass
class RolloutConfig:
    backend: Literal["vllm", "hf", "server"] = option(
        "the student's sampler: a colocated vLLM engine, HF generate, or a vLLM server in another process "
        "or node that takes the trainer's weights after every update (rollout.server)", "vllm")
    max_new_tokens: int = option("length budget of each sample", 64)
    temperature: float = option("sampling temperature (0: greedy)", 1.0)
    top_p: float = option("nucleus sampling threshold", 1.0)
    samples_per_prompt: int = option("samples drawn per prompt", 1)
    kv_cache_gb: float = option("vLLM KV-cache size in GiB (CPU engines)", 1.0)
    gpu_memory_utilization: float = option("vLLM's share of GPU memory (GPU engines)", 0.3)
    max_model_len: int = option("vLLM's context length (prompt + sample)", 512)
    enforce_eager: bool = option("True: the engine starts in seconds and samples ~2x slower", False)
    on_policy_fraction: float = option(
        "share of each batch's prompts the student answers itself (TRL GKD's `lmbda`); the rest train "
        "teacher-forced on the dataset's `completion` column, still against the teacher's whole "
        "distribution; 1: purely on-policy; below 1 needs loss.kl=full", 1.0)
    on_policy_ramp_steps: int = option(
        "> 0: the on-policy share ramps linearly from 0 at step 0 to on_policy_fraction at this step "
        "(teacher-forced first, the student's own samples once they are mostly right)", 0)
    correct_below: float = option(
        "> 0: teacher-corrected samples (Speculative KD): the first sampled token the teacher gives less "
        "than this probability (and that is not its own top token) is replaced by the teacher's top "
        "token and the student samples the rest again; needs loss.kl=full", 0.0)
    correct_rounds: int = option("at most this many corrections per sample", 2)
    async_steps: bool = option(
        "true: the next batch is sampled (with the weights before this update) while this batch's update "
        "runs, so its tokens train one batch old under the truncated IS correction; needs "
        "loss.max_staleness >= 2 * train.minibatches - 1; single-turn domains only (no agents, no "
        "correct_below)", False)
    server: SamplerServer = option("the sampler server (rollout.backend=server)", factory=SamplerServer)
    by_domain: dict[str, DomainRollout] = option(
        "per-domain settings over the ones above, e.g. {math: {temperature: 0.5}}: each team tuned its "
        "rollouts for its own domain, and one setting rarely suits all", factory=dict)

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
        self.server.validate()   # its urls are checked before the run (check_inputs): `teachers serve` writes them
        for d in self.by_domain:
            try:
                self.for_domain(d).validate()
            except ValueError as e:
                raise ValueError(f"by_domain.{d}: {e}") from None
        # a negative temperature samples the *least* likely tokens (HF) or fails only once
        # vLLM's engine started; top_p 0 is a silent greedy (HF) or a traceback (vLLM)
        if not _finite("rollout.temperature", self.temperature) >= 0:
            raise ValueError(f"rollout.temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0.0 < _finite("rollout.top_p", self.top_p) <= 1.0:
            raise ValueError(f"rollout.top_p must be in (0, 1] (1: off), got {self.top_p}")
        _at_least("rollout.samples_per_prompt", self.samples_per_prompt, 1)
        _at_least("rollout.max_new_tokens", self.max_new_tokens, 1)
        _at_least("rollout.max_model_len", self.max_model_len, 2)
        if not _finite("rollout.kv_cache_gb", self.kv_cache_gb) > 0:
            raise ValueError(f"rollout.kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if not 0.0 < _finite("rollout.gpu_memory_utilization", self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.backend in ("vllm", "server") and self.max_new_tokens >= self.max_model_len:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} leaves no room for the prompt in "
                             f"rollout.max_model_len={self.max_model_len}")
        _finite("rollout.on_policy_fraction", self.on_policy_fraction)
        _finite("rollout.correct_below", self.correct_below)
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
class PartialRollouts:
    """Partial rollouts of an agent domain in the MOPD loop: a step stops waiting for its
    slowest episodes; those still going carry over and continue with the next step's weights."""
    enabled: bool = option("true: a step stops waiting for its episodes at min_finished / max_tokens; false "
                           "(the default): every episode of a step is played to its end before the update", False)
    min_finished: float = option(
        "a step stops playing once this share of its episodes (carried over + new) has ended; the others "
        "carry over to the next step, continue with its weights, and are trained once they end", 1.0)
    max_tokens: int = option("a step also stops playing once its episodes of this domain sampled this many "
                             "student tokens (0: no budget)", 0)

    def validate(self):
        if not 0.0 < _finite("partial.min_finished", self.min_finished) <= 1.0:
            raise ValueError(f"partial.min_finished must be in (0, 1] (a share of the step's episodes), "
                             f"got {self.min_finished}")
        _at_least("partial.max_tokens", self.max_tokens, 0)


@dataclass
class AgentDomainConfig:
    """A domain whose rows are agent tasks: the student plays multi-turn episodes against an
    environment instead of answering once (core.agent.episode)."""
    env: str = option("'module:function' building the environment, called as factory(harness_cfg=..., "
                      "memory=...) once per episode (core.agent.env.ToolEnv over the domain's tools)",
                      "rewards.agent:make_env")
    harnesses: str = option("harness-mix YAML (core.agent.harness.load_harnesses); each episode's harness is "
                            "drawn from its `harnesses` with a seeded rng, `held_out` ones are never trained "
                            "with", "")
    max_turns: int = option("student turns per episode; an episode still going after them is cut", 16)
    max_context_tokens: int = option("tokens one episode's sequence may reach (prompt, turns, observations); a "
                                     "turn that would not fit is not sampled and the episode is cut", 1024)
    max_new_tokens: int = option("length budget of each turn (a turn cut by it gets the template's end of "
                                 "turn, without loss)", 64)
    partial: PartialRollouts = option(
        "partial rollouts (off by default): a step trains on the episodes that ended and carries the rest "
        "over; each token keeps its sampler log-prob and weights version, its importance weight corrects "
        "for the newer weights, and tokens more than loss.max_staleness versions old get no loss",
        factory=PartialRollouts)

    def validate(self):
        if not self.harnesses:
            raise ValueError("harnesses is required: a harness-mix YAML (core.agent.harness.load_harnesses)")
        if ":" not in self.env:
            raise ValueError(f"env must be 'module:function', got {self.env!r}")
        if self.max_turns < 1 or self.max_new_tokens < 1:
            raise ValueError(f"max_turns ({self.max_turns}) and max_new_tokens ({self.max_new_tokens}) must be >= 1")
        if self.max_context_tokens <= self.max_new_tokens:
            raise ValueError(f"max_context_tokens ({self.max_context_tokens}) must be above max_new_tokens "
                             f"({self.max_new_tokens}): the prompt and one turn must fit")


# loss.estimator: the fields each named estimator sets (docs/estimators.md). A name is the
# estimator whole: these values replace the recipe's for the same keys.
ESTIMATORS: dict[str, dict] = {
    # today's pipeline loss: forward KL over the vocabulary to the 0.5-sharpened teacher (GKD)
    "gkd_full": dict(kl="full", beta=0.0, teacher_temperature=0.5, discount=0.0, task_reward_alpha=0.0,
                     outcome="raw"),
    # Thinking Machines' on-policy distillation: reverse KL on the sampled token, samples at
    # temperature 1 (DistillConfig checks the rollout), truncated IS for the sampler gap
    "sampled_reverse_kl": dict(kl="sampled", beta=1.0, teacher_temperature=1.0, discount=0.0,
                               task_reward_alpha=0.0, outcome="raw"),
    # the seeds' (and MiMo's) MOPD: A_t = log p_T(y_t) - log p_S(y_t) + alpha * the outcome
    # reward normalized over the prompt's samples, IS-weighted; alpha is the recipe's (> 0)
    "mopd_advantage": dict(kl="sampled", beta=1.0, teacher_temperature=1.0, discount=0.0, outcome="group"),
}


@dataclass
class LossConfig:
    estimator: Literal["", "gkd_full", "sampled_reverse_kl", "mopd_advantage"] = option(
        "a named estimator that sets the keys defining it (docs/estimators.md): gkd_full (forward KL over "
        "the vocabulary to the 0.5-sharpened teacher), sampled_reverse_kl (sampled-token reverse KL at "
        "temperature 1, IS-weighted), mopd_advantage (token advantage log p_T - log p_S plus "
        "task_reward_alpha times the outcome reward normalized over each prompt's samples); empty: the "
        "keys as given", "")
    outcome: Literal["raw", "group"] = option(
        "how the task reward enters the advantage (with task_reward_alpha > 0): raw, alpha * R; group, "
        "alpha * (R - mean) / (std + 1e-4) over the rollout.samples_per_prompt samples of the same prompt "
        "(GRPO's group normalization)", "raw")
    discount: float = option("gamma of the returns: 0 per-token reward, 1 undiscounted return", 0.0)
    task_reward_alpha: float = option("advantage += alpha * the domain's task reward (see `rewards`)", 0.0)
    is_truncation: float = option("C in min(rho, C): the importance weight's cap", 2.0)
    is_mask_low: float = option("tokens whose importance ratio is below this are dropped", 0.5)
    is_mask_high: float = option("tokens whose importance ratio is above this are dropped", 2.0)
    max_staleness: int = option("optimizer steps a sampled batch may lag the weights", 1)
    baseline: Literal["none", "domain_mean", "leave_one_out"] = option(
        "subtracted from the advantages to lower the variance when every sampled token has a large negative "
        "reward. leave_one_out: the token mean of the advantages of the other rows of the row's domain (never "
        "its own: the expected gradient is unchanged); domain_mean: the domain's token mean including the row "
        "itself (biased by about the row's share of its domain's tokens, O(1/N)); none", "leave_one_out")
    kl: Literal["sampled", "full"] = option(
        "sampled: the dense reward log p_T(y_t) - log p_S(y_t) on the sampled token, trained with a "
        "policy gradient (any teacher backend); full: the exact divergence over the whole vocabulary "
        "at each sampled position (hf teachers, or server and vllm ones with top_k); both are on-policy", "sampled")
    beta: float = option("kl=full: 1 reverse KL, 0 forward KL(teacher || student), in between the "
                        "generalized JSD (TRL's DistillationConfig.beta)", 1.0)
    teacher_temperature: float = option(
        "kl=full: train toward the teacher's distribution at this temperature (below 1 sharper); the "
        "logged KL stays against the teacher itself", 1.0)
    pack_completions: bool = option(
        "with logits_chunk=0: the student's output layer, log-softmax and divergence run on its completion "
        "tokens only, packed into one [tokens, vocabulary] block (no prompt or padding positions), the same "
        "loss and gradient up to rounding; false: on the padded [batch, length, vocabulary] logits (models "
        "whose logits are changed after the output layer always take that path)", True)
    logits_chunk: int = option(
        "> 0: the student's logits and both distributions are made this many completion positions at a time, "
        "each chunk recomputed in the backward instead of kept, so no [batch, length, vocabulary] tensor is "
        "ever whole (the loss's memory grows with the chunk, not with batch x length x vocabulary); the same "
        "loss and gradient up to rounding. 0: all at once. HF causal LMs, one process, DDP or FSDP2 (the head, "
        "applied outside the forward, still takes its gradient all-reduce or its shard's all-gather)", 0)

    def __post_init__(self):
        for k, v in ESTIMATORS.get(self.estimator, {}).items():
            setattr(self, k, v)

    def validate(self):
        if self.estimator == "mopd_advantage" and self.task_reward_alpha <= 0:
            raise ValueError("loss.estimator=mopd_advantage adds alpha times the group-normalized outcome "
                             "reward: set loss.task_reward_alpha > 0 (e.g. 1.0), or use sampled_reverse_kl")
        for k in ("discount", "task_reward_alpha", "is_truncation", "is_mask_low", "is_mask_high", "beta",
                  "teacher_temperature"):
            _finite(f"loss.{k}", getattr(self, k))
        if self.task_reward_alpha < 0:
            raise ValueError(f"loss.task_reward_alpha must be >= 0, got {self.task_reward_alpha}")
        if self.is_truncation <= 0:
            raise ValueError(f"loss.is_truncation must be > 0, got {self.is_truncation}")
        _at_least("loss.max_staleness", self.max_staleness, 0)
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {self.discount}")
        if not 0 < self.is_mask_low <= 1.0 <= self.is_mask_high:
            raise ValueError("need 0 < is_mask_low <= 1 <= is_mask_high")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"loss.beta must be in [0, 1] (1 reverse KL, 0 forward KL), got {self.beta}")
        if self.teacher_temperature <= 0:
            raise ValueError(f"loss.teacher_temperature must be > 0, got {self.teacher_temperature}")
        _at_least("loss.logits_chunk", self.logits_chunk, 0)
        if self.teacher_temperature != 1.0 and self.kl != "full":
            raise ValueError(f"loss.teacher_temperature={self.teacher_temperature} reshapes the teacher's whole "
                             f"next-token distribution: it needs loss.kl=full")
        if self.beta != 1.0 and self.kl != "full":
            raise ValueError(f"loss.beta={self.beta} picks the divergence over the whole vocabulary: it needs "
                             f"loss.kl=full (kl=sampled estimates the reverse KL on the sampled token only)")


@dataclass
class TrainConfig:
    max_steps: int = option("optimizer steps", 100)
    max_tokens: int = option("also stop once the student has trained on this many of its tokens (all processes; "
                             "0: steps only). max_steps stays the cap and the length of the lr schedule", 0)
    prompts_per_step: int = option("prompts per sampled batch, global across processes", 32)
    minibatches: int = option("optimizer steps per sampled batch (later ones are stale)", 1)
    micro_batches: int = option(
        "each minibatch's forward and backward run in this many micro-batches whose gradients are summed "
        "before its one optimizer step: the same update, with the activations of one micro-batch at a time "
        "(the rows are sorted by length before they are cut, so each is padded to its own longest row)", 1)
    optimizer: Literal["adamw", "sgd"] = option("the optimizer", "adamw")
    lr: float = option("peak learning rate", 1e-4)
    weight_decay: float = option("weight decay", 0.0)
    adam_betas: list[float] = option(
        "AdamW's betas; beta2 is how many steps the per-weight gradient scale remembers (~1/(1-beta2)); "
        "the SFT stages and seq-KD use [0.9, 0.95]", factory=lambda: [0.9, 0.999])
    warmup_steps: int = option("linear warm-up steps", 0)
    lr_schedule: Literal["constant", "cosine", "linear"] = option("decay after the warm-up", "constant")
    lr_min_ratio: float = option("cosine / linear decay ends at lr * this", 0.0)
    grad_clip: float = option("gradient-norm clip (0: off)", 1.0)
    seed: int = option("seeds the prompt stream, the samples and the initialisation", 0)
    save_every: int = option("checkpoint every N steps (0: only the final one)", 0)
    keep_checkpoints: int = option("checkpoints kept on disk", 2)
    resume: bool = option("continue from the latest good checkpoint in --out, in the same MLflow run; "
                          "refused when the training settings differ from the checkpoint's", False)
    accept_config_change: bool = option(
        "with resume: continue even though training settings differ from the checkpoint's; the new "
        "settings apply from the resumed step on (lr and schedule included) and the change is tagged "
        "on the MLflow run", False)

    def validate(self):
        if self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0: no token limit), got {self.max_tokens}")
        if self.prompts_per_step < 1 or self.minibatches < 1:
            raise ValueError("prompts_per_step and minibatches must be >= 1")
        _at_least("train.micro_batches", self.micro_batches, 1)
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"train.lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}")
        if not _finite("train.lr", self.lr) > 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if not _finite("train.weight_decay", self.weight_decay) >= 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if not _finite("train.grad_clip", self.grad_clip) >= 0:
            raise ValueError(f"train.grad_clip must be >= 0 (0: off), got {self.grad_clip}")
        _at_least("train.warmup_steps", self.warmup_steps, 0)
        _at_least("train.save_every", self.save_every, 0)
        _at_least("train.keep_checkpoints", self.keep_checkpoints, 1)
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"train.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")


@dataclass
class MlflowConfig:
    experiment: str = option("MLflow experiment name", "mopd")
    tracking_uri: str | None = option("default: $MLFLOW_TRACKING_URI, else sqlite:///<out>/mlflow.db", None)
    run_name: str | None = option("default: the --out folder's name", None)
    log_model: bool = option("log the final model as an MLflow transformers model (`model` of the run: "
                             "mlflow.transformers.load_model('runs:/<id>/model') opens it)", True)
    register: bool = option("with log_model: register the final model as a new version of <registered_name>-student "
                            "(alias student), tagged with its lineage: each teacher's version, the data mix, the "
                            "recipe's hash", True)
    registered_name: str | None = option("the student's registered name, -student appended (default: the run name)",
                                         None)
    tags: dict[str, str] = option("extra run tags", factory=dict)
    parent_run_id: str | None = option("nest the run under this MLflow run (the pipeline sets it)", None)


@dataclass
class DistillConfig:
    model: ModelConfig = option("the student", factory=ModelConfig)
    data: DataConfig = option("prompt datasets and the domain mix", factory=DataConfig)
    teachers: dict[str, TeacherSpec] = option("'domain' or 'domain/effort' -> its teacher", factory=dict)
    rewards: dict[str, str] = option("domain -> 'module:function' task reward (with loss.task_reward_alpha); "
                                    "an agent domain's task reward is its episodes' own", factory=dict)
    reward_kwargs: dict[str, dict] = option("domain -> keyword arguments of its reward, e.g. "
                                           "{chat: {reward_model: runs/pipeline/chat_rm}}", factory=dict)
    rollout: RolloutConfig = option("how the student samples", factory=RolloutConfig)
    agents: dict[str, AgentDomainConfig] = option(
        "domain -> its environment and harnesses: that domain's rows (with a `task` column, a JSON object) "
        "are played as multi-turn episodes; the teacher scores each whole transcript and only the "
        "student's own tokens carry loss", factory=dict)
    loss: LossConfig = option("the distillation loss", factory=LossConfig)
    train: TrainConfig = option("optimizer, schedule, checkpoints", factory=TrainConfig)
    mlflow: MlflowConfig = option("tracking", factory=MlflowConfig)
    quant: QuantConfig = option("quantization-aware training (INT4 fake-quant, the sampler gets the same "
                               "weights)", factory=QuantConfig)

    @property
    def uses_vllm(self) -> bool:
        """A vLLM engine (the student's sampler, in process or a server `mopd teachers serve`
        starts with rollout.max_model_len, or a teacher) holds the sequences."""
        return self.rollout.backend in ("vllm", "server") or any(t.backend == "vllm" for t in self.teachers.values())

    def check_context(self, domains: list[str] | None = None, positions: int | None = None,
                      model: str = "the student") -> None:
        """Prompt plus completion within the engines' rollout.max_model_len (when vLLM is
        used) and within `positions`, the model's max_position_embeddings (when known):
        a single-turn row is up to data.max_prompt_tokens + rollout.max_new_tokens tokens,
        an agent episode up to its max_context_tokens. `domains`: the domains the data has
        (None: single-turn rows unless the config has agent domains). A ValueError when not."""
        single = (not self.agents) if domains is None else any(d not in self.agents for d in domains)
        agent = [d for d in (self.agents if domains is None else domains) if d in self.agents]
        need = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        limits = []
        if self.uses_vllm:
            limits.append(("rollout.max_model_len", self.rollout.max_model_len, "raise rollout.max_model_len"))
        if positions is not None:
            limits.append((f"{model}'s max_position_embeddings", positions, "use a model with more positions"))
            if self.uses_vllm and self.rollout.max_model_len > positions:
                raise ValueError(f"rollout.max_model_len={self.rollout.max_model_len} is above {model}'s "
                                 f"max_position_embeddings={positions}: lower it to {positions} at most")
        for name, limit, fix in limits:
            if single and need > limit:
                raise ValueError(f"data.max_prompt_tokens={self.data.max_prompt_tokens} + rollout.max_new_tokens="
                                 f"{self.rollout.max_new_tokens} = {need} tokens is above {name}={limit}: lower "
                                 f"data.max_prompt_tokens (longer prompts are skipped) or max_new_tokens, or {fix}")
            for d in agent:
                if self.agents[d].max_context_tokens > limit:
                    raise ValueError(f"agents.{d}.max_context_tokens={self.agents[d].max_context_tokens} is above "
                                     f"{name}={limit}: lower it, or {fix}")

    def check_async(self):
        """rollout.async_steps: the batch trained by a batch's last minibatch was sampled one
        whole batch (train.minibatches updates) before that batch began."""
        age = 2 * self.train.minibatches - 1
        if self.loss.max_staleness < age:
            raise ValueError(f"rollout.async_steps=true trains tokens up to {age} weights versions old "
                             f"(2 * train.minibatches - 1, train.minibatches={self.train.minibatches}), above "
                             f"loss.max_staleness={self.loss.max_staleness}: raise loss.max_staleness to {age}")
        if self.agents:
            raise ValueError(f"rollout.async_steps=true is for single-turn domains; agent domains "
                             f"{sorted(self.agents)} are not supported with it (use their partial rollouts)")
        if self.rollout.any_correction:
            raise ValueError("rollout.async_steps=true cannot be combined with rollout.correct_below > 0 "
                             "(the corrections would resample with newer weights than the batch's own)")

    def check_sampled_estimator(self):
        """loss.kl=sampled corrects tempered samples to the temperature-1 student with the
        weight p / q (mopd.distill.loss): q must give mass wherever p does, which greedy
        sampling and a top-p nucleus do not."""
        for where, r in [("rollout", self.rollout)] + [(f"rollout.by_domain.{d}", self.rollout.for_domain(d))
                                                       for d in sorted(self.rollout.by_domain)]:
            if r.temperature == 0 or r.top_p < 1.0:
                what = "temperature=0 (greedy)" if r.temperature == 0 else f"top_p={r.top_p}"
                raise ValueError(f"{where}: {what} with loss.kl=sampled: the sampled estimator trains the "
                                 f"temperature-1 student by reweighting each sampled token by p / q, and {what} "
                                 f"never samples some tokens the student gives mass to, so their part of the "
                                 f"gradient cannot be recovered; use temperature > 0 with top_p 1, or loss.kl=full "
                                 f"(exact over the vocabulary at every position, whatever the sampling)")

    def check_estimator(self):
        """What a named estimator needs of the rollout (loss.estimator)."""
        est = self.loss.estimator
        rollouts = [("rollout", self.rollout)] + [(f"rollout.by_domain.{d}", self.rollout.for_domain(d))
                                                  for d in sorted(self.rollout.by_domain)]
        if est == "sampled_reverse_kl":
            for where, r in rollouts:
                if r.temperature != 1.0 or r.top_p != 1.0:
                    raise ValueError(f"{where}: temperature={r.temperature}, top_p={r.top_p} with "
                                     "loss.estimator=sampled_reverse_kl, which samples at temperature 1 (top_p 1); "
                                     "set them to 1")
        if self.loss.outcome == "group" and self.rollout.samples_per_prompt < 2:
            raise ValueError(f"loss.outcome=group{' (loss.estimator=mopd_advantage)' if est else ''} normalizes "
                             f"the outcome reward over each prompt's samples: rollout.samples_per_prompt="
                             f"{self.rollout.samples_per_prompt} needs to be >= 2 (e.g. 4)")

    def validate(self):
        self.check_estimator()
        if not self.agents:     # with agent domains: once the data's domains are known (check_inputs)
            self.check_context()
        if self.train.minibatches - 1 > self.loss.max_staleness:
            raise ValueError(f"train.minibatches={self.train.minibatches} trains the last minibatch "
                             f"{self.train.minibatches - 1} steps after sampling, above "
                             f"loss.max_staleness={self.loss.max_staleness}")
        if self.train.prompts_per_step % self.train.minibatches:
            raise ValueError("train.prompts_per_step must be divisible by train.minibatches")
        if self.rollout.async_steps:
            self.check_async()
        if not self.data.datasets:
            raise ValueError("data.datasets is empty: give at least one prompt dataset")
        if not self.teachers:
            raise ValueError("teachers is empty: map each domain to a teacher checkpoint")
        for d, a in self.agents.items():
            r = self.rollout.for_domain(d)
            own = self.rollout.by_domain.get(d)
            # the top-level correct_below is for single-turn rows: episodes are never corrected
            if own is not None and (own.correct_below or 0) > 0:
                raise ValueError(f"agents.{d}: rollout.by_domain.{d}.correct_below={own.correct_below} "
                                 f"(teacher-corrected samples) is not supported for agent episodes: an episode's "
                                 f"later turns depend on the environment's answers to what was sampled")
            if r.uses_references:
                raise ValueError(f"agents.{d}: rollout.on_policy_fraction={r.on_policy_fraction} (ramp "
                                 f"{r.on_policy_ramp_steps} steps) trains on dataset completions, which agent "
                                 f"episodes do not have: agent domains are on-policy only (set it to 1 for {d!r})")
            if self.rollout.backend in ("vllm", "server") and a.max_context_tokens > self.rollout.max_model_len:
                raise ValueError(f"agents.{d}.max_context_tokens={a.max_context_tokens} is above "
                                 f"rollout.max_model_len={self.rollout.max_model_len}, the engines' context: "
                                 f"raise max_model_len or lower max_context_tokens")
        if self.rollout.any_references and self.loss.kl != "full":
            raise ValueError(f"rollout.on_policy_fraction={self.rollout.on_policy_fraction} (ramp "
                             f"{self.rollout.on_policy_ramp_steps} steps, or a by_domain one) trains some rows on "
                             f"dataset completions, which the sampled-token policy gradient cannot use (they are "
                             f"not the student's samples): set loss.kl=full")
        if self.rollout.any_correction and self.loss.kl != "full":
            raise ValueError(f"rollout.correct_below={self.rollout.correct_below} (or a by_domain one) checks "
                             f"each sampled token against the teacher's whole next-token distribution: "
                             f"set loss.kl=full")
        if self.loss.kl == "sampled":
            self.check_sampled_estimator()
        if self.loss.kl == "full":
            bad = sorted(f"{k} ({t.backend})" for k, t in self.teachers.items()
                         if t.backend != "hf" and not t.top_k > 0)
            if bad:
                raise ValueError(f"loss.kl=full needs each teacher's next-token distribution, which the hf "
                                 f"backend returns whole and a server or vllm teacher with top_k > 0 as its top "
                                 f"k tokens; teachers {bad} give sampled-token log-probs only: set top_k (server, "
                                 f"vllm), backend hf, or use loss.kl=sampled")
