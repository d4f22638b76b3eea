"""Models and batches: building the student, the weights its sampler gets, padding
token sequences into rectangular batches, and the completion log-probs the loss reads."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from mopd.quant import apply_qat, quantized_state_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def build_student(path: str, *, dtype: str = "float32", lora=None, quant=None):
    """The trainable student: the checkpoint at `path`, optionally with a LoRA adapter
    (`lora`: enabled, r, alpha, dropout, target_modules) and QAT (`quant`)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    if lora is not None and lora.enabled:
        from peft import LoraConfig as PeftLora, get_peft_model  # peft only where LoRA is asked for

        model = get_peft_model(model, PeftLora(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                               target_modules=lora.target_modules, task_type="CAUSAL_LM"))
    # LoRA first, then QAT: the merged weight W + BA is what gets fake-quantized.
    if quant is not None:
        apply_qat(model, quant)
    return model


def sampler_weights(model) -> list[tuple[str, torch.Tensor]]:
    """Exactly the weights the trainer's forward uses, under HF names: LoRA merged in
    (without touching the model: a merge/unmerge round trip would not restore the base
    bit for bit) and, with QAT on, fake-quantized. So the sampler is on-policy by
    construction."""
    out = {}
    for k, v in quantized_state_dict(model).items():
        if hasattr(v, "full_tensor"):  # FSDP2 DTensor shard: every rank's sampler needs it whole
            v = v.full_tensor()
        out[k] = v.detach()
    return list(checkpoint_layout(model, out).items())


def checkpoint_layout(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (in-memory names) under the names and shapes a saved checkpoint has, which
    is what vLLM loads: transformers fuses some weights in memory (an MoE's experts into
    one [E, ...] tensor) and splits them again in save_pretrained. Unchanged for models
    without such conversions."""
    from transformers.core_model_loading import revert_weight_conversion

    base = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft: the HF model
    base = getattr(base, "module", base)   # DDP
    return revert_weight_conversion(base, tensors) if hasattr(base, "config") else tensors


def pad_batch(seqs: list[list[int]], pad_id: int, *, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences -> (ids_BT, attention mask_BT), padded on the `side` given: left for
    generation (every row's last prompt token in the last column), right for training."""
    if side not in ("left", "right"):
        raise ValueError(f"pad_batch: side must be 'left' or 'right', got {side!r}")
    B, T = len(seqs), max(1, max((len(s) for s in seqs), default=0))
    ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((B, T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not len(s):
            continue
        cols = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids_BT[i, cols] = torch.as_tensor(s, dtype=torch.long)
        mask_BT[i, cols] = 1
    return ids_BT, mask_BT


def collate(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
            extra: dict[str, list[list[float]]],
            token_mask: list[list[int] | None] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion ids; completion-aligned [B, T] tensors for the rest.
    `mask` marks the completion tokens that carry loss: all of them, or where a row's
    `token_mask` (an agent transcript's loss_mask: 1 = the student wrote it) is 1, so
    observation tokens get no loss and no gradient."""
    B = len(prompts)
    ids, attn = pad_batch([p + c for p, c in zip(prompts, completions)], pad_id, side="right")
    T = max(1, max(len(c) for c in completions))
    mask = torch.zeros((B, T))
    start = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    out = {k: torch.zeros((B, T)) for k in extra}
    for i, c in enumerate(completions):
        tm = token_mask[i] if token_mask is not None else None
        if tm is None:
            mask[i, :len(c)] = 1
        else:
            if len(tm) != len(c):
                raise ValueError(f"collate: row {i} has {len(c)} completion tokens but {len(tm)} loss-mask entries")
            mask[i, :len(c)] = torch.as_tensor(tm, dtype=torch.float32)
        for k, vals in extra.items():
            if len(c):
                out[k][i, :len(c)] = torch.as_tensor(vals[i], dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attn, "mask": mask, "completion_start": start, **out}


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
