"""HF rollout: samples with the trainer's own `nn.Module` (no second copy of the
weights, no sync needed). Slow, but has no dependency on vLLM; the fallback, the greedy
decoder of the evals (temperature 0), and the reference the vLLM backend is tested
against."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from core.models import pad_batch
from core.quant import frozen_weights
from core.rollout.base import Sample, _check_batch, eos_ids



def sample_from_logits(logits_BV: torch.Tensor, u_B: torch.Tensor, *, temperature: float,
                       top_p: float) -> torch.Tensor:
    """Inverse-CDF sampling with one given uniform per row.

    Each row's token depends only on its own logits and its own uniform u, so a row
    samples the same token whatever else is in the batch (up to float noise in the
    logits, which flips a token only when u lands within ~1e-7 of a CDF boundary).
    temperature == 0 means greedy.
    """
    if temperature == 0:
        return logits_BV.argmax(-1)
    probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        cum_BV = probs_BV.cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always keeps the top token).
        probs_BV = probs_BV.masked_fill(cum_BV - probs_BV >= top_p, 0.0)
    cdf_BV = probs_BV.cumsum(-1)
    target_B1 = (u_B.to(cdf_BV.device) * cdf_BV[:, -1]).unsqueeze(-1)
    idx_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1)
    idx_B = idx_B.clamp_(max=probs_BV.shape[-1] - 1)
    # Never pick a zero-probability token (possible only at float edges of the CDF).
    zero = probs_BV.gather(-1, idx_B[:, None]).squeeze(-1) == 0
    if zero.any():
        idx_B = torch.where(zero, probs_BV.argmax(-1), idx_B)
    if top_p < 1.0:
        idx_B = order_BV.gather(-1, idx_B[:, None]).squeeze(-1)
    return idx_B


class HFRollout:
    """Samples with the trainer's in-memory model (shares its weights: nothing to sync).

    Prompts are left-padded into batches of `batch_size`; each row draws its random
    numbers from its own CPU `torch.Generator(seed)`, so a prompt's sample is the same
    alone or in any batch.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.eos_ids = eos_ids(tokenizer, getattr(model, "generation_config", None))
        if not self.eos_ids:
            raise ValueError("HFRollout: neither the tokenizer nor the model's generation_config has an eos_token_id")
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        # An MoE checkpoint saved by TRL has output_router_logits=true; its router loss in a
        # cached decoding step breaks (gate logits of one token against the whole mask), and
        # sampling needs no loss.
        cfg = getattr(model, "config", None)
        self.extra = {"output_router_logits": False} if hasattr(cfg, "output_router_logits") else {}
        # A vision-language model never writes its image/vision markers: a sampled image pad
        # would take an image feature's place in every later forward. They are not sampled
        # (the recorded log-probs stay the raw ones, as with top-p).
        self.unsampled = [int(i) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                           "vision_end_token_id") if (i := getattr(cfg, k, None)) is not None] \
            if getattr(cfg, "vision_config", None) is not None else []

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seeds: list[int], vision: list | None = None) -> list[Sample]:
        """`vision[i]`: prompt i's images (core.vision.Vision, or None) for a vision-language
        model; its positions are then the model's 3D ones."""
        _check_batch(prompts, seeds, max_new_tokens)
        vision = vision if vision is not None and any(v is not None for v in vision) else None
        was_training = self.model.training
        self.model.eval()  # no dropout; gradient checkpointing off so the KV cache is used
        try:
            out: list[Sample] = []
            with frozen_weights(self.model):  # a QAT student: quantize once, not at every token
                for i in range(0, len(prompts), self.batch_size):
                    out += self._generate_batch(prompts[i:i + self.batch_size], seeds[i:i + self.batch_size],
                                                max_new_tokens, temperature, top_p,
                                                vision[i:i + self.batch_size] if vision else None)
            return out
        finally:
            self.model.train(was_training)

    def _generate_batch(self, prompts, seeds, max_new_tokens, temperature, top_p, vision=None) -> list[Sample]:
        device = next(self.model.parameters()).device
        B = len(prompts)
        ids_BL, mask_BL = pad_batch(prompts, self.pad_id, side="left")
        ids_BL, mask_BL = ids_BL.to(device), mask_BL.to(device)
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        eos_B = torch.tensor(sorted(self.eos_ids), device=device)
        extra = dict(self.extra)
        if vision is not None:   # images: the model's 3D positions; text after them continues +1 on all three
            from core.vision import cat_vision, forward_kwargs, rope_positions

            v = cat_vision(vision)
            pos_BL = rope_positions(self.model, ids_BL, mask_BL, v)
            extra.update(forward_kwargs(self.model, ids_BL, v))

        res = self.model(input_ids=ids_BL, attention_mask=mask_BL, position_ids=pos_BL, use_cache=True, **extra)
        past, logits_BV = res.past_key_values, res.logits[:, -1, :]
        next_pos_B = pos_BL[..., -1] + 1
        done_B = torch.zeros(B, dtype=torch.bool, device=device)
        toks, lps = [[] for _ in range(B)], [[] for _ in range(B)]
        for t in range(max_new_tokens):
            u_B = torch.stack([torch.rand((), generator=g) for g in gens])
            allowed_BV = logits_BV.index_fill(-1, torch.tensor(self.unsampled, device=device), float("-inf")) \
                if self.unsampled else logits_BV
            tok_B = sample_from_logits(allowed_BV, u_B, temperature=temperature, top_p=top_p)
            lp_B = torch.log_softmax(logits_BV.float(), dim=-1).gather(-1, tok_B[:, None]).squeeze(-1)
            for b in (~done_B).nonzero().flatten().tolist():
                toks[b].append(int(tok_B[b]))
                lps[b].append(float(lp_B[b]))
            done_B |= torch.isin(tok_B, eos_B)
            if bool(done_B.all()) or t == max_new_tokens - 1:
                break
            # Finished rows keep running (masked out) so the batch stays rectangular.
            mask_BL = torch.cat([mask_BL, (~done_B).long()[:, None]], dim=1)
            res = self.model(input_ids=tok_B[:, None], attention_mask=mask_BL, position_ids=next_pos_B[..., None],
                             past_key_values=past, use_cache=True, **self.extra)
            past, logits_BV = res.past_key_values, res.logits[:, -1, :]
            next_pos_B = next_pos_B + 1
        return [Sample(prompt_ids=list(p), completion_ids=toks[b], sampler_logprobs=lps[b],
                       finished=bool(toks[b]) and toks[b][-1] in self.eos_ids)
                for b, p in enumerate(prompts)]

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """No-op: HFRollout samples with the trainer's module itself."""

    def read_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def close(self) -> None:
        pass




class HFCopyRollout(HFRollout):
    """HF sampling with its own copy of the student's weights, loaded from `model_path`
    and overwritten by `sync_weights` (HF names, LoRA merged, as the vLLM engine takes
    them). For asynchronous steps: the trainer's module changes in place during an update,
    so a sampler running beside it must hold the previous version's weights itself."""

    def __init__(self, model_path: str, tokenizer: Any, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", batch_size: int = 64):
        from core.vision import load_model   # a vision-language student's copy is of its own class

        model = load_model(model_path, dtype).to(device)
        model.requires_grad_(False)
        super().__init__(model.eval(), tokenizer, batch_size=batch_size)
        # the pushed names are the saved checkpoint's (core.models.checkpoint_layout); a model
        # whose classes rename weights in memory (Qwen-VL: visual.* -> model.visual.*) maps them back
        from core.models import checkpoint_layout

        self.in_memory = {saved: n for n, t in self.model.state_dict().items()
                          if len(renamed := checkpoint_layout(self.model, {n: t})) == 1 and (saved := next(iter(renamed))) != n}

    @torch.no_grad()
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        sd = self.model.state_dict(keep_vars=True)
        written: set[int] = set()
        for name, v in named_tensors:
            name = self.in_memory.get(name, name)
            if name not in sd:
                raise KeyError(f"HFCopyRollout.sync_weights: the sampler's model has no weight {name!r}")
            sd[name].copy_(v.detach().to(sd[name].device, sd[name].dtype))
            written.add(id(sd[name]))
        # tied weights appear once among the parameters, under either name
        missing = [n for n, p in self.model.named_parameters() if id(p) not in written]
        if missing:
            raise KeyError(f"HFCopyRollout.sync_weights: no new value for {missing[:5]} "
                           f"({len(missing)} weight(s) would stay stale)")
