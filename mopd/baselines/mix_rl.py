"""mix_rl: joint RL over every domain at once (Mix-RL, the MOPD paper's main comparison),
and cascade RL (the domains one after another), trained from the same starting point as
the MOPD student with the same number of student samples.

One TRL GRPOTrainer run over MOPD's own prompt stream (its data, domain mix, seed and
order: mopd_prompt_stream), each completion scored by its row's domain's reward
(rewards/<domain>.py, the chat one through the chat reward model). The rows reach TRL as
{prompt, row}: `row` indexes the Python-side prompt table, and one routing reward
function calls each domain's reward with that domain's rows and their own columns. That
keeps every domain's columns out of one Arrow table, where a column two domains share
with different types (or one domain lacks) would not fit.

Budget: `n_samples` student samples (completions) in all, as MOPD drew (prompts per
sampled batch x samples per prompt x sampled batches). With `batch_size` prompts per step
and `num_generations` completions per prompt, that is round(n_samples / (batch_size *
num_generations)) steps (at least one), each on a new prompt draw; the count trained is
in the summary. Cascade RL splits the samples evenly over its domains (the remainder
goes to the last), each domain a GRPO phase from the previous phase's model.

QAT is on while training when `quant` is given (like the experts), and the model is
exported through core.export (the fake-quantized INT4 grid), like every other model in
the report. Single-turn domains only: an agent domain's rows would need episodes, not
one completion; the caller leaves them out.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from core import ranks
from core.models import disable_dropout
from core.quant import quantize_once_per_generation


def _say(msg: str):
    print(f"[mix-rl] {msg}", file=sys.stderr, flush=True)


def rl_steps(n_samples: int, batch_size: int, num_generations: int) -> int:
    """GRPO steps whose samples (batch_size * num_generations each) come closest to n_samples."""
    if n_samples < 1:
        raise ValueError(f"mix_rl: n_samples must be >= 1, got {n_samples}")
    return max(1, round(n_samples / (batch_size * num_generations)))


def rl_prompts(stream: Iterable, n: int, domains: set[str] | None = None, *, max_scan: int = 1_000_000) -> list:
    """The first `n` prompts of `stream` (of `domains` only, when given)."""
    out, seen = [], 0
    for p in stream:
        seen += 1
        if domains is None or p.domain in domains:
            out.append(p)
            if len(out) == n:
                return out
        if seen >= max_scan:
            break
    raise ValueError(f"mix_rl: the prompt stream gave {len(out)} of {n} prompts"
                     + (f" of domains {sorted(domains)}" if domains else "") + f" in {seen} draws")


def plan_phases(stream: Iterable, domains: list[str], n_samples: int, *, batch_size: int, num_generations: int,
                cascade: bool = False) -> list[tuple[str, list]]:
    """[(phase name, its prompts)]: one phase "mix" over the stream as it comes, or (cascade)
    one phase per domain in `domains`' order, each that domain's prompts from the stream,
    with n_samples split evenly."""
    if not cascade:
        steps = rl_steps(n_samples, batch_size, num_generations)
        return [("mix", rl_prompts(stream, steps * batch_size, set(domains)))]
    stream = iter(stream)
    per, phases = n_samples // len(domains), []
    for i, d in enumerate(domains):
        share = per + (n_samples - per * len(domains) if i == len(domains) - 1 else 0)
        steps = rl_steps(share, batch_size, num_generations)
        phases.append((d, rl_prompts(stream, steps * batch_size, {d})))
    return phases


class RoutedReward:
    """One TRL reward over the rows of every domain: each domain's reward is called with its
    own rows and their columns (by the `row` column, an index into `rows`). It counts the
    samples and tokens it scored and keeps each domain's mean reward per call."""

    def __init__(self, rows: list, rewards: dict[str, Callable]):
        missing = sorted({p.domain for p in rows} - set(rewards))
        if missing:
            raise ValueError(f"mix_rl: no reward for domains {missing} (rewards for {sorted(rewards)})")
        self.rows, self.rewards = rows, rewards
        self.samples = 0
        self.tokens = 0
        self.history: list[dict[str, float]] = []
        self.__name__ = "mix_reward"    # TRL names the reward column after it

    def __call__(self, prompts, completions, row, completion_ids=None, log_metric=None, **_) -> list[float | None]:
        out: list[float | None] = [None] * len(prompts)
        by: dict[str, list[int]] = {}
        for i, r in enumerate(row):
            by.setdefault(self.rows[r].domain, []).append(i)
        means = {}
        for d, idx in by.items():
            ps = [self.rows[row[i]] for i in idx]
            keys = sorted({k for p in ps for k in p.columns})
            cols = {k: [p.columns.get(k) for p in ps] for k in keys}
            vals = self.rewards[d]([prompts[i] for i in idx], [completions[i] for i in idx], **cols)
            if len(vals) != len(idx):
                raise ValueError(f"mix_rl: the {d} reward returned {len(vals)} values for {len(idx)} rows")
            for i, v in zip(idx, vals):
                out[i] = None if v is None else float(v)
            got = [out[i] for i in idx if out[i] is not None]
            if got:
                means[d] = sum(got) / len(got)
                if log_metric is not None:
                    log_metric(f"reward/{d}", means[d])
        self.history.append(means)
        self.samples += len(prompts)
        if completion_ids is not None:
            self.tokens += sum(len(c) for c in completion_ids)
        return out


def _grpo(model, tok, prompts: list, reward: RoutedReward, out: Path, *, steps: int, lr: float, batch_size: int,
          num_generations: int, max_completion_length: int, temperature: float, beta: float, epsilon: float,
          loss_type: str, scale_rewards: str, warmup_steps: int, grad_clip: float, seed: int, logging_steps: int,
          progress: bool):
    import datasets
    from trl import GRPOConfig, GRPOTrainer  # trl loads in seconds: only when training starts

    from core.tracking import trainer_callback   # mlflow, likewise

    # the prompts in the stream's order, each once: the draws are already MOPD's mix
    ds = datasets.Dataset.from_dict({"prompt": [p.messages for p in prompts], "row": list(range(len(prompts)))})
    args = GRPOConfig(output_dir=str(out / "trainer"), max_steps=steps, learning_rate=lr, warmup_steps=warmup_steps,
                      lr_scheduler_type="constant_with_warmup" if warmup_steps else "constant",
                      max_grad_norm=grad_clip, seed=seed, data_seed=seed, logging_steps=logging_steps,
                      save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), bf16=False,
                      fp16=False, dataloader_num_workers=0, disable_tqdm=not progress,
                      per_device_train_batch_size=batch_size * num_generations // ranks.world_size(),
                      num_generations=num_generations,
                      max_completion_length=max_completion_length, temperature=temperature, beta=beta,
                      epsilon=epsilon, loss_type=loss_type, scale_rewards=scale_rewards, use_vllm=False,
                      log_completions=False, shuffle_dataset=False)
    disable_dropout(model)   # GRPO's ratios compare log-probs with the sampler's (issue 44)
    trainer = quantize_once_per_generation(GRPOTrainer)(model=model, reward_funcs=[reward], args=args,
                                                        train_dataset=ds, processing_class=tok,
                                                        callbacks=[trainer_callback()])
    trainer.train()
    return unwrap(trainer.model)


def unwrap(model):
    """The model itself, not a DistributedDataParallel wrapper around it (under a launcher)."""
    return getattr(model, "module", model)


def mix_rl(start: str | Path, phases: list[tuple[str, list]], rewards: dict[str, Callable], out_dir: str | Path, *,
           lr: float, batch_size: int, num_generations: int, max_completion_length: int, temperature: float = 1.0,
           beta: float = 0.0, epsilon: float = 0.2, loss_type: str = "dapo", scale_rewards: str = "group",
           warmup_steps: int = 0, grad_clip: float = 1.0, seed: int = 0, quant=None, num_threads: int = 0,
           logging_steps: int = 10, progress: bool = True) -> dict:
    """GRPO of the checkpoint `start` over `phases` (plan_phases; one phase: Mix-RL, one per
    domain: cascade RL), each phase's prompts in order, batch_size prompts x num_generations
    completions per step, the rows scored by `rewards[domain]` -> out_dir/model (QAT on and
    the fake-quantized export with `quant`). Returns a summary with the sample and token counts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.export import export_model
    from core.quant import apply_qat

    for k, v in (("batch_size", batch_size), ("num_generations", num_generations),
                 ("max_completion_length", max_completion_length)):
        if v < 1:
            raise ValueError(f"mix_rl: {k} must be >= 1, got {v}")
    if (batch_size * num_generations) % ranks.world_size():
        raise ValueError(f"mix_rl: batch_size x num_generations = {batch_size * num_generations} does not split "
                         f"over {ranks.world_size()} processes")
    if num_generations < 2:
        raise ValueError("mix_rl: num_generations must be >= 2 (GRPO compares completions within a group)")
    if not phases or any(not ps for _, ps in phases):
        raise ValueError(f"mix_rl: a phase without prompts ({[(n, len(ps)) for n, ps in phases]})")
    for name, ps in phases:
        if len(ps) % batch_size:
            raise ValueError(f"mix_rl: phase {name} has {len(ps)} prompts, not a multiple of batch_size {batch_size}")
        missing = sorted({p.domain for p in ps} - set(rewards))
        if missing:
            raise ValueError(f"mix_rl: phase {name}: no reward for domains {missing}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(start), dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(start))
        if quant is not None and quant.enabled:
            apply_qat(model, quant)
        summary_phases = []
        for name, ps in phases:
            steps = len(ps) // batch_size
            reward = RoutedReward(ps, rewards)
            by_domain: dict[str, int] = {}
            for p in ps:
                by_domain[p.domain] = by_domain.get(p.domain, 0) + 1
            _say(f"phase {name}: {steps} GRPO steps of {batch_size} prompts x {num_generations} completions "
                 f"({len(ps) * num_generations:,} samples; prompts per domain {by_domain})")
            tp = time.perf_counter()
            model = _grpo(model, tok, ps, reward, out, steps=steps, lr=lr, batch_size=batch_size,
                          num_generations=num_generations, max_completion_length=max_completion_length,
                          temperature=temperature, beta=beta, epsilon=epsilon, loss_type=loss_type,
                          scale_rewards=scale_rewards, warmup_steps=warmup_steps, grad_clip=grad_clip,
                          seed=seed, logging_steps=logging_steps, progress=progress)
            # under a launcher each rank scored its shard of the samples
            counts = ranks.gather((reward.samples, reward.tokens))
            summary_phases.append({"name": name, "steps": steps, "prompts": len(ps), "prompts_per_domain": by_domain,
                                   "samples": sum(c[0] for c in counts), "tokens": sum(c[1] for c in counts),
                                   "seconds": round(time.perf_counter() - tp, 1), "rewards": reward.history})
        if ranks.is_main():   # every rank holds the same weights; rank 0 writes them
            shutil.rmtree(out / "model", ignore_errors=True)
            export_model(unwrap(model), tok, out / "model")
            shutil.rmtree(out / "trainer", ignore_errors=True)
            (out / "history.json").write_text(json.dumps(summary_phases))
        ranks.barrier()
    finally:
        torch.set_num_threads(old_threads)
    first_last = {}
    for ph in summary_phases:
        for d in sorted({d for h in ph["rewards"] for d in h}):
            xs = [h[d] for h in ph["rewards"] if d in h]
            k = max(1, math.ceil(len(xs) / 10))   # the mean of the first and last tenth of the calls
            first_last[f"{ph['name']}/{d}"] = {"first": sum(xs[:k]) / k, "last": sum(xs[-k:]) / k}
    return {"checkpoint": str((out / "model").resolve()), "phases": [{k: v for k, v in ph.items() if k != "rewards"}
                                                                       for ph in summary_phases],
            "steps": sum(p["steps"] for p in summary_phases), "samples": sum(p["samples"] for p in summary_phases),
            "tokens": sum(p["tokens"] for p in summary_phases), "reward": first_last,
            "seconds": round(time.perf_counter() - t0, 1)}
