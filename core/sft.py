"""Supervised fine-tuning for tiny models: a plain torch loop.

For models of a few million parameters a hand-written loop is several times faster than
a Trainer (no accelerate wrapping, no collator machinery), and it is short enough to
read top to bottom: tokenize, batch, loss on the assistant tokens, step, save.

Rows are chat data: `prompt` (messages, ending with a user turn) and `completion` (one
assistant message). The model sees the prompt rendered by the chat template with the
generation prompt, followed by the completion text and EOS; only the completion tokens
and the EOS carry loss, so the model learns what to say and when to stop.

Rows may instead come tokenized (`prompt_ids`, `completion_ids`, `loss_mask`): agent
transcripts, whose completion holds observations that carry no loss
(core.agent.transcript). A tokenized single-turn row (mask all 1) trains exactly like
its chat form.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from core import ranks
from core.completions import completion_text
from core.export import export_model
from core.models import pad_batch
from core.quant import apply_qat


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat `messages` plus the assistant generation prompt."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def encode_example(tokenizer, prompt: list[dict], completion) -> tuple[list[int], list[int]]:
    """(prompt_ids, completion_ids); completion_ids end with EOS. The completion is
    tokenized on its own, exactly as a sampler would produce it after the prompt."""
    text = completion_text(completion)
    comp = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return encode_prompt(tokenizer, prompt), comp


def _lr_at(step: int, steps: int, warmup: int, lr: float) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _collate(examples: list[tuple], pad_id: int):
    """Right-padded input_ids_BT, attention_mask_BT and labels_BT (-100 outside the
    completion, and where a row's loss mask, its optional third item, is 0). labels are
    aligned with input_ids; the shift happens in the loss."""
    ids_BT, mask_BT = pad_batch([ex[0] + ex[1] for ex in examples], pad_id, side="right")
    labels_BT = torch.full_like(ids_BT, -100)
    for i, ex in enumerate(examples):
        p, c = ex[0], ex[1]
        lab = torch.tensor(c)
        if len(ex) > 2 and ex[2] is not None:
            lab = torch.where(torch.tensor(ex[2], dtype=torch.bool), lab, torch.tensor(-100))
        labels_BT[i, len(p):len(p) + len(c)] = lab
    return ids_BT, mask_BT, labels_BT


def encode_rows(tokenizer, dataset: datasets.Dataset) -> list[tuple]:
    """(prompt_ids, completion_ids[, loss_mask]) per row, from chat or tokenized rows."""
    if "completion_ids" in dataset.column_names:
        masks = dataset["loss_mask"] if "loss_mask" in dataset.column_names else [None] * len(dataset)
        out = []
        for i, (p, c, m) in enumerate(zip(dataset["prompt_ids"], dataset["completion_ids"], masks)):
            if m is not None and len(m) != len(c):
                raise ValueError(f"sft: row {i} has {len(c)} completion tokens but {len(m)} loss-mask entries")
            out.append((list(p), list(c), None if m is None else list(m)))
        return out
    return [encode_example(tokenizer, p, c) for p, c in zip(dataset["prompt"], dataset["completion"])]


def completion_logits(model, ids_BT, mask_BT, labels_BT, vision=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits_NV, target_N): the logits of the N positions that predict a completion token
    (label != -100 one position on) and those tokens. `vision`: the batch's images
    (core.vision.Vision, rows' in row order) for a vision-language model.

    The LM head runs only on those positions: prompts are most of each sequence here, and
    with a 2k vocabulary the head is a third of a tiny model's FLOPs."""
    target_BT = labels_BT[:, 1:]
    keep_BT = target_BT != -100
    kw = {}
    if vision is not None:
        from core.vision import forward_kwargs

        kw = forward_kwargs(model, ids_BT, vision)
    decoder, head = getattr(model, "model", None), model.get_output_embeddings()
    if decoder is None or head is None:  # not a plain *ForCausalLM: full logits
        logits_BTV = model(input_ids=ids_BT, attention_mask=mask_BT, **kw).logits[:, :-1]
        return logits_BTV[keep_BT], target_BT[keep_BT]
    hidden_BTD = decoder(input_ids=ids_BT, attention_mask=mask_BT, use_cache=False, **kw).last_hidden_state[:, :-1]
    return head(hidden_BTD[keep_BT]), target_BT[keep_BT]


def completion_loss(model, ids_BT, mask_BT, labels_BT, vision=None) -> torch.Tensor:
    """Mean next-token cross-entropy over the completion tokens of the batch (`vision`: its
    images, completion_logits)."""
    logits_NV, target_N = completion_logits(model, ids_BT, mask_BT, labels_BT, vision)
    return F.cross_entropy(logits_NV.float(), target_N)


def step_precision(precision: str):
    """The context a training step runs in: bf16 autocast (fp32 weights and optimizer state)
    for "bf16", nothing for "fp32"."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"sft: precision must be fp32 or bf16, got {precision!r}")
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


def sft(model_dir: str, dataset: datasets.Dataset, out_dir: str, *, steps: int, lr: float,
        batch_size: int, seed: int = 0, warmup: int = 0, log_every: int = 50,
        progress: bool = True, weight_decay: float = 0.0, num_threads: int | None = 1,
        quant=None, save_at: tuple[int, ...] = (), precision: str = "fp32") -> str:
    """Fine-tune the HF checkpoint at `model_dir` on chat rows (prompt, completion) for
    `steps` AdamW steps of `batch_size` rows (reshuffled every epoch), and save model and
    tokenizer to `out_dir`. Deterministic given `seed`. Writes `sft_log.json` (losses,
    seconds) beside the checkpoint and returns `out_dir`.

    `num_threads` sets torch's intra-op threads for the run (restored afterwards; None
    leaves torch's setting). The default, 1, suits the tiny models this loop is for: at
    ~1M parameters one thread is 3-5x more CPU-efficient than two, and frees the other
    core for a second run in parallel. Pass None for bigger models.

    `quant` (a core.quant.QuantConfig with enabled=True) trains with fake-quantized
    Linear layers (QAT) and saves the fake-quantized weights: the checkpoint is exactly
    the model the training forward used, which is what a QAT teacher or base should be.

    `save_at`: step counts (1..steps) after which the model is also saved, as the final one
    is, to out_dir/checkpoints/step_<k> (for score-vs-budget curves along one run; the
    learning-rate schedule stays the whole run's).

    `precision`: fp32, or bf16 autocast of forward and backward (fp32 weights and AdamW
    state), about 1.3-1.5x faster per step on CPUs with AVX-512 bf16 / AMX. For stages that
    no sampler follows directly (the base): under QAT the fake-quantized weights would be
    rounded to bf16 inside the matmuls, which an fp32 sampler does not do."""
    cols = ("prompt_ids", "completion_ids") if "completion_ids" in dataset.column_names else ("prompt", "completion")
    for col in cols:
        if col not in dataset.column_names:
            raise ValueError(f"sft: dataset has no {col!r} column (columns: {dataset.column_names})")
    if len(dataset) == 0:
        raise ValueError("sft: dataset is empty")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"sft: steps and batch_size must be >= 1 (got {steps}, {batch_size})")
    if save_at and quant is not None and quant.enabled:
        raise ValueError("sft: save_at with QAT is not supported (a mid-run export would change the trained model)")

    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _sft(model_dir, dataset, out_dir, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                    warmup=warmup, log_every=log_every, progress=progress, weight_decay=weight_decay,
                    quant=quant, save_at=tuple(save_at), precision=precision)
    finally:
        torch.set_num_threads(old_threads)


def _save(model, tokenizer, out: Path, quant) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    if quant is not None and quant.enabled:
        export_model(model, tokenizer, out)
    else:
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))


def _sft(model_dir, dataset, out_dir, *, steps, lr, batch_size, seed, warmup, log_every, progress,
         weight_decay, quant=None, save_at=(), precision="fp32") -> str:
    step_precision(precision)   # a bad value fails before the model loads

    t0 = time.perf_counter()
    cpu0 = time.process_time()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    if quant is not None and quant.enabled:
        apply_qat(model, quant)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"sft: tokenizer in {model_dir} has no eos_token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    examples = encode_rows(tokenizer, dataset)
    for i, ex in enumerate(examples):
        if len(ex[1]) < 1 or (len(ex) > 2 and ex[2] is not None and not any(ex[2])):
            raise ValueError(f"sft: row {i} has an empty completion")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )

    rng = random.Random(seed)
    order: list[int] = []
    losses: list[float] = []
    seen, seen_at = 0, {}   # completion tokens trained on so far; at each save_at step
    bar = tqdm(range(steps), desc=f"sft {Path(out_dir).name}", disable=not progress)
    for step in bar:
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        seen += sum(len(ex[1]) if len(ex) < 3 or ex[2] is None else sum(ex[2]) for ex in batch)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, steps, warmup, lr)
        opt.zero_grad(set_to_none=True)
        with step_precision(precision):
            loss = _global_batch_backward(model, batch, pad_id)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss)
        if step + 1 in save_at:
            seen_at[step + 1] = seen
        if step + 1 in save_at and step + 1 < steps:
            _save(model, tokenizer, Path(out_dir) / "checkpoints" / f"step_{step + 1}", None)
            model.train()
        if progress and (step % max(1, log_every) == 0 or step == steps - 1):
            recent = losses[-max(1, log_every):]
            bar.set_postfix(loss=f"{sum(recent) / len(recent):.4f}")
    bar.close()

    out = Path(out_dir)
    _save(model, tokenizer, out, quant)
    seconds = time.perf_counter() - t0
    (out / "sft_log.json").write_text(json.dumps({
        "model_dir": str(model_dir), "steps": steps, "lr": lr, "batch_size": batch_size,
        "seed": seed, "warmup": warmup, "rows": len(dataset), "precision": precision,
        "quant": None if quant is None or not quant.enabled else {"group_size": quant.group_size,
                                                                  "convention": quant.convention,
                                                                  "format": quant.format}, "seconds": round(seconds, 2),
        "cpu_seconds": round(time.process_time() - cpu0, 2), "threads": torch.get_num_threads(),
        "losses": [round(x, 5) for x in losses], "processes": ranks.world_size(), "tokens": seen,
        **({"checkpoint_tokens": seen_at} if save_at else {}),
    }))
    ranks.barrier()   # the other ranks return once the checkpoint is on disk
    return str(out)


def _global_batch_backward(model, batch: list[tuple], pad_id: int) -> float:
    """Gradients of the mean completion loss over the whole `batch` (the global batch);
    returns that loss. Under a launcher each rank takes its shard of the rows (rank r:
    rows r, r + world, ...), weighs its token-mean by its share of the batch's loss tokens
    and the ranks sum their gradients: the update a single process makes on the whole
    batch, up to float summation order."""
    world = ranks.world_size()
    if world == 1:
        loss = completion_loss(model, *_collate(batch, pad_id))
        loss.backward()
        return loss.item()
    import torch.distributed as dist

    def tokens(ex) -> int:
        return int(sum(ex[2])) if len(ex) > 2 and ex[2] is not None else len(ex[1])
    mine = batch[ranks.rank()::world]
    share = sum(tokens(ex) for ex in mine) / sum(tokens(ex) for ex in batch)
    loss = completion_loss(model, *_collate(mine, pad_id)) * share
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item()
