"""Supervised training on agent transcripts: cross-entropy on the tokens the assistant
wrote, none on the system prompt, the task or the observations. Used by the agent
expert's SFT stage (oracle episodes) and by seq-KD on agents (the teacher's episodes);
the rows come from `core.agent.transcript.encode_transcript` or from an `Episode`'s
segments, so they have exactly the token layout the episode runner samples."""
from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable

import mlflow
import torch

from core.agent.harness import load_harnesses
from core.agent.transcript import encode_segments
from core.models import collate, pad_batch
from core.sft import completion_loss, step_precision

Row = tuple[list[int], list[int], list[int]]   # prompt_ids, completion_ids, loss_mask
# A vision-language model's rows carry a fourth item, their images (core.vision.Vision or
# None), from encode_segments(..., processor=): the forward gets them, the loss never sees
# their pad tokens (observations, mask 0).


def masked_batch(rows: list[Row], pad_id: int) -> dict:
    """core.models.collate of the rows: `mask` is 1 on the assistant-written tokens only."""
    return collate([r[0] for r in rows], [r[1] for r in rows], pad_id, {}, token_mask=[r[2] for r in rows])


def labelled_batch(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids_BT, attention mask_BT, labels_BT) for core.sft.completion_loss: labels are the
    tokens themselves where the assistant wrote them, -100 elsewhere (prompt,
    observations, padding)."""
    ids_BT, attn_BT = pad_batch([r[0] + r[1] for r in rows], pad_id, side="right")
    labels_BT = torch.full_like(ids_BT, -100)
    for i, (p, c, m) in enumerate(r[:3] for r in rows):
        if len(m) != len(c):   # torch.where would broadcast a 1-long mask over the row
            raise ValueError(f"labelled_batch: row {i} has {len(c)} completion tokens but {len(m)} loss-mask entries")
        keep = torch.tensor(m, dtype=torch.bool)
        labels_BT[i, len(p):len(p) + len(c)] = torch.where(keep, torch.tensor(c), torch.tensor(-100))
    return ids_BT, attn_BT, labels_BT


def batch_vision(rows: list) -> dict:
    """completion_loss's `vision` for rows with images (the rows' Visions in row order, which
    is the order the forward scatters them into the pads): {} for text rows."""
    from core.vision import cat_vision

    v = cat_vision([r[3] for r in rows if len(r) > 3])
    return {} if v is None else {"vision": v}


def lr_lambda(max_steps: int, warmup: int, schedule: str) -> Callable[[int], float]:
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr schedule must be constant, linear or cosine, got {schedule!r}")

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return {"constant": 1.0, "linear": 1.0 - frac, "cosine": 0.5 * (1 + math.cos(math.pi * frac))}[schedule]
    return f


def train_on_transcripts(model, rows: list[Row], *, pad_id: int, steps: int, lr: float, batch_size: int,
                         grad_accum: int = 1, warmup: int = 0, schedule: str = "constant",
                         weight_decay: float = 0.0, grad_clip: float = 1.0, seed: int = 0,
                         log: Callable[[int, dict], None] | None = None, log_every: int = 10,
                         label: str = "agent sft", precision: str = "fp32") -> list[float]:
    """`steps` AdamW steps of `batch_size` x `grad_accum` rows drawn without replacement
    (reshuffled each pass); returns the loss per step. `precision` bf16 autocasts forward and
    backward (fp32 weights and optimizer state), as core.sft.sft does."""
    if not rows:
        raise ValueError(f"{label}: no training rows")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, warmup, schedule))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    order: list[int] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        total = 0.0
        for _ in range(grad_accum):
            if len(order) < batch_size:
                order += torch.randperm(len(rows), generator=gen).tolist()
            idx, order = order[:batch_size], order[batch_size:]
            batch = [rows[i] for i in idx]
            # the LM head only at the positions that predict an assistant token
            with step_precision(precision):
                loss = completion_loss(model, *labelled_batch(batch, pad_id), **batch_vision(batch)) / grad_accum
            loss.backward()
            total += float(loss.detach())
        gn = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip > 0 else torch.tensor(0.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if step % log_every == 0 or step == steps:
            print(f"[{label}] step {step}/{steps} loss {total:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if log is not None:
                log(step, {"loss": total, "grad_norm": float(gn), "lr": sched.get_last_lr()[0]})
    return losses


def log_metrics(step: int, m: dict) -> None:
    """To the active MLflow run, if any (a stage run outside `mopd expert` has none)."""
    if mlflow.active_run() is not None:
        mlflow.log_metrics(m, step=step)


def oracle_transcripts(cfg, tokenizer, train_ds, episode: Callable, label: str, processor=None) -> list[Row]:
    """An agent expert's SFT rows: every training task's oracle episode, each through a
    harness drawn (seeded by data.seed) from `cfg.agent.harnesses`. `episode(task,
    harness_cfg, rng) -> (messages, apply_context)` is the domain's: its system prompt and
    oracle turns (a share perturbed, drawing from `rng`), and its harness's context policy.
    Episodes with a turn longer than train.max_length are left out and counted. `processor`
    (a vision-language model's): image observations become image tokens and each row
    carries its Vision (encode_segments)."""
    mix = load_harnesses(cfg.agent.harnesses)
    rng = random.Random(cfg.data.seed)
    out, cut = [], 0
    for row in train_ds:
        task = json.loads(row["task"])
        msgs, apply_context = episode(task, mix.sample(rng), rng)
        rows = encode_segments(tokenizer, msgs, apply_context, processor)
        if any(len(r[0]) + len(r[1]) > cfg.train.max_length for r in rows):
            cut += 1
            continue
        out += rows
    if cut:
        print(f"[expert] {label} sft: {cut} of {len(train_ds)} oracle episodes are longer than "
              f"train.max_length={cfg.train.max_length} tokens and were left out", flush=True)
    if not out:
        raise ValueError(f"{label} sft: no oracle episode fits train.max_length; raise it")
    return out


def train_sft_stage(cfg, model, tokenizer, rows: list[Row]):
    """An agent expert's SFT stage on `rows` with the recipe's train settings; returns the model."""
    t = cfg.train
    train_on_transcripts(model, rows, pad_id=tokenizer.pad_token_id, steps=t.max_steps, lr=t.lr,
                         batch_size=t.batch_size, grad_accum=t.grad_accum, warmup=t.warmup_steps,
                         schedule=t.lr_schedule, weight_decay=t.weight_decay, grad_clip=t.grad_clip, seed=t.seed,
                         log=log_metrics, log_every=t.logging_steps, precision=t.precision)
    return model
