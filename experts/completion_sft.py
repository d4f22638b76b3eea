"""TRL's SFTTrainer with its completion-only loss computed on the completion positions alone.

TRL 1.16 computes the SFT loss through a fused, chunked LM head (`trl/kernels/chunked_logprob.py`).
On GPUs a Triton kernel scores only the positions that carry loss; on a CPU its torch fallback
scores every position of the batch, prompts and padding included, and derives entropy and
top-1 over [tokens, vocab] tiles in Python. For the tiny experts, whose prompts are 60-80% of
each row, that head took about half of an SFT step (profile in
docs/results/2026-12-05-tiny-preset.md). This trainer runs the LM head on the completion
positions only (core.sft.completion_logits, the base stage's loss) and keeps TRL's loss
normalization (the sum over tokens / `num_items_in_batch`) and its logged metrics (entropy,
mean_token_accuracy, num_tokens). It takes TRL's own path wherever the shortcut would not be
the same update: several processes (the shortcut would bypass DDP's gradient hooks), an
MoE's auxiliary loss, another loss type, label smoothing, a custom loss function, or a
padding-free batch."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from core.sft import completion_logits


def completion_sft_trainer(autocast_bf16: bool = False):
    """The SFTTrainer subclass (trl is imported here: it loads in seconds). `autocast_bf16`:
    forward and backward under bf16 autocast with fp32 weights (TRL's `bf16=True` does not
    autocast on a CPU: checked with trl 1.16, the layers' outputs stay fp32)."""
    from trl import SFTTrainer

    class CompletionSFTTrainer(SFTTrainer):
        def compute_loss_context_manager(self):
            inner = super().compute_loss_context_manager()
            return _with_autocast(inner, self.model.device.type) if autocast_bf16 else inner

        def _plain_model(self, model, inputs, return_outputs):
            if (return_outputs or self.accelerator.num_processes != 1 or self.aux_loss_enabled
                    or self.args.loss_type != "nll" or self.label_smoother is not None
                    or self.compute_loss_func is not None or "attention_mask" not in inputs
                    or "labels" not in inputs):
                return None
            m = self.accelerator.unwrap_model(model)
            m = m.get_base_model() if hasattr(m, "get_base_model") else m   # PEFT: LoRA layers stay in place
            if getattr(m, "model", None) is None or m.get_output_embeddings() is None:
                return None
            return m

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            m = self._plain_model(model, inputs, return_outputs)
            if m is None:
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
            logits_NV, target_N = completion_logits(m, inputs["input_ids"], inputs["attention_mask"],
                                                    inputs["labels"])
            logits_NV = logits_NV.float()
            n = target_N.numel()
            denom = max(n, 1) if num_items_in_batch is None else num_items_in_batch
            loss = F.cross_entropy(logits_NV, target_N, reduction="sum") / denom
            mode = "train" if self.model.training else "eval"
            with torch.no_grad():
                logp_NV = logits_NV.log_softmax(-1)
                entropy = -(logp_NV.exp() * logp_NV).sum(-1).sum().item()
                correct = (logits_NV.argmax(-1) == target_N).sum().item()
            self._metrics[mode]["entropy"].append(entropy / n if n else 0.0)
            self._metrics[mode]["mean_token_accuracy"].append(correct / n if n else 0.0)
            if mode == "train":
                self._total_train_tokens += int(inputs["attention_mask"].sum().item())
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            return loss

    return CompletionSFTTrainer


@contextlib.contextmanager
def _with_autocast(inner, device_type: str):
    with inner, torch.autocast(device_type, dtype=torch.bfloat16):
        yield
