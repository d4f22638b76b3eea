"""Teacher scoring: log p_T(y_t | prompt, y_<t) of exactly the tokens the student sampled.

Teacher-forced, one float32 tensor [len(completion)] per (prompt, completion) pair.
Every backend follows the `Teacher` protocol:

- `HFTeacher`: a plain transformers forward in this process (reference; fine for tiny
  and small teachers); also returns the whole next-token distribution (`score_full`).
  The only backend that takes images (`score_images`: a vision-language teacher scores
  an agent transcript with its screenshots in context).
- `VLLMTeacher`: a vLLM engine in this process, scored with `prompt_logprobs` on
  prompt + completion (one engine per teacher; several engines share a process). It
  returns sampled-token log-probs; with `top_k` > 0 also, per position, its k most likely
  tokens renormalized over themselves (`score_full`, `topk_rows`), as a server teacher
  with top_k does; with top_k 0 asking it for `score_full` is an error naming the fix.
- `teachers.server.ServerTeacher`: the same prompt_logprobs from a vLLM OpenAI-compatible
  server over HTTP (backend server; built by the router from its TeacherSpec).
"""
from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from core.rollout import shutdown_vllm_engine, start_vllm_engine


class Teacher(Protocol):
    path: str
    full_distributions: bool   # score_full is available (loss.kl=full, teacher-corrected samples)

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
        """log p_T of each completion token, one [len(completion)] tensor per pair."""

    def score_full(self, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
        """log p_T over the whole vocabulary at each completion position, [len(completion), V]."""

    def close(self) -> None:
        """Release the model or engine."""


def topk_rows(positions: list[list[tuple[int, float]]]) -> torch.Tensor:
    """[T, V'] log-probs from each position's (token id, log-prob) pairs (a teacher's top k,
    and the sampled token): renormalized over those tokens, -inf elsewhere, so the loss
    restricts the divergence to them (`mopd.distill.step.restrict_to_support`); V' is the
    largest id seen + 1, and `pad_full` widens or cuts it to the vocabulary."""
    V = max(max(i for i, _ in pos) for pos in positions) + 1
    out = torch.full((len(positions), V), float("-inf"))
    for t, pos in enumerate(positions):
        out[t, [i for i, _ in pos]] = torch.tensor([v for _, v in pos], dtype=torch.float32)
    return out - torch.logsumexp(out, dim=-1, keepdim=True)


def _check_pairs(prompts: list[list[int]], completions: list[list[int]]) -> None:
    if len(prompts) != len(completions):
        raise ValueError(f"score: got {len(prompts)} prompts but {len(completions)} completions")
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if len(p) == 0 and len(c) > 0:
            raise ValueError(f"score: prompt {i} is empty; the first completion token has nothing to condition on")


class HFTeacher:
    full_distributions = True

    def __init__(self, path: str, *, dtype: str = "float32", batch_size: int = 32, device: str | None = None):
        self.path = str(path)
        self.batch_size = batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        from core.vision import load_model   # a vision-language checkpoint gets its own class

        self.model = load_model(self.path, getattr(torch, dtype)).to(self.device)
        self.model.eval().requires_grad_(False)

    @torch.no_grad()
    def score_images(self, prompts: list[list[int]], completions: list[list[int]], visions: list, *,
                     full: bool = False, chunk: int = 0) -> list:
        """`score` (or with `full`, `score_full`; with `full` and `chunk` > 0, `score_hidden`)
        of pairs whose transcripts hold images: `visions[i]` (core.vision.Vision or None) are
        pair i's, in the order of its image pad tokens. Each batch goes through the forward
        the student's loss uses (`core.models.collate` with the rows' images, then
        `completion_logprobs` / `completion_hidden`), so the teacher sees the same pages at
        the same (3D) positions the student did."""
        from core.models import collate, completion_hidden, completion_logprobs
        from core.vision import is_vision_model

        if not is_vision_model(self.model):
            raise ValueError(f"teacher {self.path} is a text-only model: it cannot see the images in these "
                             f"transcripts; use a vision-language teacher (a checkpoint with a vision_config)")
        _check_pairs(prompts, completions)
        out: list = [torch.zeros((0, 0) if full else (0,)) for _ in prompts]
        todo = sorted((i for i, c in enumerate(completions) if len(c)), key=lambda i: len(prompts[i]) + len(completions[i]))
        for k in range(0, len(todo), self.batch_size):
            idx = todo[k:k + self.batch_size]
            batch = collate([list(prompts[i]) for i in idx], [list(completions[i]) for i in idx], 0, {},
                            vision=[visions[i] for i in idx])
            batch = {n: v.to(self.device) if isinstance(v, torch.Tensor) else v for n, v in batch.items()}
            if full and chunk > 0:
                h_BTH, head = completion_hidden(self.model, batch)
                rows = [HeadRows(h_BTH[j, :len(completions[i])].cpu(), head, chunk) for j, i in enumerate(idx)]
            elif full:
                rows = [r[:len(completions[i])].cpu() for r, i in zip(completion_logprobs(self.model, batch, full=True)[1], idx)]
            else:
                rows = [r[:len(completions[i])].cpu() for r, i in zip(completion_logprobs(self.model, batch), idx)]
            for i, r in zip(idx, rows):
                out[i] = r
        return out

    @torch.no_grad()
    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
        return self._each_pair(prompts, completions, torch.zeros(0, dtype=torch.float32))

    @torch.no_grad()
    def score_full(self, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
        """The teacher's whole next-token log-distribution at each completion position,
        one float32 tensor [len(completion), V] per pair (for loss.kl=full)."""
        return self._each_pair(prompts, completions, torch.zeros(0, 0, dtype=torch.float32), full=True)

    @torch.no_grad()
    def score_hidden(self, prompts: list[list[int]], completions: list[list[int]], chunk: int) -> list["HeadRows"]:
        """`score_full`'s rows as the teacher's final hidden states at the completion positions
        and its output head (`HeadRows`), for loss.logits_chunk > 0: the loss makes the rows
        `chunk` positions at a time, so no [len(completion), V] tensor is ever whole. A model
        that changes its logits after the head (soft-capping, a logit scale) is refused, as
        for the student (`core.models.output_head`)."""
        from core.models import output_head

        try:
            head = output_head(self.model)
        except ValueError as e:
            raise ValueError(f"teacher {self.path}: {e}") from None
        return [HeadRows(h, head, chunk) for h in self._each_pair(prompts, completions, torch.zeros(0, 0), hidden=True)]

    def _each_pair(self, prompts, completions, empty: torch.Tensor, **kw) -> list[torch.Tensor]:
        """`_score_batch(**kw)`'s answer for each pair, `empty` for a pair without completion;
        `batch_size` pairs at a time, similar lengths together (less padding)."""
        _check_pairs(prompts, completions)
        out = [empty for _ in prompts]
        todo = [i for i, c in enumerate(completions) if len(c) > 0]
        todo.sort(key=lambda i: len(prompts[i]) + len(completions[i]))
        for k in range(0, len(todo), self.batch_size):
            idx = todo[k:k + self.batch_size]
            for i, r in zip(idx, self._score_batch([prompts[i] for i in idx], [completions[i] for i in idx], **kw)):
                out[i] = r
        return out

    def _score_batch(self, prompts, completions, full: bool = False, hidden: bool = False) -> list[torch.Tensor]:
        # Left-pad so every completion ends at the last position: only the last
        # max(len(c)) + 1 positions need logits (logits_to_keep), not B x L x V.
        seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
        B, L = len(seqs), max(len(s) for s in seqs)
        ids_BL = torch.zeros((B, L), dtype=torch.long)
        mask_BL = torch.zeros((B, L), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids_BL[b, L - len(s):] = torch.tensor(s)
            mask_BL[b, L - len(s):] = 1
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        C = max(len(c) for c in completions)
        from core.models import head_passed_through

        with head_passed_through(self.model) if hidden else contextlib.nullcontext():
            # hidden: the head is the identity, so these are the last hidden states [B, K, H]
            logits_BKV = self.model(input_ids=ids_BL.to(self.device), attention_mask=mask_BL.to(self.device),
                                    position_ids=pos_BL.to(self.device), logits_to_keep=C + 1).logits
        res = []
        for b, c in enumerate(completions):
            # Logit at position j predicts token j+1: completion token t sits at L-len(c)+t,
            # predicted by kept row K-1-len(c)+t (K = C+1 kept rows ending at position L-1).
            if hidden:
                res.append(logits_BKV[b, C - len(c):C].cpu())
                continue
            rows_CV = logits_BKV[b, C - len(c):C].float()
            if full:
                res.append(torch.log_softmax(rows_CV, dim=-1).cpu())
                continue
            tgt = torch.tensor(c, device=rows_CV.device)[:, None]
            res.append(torch.log_softmax(rows_CV, dim=-1).gather(-1, tgt).squeeze(-1).cpu())
        return res

    def close(self) -> None:
        self.model = None


class HeadRows:
    """A teacher's log-distribution at each completion position, [len, V] as `score_full`
    gives it, kept as its final hidden states [len, H] and its output head: indexing makes
    only the rows asked for (log-softmax in float32, without gradient), so the loss
    (`mopd.distill.step.teacher_rows`, loss.logits_chunk > 0) never holds the whole tensor.
    `shape`, `len` and `gather` behave as on the tensor; `gather` goes `chunk` rows at a time."""

    def __init__(self, h_TH: torch.Tensor, head: torch.nn.Module, chunk: int):
        self.h_TH, self.head, self.chunk = h_TH, head, max(1, chunk)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.h_TH), self.head.weight.shape[0]))

    def __len__(self) -> int:
        return len(self.h_TH)

    @torch.no_grad()
    def __getitem__(self, idx) -> torch.Tensor:
        dev = self.head.weight.device
        return torch.log_softmax(self.head(self.h_TH[idx].to(dev)).float(), dim=-1).cpu()

    def gather(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        c = self.chunk
        return torch.cat([self[s:s + c].gather(dim, index[s:s + c]) for s in range(0, len(self), c)])


class VLLMTeacher:
    def __init__(self, path: str, *, dtype: str = "float32", max_model_len: int = 512, kv_cache_gb: float | None = 1.0,
                 gpu_memory_utilization: float = 0.3, top_k: int = 0, **engine_kwargs: Any):
        self.path = str(path)
        self.top_k = top_k
        if top_k > 20:   # vLLM refuses prompt_logprobs above max_logprobs (default 20)
            engine_kwargs.setdefault("max_logprobs", top_k)
        # Prefix caching off: cached prompt tokens would get no prompt_logprobs.
        self.llm = start_vllm_engine(self.path, dtype=dtype, max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
                                     enable_prefix_caching=False, gpu_memory_utilization=gpu_memory_utilization,
                                     **engine_kwargs)

    @property
    def full_distributions(self) -> bool:
        return self.top_k > 0    # top-k rows stand in for the whole distribution

    def _prompt_logprobs(self, prompts: list[list[int]], completions: list[list[int]], k: int) -> list:
        """(i, vLLM output) for each pair i with a completion, scored with prompt_logprobs=k:
        for every position after the first, the log-prob of the token there and, k > 0,
        of the k most likely tokens. One throwaway greedy token per request."""
        from vllm import SamplingParams, TokensPrompt  # vllm is an optional extra; HFTeacher needs none

        _check_pairs(prompts, completions)
        todo = [i for i, c in enumerate(completions) if len(c) > 0]
        if not todo:
            return []
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
        reqs = [TokensPrompt(prompt_token_ids=list(prompts[i]) + list(completions[i])) for i in todo]
        return list(zip(todo, self.llm.generate(reqs, params, use_tqdm=False), strict=True))

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.float32) for _ in prompts]
        for i, o in self._prompt_logprobs(prompts, completions, 0):
            P, ids = len(prompts[i]), o.prompt_token_ids
            out[i] = torch.tensor([o.prompt_logprobs[j][ids[j]].logprob for j in range(P, len(ids))],
                                  dtype=torch.float32)
        return out

    def score_full(self, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
        """With top_k > 0: per pair a [len(completion), V'] tensor of the teacher's top-k
        log-probs (and the sampled token's) at each completion position, renormalized over
        them, -inf elsewhere (`topk_rows`)."""
        if not self.top_k:
            raise ValueError(f"teacher {self.path}: the vllm backend returns sampled-token log-probs only unless "
                             f"top_k > 0 (prompt_logprobs=k); loss.kl=full and rollout.correct_below need top_k "
                             f"or backend hf")
        out: list[torch.Tensor] = [torch.zeros(0, 0, dtype=torch.float32) for _ in prompts]
        for i, o in self._prompt_logprobs(prompts, completions, self.top_k):
            out[i] = topk_rows([[(int(t), float(lp.logprob)) for t, lp in pos.items()]
                                for pos in o.prompt_logprobs[len(prompts[i]):]])
        return out

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            llm, self.llm = self.llm, None
            shutdown_vllm_engine(llm)


def make_teacher(backend: str, path: str, **kw: Any):
    """'hf' -> HFTeacher(path, ...); 'vllm' -> VLLMTeacher(path, ...)."""
    backends = {"hf": HFTeacher, "vllm": VLLMTeacher}
    if backend not in backends:
        raise ValueError(f"unknown teacher backend {backend!r}; valid: {sorted(backends)}")
    return backends[backend](path, **kw)
