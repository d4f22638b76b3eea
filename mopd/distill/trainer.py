"""`MOPDTrainer`: the loop's steps as named methods. Per sampled batch: `sample` ->
`score` (and correct) -> per minibatch `update` -> `log` -> `save`, then `sync` (the new
weights into the sampler); `stop` on a signal. `train_sync` and `train_async` are the two
loops: the second samples the next batch in a thread while this one's updates run."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mopd.distill import agents as A
from mopd.distill.batch import Batch, minibatch_slices, sample_batch, score_batch, task_rewards
from mopd.distill.checkpoints import load_checkpoint, save_checkpoint, settings_hash
from mopd.distill.config import DistillConfig, LossConfig, RolloutConfig, TrainConfig
from mopd.distill.data import Prompt, PromptSampler
from mopd.distill.inputs import Inputs, open_rollout
from mopd.distill.publish import publish
from mopd.distill.metrics import (batch_metrics, episode_metrics, partial_metrics, print_table, reference_metrics,
                                  step_metrics, turn_kl_metrics)
from mopd.distill.signals import Interrupted, StopOnSignal
from mopd.distill.step import StepResult, train_step
from mopd.distill.timing import timed
from core.export import export_model
from core.models import build_student, sampler_weights
from core.rollout import eos_ids
from core.tracking import MetricLogger
from teachers.routing import TeacherRouter

# Called after every optimizer step with (step, metrics): a hook for callers (a test
# injects its fault here), never needed to train.
StepCallback = Callable[[int, dict], None]


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
class Models:
    """What the loop trains with, built by `build_models`."""
    accelerator: Accelerator
    tokenizer: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    rollout: object
    teachers: TeacherRouter
    eos: set[int]


def build_models(cfg: DistillConfig, accelerator: Accelerator, inputs: Inputs) -> tuple[Models, dict]:
    """The student (LoRA, QAT) with its optimizer and schedule, restored from the
    checkpoint when resuming, then its sampler holding the student's exact weights (the
    one `check_inputs` opened, or a new one), and the teachers. Returns the models and the
    checkpoint's trainer_state ({} for a fresh run)."""
    set_seed(cfg.train.seed)
    model = build_student(cfg.model.path, dtype=cfg.model.dtype, lora=cfg.model.lora, quant=cfg.quant,
                          dropout=cfg.model.dropout, gradient_checkpointing=cfg.model.gradient_checkpointing)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.train.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                      betas=tuple(cfg.train.adam_betas))
    else:
        optimizer = torch.optim.SGD(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg.train))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    state = load_checkpoint(accelerator, inputs.ckpt) if inputs.ckpt is not None else {}
    unwrapped = accelerator.unwrap_model(model)
    tokenizer = inputs.tokenizer
    rollout = inputs.rollout or open_rollout(cfg, accelerator, model=unwrapped, tokenizer=tokenizer)
    rollout.sync_weights(sampler_weights(unwrapped))
    r = cfg.rollout
    teachers = TeacherRouter.load(cfg.teachers, inputs.teacher_paths, dtype=cfg.model.dtype,
                                  vllm_kwargs={"enforce_eager": r.enforce_eager, "kv_cache_gb": r.kv_cache_gb,
                                               "max_model_len": r.max_model_len},
                                  logits_chunk=cfg.loss.logits_chunk if cfg.loss.kl == "full" else 0)
    return Models(accelerator, tokenizer, model, optimizer, scheduler, rollout, teachers,
                  eos_ids(tokenizer, getattr(unwrapped, "generation_config", None))), state


def apply_new_settings(cfg: TrainConfig, t: Models) -> None:
    """After restoring a checkpoint with accepted changes: the optimizer's and the
    schedule's hyperparameters are the new config's (a restored LambdaLR keeps its old
    base lr; its lambda, built from the new config, already follows the new schedule)."""
    sched = getattr(t.scheduler, "scheduler", t.scheduler)
    opt = getattr(t.optimizer, "optimizer", t.optimizer)
    sched.base_lrs = [cfg.lr for _ in sched.base_lrs]
    for g, fn in zip(opt.param_groups, sched.lr_lambdas):
        g["initial_lr"] = cfg.lr
        g["lr"] = cfg.lr * fn(sched.last_epoch)
        g["weight_decay"] = cfg.weight_decay
        if "betas" in g:
            g["betas"] = tuple(cfg.adam_betas)
    sched._last_lr = [g["lr"] for g in opt.param_groups]


@dataclass
class Pending:
    """The batch sampled in a thread (asynchronous steps) while this batch's updates run."""
    future: object          # -> (Batch, timed) of the sampling
    data: dict              # the prompt sampler's state from before its prompts were drawn
    version: int            # the weights version it samples with


class MOPDTrainer:
    """One run's training: the models, the prompt sampler, the position (step, history)
    and the run's bookkeeping (MLflow logger, progress bar, signals, callbacks)."""

    def __init__(self, cfg: DistillConfig, out: Path, accelerator: Accelerator, inputs: Inputs, *,
                 run_id: str | None, metrics: MetricLogger | None, stop_signal: StopOnSignal,
                 progress: bool = True, callbacks: list[StepCallback] | None = None):
        self.cfg, self.out, self.acc, self.inputs = cfg, out, accelerator, inputs
        self.main, self.domains, self.agents = accelerator.is_main_process, inputs.domains, inputs.agents
        self.run_id, self.metrics, self.stop_signal, self.callbacks = run_id, metrics, stop_signal, callbacks or ()
        self.m, st = build_models(cfg, accelerator, inputs)
        if inputs.changed:
            apply_new_settings(cfg.train, self.m)
        self.sampler = PromptSampler(inputs.by_domain, cfg.data.mix, cfg.train.seed)
        self.step, self.history = st.get("step", 0), st.get("history", [])
        self.first_step = self.step
        if inputs.ckpt is not None:
            self.sampler.load_state_dict(st["data"])
            if self.main:
                print(f"[mopd] resuming from {inputs.ckpt} at step {self.step}", file=sys.stderr)
        self.bar = tqdm(total=cfg.train.max_steps, initial=self.step, disable=not (self.main and progress),
                        desc="mopd", dynamic_ncols=True)
        # each domain's own sampling settings; agent episodes are never teacher-corrected
        self.rd = {d: cfg.rollout.for_domain(d) if d not in cfg.agents else
                   dataclasses.replace(cfg.rollout.for_domain(d), correct_below=0.0) for d in self.domains}
        self.corrected_domains = {d for d in self.domains if self.rd[d].correct_below > 0}
        self.local_n = cfg.train.prompts_per_step // accelerator.num_processes
        self._init_partial(st)
        self.engine_lock = threading.Lock()   # generate and the weight push never run at once on the sampler
        self.pending: Pending | None = None   # asynchronous steps: the batch in flight
        self.executor: ThreadPoolExecutor | None = None
        self.sync_s: float | None = None      # seconds of the last weight push into the sampler (time/sync_s)
        self.t_last = 0.0                     # asynchronous steps: when the last step ended (time/step_s)
        # student tokens trained so far (all ranks; restored with the history on resume)
        self.trained = sum(float(h.get("tokens", 0.0)) for h in self.history)

    def _init_partial(self, st: dict) -> None:
        """Partial rollouts: episodes still going at the end of a step wait in the pool for
        the next. A checkpoint cannot hold their live environments: it records how many
        there were, and a resume starts without them (logged, and
        agent/dropped_in_flight/<d> at its first step); the run that wrote it keeps them."""
        self.pool: A.Pool = {}
        self.partial = A.partial_domains(self.agents)
        self.dropped = ({d: int(n) for d, n in st.get("in_flight", {}).items() if n}
                        if self.inputs.ckpt is not None else {})
        if self.dropped and self.main:
            print(f"[mopd] resuming from step {self.step}: {sum(self.dropped.values())} agent episode(s) in flight "
                  f"at the checkpoint are dropped ({', '.join(f'{d}: {n}' for d, n in sorted(self.dropped.items()))})"
                  f"; their rows are not replayed", file=sys.stderr)

    # --- the two loops
    def train(self) -> dict:
        """Train to train.max_steps (or train.max_tokens), then save and export the final
        model; returns the run's summary."""
        if self.stop_signal.requested(self.acc):
            self.stop(saved=True)
        self.stop_signal.start()   # a signal from here on finishes its step and saves
        (self.train_async if self.cfg.rollout.async_steps else self.train_sync)()
        return self.finish()

    def train_sync(self) -> None:
        """Per batch: sample it with the current weights, score it, train its minibatches,
        push the new weights into the sampler."""
        while not self.done():
            b = self.sample(self.step)
            self.score(b)
            self.train_batch(b)
            self.sync()

    def train_async(self) -> None:
        """Per batch: score it, start sampling the next one in a thread with the weights of
        now, train this one's minibatches meanwhile, wait for the next batch, then push the
        new weights into the sampler. The first batch (and the first after a resume, which
        discards the batch in flight) is sampled synchronously: token age 0."""
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="mopd-sample")
        self.t_last = time.perf_counter()
        nxt: tuple[Batch, int, float] | None = None   # the next batch, its weights version, overlap seconds
        try:
            while not self.done():
                if nxt is None:
                    b, lag, overlap = self.sample(self.step), 0, 0.0
                else:
                    (b, version, overlap), nxt = nxt, None
                    lag = self.step - version
                self.score(b)
                self.sample_ahead(b)
                with timed("updates") as upd:
                    self.train_batch(b, lag=lag, overlap=overlap)
                if self.pending is not None:
                    nb, s = self.pending.future.result()
                    nxt = (nb, self.pending.version, max(0.0, min(s.end, upd.end) - max(s.start, upd.start)))
                    self.pending = None
                self.sync()
        finally:
            self.executor.shutdown(wait=True)

    def done(self) -> bool:
        t = self.cfg.train
        return self.step >= t.max_steps or (t.max_tokens > 0 and self.trained >= t.max_tokens)

    # --- the steps
    def shard(self, at: int) -> list[Prompt]:
        """This rank's slice of the global batch of step `at`."""
        rank = self.acc.process_index
        return self.sampler.next_batch(at, self.cfg.train.prompts_per_step)[rank * self.local_n:
                                                                            (rank + 1) * self.local_n]

    def sample(self, at: int, mine: list[Prompt] | None = None) -> Batch:
        """The student's samples of this rank's prompts of step `at`."""
        mine = self.shard(at) if mine is None else mine
        return sample_batch(self.cfg, self.m.rollout, self.rd, mine, at, self.agents, self.m.tokenizer, self.m.eos,
                            pool=self.pool)

    def sample_ahead(self, b: Batch) -> None:
        """Asynchronous steps: the next batch (its own step's prompts and seeds), sampled in
        a thread with the weights of now (version `step`) while `b`'s updates run; none
        when the run ends within `b`."""
        t, n_mb = self.cfg.train, self.cfg.train.minibatches
        if self.step + n_mb >= t.max_steps or (t.max_tokens > 0 and self.trained + b.n_gen >= t.max_tokens):
            return
        data = copy.deepcopy(self.sampler.state_dict())
        mine = self.shard(self.step + n_mb)
        self.pending = Pending(self.executor.submit(self._sample_locked, mine, self.step + n_mb), data, self.step)

    def _sample_locked(self, mine: list[Prompt], at: int) -> tuple[Batch, timed]:
        with self.engine_lock, timed("sample") as t:
            b = self.sample(at, mine)
        return b, t

    def score(self, b: Batch) -> None:
        """Teacher log-probs (and corrections) of every row, and the rows' task rewards."""
        score_batch(self.m.teachers, self.m.rollout, self.rd, b, self.m.eos, full=self.cfg.loss.kl == "full")
        task_rewards(self.cfg, self.inputs.reward_fns, self.m.tokenizer, b)

    def train_batch(self, b: Batch, *, lag: int = 0, overlap: float | None = None) -> None:
        """The batch's optimizer steps, one per minibatch: update -> log -> save, then the
        callbacks and a stop on a signal. Minibatches are contiguous slices of the local
        shard, so the k-th minibatch of every rank comes from the k-th slice of the global
        batch, as in one process (agent episodes add rows per segment: the slices cover
        them all). `lag`: weights versions between the sampler's and the first update's."""
        for mb, sl in enumerate(minibatch_slices(len(b.rows), self.cfg.train.minibatches)):
            if self.done():
                break
            if mb + lag > self.cfg.loss.max_staleness:
                raise RuntimeError(f"batch is {mb + lag} steps stale (> max_staleness)")
            sub = list(sl)
            with timed("update") as t:
                res = self.update(b, sub)
            self.step += 1
            m = self.log(self.measure(b, sub, res, mb=mb, lag=lag, t_update=t.seconds), mb=mb, overlap=overlap)
            saved = False
            if self.cfg.train.save_every and self.step % self.cfg.train.save_every == 0 and not self.done():
                saved = self.save()
            for cb in self.callbacks:
                cb(self.step, m)
            if not self.done() and self.stop_signal.requested(self.acc):
                self.stop(saved)

    def update(self, b: Batch, sub: list[int]) -> StepResult:
        """One optimizer step on the rows `sub` of the batch."""
        t, domains = self.m, self.domains
        return train_step(t.accelerator, t.model, t.optimizer, t.scheduler, loss_cfg=self.cfg.loss,
                          grad_clip=self.cfg.train.grad_clip, prompt_ids=[b.rows[i].ids for i in sub],
                          samples=[b.samples[i] for i in sub], teacher_lp=[b.teacher_lp[i] for i in sub],
                          teacher_full=[b.teacher_full[i] for i in sub],
                          off_B=torch.tensor([b.off[i] for i in sub], dtype=torch.bool),
                          task_reward_B=b.task_reward[sub],
                          domain_ids_B=torch.tensor([domains.index(b.rows[i].domain) for i in sub]),
                          n_domains=len(domains), pad_id=t.tokenizer.pad_token_id, vocab=len(t.tokenizer),
                          sampling=[self.cfg.rollout.for_domain(b.rows[i].domain) for i in sub],
                          micro_batches=self.cfg.train.micro_batches)

    def measure(self, b: Batch, sub: list[int], res: StepResult, *, mb: int, lag: int,
                t_update: float) -> dict[str, float]:
        """The step's metrics (`log_step`)."""
        return log_step(self.cfg.loss, self.cfg.rollout, self.m.accelerator, self.m.scheduler, b, sub, res, mb=mb,
                        t_update=t_update, domains=self.domains, corrected_domains=self.corrected_domains,
                        agent_domains=[d for d in self.domains if d in self.cfg.agents], lag=lag)

    def log(self, m: dict[str, float], *, mb: int, overlap: float | None = None) -> dict[str, float]:
        """The loop's own keys (sampler push, async overlap and step time, episodes dropped
        on resume) into the step's metrics `m`; then into the history, MLflow (buffered: a
        slow or locked store never stops training) and the progress bar."""
        # the server teachers' failed requests, fail-overs and serving URL for this batch; the
        # fail-over lines they printed become run tags
        faults, events = self.m.teachers.take_faults() if mb == 0 else ({}, [])
        m.update(faults)
        if self.sync_s is not None and mb == 0:   # the push of the previous batch's weights into the sampler
            m["time/sync_s"] = self.sync_s
        if self.cfg.rollout.async_steps:
            if mb == 0:   # how much of this batch's sampling ran beside the previous update
                m["async/overlap_s"] = overlap
            now = time.perf_counter()
            m["time/step_s"], self.t_last = now - self.t_last, now
        if self.dropped:   # once, at the first step after a resume that dropped episodes in flight
            m.update({f"agent/dropped_in_flight/{d}": float(n) for d, n in self.dropped.items()})
            self.dropped = {}
        self.trained += float(m.get("tokens", 0.0))
        self.history.append({"step": self.step, **m})
        if self.main:
            self.metrics.log(m, step=self.step,
                             tags={f"mopd.fault.step_{self.step}.{k}": e for k, e in enumerate(events)})
            self.bar.set_postfix({f"kl/{d}": f"{m[f'reverse_kl/{d}']:.3f}" for d in self.domains
                                  if f"reverse_kl/{d}" in m})
            self.bar.update(1)
        return m

    def state(self) -> dict:
        """The trainer_state of a checkpoint now. With a batch in flight, the data position
        is the one before its prompts were drawn: a resume draws the same prompts (same
        seeds) and samples them from the checkpoint's weights, synchronously."""
        data = self.pending.data if self.pending is not None else self.sampler.state_dict()
        s = {"data": data, "mlflow_run_id": self.run_id, "history": self.history,
             "settings": self.inputs.settings, "settings_hash": settings_hash(self.inputs.settings)}
        if self.partial:
            s["in_flight"] = self.in_flight()
        return s

    def in_flight(self) -> dict[str, int]:
        """Agent episodes carried over to the next step, per partial-rollout domain (all ranks)."""
        n = torch.tensor([float(len(self.pool.get(d, []))) for d in self.partial], device=self.acc.device)
        n = self.acc.reduce(n, reduction="sum") if self.acc.num_processes > 1 else n
        return {d: int(x) for d, x in zip(self.partial, n.tolist())}

    def save(self) -> bool:
        """A checkpoint of this step; True."""
        save_checkpoint(self.acc, self.m.model, self.m.tokenizer, self.out, self.step, self.state(),
                        self.cfg.train.keep_checkpoints)
        return True

    def sync(self) -> None:
        """The new weights into the sampler, in memory, after every update of the batch
        (asynchronous steps: after the next batch's sampling ended, before the one after
        it starts)."""
        with timed("sync") as t, self.engine_lock:
            self.m.rollout.sync_weights(sampler_weights(self.acc.unwrap_model(self.m.model)))
        self.sync_s = t.seconds

    def stop(self, saved: bool):
        """On SIGTERM / SIGINT: a checkpoint of the last finished step, then exit."""
        if not saved and self.step > self.first_step:
            self.save()
        self.bar.close()
        if self.executor is not None:   # the batch in flight finishes before its sampler closes
            self.executor.shutdown(wait=True)
        self.drop_pool(f"stopped after step {self.step}")
        if self.main:
            print(f"[mopd] stopped by {signal.Signals(self.stop_signal.signum).name} after step {self.step}: "
                  f"checkpoint in {self.out / 'checkpoints' / f'step_{self.step}'}; continue with "
                  f"train.resume=true", file=sys.stderr)
        self.close()
        raise Interrupted(self.stop_signal.signum)

    def drop_pool(self, why: str) -> None:
        n = A.drop_in_flight(self.pool)
        if sum(n.values()) and self.main:
            print(f"[mopd] {why}: {sum(n.values())} agent episode(s) still in flight on this rank are dropped "
                  f"({', '.join(f'{d}: {k}' for d, k in sorted(n.items()) if k)})", file=sys.stderr)

    def close(self) -> None:
        self.m.rollout.close()
        self.m.teachers.close()

    def finish(self) -> dict:
        """The final checkpoint, the HF export (LoRA merged), history.json and the MLflow
        artifacts; returns the run's summary."""
        self.bar.close()
        self.save()
        self.drop_pool(f"the run ended at step {self.step}")
        final_dir = self.out / "final"
        if self.main:
            shutil.rmtree(final_dir, ignore_errors=True)
            export_model(self.acc.unwrap_model(self.m.model), self.m.tokenizer, final_dir, source=self.cfg.model.path)
            (self.out / "history.json").write_text(json.dumps(self.history))
            registered = publish(self.cfg, self.out, final_dir, self.run_id, self.inputs)
            print_table(self.history, self.domains)
        failed = self.m.teachers.failed_urls()   # the summary names every teacher URL that failed in the run
        if failed and self.main:
            print("[mopd] teacher servers that failed during the run: " + "; ".join(
                f"{k}: {u} ({e.split(':')[0]})" for k, urls in failed.items() for u, e in urls.items()), file=sys.stderr)
            self.metrics.log({}, step=self.step, tags={"mopd.failed_urls": json.dumps(failed)})
        self.acc.wait_for_everyone()
        self.close()
        return {"history": self.history, "final": str(final_dir), "mlflow_run_id": self.run_id,
                "domains": self.domains, "failed_urls": failed, **({"registered": registered} if self.main else {})}


def log_step(loss: LossConfig, rollout: RolloutConfig, acc: Accelerator, scheduler, b: Batch, sub: list[int],
             res: StepResult, *, mb: int, t_update: float, domains: list[str], corrected_domains: set[str],
             agent_domains: list[str], lag: int = 0) -> dict[str, float]:
    """The step's metrics: loss, schedule, per-domain KL / mismatch / importance weights,
    the batch's sampling times (first minibatch), tokens; per turn and per episode for
    `agent_domains`. `lag`: weights versions between the sampler's weights and the
    batch's first update (rollout.async_steps)."""
    world = acc.num_processes
    m = {"loss": acc.reduce(res.loss.detach().reshape(1) / world, reduction="sum").item(),
         "lr": scheduler.get_last_lr()[0], "grad_norm": res.grad_norm, "staleness": mb + lag}
    m.update(step_metrics(acc, res, domains=domains, row_domains=[b.rows[i].domain for i in sub],
                          off=[b.off[i] for i in sub], n_fixed=[b.n_fixed[i] for i in sub],
                          task_reward_B=(b.task_reward if b.task_reward_raw is None else b.task_reward_raw)[sub],
                          is_truncation=loss.is_truncation,
                          task_reward_on=loss.task_reward_alpha > 0, corrected_domains=corrected_domains))
    if mb == 0:
        m.update(batch_metrics(acc, n_gen=b.n_gen, seconds=b.seconds, correction_on=rollout.any_correction))
    if agent_domains:   # per turn of the transcripts, and (once per sampled batch) per episode
        m.update(turn_kl_metrics(acc, res, turn_ids=[b.samples[i].turn_ids for i in sub],
                                 row_domains=[b.rows[i].domain for i in sub], agent_domains=agent_domains))
        if mb == 0:
            m.update(episode_metrics(acc, b.episodes, agent_domains))
        if mb == 0 and b.partial is not None:
            m.update(partial_metrics(acc, b.partial["stats"], b.partial["carried"], sorted(b.partial["carried"])))
    m["time/update_s"] = t_update
    if rollout.async_steps:
        # single-turn rows: every token of a minibatch was sampled with the same weights
        m["async/token_age_mean"] = float(mb + lag)
    m["tokens_per_s/update"] = res.n_tok_global / max(t_update, 1e-9)
    m["tokens"] = float(res.n_tok_global)  # student tokens trained on this step (all ranks)
    if rollout.any_references:  # over the global minibatch, like every other metric
        m.update(reference_metrics(acc, res, [b.off[i] for i in sub]))
    return m
