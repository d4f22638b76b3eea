"""Models and batches: building the student, the weights its sampler gets, padding
token sequences into rectangular batches, and the completion log-probs the loss reads."""
from __future__ import annotations

import contextlib
import warnings

import torch

from core.quant import apply_qat, quantized_state_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def disable_dropout(model: torch.nn.Module) -> int:
    """Dropout off in every forward of `model`, in train mode too; returns how many modules
    changed. Log-probs that feed a loss, an importance weight or a reward must come from
    the same function the sampler ran (which never drops units): with a checkpoint's
    `attention_dropout: 0.1` a train-mode forward is off by ~0.1 nats per token.

    Sets `p = 0` on every `nn.Dropout` (as TRL's `disable_dropout_in_model`, which covers
    peft's `lora_dropout`) and every float attribute named `*dropout*` to 0: HF attention
    reads `self.attention_dropout` (a float, not a module) whenever `self.training`, which
    TRL's helper misses. The model's config is left as it is, so an export keeps it."""
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            n += module.p != 0
            module.p = 0.0
        for k, v in list(vars(module).items()):
            if "dropout" in k and isinstance(v, float) and v != 0.0:
                setattr(module, k, 0.0)
                n += 1
    return n


def set_dropout(model: torch.nn.Module, *, keep: bool, switch: str) -> None:
    """Where a model is loaded for training on its own samples (MOPD's student, GRPO's
    policy): dropout off (`disable_dropout`) unless the recipe's `switch` keeps it, and
    then a warning, since the sampler samples without dropout."""
    if not keep:
        disable_dropout(model)
        return
    warnings.warn(f"{switch}=true: dropout stays on in the trainer's forward while the sampler samples without "
                  f"it, so the trainer's log-probs of the samples are not the sampler's: the importance weights "
                  f"move away from 1 and tokens get masked as off-policy (a mean |dlog p| of ~0.1 per token with "
                  f"attention_dropout 0.1). Set it to false unless that is what you want.", UserWarning, stacklevel=2)


def build_student(path: str, *, dtype: str = "float32", lora=None, quant=None, dropout: bool = False,
                  gradient_checkpointing: bool = False):
    """The trainable student: the checkpoint at `path`, optionally with a LoRA adapter
    (`lora`: enabled, r, alpha, dropout, target_modules) and QAT (`quant`). Dropout (the
    checkpoint's and the LoRA branch's) is off unless `dropout` (model.dropout) is true:
    the student's log-probs must be the sampler's (`disable_dropout`).
    `gradient_checkpointing`: the decoder layers recompute their activations in backward
    (non-reentrant, so a LoRA student's frozen inputs need no requires_grad trick)."""
    from core.vision import load_model   # a vision-language checkpoint gets its own class

    model = load_model(path, torch_dtype(dtype))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False   # a KV cache is never wanted in the trainer's forward
    if lora is not None and lora.enabled:
        from peft import LoraConfig as PeftLora, get_peft_model  # peft only where LoRA is asked for

        model = get_peft_model(model, PeftLora(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                               target_modules=lora.target_modules, task_type="CAUSAL_LM"))
    set_dropout(model, keep=dropout, switch="model.dropout")
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


def pad_id_of(tokenizer) -> int:
    """The id to pad batches with: the tokenizer's pad token, else its EOS (Llama 3 has no
    pad token), else 0. Which id it is never matters: attention masks and loss masks come
    from the sequences' lengths, never from comparing ids with it, so a pad id equal to EOS
    keeps each row's own (first) EOS in the loss."""
    for k in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, k, None)
        if isinstance(v, int):
            return v
    return 0


def pad_batch(seqs: list[list[int]], pad_id: int | None, *, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences -> (ids_BT, attention mask_BT), padded on the `side` given: left for
    generation (every row's last prompt token in the last column), right for training.
    `pad_id` None (a tokenizer without a pad token) pads with 0: the masks come from the
    lengths, so the padding id is never read."""
    if side not in ("left", "right"):
        raise ValueError(f"pad_batch: side must be 'left' or 'right', got {side!r}")
    pad_id = 0 if pad_id is None else int(pad_id)
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
            token_mask: list[list[int] | None] | None = None, vision: list | None = None) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion ids; completion-aligned [B, T] tensors for the rest.
    `vision[i]`: row i's images (core.vision.Vision or None), kept as the batch's `vision`
    (all rows' in row order) for the forwards over it.
    `mask` marks the completion tokens that carry loss: all of them, or where a row's
    `token_mask` (an agent transcript's loss_mask: 1 = the student wrote it) is 1, so
    observation tokens get no loss and no gradient. `completion_ids` holds each row's
    completion tokens, right-padded with 0 (read where `mask` is 1)."""
    B = len(prompts)
    ids, attn = pad_batch([p + c for p, c in zip(prompts, completions)], pad_id, side="right")
    if ids.shape[1] < 2:   # one-token rows only (empty completions): a padding column gives the forward a position to predict from
        ids, attn = torch.nn.functional.pad(ids, (0, 1), value=pad_id or 0), torch.nn.functional.pad(attn, (0, 1))
    T = max(1, max(len(c) for c in completions))
    mask = torch.zeros((B, T))
    start = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    out = {k: torch.zeros((B, T)) for k in extra}
    comp = torch.zeros((B, T), dtype=torch.long)
    for i, c in enumerate(completions):
        comp[i, :len(c)] = torch.as_tensor(list(c), dtype=torch.long)
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
    batch = {"input_ids": ids, "attention_mask": attn, "mask": mask, "completion_start": start,
             "completion_ids": comp, **out}
    if vision is not None and any(v is not None for v in vision):
        from core.vision import cat_vision

        batch["vision"] = cat_vision(vision)
    return batch


def _inputs(model, batch: dict) -> dict:
    """The forward's inputs of a collated batch: ids, mask, and its images if it has any."""
    kw = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if batch.get("vision") is not None:
        from core.vision import forward_kwargs

        kw.update(forward_kwargs(model, batch["input_ids"], batch["vision"]))
    return kw


def completion_logprobs(model, batch: dict[str, torch.Tensor], full: bool = False):
    """log p(y_t | prefix) for the completion tokens, [B, T_completion]; with `full`, also
    the whole log-softmax at those positions, [B, T_completion, V]."""
    out = model(**_inputs(model, batch))
    logits = out.logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    logsm = torch.log_softmax(logits, dim=-1)
    lp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # Completion token t sits at input position P_i + t; its log-prob at logits position P_i + t - 1.
    idx = batch["completion_start"].unsqueeze(1) - 1 + torch.arange(batch["mask"].shape[1]).unsqueeze(0)
    idx = idx.clamp(max=lp.shape[1] - 1)
    # where, not a product: a padding position may hold an id whose logit is -inf (0 * -inf = nan)
    lp_BT = torch.where(batch["mask"] > 0, lp.gather(1, idx), 0.0)
    if not full:
        return lp_BT
    V = logsm.shape[-1]
    return lp_BT, logsm.gather(1, idx.unsqueeze(-1).expand(-1, -1, V))


def output_head(model) -> torch.nn.Module:
    """The module that turns the last hidden states into logits (`get_output_embeddings`,
    through DDP's and peft's wrappers). Models that change the logits after it (Gemma's
    softcapping, a logit scale) are refused: their head alone would give other logits."""
    m = getattr(model, "module", model)
    get = getattr(m, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        raise ValueError(f"loss.logits_chunk needs an HF causal LM with get_output_embeddings(); "
                         f"{type(m).__name__} has none: set loss.logits_chunk=0")
    cfg = getattr(m, "config", None)
    for k in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, k, None) not in (None, 1.0):
            raise ValueError(f"loss.logits_chunk: {type(m).__name__} applies {k}={getattr(cfg, k)} after its output "
                             f"layer, which the chunked loss does not: set loss.logits_chunk=0")
    return head


def _identity(x):
    return x


@contextlib.contextmanager
def head_passed_through(model):
    """Within it, the model's output head (`output_head`) is the identity: the model's own
    forward (DDP's included) returns its last hidden states as `.logits`, no [B, L, V]
    tensor made. Yields the head."""
    head = output_head(model)
    own = head.__dict__.get("forward")      # a hook library may have set one: put it back after
    head.forward = _identity
    try:
        yield head
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def completion_hidden(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.nn.Module]:
    """The last hidden states that predict the completion tokens, [B, T_completion, H], and
    the output head that makes them logits: the model's own forward (DDP's included) with
    its head passed through, so no [B, L, V] tensor is ever made; the caller applies the
    head a chunk of positions at a time (`mopd.distill.step.chunked_terms`)."""
    with head_passed_through(model) as head:
        out = model(**_inputs(model, batch))
    hidden = out.logits[:, :-1]
    idx = batch["completion_start"].unsqueeze(1) - 1 + torch.arange(batch["mask"].shape[1]).unsqueeze(0)
    idx = idx.clamp(max=hidden.shape[1] - 1)
    return hidden.gather(1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])), head
