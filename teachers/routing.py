"""Routing a batch's rows to their teachers, and teacher-corrected sampling.

The loop makes one call per batch, `TeacherRouter.score_batch`: every row is scored by
the teacher of its key (its domain, or domain/effort), and the rows whose sampling
settings ask for it are corrected (after Speculative KD: the first sampled token the
teacher finds too unlikely is replaced by the teacher's top token and the student
samples the rest again). Rows are any objects with `.ids` (prompt token ids) and
`.teacher_key`; samples are `core.rollout.Sample`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.rollout import Sample
from teachers.check import resolve_teacher_key
from teachers.scoring import Teacher, make_teacher


def resolve_teachers(specs: dict[str, Any], keys: list[str], tokenizer, student: str,
                     tracking_uri: str | None = None, cache_dir: str | Path | None = None) -> dict[str, Path | None]:
    """The local folder of each used teacher key, each checked to fit the student's
    tokenizer and chat template: errors name the key and the reference, before any model
    is loaded. `specs[key].path` is a folder or a models:/ URI, looked up in the store at
    `tracking_uri` (`teachers.resolve.resolve_ref`). A server teacher (backend server) is
    checked through its servers' /tokenize instead (one must answer); its path, optional,
    is None when not given. A LoRA teacher (`specs[key].adapter`, or a path that resolves
    to a registered adapter) gets its base folder, a `TeacherPath` whose `.adapter` is the
    adapter folder, checked to fit the base (`teachers.resolve.check_adapter`)."""
    return {key: resolve_teacher_key(key, specs[key], tokenizer, student, tracking_uri=tracking_uri,
                                     cache_dir=cache_dir) for key in keys}


def lora_groups(specs: dict[str, Any], paths: dict[str, Path | None]) -> dict[tuple[str, str], list[str]]:
    """(backend, base folder) -> the LoRA teacher keys served together on it."""
    groups: dict[tuple[str, str], list[str]] = {}
    for k, p in paths.items():
        if p is not None and getattr(p, "adapter", None) is not None and specs[k].backend != "server":
            groups.setdefault((specs[k].backend, str(Path(p).resolve())), []).append(k)
    return groups


def first_to_correct(teacher_full_TV: torch.Tensor, completion_ids: list[int], below: float) -> int | None:
    """Position of the first sampled token that the teacher gives probability < `below` and
    that is not the teacher's own top token there; None if there is none."""
    if below <= 0 or not completion_ids or teacher_full_TV is None or not len(teacher_full_TV):
        return None
    if not isinstance(teacher_full_TV, torch.Tensor):
        teacher_full_TV = teacher_full_TV[:]    # HeadRows (loss.logits_chunk): this row, for the check only
    T, V = teacher_full_TV.shape
    ids = torch.tensor(completion_ids[:T], dtype=torch.long)
    lp = torch.full((len(ids),), float("-inf"))
    known = ids < V          # a token outside the teacher's vocabulary has p_T = 0
    lp[known] = teacher_full_TV[torch.arange(len(ids))[known], ids[known]]
    bad = ((lp < math.log(below)) & (ids != teacher_full_TV[:len(ids)].argmax(-1))).nonzero()
    return int(bad[0]) if len(bad) else None


def group_by(idx, key: Callable) -> dict:
    """Indices grouped by key(i), each group in the order of `idx`."""
    out: dict = {}
    for i in idx:
        out.setdefault(key(i), []).append(i)
    return out


@dataclass
class BatchScores:
    """What the teachers said about one batch, row by row."""
    logprobs: list[list[float]]                  # log p_T of each completion token
    full: list[torch.Tensor | None]              # [len, V] whole distributions (full=True), else None
    n_fixed: list[int]                           # teacher tokens inserted per row (correction)
    seconds: dict[str, float] = field(default_factory=dict)   # teacher, correct


class TeacherRouter:
    """The teachers of one run, keyed by teacher key, behind one call per batch."""

    def __init__(self, teachers: dict[str, Teacher], logits_chunk: int = 0):
        self.teachers = teachers
        # > 0 (loss.logits_chunk): in-process HF teachers give whole rows as hidden states
        # and head (`HFTeacher.score_hidden`), made into rows a chunk at a time by the loss
        self.logits_chunk = logits_chunk

    @classmethod
    def load(cls, specs: dict[str, Any], paths: dict[str, Path], *, dtype: str, vllm_kwargs: dict,
             logits_chunk: int = 0) -> "TeacherRouter":
        """Start each teacher on its backend (`specs[key].backend`); vllm ones get `vllm_kwargs`,
        server ones (`teachers.server`) only connect when first asked. LoRA teachers (paths
        with an `.adapter`, see `resolve_teachers`) that share a base and a backend share one
        model or engine, one adapter per key (`teachers.lora`)."""
        from teachers.server import from_spec

        teachers: dict[str, Teacher] = {}
        for (backend, base), group in lora_groups(specs, paths).items():
            from teachers.lora import load_lora_teachers  # peft / LoRA engines only when used

            teachers.update(load_lora_teachers(base, backend, {k: str(paths[k].adapter) for k in group}, dtype=dtype,
                                               vllm_kwargs=vllm_kwargs if backend == "vllm" else None))
        for k, p in paths.items():
            if k in teachers:
                continue
            b = specs[k].backend
            kw = {**vllm_kwargs, "top_k": getattr(specs[k], "top_k", 0)} if b == "vllm" else {}
            teachers[k] = from_spec(k, specs[k], p) if b == "server" else make_teacher(b, str(p), dtype=dtype, **kw)
        return cls({k: teachers[k] for k in paths}, logits_chunk)

    def score(self, rows: list, samples: list[Sample], idx, full: bool,
              teacher_lp: list, teacher_full: list) -> None:
        """Fill teacher_lp[i] (sampled-token log-probs) and, with `full`, teacher_full[i] (the
        whole log-distribution, [len, V]) for each i in idx, each row scored by its own teacher."""
        idx = list(idx)
        jobs = [(t, sel) for key, t in self.teachers.items()
                if (sel := [i for i in idx if rows[i].teacher_key == key])]
        for key, t in self.teachers.items():   # never scored without the images its rows hold
            if not hasattr(t, "score_images") and any(rows[i].teacher_key == key and _vision(samples[i]) is not None
                                                      for i in idx):
                raise ValueError(f"teacher {key!r} ({type(t).__name__}) cannot take images, and its rows hold "
                                 f"screenshots; score them with an in-process teacher (backend hf)")
        if not full:
            jobs = self._score_shared_engines(jobs, rows, samples, teacher_lp)
        # Server teachers wait on the network: all of them are asked at once, in threads,
        # while the in-process ones compute here.
        remote = [(t, sel) for t, sel in jobs if getattr(t, "remote", False)] if not full else []
        pool = ThreadPoolExecutor(len(remote)) if remote else None
        try:
            futs = [(pool.submit(t.score, [rows[i].ids for i in sel], [samples[i].completion_ids for i in sel]), sel)
                    for t, sel in remote]
            for teacher, sel in jobs:
                if not any(teacher is t for t, _ in remote):
                    self._score_one(teacher, rows, samples, sel, full, teacher_lp, teacher_full, self.logits_chunk)
            for f, sel in futs:
                for i, sc in zip(sel, f.result()):
                    teacher_lp[i] = sc.tolist()
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _score_shared_engines(jobs: list, rows: list, samples: list[Sample], teacher_lp: list) -> list:
        """Adapter views of one engine that scores many adapters per call (vLLM LoRA): all
        their rows in one call, so the engine batches across adapters. Returns the other jobs."""
        shared: dict[int, list] = {}
        rest = []
        for t, sel in jobs:
            eng = getattr(t, "shared", None)
            (shared.setdefault(id(eng), []) if hasattr(eng, "score_many") else rest).append((t, sel))
        for group in shared.values():
            res = group[0][0].shared.score_many([(t.adapter, [rows[i].ids for i in sel],
                                                  [samples[i].completion_ids for i in sel]) for t, sel in group])
            for (_, sel), scores in zip(group, res):
                for i, sc in zip(sel, scores):
                    teacher_lp[i] = sc.tolist()
        return rest

    @staticmethod
    def _score_one(teacher, rows: list, samples: list[Sample], sel: list[int], full: bool,
                   teacher_lp: list, teacher_full: list, chunk: int = 0) -> None:
        prompts, comps = [rows[i].ids for i in sel], [samples[i].completion_ids for i in sel]
        visions = [_vision(samples[i]) for i in sel]
        images = any(v is not None for v in visions)   # the teacher reads them as the student did
        if not full:
            scores = teacher.score_images(prompts, comps, visions) if images else teacher.score(prompts, comps)
            for i, sc in zip(sel, scores):
                teacher_lp[i] = sc.tolist()
            return
        if images:
            whole = teacher.score_images(prompts, comps, visions, full=True, chunk=chunk)
        elif chunk > 0 and hasattr(teacher, "score_hidden"):
            whole = teacher.score_hidden(prompts, comps, chunk)
        else:
            whole = teacher.score_full(prompts, comps)
        for i, f in zip(sel, whole):
            teacher_full[i] = f
            ids = torch.tensor(samples[i].completion_ids, dtype=torch.long)
            teacher_lp[i] = f.gather(-1, ids[:, None]).squeeze(-1).tolist() if len(ids) else []

    def correct(self, rollout, rows: list, samples: list[Sample], idx: list[int], r, seeds: list[int],
                eos_ids: set[int], teacher_lp: list, teacher_full: list) -> list[int]:
        """Teacher-corrected rollouts (`r.correct_below`, `r.correct_rounds`, sampled at
        `r.temperature` / `r.top_p` within `r.max_new_tokens`): in each round, every row of
        `idx` whose sample has a token to correct is cut there, gets the teacher's top token,
        and the student samples the rest again (same length budget). The inserted tokens get
        sampler log-prob NaN, which the loss reads as "not the sampler's" (importance weight
        1). The rows' teacher scores are kept current. Returns teacher tokens per row."""
        n_fixed = [0] * len(rows)
        todo = list(idx)
        for rnd in range(r.correct_rounds):
            fix = {i: t for i in todo
                   if (t := first_to_correct(teacher_full[i], samples[i].completion_ids, r.correct_below)) is not None}
            if not fix:
                break
            regen = []
            for i, t in fix.items():
                s = samples[i]
                tok = int(teacher_full[i][t].argmax())
                samples[i] = Sample(prompt_ids=s.prompt_ids, completion_ids=s.completion_ids[:t] + [tok],
                                    sampler_logprobs=s.sampler_logprobs[:t] + [float("nan")],
                                    finished=tok in eos_ids)
                n_fixed[i] += 1
                if not samples[i].finished and t + 1 < r.max_new_tokens:
                    regen.append(i)
            if regen:
                budget = [r.max_new_tokens - len(samples[i].completion_ids) for i in regen]
                cont = rollout.generate([rows[i].ids + samples[i].completion_ids for i in regen],
                                        max_new_tokens=max(budget), temperature=r.temperature, top_p=r.top_p,
                                        seeds=[seeds[i] + 7_919 * (rnd + 1) for i in regen])
                for i, b, c in zip(regen, budget, cont):
                    s = samples[i]
                    samples[i] = Sample(prompt_ids=s.prompt_ids,
                                        completion_ids=s.completion_ids + c.completion_ids[:b],
                                        sampler_logprobs=s.sampler_logprobs + c.sampler_logprobs[:b],
                                        finished=c.finished and len(c.completion_ids) <= b)
            self.score(rows, samples, fix, True, teacher_lp, teacher_full)
            todo = list(fix)
        return n_fixed

    def score_batch(self, rollout, rows: list, samples: list[Sample], *, full: bool, correct_idx: list[int],
                    settings: Callable[[int], Any], seeds: list[int], eos_ids: set[int]) -> BatchScores:
        """Score every row with its teacher, then correct the rows of `correct_idx` (the
        student's own samples) under each row's sampling `settings(i)` where those ask for it
        (`correct_below > 0`). One correction call per distinct setting."""
        t0 = time.perf_counter()
        teacher_lp: list = [None] * len(rows)
        teacher_full: list = [None] * len(rows)
        self.score(rows, samples, range(len(rows)), full, teacher_lp, teacher_full)
        t_teacher = time.perf_counter() - t0
        n_fixed = [0] * len(rows)
        t0 = time.perf_counter()
        wanted = [i for i in correct_idx if settings(i).correct_below > 0]
        for idx in group_by(wanted, lambda i: _correction_key(settings(i))).values():
            fixed = self.correct(rollout, rows, samples, idx, settings(idx[0]), seeds, eos_ids,
                                 teacher_lp, teacher_full)
            for i in idx:
                n_fixed[i] = fixed[i]
        return BatchScores(teacher_lp, teacher_full, n_fixed,
                           {"teacher": t_teacher, "correct": time.perf_counter() - t0})

    def take_faults(self) -> tuple[dict[str, float], list[str]]:
        """The server teachers' fail-over metrics and printed lines since the last call
        (`ServerTeacher.take_faults`); nothing for in-process teachers."""
        metrics: dict[str, float] = {}
        events: list[str] = []
        for t in self.teachers.values():
            if hasattr(t, "take_faults"):
                m, e = t.take_faults()
                metrics.update(m)
                events += e
        return metrics, events

    def failed_urls(self) -> dict[str, dict[str, str]]:
        """Teacher key -> {URL: its first error} for every server URL that failed in this run."""
        return {k: dict(t.failed_urls) for k, t in self.teachers.items() if getattr(t, "failed_urls", None)}

    def close(self) -> None:
        for t in self.teachers.values():
            t.close()


def _vision(sample):
    """A sample's images (core.vision.Vision; an agent segment with image observations), or None."""
    return getattr(sample, "vision", None)


def _correction_key(r) -> tuple:
    return (r.correct_below, r.correct_rounds, r.temperature, r.top_p)
