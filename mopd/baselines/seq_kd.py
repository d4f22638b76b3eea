"""seq_kd: off-policy sequence-level distillation (Kim & Rush, 2016), the baseline that
shows what MOPD buys, trained from the same base on the same prompts.

Each domain's teacher answers the MOPD train prompts (greedy by default), and the student
is fine-tuned on those answers with core.sft.sft. The number of SFT rows is chosen so
that the completion tokens it trains on (as core.sft tokenizes them, EOS included) match
the student tokens MOPD sampled and trained on; every row is seen once (steps = rows /
batch_size). The prompts are the ones MOPD sampled, in its order: its own PromptSampler
is replayed from the same config (mopd_prompt_stream), one answer per prompt draw, and on
past the run's last batch if the teachers answer more briefly than the student did.

Agent domains (`agents`, the MOPD config's): the teacher plays each of their prompts as a
greedy episode (core.agent.episode, a harness drawn per prompt from the domain's mix) and
the student is trained on the whole transcript with the loss on the assistant's tokens
only; those count toward the budget, as the student's own tokens do in MOPD. The rows
are then tokenized (prompt_ids, completion_ids, loss_mask) for every domain; a
single-turn row trains exactly as its chat form would.

The model is exported like the student (export_checkpoint): with `quant` enabled, through
the same INT4 fake-quantization (core.quant).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

import datasets
import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from core import ranks
from core.agent.episode import run_episodes
from mopd.baselines.weight_avg import export_checkpoint
from mopd.distill.data import PromptSampler, load_prompts
from core.rollout import HFRollout
from core.sft import encode_example, encode_prompt, sft


def _say(msg: str):
    print(f"[baselines] {msg}", file=sys.stderr, flush=True)


def mopd_prompt_stream(cfg, tokenizer) -> Iterator:
    """The prompts a MOPD run with DistillConfig `cfg` samples, in its order: the loop's
    own PromptSampler replayed batch by batch (one sampled batch per `minibatches`
    optimizer steps), and on past the run's end for as long as it is read."""
    by_domain = load_prompts(cfg, tokenizer)
    sampler = PromptSampler(by_domain, cfg.data.mix, cfg.train.seed)
    step = 0
    while True:
        yield from sampler.next_batch(step, cfg.train.prompts_per_step)
        step += cfg.train.minibatches


class _TeacherAnswers:
    """Answers of one teacher. Greedy answers are cached by prompt index (a prompt drawn
    again gets the same answer); sampled ones get a seed per (prompt, draw)."""

    def __init__(self, teacher_path: str, tokenizer, *, max_new_tokens: int, temperature: float,
                 seed: int, batch_size: int):
        self.model = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
        self.tok = tokenizer
        self.rollout = HFRollout(self.model, tokenizer, batch_size=batch_size)
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.cache: dict = {}

    def answers(self, prompts: list, draws: list[int]) -> list[str]:
        todo = [i for i, p in enumerate(prompts) if self.temperature > 0 or p.index not in self.cache]
        fresh: dict[int, str] = {}
        if todo:
            ids = [list(prompts[i].ids) if getattr(prompts[i], "ids", None) else
                   encode_prompt(self.tok, prompts[i].messages) for i in todo]
            seeds = [int(hashlib.sha256(f"{self.seed}/{prompts[i].index}/{draws[i]}".encode()).hexdigest()[:8], 16)
                     for i in todo]
            samples = self.rollout.generate(ids, max_new_tokens=self.max_new_tokens,
                                            temperature=self.temperature, seeds=seeds)
            eos = set(self.rollout.eos_ids)
            for i, smp in zip(todo, samples):
                fresh[i] = self.tok.decode([t for t in smp.completion_ids if t not in eos], skip_special_tokens=True)
                if self.temperature == 0:
                    self.cache[prompts[i].index] = fresh[i]
        return [fresh[i] if i in fresh else self.cache[p.index] for i, p in enumerate(prompts)]

    def episodes(self, prompts: list, draws: list[int], agent, temperature_key: str = "agent") -> list[list[tuple]]:
        """Token rows (prompt_ids, completion_ids, loss_mask) of the teacher's episode on each
        agent prompt, one row per segment; greedy episodes are cached like answers."""
        todo = [i for i, p in enumerate(prompts) if self.temperature > 0 or ("ep", p.index) not in self.cache]
        fresh: dict[int, list[tuple]] = {}
        if todo:
            seeds = [int(hashlib.sha256(f"{self.seed}/{prompts[i].index}/{draws[i]}".encode()).hexdigest()[:8], 16)
                     for i in todo]
            envs = [agent.factory(harness_cfg=agent.mix.sample(random.Random(sd)), memory=agent.memory)
                    for sd in seeds]
            tasks = [json.loads(t) if isinstance(t, str) else dict(t)
                     for t in (prompts[i].columns["task"] for i in todo)]
            eps = run_episodes(self.rollout, self.tok, envs, tasks, seeds=seeds, temperature=self.temperature,
                               top_p=1.0, max_turns=agent.cfg.max_turns,
                               max_context_tokens=agent.cfg.max_context_tokens,
                               max_new_tokens=agent.cfg.max_new_tokens, eos_ids=set(self.rollout.eos_ids))
            for i, ep in zip(todo, eps):
                rows = [(list(g.prompt_ids), list(g.completion_ids),
                         list(g.loss_mask) if g.loss_mask is not None else [1] * len(g.completion_ids))
                        for g in ep.segments]
                # a segment without a teacher token (an episode cut before its first turn)
                # teaches nothing, and core.sft refuses a row with an empty completion
                fresh[i] = [r for r in rows if any(r[2])]
                if self.temperature == 0:
                    self.cache[("ep", prompts[i].index)] = fresh[i]
        return [fresh[i] if i in fresh else self.cache[("ep", p.index)] for i, p in enumerate(prompts)]


# What seq-KD's budget equals of the MOPD run's (seq_kd's `match`).
MATCHES = ("tokens", "updates")


def seq_kd_dataset(prompts: Iterable, teachers: dict[str, str], tokenizer, *, budget_tokens: int,
                   batch_size: int, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
                   gen_batch_size: int = 64, progress: bool = True, agents: dict | None = None,
                   budget_rows: int = 0):
    """(dataset, completion tokens): teacher answers to `prompts` (an iterable of
    mopd.distill.data.Prompt-like objects: index, domain, teacher_key, messages; e.g.
    mopd_prompt_stream) in order, each answered by `teachers[prompt.teacher_key]`, until
    the completion tokens (as core.sft tokenizes them, EOS included) reach
    `budget_tokens`. The row count is a multiple of `batch_size`, rounded to whichever
    side lands closer to the budget. Columns: prompt, completion, domain, effort, teacher;
    with `agents` (domain -> mopd.distill.agents.AgentDomain) prompt_ids, completion_ids,
    loss_mask, domain, effort, teacher, and an agent prompt's episode may add several rows
    (one per transcript segment). `budget_rows` > 0: exactly that many rows instead,
    whatever their tokens (seq-KD at matched optimizer updates)."""
    agents = agents or {}
    if budget_rows > 0:
        budget_tokens = max(budget_tokens, 1)
    if budget_tokens < 1:
        raise ValueError(f"seq_kd: token budget must be >= 1, got {budget_tokens}")
    it = iter(prompts)
    gens: dict[str, _TeacherAnswers] = {}
    draws: dict[int, int] = {}
    rows: list[dict] = []
    counts: list[int] = []
    bar = tqdm(total=budget_tokens, desc="seq-kd teacher answers", unit="tok", disable=not progress)

    def more(k: int):
        chunk = []
        for p in it:
            chunk.append(p)
            if len(chunk) == k:
                break
        if not chunk:
            raise ValueError(f"seq_kd: the prompts ran out after {len(rows)} rows "
                             f"({sum(counts)} of {budget_tokens} tokens)")
        texts: list[str] = [""] * len(chunk)
        by_key: dict[str, list[int]] = {}
        for j, p in enumerate(chunk):
            by_key.setdefault(p.teacher_key, []).append(j)
        nth = []
        for p in chunk:
            draws[p.index] = draws.get(p.index, -1) + 1
            nth.append(draws[p.index])
        played: dict[int, list[tuple]] = {}
        for key, js in by_key.items():
            if key not in teachers:
                raise ValueError(f"seq_kd: no teacher for {key!r} (teachers: {sorted(teachers)})")
            if key not in gens:
                gens[key] = _TeacherAnswers(str(teachers[key]), tokenizer, max_new_tokens=max_new_tokens,
                                            temperature=temperature, seed=seed, batch_size=gen_batch_size)
            for d in {chunk[j].domain for j in js}:
                dj = [j for j in js if chunk[j].domain == d]
                if d in agents:
                    for j, r in zip(dj, gens[key].episodes([chunk[j] for j in dj], [nth[j] for j in dj], agents[d])):
                        played[j] = r
                else:
                    for j, a in zip(dj, gens[key].answers([chunk[j] for j in dj], [nth[j] for j in dj])):
                        texts[j] = a
        for j, (p, text) in enumerate(zip(chunk, texts)):
            cols = getattr(p, "columns", {}) or {}
            meta = {"domain": p.domain, "effort": cols.get("effort"), "teacher": p.teacher_key}
            if not agents:
                comp = [{"role": "assistant", "content": text}]
                toks = [(None, encode_example(tokenizer, p.messages, comp)[1], None)]
                rows.append({"prompt": p.messages, "completion": comp, **meta})
            else:
                if j in played:
                    toks = played[j]
                else:
                    pi, ci = encode_example(tokenizer, p.messages, [{"role": "assistant", "content": text}])
                    toks = [(pi, ci, [1] * len(ci))]
                rows.extend({"prompt_ids": pi, "completion_ids": ci, "loss_mask": m, **meta} for pi, ci, m in toks)
            for _, ci, m in toks:   # a count per row, so the budget can cut between segments
                counts.append(int(sum(m)) if m is not None else len(ci))
                bar.update(counts[-1])

    if budget_rows > 0:
        while len(counts) < budget_rows:
            more(min(gen_batch_size, budget_rows - len(counts)))
        bar.close()
        return datasets.Dataset.from_list(rows[:budget_rows]), int(sum(counts[:budget_rows]))
    while sum(counts) < budget_tokens:
        more(gen_batch_size)
    cum = np.cumsum(counts)
    first = int(np.searchsorted(cum, budget_tokens)) + 1        # rows that reach the budget
    n_up = max(batch_size, math.ceil(first / batch_size) * batch_size)
    n_down = max(batch_size, (first // batch_size) * batch_size)
    while len(counts) < n_up:
        more(min(gen_batch_size, n_up - len(counts)))
    bar.close()
    cum = np.cumsum(counts)
    tok_up, tok_down = int(cum[n_up - 1]), int(cum[n_down - 1])
    n = n_up if abs(tok_up - budget_tokens) <= abs(tok_down - budget_tokens) else n_down
    return datasets.Dataset.from_list(rows[:n]), int(cum[n - 1])


def _reuse_answers(src: Path, out: Path, *, updates: int, batch_size: int) -> tuple:
    """(dataset, completion tokens) of an earlier run's teacher_answers folder `src`, copied
    to out/teacher_answers (rank 0) and read there by every rank. `updates` > 0: it must hold
    exactly updates x batch_size rows (seq-KD at matched updates trains on each row once)."""
    if not (src / "tokens.json").is_file():
        raise ValueError(f"seq_kd: answers={str(src)!r} is not a seq_kd teacher_answers folder "
                         f"(no tokens.json): pass <an earlier seq_kd out_dir>/teacher_answers")
    n = len(datasets.load_from_disk(str(src)))
    if updates and n != updates * batch_size:
        raise ValueError(f"seq_kd: answers={str(src)!r} has {n} rows, budget_updates x batch_size is "
                         f"{updates} x {batch_size}: each row is trained on once, so they must agree")
    dst = out / "teacher_answers"
    if ranks.is_main() and src.resolve() != dst.resolve():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    ranks.barrier()
    return datasets.load_from_disk(str(dst)), json.loads((dst / "tokens.json").read_text())["tokens"]


def seq_kd(base: str, teachers: dict[str, str], prompts: Iterable, out_dir: str | Path, *, budget_tokens: int,
           lr: float = 1e-3, batch_size: int = 32, warmup: int = 0, max_new_tokens: int = 64,
           temperature: float = 0.0, seed: int = 0, gen_batch_size: int = 64, quant=None,
           num_threads: int | None = 1, progress: bool = True, agents: dict | None = None,
           match: str = "tokens", budget_updates: int = 0, save_fractions: tuple[float, ...] = (),
           answers: str | Path | None = None) -> dict:
    """Teacher answers to `prompts` (seq_kd_dataset) -> SFT of `base` on them, each row
    once -> out_dir/model (fake-quantized with `quant`). Returns a summary with the
    token counts and `match`; the answers are kept in out_dir/teacher_answers.

    `match` says what is equal to the MOPD run's: "tokens", the student tokens trained on
    (`budget_tokens`; the update count follows from the answers' lengths, ~37% more
    updates than MOPD's on agent episodes, whose failing episodes are longer); "updates",
    the optimizer updates (`budget_updates` steps of `batch_size` rows, each row once; the
    tokens follow).

    `save_fractions` (each in (0, 1)): also save the model after those fractions of the
    SFT steps, to out_dir/checkpoints/step_<k> (not with `quant`);
    the summary's `checkpoints` maps each k to its completion tokens so far.

    `answers`: the teacher_answers folder of an earlier seq_kd run, trained on instead of
    asking the teachers again (`prompts` and the budget are then not used). It is for
    re-training on one set of teacher answers under other training seeds or learning rates:
    generating agent episodes costs far more than the SFT on them."""
    if match not in MATCHES:
        raise ValueError(f"seq_kd: match={match!r}: expected one of {', '.join(MATCHES)}")
    if match == "updates" and budget_updates < 1:
        raise ValueError(f"seq_kd: match='updates' needs budget_updates >= 1 (the MOPD run's optimizer steps), "
                         f"got {budget_updates}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(base)
    t0 = time.perf_counter()
    old_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    # Under a launcher rank 0 asks the teachers and writes the answers; every rank then reads
    # them and trains on its shard of each batch (core.sft)
    if answers is not None:
        torch.set_num_threads(old_threads)
        ds, tokens = _reuse_answers(Path(answers), out, updates=budget_updates if match == "updates" else 0,
                                    batch_size=batch_size)
    elif ranks.is_main():
        try:
            ds, tokens = seq_kd_dataset(prompts, teachers, tok, budget_tokens=budget_tokens, batch_size=batch_size,
                                        max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                        gen_batch_size=gen_batch_size, progress=progress, agents=agents,
                                        budget_rows=budget_updates * batch_size if match == "updates" else 0)
        finally:
            torch.set_num_threads(old_threads)
        ds.save_to_disk(str(out / "teacher_answers"))
        (out / "teacher_answers" / "tokens.json").write_text(json.dumps({"tokens": tokens}))
    else:
        torch.set_num_threads(old_threads)
    if answers is None:
        ranks.barrier()
        if not ranks.is_main():
            ds = datasets.load_from_disk(str(out / "teacher_answers"))
            tokens = json.loads((out / "teacher_answers" / "tokens.json").read_text())["tokens"]
    gen_s = time.perf_counter() - t0
    steps = len(ds) // batch_size
    target = f"{budget_updates:,} updates" if match == "updates" else f"{budget_tokens:,} tokens"
    _say(f"seq-KD at matched {match}: SFT on {len(ds)} teacher answers ({tokens:,} completion tokens, "
         f"budget {target}), {steps} steps of {batch_size}")
    t1 = time.perf_counter()
    sft_dir = out / "sft"
    save_at = sorted({max(1, round(f * steps)) for f in save_fractions})
    sft(base, ds, str(sft_dir), steps=steps, lr=lr, batch_size=batch_size, seed=seed, warmup=warmup,
        num_threads=num_threads, progress=progress, save_at=tuple(save_at))
    if save_at:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        shutil.move(str(sft_dir / "checkpoints"), str(out / "checkpoints"))
    sft_s = time.perf_counter() - t1
    losses = json.loads((sft_dir / "sft_log.json").read_text()).get("losses", [])
    if ranks.is_main():
        model = AutoModelForCausalLM.from_pretrained(str(sft_dir), dtype=torch.float32)
        export_checkpoint(model, tok, out / "model", quant)
        shutil.copy(sft_dir / "sft_log.json", out / "sft_log.json")
    ranks.barrier()   # the model is exported before any rank goes on (or rank 0 removes the SFT folder)
    if ranks.is_main():
        shutil.rmtree(sft_dir, ignore_errors=True)
    by_teacher: dict[str, int] = {}
    for k in ds["teacher"]:
        by_teacher[k] = by_teacher.get(k, 0) + 1
    return {"checkpoint": str((out / "model").resolve()), "rows": len(ds), "steps": steps,
            "tokens": tokens, "budget_tokens": int(budget_tokens), "match": match,
            "budget_updates": int(budget_updates), "rows_per_teacher": by_teacher,
            "generate_seconds": round(gen_s, 1), "sft_seconds": round(sft_s, 1), "losses": losses}
