"""The MOPD loop: on-policy samples from the student, scored token by token by the
teacher of each prompt's domain, trained with an importance-corrected policy gradient.

    accelerate launch -m mopd.distill --config recipes/mopd/toy.yaml --out runs/toy [key=value ...]
    mopd distill --config recipes/mopd/toy.yaml --out runs/toy

`run()` reads as its steps: check the data and teachers, build the models, then per
sampled batch sample -> score (and correct) -> step (per minibatch) -> log -> save, and
push the new weights into the sampler. Every rank samples its own shard of the global
batch with its own colocated sampler; the gradient is averaged by DDP/FSDP, so the
update does not depend on how many processes share the batch.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from mopd.config import ConfigError, describe_fields, dump_yaml, flatten, load_config, to_dict
from mopd.distill import agents as A
from mopd.distill.checkpoints import (latest_checkpoint, load_checkpoint, read_state, save_checkpoint, settings_diff,
                                     settings_hash, training_settings)
from mopd.distill.config import DistillConfig, PartialRollouts, RolloutConfig, TrainConfig
from mopd.distill.data import Prompt, PromptSampler, load_prompts, load_reward_fn
from mopd.distill.preflight import check_checkpoint_dir, check_context, check_model_dir
from mopd.distill.metrics import (batch_metrics, episode_metrics, partial_metrics, print_table, reference_metrics,
                                  step_metrics, turn_kl_metrics)
from mopd.distill.step import StepResult, train_step
from mopd.export import export_model
from mopd.models import build_student, sampler_weights, torch_dtype
from mopd.outdir import hold_out_dir
from mopd.rollout import Sample, eos_ids, make_rollout
from mopd.tracking import MetricLogger, close_stale_run, end_run, record_run, resolve_uri, start_run
from teachers.routing import TeacherRouter, group_by, resolve_teachers

# Called after every optimizer step with (step, metrics): a hook for callers (a test
# injects its fault here), never needed to train.
StepCallback = Callable[[int, dict], None]


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


@dataclass
class Batch:
    """One sampled batch of this rank: rows (a prompt per sample, or per segment of an
    agent episode), their samples and what the teachers said about them."""
    rows: list[Prompt]
    seeds: list[int]
    off: list[bool]          # teacher-forced on the dataset's reference (not the student's sample)
    samples: list[Sample]
    n_gen: int               # tokens the student sampled
    seconds: dict[str, float]
    teacher_lp: list | None = None
    teacher_full: list | None = None
    n_fixed: list[int] | None = None
    task_reward: torch.Tensor | None = None
    episodes: list = field(default_factory=list)    # (domain, Episode) of the batch's agent rows
    episode_of: list | None = None                  # row -> index into episodes (None: single-turn row)
    # partial rollouts: row -> its tokens' weights versions (None: not tracked), and the
    # per-domain token-age sums and carried-over counts (`partial_metrics`)
    versions: list | None = None
    partial: dict | None = None


def minibatch_slices(n_rows: int, n_mb: int) -> list[range]:
    """The rows of each of a batch's minibatches: contiguous slices of the local shard."""
    return [range(mb * n_rows // n_mb, (mb + 1) * n_rows // n_mb) for mb in range(n_mb)]


def sample_batch(cfg: DistillConfig, rollout, rd: dict[str, RolloutConfig], mine: list[Prompt],
                 step: int, agents: dict[str, A.AgentDomain] | None = None, tokenizer=None,
                 eos: set[int] | None = None, pool: A.Pool | None = None) -> Batch:
    """The student's samples of this rank's prompts (each domain at its own settings);
    teacher-forced rows take the dataset's completion instead; rows of an agent domain are
    played as episodes (seeded by their sample seed), one row per episode segment. A
    partial-rollout domain's rows start episodes that join `pool` (its carried-over ones,
    continued first); the batch trains the episodes of `pool` that ended (`_partial_rows`)."""
    agents = agents or {}
    partial = set(A.partial_domains(agents))
    if partial and pool is None:
        raise ValueError(f"sample_batch: agent domains {sorted(partial)} use partial rollouts, which need a "
                         "carry-over pool (pool={})")
    n = cfg.rollout.samples_per_prompt
    rows = [p for p in mine for _ in range(n)]
    seeds = [_seed_for(cfg.train.seed, step, p.index, k) for p in mine for k in range(n)]
    # Off-policy rows (on_policy_fraction < 1 or a ramp, top-level or the row's domain's
    # by_domain one) take the dataset's completion; the choice is a seeded function of
    # (seed, step, prompt, sample), so reruns and ranks agree.
    off = [rd[p.domain].uses_references and _seed_for(cfg.train.seed + 7919, step, p.index, k) % 10_000
           >= rd[p.domain].on_policy_fraction_at(step) * 10_000 for p in mine for k in range(n)]
    on_idx = [i for i, o in enumerate(off) if not o]
    single = [i for i in on_idx if rows[i].domain not in agents]
    t0 = time.perf_counter()
    samples: list[Sample] = [None] * len(rows)  # type: ignore
    # one sampler call per distinct (temperature, top_p); one call when no domain has its own
    for (temp, top_p), idx in group_by(single, lambda i: (rd[rows[i].domain].temperature,
                                                         rd[rows[i].domain].top_p)).items():
        for i, smp in zip(idx, rollout.generate([rows[i].ids for i in idx], max_new_tokens=cfg.rollout.max_new_tokens,
                                                temperature=temp, top_p=top_p, seeds=[seeds[i] for i in idx])):
            samples[i] = smp
    agent_idx = [i for i in on_idx if rows[i].domain in agents]
    new_idx = [i for i in agent_idx if rows[i].domain in partial]
    if partial:
        agent_idx = [i for i in agent_idx if rows[i].domain not in partial]
    episodes = A.play(agents, rollout, tokenizer, eos, rows, seeds, agent_idx, rd) if agent_idx else []
    finished, n_partial = (A.play_partial(agents, rollout, tokenizer, eos, rows, seeds, new_idx, rd, pool, step)
                           if partial else ([], 0))
    t_sample = time.perf_counter() - t0
    n_gen = sum(len(samples[i].completion_ids) for i in single) + sum(e.student_tokens for e in episodes) + n_partial
    for i, o in enumerate(off):
        if o:  # sampler log-probs are filled with the trainer's in the step: importance weight 1
            ref = rows[i].reference_ids
            samples[i] = Sample(prompt_ids=list(rows[i].ids), completion_ids=list(ref),
                                sampler_logprobs=[0.0] * len(ref), finished=True)
    if partial:
        return _partial_rows(cfg, step, rows, seeds, off, samples, n_gen, t_sample, agent_idx, episodes, new_idx,
                             finished, pool, sorted(partial))
    if not agent_idx:
        return Batch(rows, seeds, off, samples, n_gen, {"sample": t_sample})
    domains = [rows[i].domain for i in agent_idx]
    rows, seeds, off, samples, episode_of = A.segment_rows(rows, seeds, off, samples, agent_idx, episodes)
    return Batch(rows, seeds, off, samples, n_gen, {"sample": t_sample}, episodes=list(zip(domains, episodes)),
                 episode_of=episode_of)


def _partial_rows(cfg: DistillConfig, step: int, rows, seeds, off, samples, n_gen: int, t_sample: float,
                  agent_idx: list[int], episodes: list, new_idx: list[int], finished: list, pool: A.Pool,
                  partial: list[str]) -> Batch:
    """The batch with partial rollouts: the rows of new episodes leave it (their episodes
    are in the pool), the episodes that ended this step (carried over or new) come in, one
    row per segment, after the other rows. Tokens too stale for their minibatch's update
    are masked. A rank left with fewer rows than minibatches gets empty rows of its
    domain (no tokens, no loss), so every minibatch has rows on every rank."""
    leave = set(new_idx)
    keep = [i for i in range(len(rows)) if i not in leave]
    pos = {i: j for j, i in enumerate(keep)}
    domains = [rows[i].domain for i in agent_idx]
    out_rows, out_seeds, out_off, out_samples, episode_of = A.segment_rows(
        [rows[i] for i in keep], [seeds[i] for i in keep], [off[i] for i in keep], [samples[i] for i in keep],
        [pos[i] for i in agent_idx], episodes)
    pairs = list(zip(domains, episodes))
    versions: list = [None] * len(out_rows)
    for f in finished:
        ep = f.live.ep
        r, s, o, smp, _ = A.segment_rows([f.row], [f.seed], [False], [None], [0], [ep])
        episode_of += [len(pairs)] * len(r)
        pairs.append((f.row.domain, ep))
        out_rows += r
        out_seeds += s
        out_off += o
        out_samples += smp
        versions += ep.versions if ep.segments else [[]]
    src = new_idx[0] if new_idx else 0   # usually a row whose episode left the batch for the pool
    while len(out_rows) < cfg.train.minibatches:
        filler = rows[src]
        out_rows.append(filler)
        out_seeds.append(seeds[src])
        out_off.append(False)
        out_samples.append(Sample(prompt_ids=list(filler.ids), completion_ids=[], sampler_logprobs=[],
                                  finished=False, loss_mask=[], turn_ids=[]))
        episode_of.append(None)
        versions.append(None)
    # a row of minibatch k is trained with the weights of step + k
    trained_at = [0] * len(out_rows)
    for k, sl in enumerate(minibatch_slices(len(out_rows), cfg.train.minibatches)):
        for j in sl:
            trained_at[j] = step + k
    out_samples, stats = A.mask_stale(out_samples, versions, [r.domain for r in out_rows], trained_at,
                                      cfg.loss.max_staleness, partial)
    return Batch(out_rows, out_seeds, out_off, out_samples, n_gen, {"sample": t_sample}, episodes=pairs,
                 episode_of=episode_of, versions=versions,
                 partial={"stats": stats, "carried": {d: len(pool.get(d, [])) for d in partial}})


def score_batch(cfg: DistillConfig, teachers: TeacherRouter, rollout, rd: dict[str, RolloutConfig],
                b: Batch, eos: set[int]) -> None:
    """Teacher log-probs of every row (whole distributions with loss.kl=full), teacher
    corrections of the student's own samples where their domain asks for them."""
    on_idx = [i for i, o in enumerate(b.off) if not o]
    s = teachers.score_batch(rollout, b.rows, b.samples, full=cfg.loss.kl == "full", correct_idx=on_idx,
                             settings=lambda i: rd[b.rows[i].domain], seeds=b.seeds, eos_ids=eos)
    b.teacher_lp, b.teacher_full, b.n_fixed = s.logprobs, s.full, s.n_fixed
    b.seconds.update(s.seconds)


def task_rewards(cfg: DistillConfig, reward_fns: dict, tokenizer, b: Batch) -> None:
    """Each row's task reward from its domain's reward function (loss.task_reward_alpha > 0);
    an agent row's is its episode's reward."""
    b.task_reward = torch.zeros(len(b.rows))
    if cfg.loss.task_reward_alpha <= 0:
        return
    for i, e in enumerate(b.episode_of or ()):
        if e is not None:
            b.task_reward[i] = b.episodes[e][1].reward
    texts = tokenizer.batch_decode([s.completion_ids for s in b.samples], skip_special_tokens=True)
    for d, fn in reward_fns.items():
        sel = [i for i, p in enumerate(b.rows) if p.domain == d and d not in cfg.agents]
        if not sel:
            continue
        cols = {c: [b.rows[i].columns.get(c) for i in sel] for c in b.rows[sel[0]].columns}
        vals = fn(prompts=[b.rows[i].messages for i in sel], completions=[texts[i] for i in sel], **cols)
        for i, v in zip(sel, vals):
            if v is None:
                raise ValueError(f"reward {cfg.rewards[d]} returned None for a {d!r} row")
            b.task_reward[i] = float(v)


@dataclass
class Trainer:
    """What the loop trains with, built by `build_trainer`."""
    accelerator: Accelerator
    tokenizer: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    rollout: object
    teachers: TeacherRouter
    eos: set[int]


def check_inputs(cfg: DistillConfig, out: Path, accelerator: Accelerator):
    """Everything that can fail without a model, before one is loaded: the batch split,
    the data rows and their routing, the teachers' tokenizers, the reward functions, the
    agent domains' environments and harnesses, and an --out that already holds a run.
    Returns (tokenizer, prompts by domain, teacher paths, reward functions, agent domains,
    checkpoint to resume from or None)."""
    world = accelerator.num_processes
    if cfg.train.prompts_per_step % world:
        raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} is not divisible by the "
                          f"{world} processes")
    if accelerator.is_main_process:
        print(f"[mopd] {world} process(es), {accelerator.distributed_type.value}, {cfg.train.prompts_per_step} "
              f"prompts per step ({cfg.train.prompts_per_step // world} per rank)", file=sys.stderr)
    check_model_dir(cfg.model.path, vllm=cfg.rollout.backend == "vllm")
    check_checkpoint_dir(out)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    by_domain = load_prompts(cfg, tokenizer)
    used_keys = sorted({p.teacher_key for ps in by_domain.values() for p in ps})
    teacher_paths = resolve_teachers(cfg.teachers, used_keys, tokenizer, cfg.model.path,
                                     tracking_uri=resolve_uri(cfg.mlflow.tracking_uri, out))
    # prompt + completion within every model's positions and the engines' max_model_len
    check_context(cfg, sorted(by_domain), {"the student (model.path)": cfg.model.path,
                                           **{f"teacher {k}": p for k, p in teacher_paths.items() if p is not None}})
    reward_fns = {d: load_reward_fn(r, cfg.reward_kwargs.get(d)) for d, r in cfg.rewards.items()}
    agents = A.load_agents(cfg, tokenizer)
    if cfg.rollout.backend == "server":   # reachable, the token route on, raw log-probs: before any model loads
        rs = cfg.rollout.server
        if not rs.urls:
            raise ConfigError("rollout.backend=server needs rollout.server.urls: start the sampler server with "
                              "`mopd teachers serve --config RECIPE --out DIR` and pass the overrides it writes")
        make_rollout("server", urls=rs.urls, timeout_s=rs.timeout_s, max_retries=rs.max_retries,
                     rank=accelerator.process_index).close()
    ckpt = latest_checkpoint(out) if cfg.train.resume else None
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if not cfg.train.resume and latest_checkpoint(out) is not None:
            raise ConfigError(f"{out} already holds checkpoints; pass train.resume=true to continue "
                              "that run, or choose a new --out")
        (out / "config.yaml").write_text(dump_yaml(cfg))
    accelerator.wait_for_everyone()
    return tokenizer, by_domain, teacher_paths, reward_fns, agents, ckpt


def build_trainer(cfg: DistillConfig, accelerator: Accelerator, tokenizer, teacher_paths: dict,
                  ckpt: Path | None) -> tuple[Trainer, dict]:
    """The student (LoRA, QAT) with its optimizer and schedule, restored from `ckpt` when
    resuming, then its sampler holding the student's exact weights, and the teachers.
    Returns the trainer and the checkpoint's trainer_state ({} for a fresh run)."""
    set_seed(cfg.train.seed)
    model = build_student(cfg.model.path, dtype=cfg.model.dtype, lora=cfg.model.lora, quant=cfg.quant)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.train.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                      betas=tuple(cfg.train.adam_betas))
    else:
        optimizer = torch.optim.SGD(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg.train))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    state = load_checkpoint(accelerator, ckpt) if ckpt is not None else {}
    unwrapped = accelerator.unwrap_model(model)
    r = cfg.rollout
    if r.backend == "vllm":
        rollout = make_rollout("vllm", model_path=cfg.model.path, dtype=cfg.model.dtype,
                               seed=cfg.train.seed, max_model_len=r.max_model_len,
                               kv_cache_gb=r.kv_cache_gb, gpu_memory_utilization=r.gpu_memory_utilization,
                               enforce_eager=r.enforce_eager)
    elif r.backend == "server":   # another process or node; the trainer pushes its weights to it
        rs = r.server
        rollout = make_rollout("server", urls=rs.urls, transfer=rs.transfer, group_host=rs.group_host,
                               group_port=rs.group_port, timeout_s=rs.timeout_s, max_retries=rs.max_retries,
                               concurrency=rs.concurrency, rank=accelerator.process_index,
                               world_size=accelerator.num_processes, check=False)   # check_inputs probed it
    elif r.async_steps:   # the trainer's module changes during the update the sampler runs beside
        rollout = make_rollout("hf_copy", model_path=cfg.model.path, tokenizer=tokenizer,
                               dtype=torch_dtype(cfg.model.dtype), device=accelerator.device)
    else:
        rollout = make_rollout("hf", model=unwrapped, tokenizer=tokenizer)
    rollout.sync_weights(sampler_weights(unwrapped))
    teachers = TeacherRouter.load(cfg.teachers, teacher_paths, dtype=cfg.model.dtype,
                                  vllm_kwargs={"enforce_eager": r.enforce_eager, "kv_cache_gb": r.kv_cache_gb,
                                               "max_model_len": r.max_model_len})
    return Trainer(accelerator, tokenizer, model, optimizer, scheduler, rollout, teachers,
                   eos_ids(tokenizer, getattr(unwrapped, "generation_config", None))), state


def update(cfg: DistillConfig, t: Trainer, b: Batch, sub: list[int], domains: list[str]) -> StepResult:
    """One optimizer step on the rows `sub` of the batch."""
    return train_step(t.accelerator, t.model, t.optimizer, t.scheduler, loss_cfg=cfg.loss,
                      grad_clip=cfg.train.grad_clip, prompt_ids=[b.rows[i].ids for i in sub],
                      samples=[b.samples[i] for i in sub], teacher_lp=[b.teacher_lp[i] for i in sub],
                      teacher_full=[b.teacher_full[i] for i in sub],
                      off_B=torch.tensor([b.off[i] for i in sub], dtype=torch.bool),
                      task_reward_B=b.task_reward[sub],
                      domain_ids_B=torch.tensor([domains.index(b.rows[i].domain) for i in sub]),
                      n_domains=len(domains), pad_id=t.tokenizer.pad_token_id)


def log_step(cfg: DistillConfig, t: Trainer, b: Batch, sub: list[int], res: StepResult, *, mb: int,
             t_update: float, domains: list[str], corrected_domains: set[str], lag: int = 0) -> dict[str, float]:
    """The step's metrics: loss, schedule, per-domain KL / mismatch / importance weights,
    the batch's sampling times (first minibatch), tokens. `lag`: weights versions between
    the sampler's weights and the batch's first update (rollout.async_steps)."""
    acc, world = t.accelerator, t.accelerator.num_processes
    m = {"loss": acc.reduce(res.loss.detach().reshape(1) / world, reduction="sum").item(),
         "lr": t.scheduler.get_last_lr()[0], "grad_norm": res.grad_norm, "staleness": mb + lag}
    m.update(step_metrics(acc, res, domains=domains, row_domains=[b.rows[i].domain for i in sub],
                          off=[b.off[i] for i in sub], n_fixed=[b.n_fixed[i] for i in sub],
                          task_reward_B=b.task_reward[sub], is_truncation=cfg.loss.is_truncation,
                          task_reward_on=cfg.loss.task_reward_alpha > 0, corrected_domains=corrected_domains))
    if mb == 0:
        m.update(batch_metrics(acc, n_gen=b.n_gen, seconds=b.seconds, correction_on=cfg.rollout.any_correction))
    agent_domains = [d for d in domains if d in cfg.agents]
    if agent_domains:   # per turn of the transcripts, and (once per sampled batch) per episode
        m.update(turn_kl_metrics(acc, res, turn_ids=[b.samples[i].turn_ids for i in sub],
                                 row_domains=[b.rows[i].domain for i in sub], agent_domains=agent_domains))
        if mb == 0:
            m.update(episode_metrics(acc, b.episodes, agent_domains))
        if mb == 0 and b.partial is not None:
            m.update(partial_metrics(acc, b.partial["stats"], b.partial["carried"], sorted(b.partial["carried"])))
    m["time/update_s"] = t_update
    if cfg.rollout.async_steps:
        # single-turn rows: every token of a minibatch was sampled with the same weights
        m["async/token_age_mean"] = float(mb + lag)
    m["tokens_per_s/update"] = res.n_tok_global / max(t_update, 1e-9)
    m["tokens"] = float(res.n_tok_global)  # student tokens trained on this step (all ranks)
    if cfg.rollout.any_references:  # over the global minibatch, like every other metric
        m.update(reference_metrics(acc, res, [b.off[i] for i in sub]))
    return m


def follow_launcher(signum: int = signal.SIGTERM) -> bool:
    """Under `accelerate launch` / torchrun (LOCAL_RANK set), ask the kernel to send
    `signum` to this rank when its launcher dies, so that killing the launcher (even with
    SIGKILL) stops every rank (SIGTERM: the step finishes and a checkpoint is saved)
    instead of leaving them training as orphans. Linux only; True when armed."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signum), 0, 0, 0) != 0:      # PR_SET_PDEATHSIG = 1
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:     # the launcher died before the request was in place
        os.kill(os.getpid(), signum)
    return True


class StopOnSignal:
    """SIGTERM (what a scheduler sends before preemption) and SIGINT (Ctrl-C) set a flag:
    the loop finishes its step, saves a checkpoint and exits with 128 + the signal's
    number (143, 130). A second signal stops at once. Only the main thread can install
    handlers; elsewhere (a thread of a caller) signals keep their default."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:
                pass

    def _handle(self, signum, frame):
        if self.signum is not None:
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Interrupted(signum)
        self.signum = signum
        print(f"\n[mopd] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              f"(send it again to stop now)", file=sys.stderr)

    def requested(self, accelerator: Accelerator) -> bool:
        """Whether any rank got a signal (all ranks must stop at the same step)."""
        flag = self.signum is not None
        if accelerator.num_processes > 1:
            t = torch.tensor([float(flag)], device=accelerator.device)
            flag = accelerator.reduce(t, reduction="sum").item() > 0
            if flag and self.signum is None:
                self.signum = signal.SIGTERM
        return flag

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


class Interrupted(SystemExit):
    """The run stopped on a signal (after saving a checkpoint); exit code 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(128 + int(signum))
        self.signum = int(signum)


def resume_settings(cfg: DistillConfig, ckpt: Path | None) -> tuple[dict, dict[str, tuple]]:
    """The run's training settings, and how they differ from those `ckpt` was written
    with; a difference is refused (before anything is loaded or written) unless
    train.accept_config_change=true."""
    settings = training_settings(flatten(to_dict(cfg)))
    if ckpt is None:
        return settings, {}
    old = read_state(ckpt).get("settings")
    if old is None:     # written before checkpoints recorded their settings
        return settings, {}
    diff = {k: v for k, v in settings_diff(old, settings).items() if not _new_default(k, v)}
    if diff and not cfg.train.accept_config_change:
        lines = "\n".join(f"  {k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in diff.items())
        raise ConfigError(f"train.resume=true from {ckpt}, but the training settings differ from the "
                          f"checkpoint's:\n{lines}\nresume with the checkpoint's settings, or pass "
                          f"train.accept_config_change=true to continue with the new ones (they apply "
                          f"from step {read_state(ckpt).get('step')} on)")
    return settings, diff


_PARTIAL_DEFAULTS = dataclasses.asdict(PartialRollouts())


def _new_default(key: str, change: tuple) -> bool:
    """A setting added after the checkpoint was written, at its default: agent domains'
    `partial` (off) changes nothing a checkpoint from before it computed."""
    parts = key.split(".")
    if key == "rollout.async_steps":   # added later; off is what every older checkpoint did
        return change[0] == "<unset>" and change[1] is False
    return (change[0] == "<unset>" and len(parts) == 4 and parts[0] == "agents" and parts[2] == "partial"
            and _PARTIAL_DEFAULTS.get(parts[3], object()) == change[1])


def apply_new_settings(cfg: DistillConfig, t: Trainer) -> None:
    """After restoring a checkpoint with accepted changes: the optimizer's and the
    schedule's hyperparameters are the new config's (a restored LambdaLR keeps its old
    base lr; its lambda, built from the new config, already follows the new schedule)."""
    sched = getattr(t.scheduler, "scheduler", t.scheduler)
    opt = getattr(t.optimizer, "optimizer", t.optimizer)
    sched.base_lrs = [cfg.train.lr for _ in sched.base_lrs]
    for g, fn in zip(opt.param_groups, sched.lr_lambdas):
        g["initial_lr"] = cfg.train.lr
        g["lr"] = cfg.train.lr * fn(sched.last_epoch)
        g["weight_decay"] = cfg.train.weight_decay
        if "betas" in g:
            g["betas"] = tuple(cfg.train.adam_betas)
    sched._last_lr = [g["lr"] for g in opt.param_groups]


def run(cfg: DistillConfig, out: str | Path, progress: bool = True,
        callbacks: list[StepCallback] | None = None) -> dict:
    """Run (or resume) a distillation; returns the per-step metric history.

    The MLflow run ends FINISHED, FAILED (any error) or KILLED (a signal, Ctrl-C); on
    SIGTERM / SIGINT a checkpoint of the last finished step is saved first."""
    out = Path(out)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    main = accelerator.is_main_process
    lock = hold_out_dir(out, "mopd distill") if main else None  # noqa: F841 - one writer per --out, held to the end
    # a resume whose settings differ is refused before anything (config.yaml) is written
    settings, changed = resume_settings(cfg, latest_checkpoint(out) if cfg.train.resume else None)
    tokenizer, by_domain, teacher_paths, reward_fns, agents, ckpt = check_inputs(cfg, out, accelerator)
    domains = sorted(by_domain)
    if ckpt is not None:
        settings, changed = resume_settings(cfg, ckpt)
    old_run_id = read_state(ckpt).get("mlflow_run_id") if ckpt is not None else None
    stop = StopOnSignal()
    follow_launcher()
    status, metrics = "FAILED", None
    try:
        # the store is opened (and a bad one reported) before any model is loaded
        run_id = _start_mlflow(cfg, out, old_run_id, domains, fresh=ckpt is None, changed=changed,
                               ckpt=ckpt) if main else None
        if main:   # the lock is ours: a run recorded here and still RUNNING was killed (SIGKILL, OOM)
            close_stale_run(out, resolve_uri(cfg.mlflow.tracking_uri, out), keep=run_id)
            record_run(out, run_id)
        if main:
            metrics = MetricLogger(run_id, resolve_uri(cfg.mlflow.tracking_uri, out),
                                   fallback=out / "metrics_unsent.jsonl")
        result = _train(cfg, out, accelerator, stop, tokenizer, by_domain, teacher_paths, reward_fns, agents,
                        ckpt, domains, settings, changed, run_id, metrics, progress, callbacks)
        status = "FINISHED"
        return result
    except (KeyboardInterrupt, Interrupted):
        status = "KILLED"
        raise
    finally:
        try:
            if metrics is not None:   # a preempted job has seconds, a finished one can wait for the store
                metrics.close(timeout=120.0 if status == "FINISHED" else 15.0)
            if main:
                end_run(status)
        finally:
            # restored last: a signal during the wait for the store must not kill the
            # process before its MLflow run is ended (it would stay RUNNING)
            stop.restore()


def _train(cfg, out, accelerator, stop, tokenizer, by_domain, teacher_paths, reward_fns, agents, ckpt, domains,
           settings, changed, run_id, metrics, progress, callbacks) -> dict:
    main = accelerator.is_main_process
    t, st = build_trainer(cfg, accelerator, tokenizer, teacher_paths, ckpt)
    if changed:
        apply_new_settings(cfg, t)
    sampler = PromptSampler(by_domain, cfg.data.mix, cfg.train.seed)
    step, history = st.get("step", 0), st.get("history", [])
    if ckpt is not None:
        sampler.load_state_dict(st["data"])
        if main:
            print(f"[mopd] resuming from {ckpt} at step {step}", file=sys.stderr)
    bar = tqdm(total=cfg.train.max_steps, initial=step, disable=not (main and progress), desc="mopd",
               dynamic_ncols=True)
    # each domain's own sampling settings; agent episodes are never teacher-corrected
    rd = {d: cfg.rollout.for_domain(d) if d not in cfg.agents else
          dataclasses.replace(cfg.rollout.for_domain(d), correct_below=0.0) for d in domains}
    corrected_domains = {d for d in domains if rd[d].correct_below > 0}
    local_n = cfg.train.prompts_per_step // accelerator.num_processes
    # Partial rollouts: episodes still going at the end of a step wait here for the next.
    # A checkpoint cannot hold their live environments: it records how many there were,
    # and a resume starts without them (logged, and agent/dropped_in_flight/<d> at its
    # first step); the run that wrote the checkpoint keeps them.
    pool: A.Pool = {}
    partial = A.partial_domains(agents)
    dropped = {d: int(n) for d, n in st.get("in_flight", {}).items() if n} if ckpt is not None else {}
    if dropped and main:
        print(f"[mopd] resuming from step {step}: {sum(dropped.values())} agent episode(s) in flight at the "
              f"checkpoint are dropped ({', '.join(f'{d}: {n}' for d, n in sorted(dropped.items()))}); their "
              f"rows are not replayed", file=sys.stderr)

    def in_flight() -> dict[str, int]:
        n = torch.tensor([float(len(pool.get(d, []))) for d in partial], device=accelerator.device)
        n = accelerator.reduce(n, reduction="sum") if accelerator.num_processes > 1 else n
        return {d: int(x) for d, x in zip(partial, n.tolist())}

    # Asynchronous steps (rollout.async_steps): the next batch is sampled in a thread while
    # this batch's updates run. A checkpoint is a step boundary that discards the batch in
    # flight: it records the data position from before that batch's prompts were drawn, so
    # a resume draws the same prompts (same seeds) and samples them from the checkpoint's
    # weights, synchronously (token age 0), then goes on asynchronously.
    async_on = cfg.rollout.async_steps
    pool_exec = ThreadPoolExecutor(1, thread_name_prefix="mopd-sample") if async_on else None
    engine_lock = threading.Lock()   # generate and the weight push never run at once on the sampler
    pending: dict | None = None      # the batch in flight: future, data state before its draw, weights version
    sync_s: float | None = None      # seconds of the last weight push into the sampler (time/sync_s)

    def state() -> dict:
        data = pending["data"] if pending is not None else sampler.state_dict()
        s = {"data": data, "mlflow_run_id": run_id, "history": history,
             "settings": settings, "settings_hash": settings_hash(settings)}
        if partial:
            s["in_flight"] = in_flight()
        return s

    def drop_pool(why: str) -> None:
        n = A.drop_in_flight(pool)
        if sum(n.values()) and main:
            print(f"[mopd] {why}: {sum(n.values())} agent episode(s) still in flight on this rank are dropped "
                  f"({', '.join(f'{d}: {k}' for d, k in sorted(n.items()) if k)})", file=sys.stderr)

    def stop_now(saved: bool):
        """On SIGTERM / SIGINT: a checkpoint of the last finished step, then exit."""
        if not saved and step > st.get("step", 0):
            save_checkpoint(accelerator, t.model, tokenizer, out, step, state(), cfg.train.keep_checkpoints)
        bar.close()
        if pool_exec is not None:   # the batch in flight finishes before its sampler closes
            pool_exec.shutdown(wait=True)
        drop_pool(f"stopped after step {step}")
        if main:
            print(f"[mopd] stopped by {signal.Signals(stop.signum).name} after step {step}: checkpoint in "
                  f"{out / 'checkpoints' / f'step_{step}'}; continue with train.resume=true", file=sys.stderr)
        t.rollout.close()
        t.teachers.close()
        raise Interrupted(stop.signum)

    if stop.requested(accelerator):
        stop_now(saved=True)

    def sample_in_thread(mine: list[Prompt], at: int) -> tuple[Batch, float, float]:
        with engine_lock:
            t0 = time.perf_counter()
            b = sample_batch(cfg, t.rollout, rd, mine, at, agents, tokenizer, t.eos, pool=pool)
            return b, t0, time.perf_counter()

    # --- loop: one sampled batch feeds `minibatches` optimizer steps
    nxt: tuple | None = None     # async: (the next batch, the weights version it was sampled with, overlap s)
    t_last = time.perf_counter()
    # student tokens trained so far (all ranks; restored with the history on resume)
    trained = [sum(float(h.get("tokens", 0.0)) for h in history)]

    def done() -> bool:
        return step >= cfg.train.max_steps or (cfg.train.max_tokens > 0 and trained[0] >= cfg.train.max_tokens)

    try:
        while not done():
            rank = accelerator.process_index
            lag, overlap = 0, 0.0
            if nxt is None:
                mine = sampler.next_batch(step, cfg.train.prompts_per_step)[rank * local_n:(rank + 1) * local_n]
                b = sample_batch(cfg, t.rollout, rd, mine, step, agents, tokenizer, t.eos, pool=pool)
            else:
                (b, version, overlap), nxt = nxt, None
                lag = step - version
            score_batch(cfg, t.teachers, t.rollout, rd, b, t.eos)
            task_rewards(cfg, reward_fns, tokenizer, b)
            # Minibatches are contiguous slices of the local shard, so the k-th minibatch of
            # every rank comes from the k-th slice of the global batch, as in one process
            # (agent episodes add rows per segment: the slices cover them all).
            n_rows, n_mb = len(b.rows), cfg.train.minibatches
            if async_on and step + n_mb < cfg.train.max_steps and not (
                    cfg.train.max_tokens > 0 and trained[0] + b.n_gen >= cfg.train.max_tokens):
                # the next batch: its own step's prompts and seeds, sampled with the weights of
                # now (version `step`) while this batch's updates run
                data = copy.deepcopy(sampler.state_dict())
                mine = sampler.next_batch(step + n_mb, cfg.train.prompts_per_step)[rank * local_n:(rank + 1) * local_n]
                pending = {"future": pool_exec.submit(sample_in_thread, mine, step + n_mb), "data": data,
                           "version": step}
            t_upd0 = time.perf_counter()
            slices = minibatch_slices(n_rows, n_mb)
            for mb in range(n_mb):
                if done():
                    break
                if mb + lag > cfg.loss.max_staleness:
                    raise RuntimeError(f"batch is {mb + lag} steps stale (> max_staleness)")
                sub = list(slices[mb])
                t0 = time.perf_counter()
                res = update(cfg, t, b, sub, domains)
                step += 1
                m = log_step(cfg, t, b, sub, res, mb=mb, t_update=time.perf_counter() - t0, domains=domains,
                             corrected_domains=corrected_domains, lag=lag)
                if sync_s is not None and mb == 0:   # the push of the previous batch's weights into the sampler
                    m["time/sync_s"] = sync_s
                if async_on:
                    if mb == 0:   # how much of this batch's sampling ran beside the previous update
                        m["async/overlap_s"] = overlap
                    now = time.perf_counter()
                    m["time/step_s"], t_last = now - t_last, now
                if dropped:   # once, at the first step after a resume that dropped episodes in flight
                    m.update({f"agent/dropped_in_flight/{d}": float(n) for d, n in dropped.items()})
                    dropped = {}
                trained[0] += float(m.get("tokens", 0.0))
                history.append({"step": step, **m})
                if main:
                    metrics.log(m, step=step)   # buffered: a slow or locked store never stops training
                    bar.set_postfix({f"kl/{d}": f"{m[f'reverse_kl/{d}']:.3f}" for d in domains
                                     if f"reverse_kl/{d}" in m})
                    bar.update(1)
                saved = False
                if cfg.train.save_every and step % cfg.train.save_every == 0 and not done():
                    save_checkpoint(accelerator, t.model, tokenizer, out, step, state(), cfg.train.keep_checkpoints)
                    saved = True
                for cb in callbacks or ():
                    cb(step, m)
                if not done() and stop.requested(accelerator):
                    stop_now(saved)
            if pending is not None:
                t_upd1 = time.perf_counter()
                nb, s0, s1 = pending["future"].result()
                nxt, pending = (nb, pending["version"], max(0.0, min(s1, t_upd1) - max(s0, t_upd0))), None
            # --- sync: new weights go into the sampler in memory after every update of the batch
            # (async: after the next batch's sampling ended, before the one after it starts)
            t_sync0 = time.perf_counter()
            with engine_lock:
                t.rollout.sync_weights(sampler_weights(accelerator.unwrap_model(t.model)))
            sync_s = time.perf_counter() - t_sync0
    finally:
        if pool_exec is not None:
            pool_exec.shutdown(wait=True)
    bar.close()

    # --- final save: HF checkpoint (LoRA merged) + MLflow artifacts
    save_checkpoint(accelerator, t.model, tokenizer, out, step, state(), cfg.train.keep_checkpoints)
    drop_pool(f"the run ended at step {step}")
    final_dir = out / "final"
    if main:
        shutil.rmtree(final_dir, ignore_errors=True)
        export_model(accelerator.unwrap_model(t.model), tokenizer, final_dir)
        (out / "history.json").write_text(json.dumps(history))
        if cfg.mlflow.log_model:
            try:
                mlflow.log_artifacts(str(final_dir), "model")
            except Exception as e:  # noqa: BLE001 - the model is on disk; its MLflow copy is a convenience
                print(f"[mopd] could not log the final model to MLflow ({type(e).__name__}: {e}); it is in "
                      f"{final_dir}", file=sys.stderr)
        print_table(history, domains)
    accelerator.wait_for_everyone()
    t.rollout.close()
    t.teachers.close()
    return {"history": history, "final": str(final_dir), "mlflow_run_id": run_id, "domains": domains}


def _start_mlflow(cfg: DistillConfig, out: Path, run_id: str | None, domains: list[str], *, fresh: bool,
                  changed: dict | None = None, ckpt: Path | None = None) -> str:
    """The run's MLflow run: the checkpoint's one on resume (a new one tagged
    mopd.resumed_from_run_id when that run is gone from the store); a new run logs the
    config, a resume with accepted setting changes tags them. A store that cannot be
    opened is an error naming its URI, raised before any model is loaded."""
    uri = resolve_uri(cfg.mlflow.tracking_uri, out)
    try:
        run = start_run(experiment=cfg.mlflow.experiment, uri=uri, run_name=cfg.mlflow.run_name or out.name,
                        run_id=run_id, tags={**cfg.mlflow.tags, "stage": "mopd", "domains": ",".join(domains)},
                        parent_run_id=cfg.mlflow.parent_run_id)
    except Exception as e:  # noqa: BLE001 - MLflow and the database driver raise many types
        raise ConfigError(f"cannot open the MLflow store at {uri}: {type(e).__name__}: {e}") from None
    new_run = fresh or run.info.run_id != run_id
    try:
        if new_run:
            flat = {k: (json.dumps(v) if isinstance(v, (list, dict)) else v)
                    for k, v in flatten(to_dict(cfg)).items()}
            mlflow.log_params({k: str(v)[:6000] for k, v in flat.items()})
            mlflow.log_artifact(str(out / "config.yaml"))
        if changed:
            step = read_state(ckpt).get("step") if ckpt is not None else None
            print(f"[mopd] resuming with changed settings from step {step}: "
                  + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()), file=sys.stderr)
            mlflow.set_tags({f"mopd.config_change.step_{step}": json.dumps(
                {k: [a, b] for k, (a, b) in changed.items()}, default=str)[:5000]})
            if not new_run:
                mlflow.log_artifact(str(out / "config.yaml"), f"config_step_{step}")
    except Exception:
        end_run("FAILED")
        raise
    return run.info.run_id


def print_config_help(cls=DistillConfig, prefix: str = "") -> None:
    """Every recipe key with its type, default and help text."""
    for line in describe_fields(cls, prefix):
        print(line)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="mopd.distill", description=__doc__.split("\n")[0])
    ap.add_argument("--config")
    ap.add_argument("--out")
    ap.add_argument("--help-config", action="store_true", help="print every recipe key with its help and exit")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. train.max_steps=10")
    args = ap.parse_args(argv)
    if args.help_config:
        print_config_help()
        return
    if not args.config or not args.out:
        ap.error("--config and --out are required")
    cfg = load_config(DistillConfig, args.config, args.overrides)
    run(cfg, args.out)
