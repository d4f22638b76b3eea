"""Many LoRA teachers on one base: one model or engine, one adapter per teacher key.

Expert runs trained with `model.lora.keep_adapter` register a peft adapter folder on a
common base instead of a merged checkpoint. Teachers that share a base (and a backend)
are then served together: `HFLoraTeacher` loads the base once with every adapter
(`peft.PeftModel` + `load_adapter`, `set_adapter` per key), `VLLMLoraTeacher` starts one
vLLM engine with `enable_lora` (max_loras = the number of adapters, max_lora_rank from
their configs) and scores each key's rows with its own `LoRARequest`, all keys in one
`generate` call. Memory is about one base plus the adapters instead of one full model
per teacher. `AdapterView` is what the router holds per key: a `Teacher` that asks the
shared model with its adapter's name.

`teachers.resolve.check_adapter` checks an adapter against its base from the files alone,
so a wrong pairing is an error naming the key before any model or engine starts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from teachers.resolve import adapter_config
from teachers.scoring import HFTeacher, VLLMTeacher, _check_pairs

class HFLoraTeacher(HFTeacher):
    """One HF base with several peft LoRA adapters; `score(..., adapter=name)` scores with
    that adapter active (peft's `set_adapter`), full distributions included."""

    def __init__(self, base: str, adapters: dict[str, str], *, dtype: str = "float32", batch_size: int = 32,
                 device: str | None = None):
        from peft import PeftModel  # peft only where adapters are used

        if not adapters:
            raise ValueError("HFLoraTeacher needs at least one adapter")
        super().__init__(base, dtype=dtype, batch_size=batch_size, device=device)
        self.adapters = dict(adapters)
        names = list(self.adapters)
        model = PeftModel.from_pretrained(self.model, self.adapters[names[0]], adapter_name=names[0])
        for n in names[1:]:
            model.load_adapter(self.adapters[n], adapter_name=n)
        self.model = model.eval().requires_grad_(False)
        self._active = names[0]
        model.set_adapter(names[0])

    def _use(self, adapter: str) -> None:
        if adapter not in self.adapters:
            raise KeyError(f"no adapter {adapter!r} on {self.path} (loaded: {sorted(self.adapters)})")
        if adapter != self._active:
            self.model.set_adapter(adapter)
            self._active = adapter
            self.model.requires_grad_(False)   # set_adapter marks the active adapter trainable

    def score(self, prompts, completions, adapter: str | None = None):
        self._use(adapter or self._active)
        return super().score(prompts, completions)

    def score_full(self, prompts, completions, adapter: str | None = None):
        self._use(adapter or self._active)
        return super().score_full(prompts, completions)


class VLLMLoraTeacher(VLLMTeacher):
    """One vLLM engine on the base with `enable_lora`; every adapter is a `LoRARequest`.
    `score_many` scores rows of several adapters in one `generate` call."""

    def __init__(self, base: str, adapters: dict[str, str], *, max_lora_rank: int | None = None, **kw: Any):
        from vllm.lora.request import LoRARequest  # vllm is an optional extra

        if not adapters:
            raise ValueError("VLLMLoraTeacher needs at least one adapter")
        ranks = [int(adapter_config(p).get("r", 8)) for p in adapters.values()]
        # vLLM accepts ranks from a fixed list; the smallest one that holds every adapter
        allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
        rank = max_lora_rank or next((a for a in allowed if a >= max(ranks)), max(ranks))
        self.adapters = dict(adapters)
        self.requests = {n: LoRARequest(lora_name=n, lora_int_id=i + 1, lora_path=str(p))
                         for i, (n, p) in enumerate(self.adapters.items())}
        super().__init__(base, enable_lora=True, max_loras=len(adapters), max_lora_rank=rank, **kw)

    def score(self, prompts, completions, adapter: str | None = None):
        name = adapter or next(iter(self.requests))
        return self.score_many([(name, prompts, completions)])[0]

    def score_many(self, jobs: list[tuple[str, list[list[int]], list[list[int]]]]) -> list[list[torch.Tensor]]:
        """[(adapter, prompts, completions), ...] -> per job, one log-prob tensor per pair;
        every row of every adapter in one generate call (vLLM batches across LoRAs)."""
        from vllm import SamplingParams, TokensPrompt

        out, reqs, loras, where = [], [], [], []
        for j, (name, prompts, completions) in enumerate(jobs):
            if name not in self.requests:
                raise KeyError(f"no adapter {name!r} on {self.path} (loaded: {sorted(self.requests)})")
            _check_pairs(prompts, completions)
            out.append([torch.zeros(0, dtype=torch.float32) for _ in prompts])
            for i, (p, c) in enumerate(zip(prompts, completions)):
                if len(c):
                    reqs.append(TokensPrompt(prompt_token_ids=list(p) + list(c)))
                    loras.append(self.requests[name])
                    where.append((j, i, len(p)))
        if not reqs:
            return out
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        for (j, i, P), o in zip(where, self.llm.generate(reqs, params, lora_request=loras, use_tqdm=False),
                                strict=True):
            ids = o.prompt_token_ids
            out[j][i] = torch.tensor([o.prompt_logprobs[t][ids[t]].logprob for t in range(P, len(ids))],
                                     dtype=torch.float32)
        return out


class AdapterView:
    """The `Teacher` of one key: the shared LoRA model or engine with this key's adapter.
    Closing a view closes the shared model once its last view is closed."""

    def __init__(self, shared, adapter: str, refs: list):
        self.shared, self.adapter, self._refs = shared, adapter, refs
        self.path = f"{shared.path}+{shared.adapters[adapter]}"
        self.full_distributions = shared.full_distributions
        refs.append(self)

    def score(self, prompts, completions):
        return self.shared.score(prompts, completions, adapter=self.adapter)

    def score_full(self, prompts, completions):
        return self.shared.score_full(prompts, completions, adapter=self.adapter)

    def close(self) -> None:
        if self in self._refs:
            self._refs.remove(self)
            if not self._refs:
                self.shared.close()


def load_lora_teachers(base: str, backend: str, adapters: dict[str, str], *, dtype: str,
                       vllm_kwargs: dict | None = None) -> dict[str, AdapterView]:
    """One shared model/engine for `adapters` (teacher key -> adapter folder) on `base`;
    returns a view per key."""
    if backend == "hf":
        shared = HFLoraTeacher(base, adapters, dtype=dtype)
    elif backend == "vllm":
        shared = VLLMLoraTeacher(base, adapters, dtype=dtype, **(vllm_kwargs or {}))
    else:
        raise ValueError(f"LoRA teachers need backend hf or vllm, got {backend!r}")
    refs: list = []
    return {k: AdapterView(shared, k, refs) for k in adapters}


def random_adapter(base: str | Path, out: str | Path, *, seed: int, r: int = 8, alpha: int = 16,
                   target_modules: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"),
                   scale: float = 0.05) -> Path:
    """A peft LoRA adapter on `base` with random A and non-zero random B (peft starts B at
    zero, which would make every adapter score like the base): for tests and benches."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules),
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(str(out))
    return Path(out)


def merge_adapter(base: str | Path, adapter: str | Path, out: str | Path) -> Path:
    """The adapter merged into the base (W + scale * B @ A), saved as a plain HF checkpoint
    with the base's tokenizer: the same teacher as a full model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return Path(out)
