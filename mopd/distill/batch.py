"""One sampled batch of a rank: the student's samples of its prompts (single-turn rows,
agent episodes, partial rollouts carried between steps, teacher-forced reference rows),
then the teachers' scores and the task rewards of its rows."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from mopd.distill import agents as A
from mopd.distill import loss as L
from mopd.distill.config import DistillConfig, RolloutConfig
from mopd.distill.data import Prompt
from mopd.distill.timing import timed
from core.rollout import Sample
from teachers.routing import TeacherRouter, group_by


def _seed_for(seed: int, step: int, idx: int, k: int) -> int:
    return int(hashlib.sha256(f"{seed}/{step}/{idx}/{k}".encode()).hexdigest()[:8], 16)



@dataclass
class Batch:
    """One sampled batch of this rank: rows (a prompt per sample, or per segment of an
    agent episode), their samples and what the teachers said about them."""
    rows: list[Prompt]
    seeds: list[int]
    off: list[bool]          # teacher-forced on the dataset's reference (not the student's sample)
    samples: list[Sample]
    n_gen: int               # tokens the student sampled
    seconds: dict[str, float]
    teacher_lp: list | None = None
    teacher_full: list | None = None
    n_fixed: list[int] | None = None
    task_reward: torch.Tensor | None = None    # what the advantage adds (loss.outcome=group: normalized)
    task_reward_raw: torch.Tensor | None = None  # the reward functions' own values (the metrics)
    episodes: list = field(default_factory=list)    # (domain, Episode) of the batch's agent rows
    episode_of: list | None = None                  # row -> index into episodes (None: single-turn row)
    # partial rollouts: row -> its tokens' weights versions (None: not tracked), and the
    # per-domain token-age sums and carried-over counts (`partial_metrics`)
    versions: list | None = None
    partial: dict | None = None


def minibatch_slices(n_rows: int, n_mb: int) -> list[range]:
    """The rows of each of a batch's minibatches: contiguous slices of the local shard."""
    return [range(mb * n_rows // n_mb, (mb + 1) * n_rows // n_mb) for mb in range(n_mb)]


def _draw(n: int, seed: int, rd: dict[str, RolloutConfig], mine: list[Prompt], step: int):
    """`n` rows per prompt, each with its sample seed and whether it is off-policy."""
    rows = [p for p in mine for _ in range(n)]
    seeds = [_seed_for(seed, step, p.index, k) for p in mine for k in range(n)]
    # Off-policy rows (on_policy_fraction < 1 or a ramp, top-level or the row's domain's
    # by_domain one) take the dataset's completion; the choice is a seeded function of
    # (seed, step, prompt, sample), so reruns and ranks agree.
    off = [rd[p.domain].uses_references and _seed_for(seed + 7919, step, p.index, k) % 10_000
           >= rd[p.domain].on_policy_fraction_at(step) * 10_000 for p in mine for k in range(n)]
    return rows, seeds, off


def sample_batch(cfg: DistillConfig, rollout, rd: dict[str, RolloutConfig], mine: list[Prompt],
                 step: int, agents: dict[str, A.AgentDomain] | None = None, tokenizer=None,
                 eos: set[int] | None = None, pool: A.Pool | None = None) -> Batch:
    """The student's samples of this rank's prompts (each domain at its own settings);
    teacher-forced rows take the dataset's completion instead; rows of an agent domain are
    played as episodes (seeded by their sample seed), one row per episode segment. A
    partial-rollout domain's rows start episodes that join `pool` (its carried-over ones,
    continued first); the batch trains the episodes of `pool` that ended (`_partial_rows`)."""
    agents = agents or {}
    partial = set(A.partial_domains(agents))
    if partial and pool is None:
        raise ValueError(f"sample_batch: agent domains {sorted(partial)} use partial rollouts, which need a "
                         "carry-over pool (pool={})")
    rows, seeds, off = _draw(cfg.rollout.samples_per_prompt, cfg.train.seed, rd, mine, step)
    on_idx = [i for i, o in enumerate(off) if not o]
    single = [i for i in on_idx if rows[i].domain not in agents]
    seconds: dict[str, float] = {}
    with timed("sample", into=seconds):
        samples: list[Sample] = [None] * len(rows)  # type: ignore
        # one sampler call per distinct (temperature, top_p); one call when no domain has its own
        for (temp, top_p), idx in group_by(single, lambda i: (rd[rows[i].domain].temperature,
                                                             rd[rows[i].domain].top_p)).items():
            for i, smp in zip(idx, rollout.generate([rows[i].ids for i in idx],
                                                    max_new_tokens=cfg.rollout.max_new_tokens, temperature=temp,
                                                    top_p=top_p, seeds=[seeds[i] for i in idx])):
                samples[i] = smp
        agent_idx = [i for i in on_idx if rows[i].domain in agents]
        new_idx = [i for i in agent_idx if rows[i].domain in partial]
        if partial:
            agent_idx = [i for i in agent_idx if rows[i].domain not in partial]
        episodes = A.play(agents, rollout, tokenizer, eos, rows, seeds, agent_idx, rd) if agent_idx else []
        finished, n_partial = (A.play_partial(agents, rollout, tokenizer, eos, rows, seeds, new_idx, rd, pool, step)
                               if partial else ([], 0))
    n_gen = sum(len(samples[i].completion_ids) for i in single) + sum(e.student_tokens for e in episodes) + n_partial
    for i, o in enumerate(off):
        if o:  # sampler log-probs are filled with the trainer's in the step: importance weight 1
            ref = rows[i].reference_ids
            samples[i] = Sample(prompt_ids=list(rows[i].ids), completion_ids=list(ref),
                                sampler_logprobs=[0.0] * len(ref), finished=True)
    if partial:
        return _partial_rows(cfg, step, rows, seeds, off, samples, n_gen, seconds, agent_idx, episodes, new_idx,
                             finished, pool, sorted(partial))
    if not agent_idx:
        return Batch(rows, seeds, off, samples, n_gen, seconds)
    domains = [rows[i].domain for i in agent_idx]
    rows, seeds, off, samples, episode_of = A.segment_rows(rows, seeds, off, samples, agent_idx, episodes)
    return Batch(rows, seeds, off, samples, n_gen, seconds, episodes=list(zip(domains, episodes)),
                 episode_of=episode_of)


def _partial_rows(cfg: DistillConfig, step: int, rows, seeds, off, samples, n_gen: int, seconds: dict,
                  agent_idx: list[int], episodes: list, new_idx: list[int], finished: list, pool: A.Pool,
                  partial: list[str]) -> Batch:
    """The batch with partial rollouts: the rows of new episodes leave it (their episodes
    are in the pool), the episodes that ended this step (carried over or new) come in, one
    row per segment, after the other rows. Tokens too stale for their minibatch's update
    are masked. A rank left with fewer rows than minibatches gets empty rows of its
    domain (no tokens, no loss), so every minibatch has rows on every rank."""
    leave = set(new_idx)
    keep = [i for i in range(len(rows)) if i not in leave]
    pos = {i: j for j, i in enumerate(keep)}
    domains = [rows[i].domain for i in agent_idx]
    out_rows, out_seeds, out_off, out_samples, episode_of = A.segment_rows(
        [rows[i] for i in keep], [seeds[i] for i in keep], [off[i] for i in keep], [samples[i] for i in keep],
        [pos[i] for i in agent_idx], episodes)
    pairs = list(zip(domains, episodes))
    versions: list = [None] * len(out_rows)
    for f in finished:
        ep = f.live.ep
        r, s, o, smp, _ = A.segment_rows([f.row], [f.seed], [False], [None], [0], [ep])
        episode_of += [len(pairs)] * len(r)
        pairs.append((f.row.domain, ep))
        out_rows += r
        out_seeds += s
        out_off += o
        out_samples += smp
        versions += ep.versions if ep.segments else [[]]
    src = new_idx[0] if new_idx else 0   # usually a row whose episode left the batch for the pool
    while len(out_rows) < cfg.train.minibatches:
        filler = rows[src]
        out_rows.append(filler)
        out_seeds.append(seeds[src])
        out_off.append(False)
        out_samples.append(Sample(prompt_ids=list(filler.ids), completion_ids=[], sampler_logprobs=[],
                                  finished=False, loss_mask=[], turn_ids=[]))
        episode_of.append(None)
        versions.append(None)
    # a row of minibatch k is trained with the weights of step + k
    trained_at = [0] * len(out_rows)
    for k, sl in enumerate(minibatch_slices(len(out_rows), cfg.train.minibatches)):
        for j in sl:
            trained_at[j] = step + k
    out_samples, stats = A.mask_stale(out_samples, versions, [r.domain for r in out_rows], trained_at,
                                      cfg.loss.max_staleness, partial)
    return Batch(out_rows, out_seeds, out_off, out_samples, n_gen, seconds, episodes=pairs,
                 episode_of=episode_of, versions=versions,
                 partial={"stats": stats, "carried": {d: len(pool.get(d, [])) for d in partial}})


def score_batch(teachers: TeacherRouter, rollout, rd: dict[str, RolloutConfig], b: Batch, eos: set[int], *,
                full: bool) -> None:
    """Teacher log-probs of every row (whole distributions with `full`, loss.kl=full),
    teacher corrections of the student's own samples where their domain asks for them."""
    on_idx = [i for i, o in enumerate(b.off) if not o]
    s = teachers.score_batch(rollout, b.rows, b.samples, full=full, correct_idx=on_idx,
                             settings=lambda i: rd[b.rows[i].domain], seeds=b.seeds, eos_ids=eos)
    b.teacher_lp, b.teacher_full, b.n_fixed = s.logprobs, s.full, s.n_fixed
    b.seconds.update(s.seconds)


def task_rewards(cfg: DistillConfig, reward_fns: dict, tokenizer, b: Batch) -> None:
    """Each row's task reward from its domain's reward function (loss.task_reward_alpha > 0);
    an agent row's is its episode's reward."""
    b.task_reward = torch.zeros(len(b.rows))
    if cfg.loss.task_reward_alpha <= 0:
        return
    for i, e in enumerate(b.episode_of or ()):
        if e is not None:
            b.task_reward[i] = b.episodes[e][1].reward
    texts = tokenizer.batch_decode([s.completion_ids for s in b.samples], skip_special_tokens=True)
    for d, fn in reward_fns.items():
        sel = [i for i, p in enumerate(b.rows) if p.domain == d and d not in cfg.agents]
        if not sel:
            continue
        cols = {c: [b.rows[i].columns.get(c) for i in sel] for c in b.rows[sel[0]].columns}
        vals = fn(prompts=[b.rows[i].messages for i in sel], completions=[texts[i] for i in sel], **cols)
        for i, v in zip(sel, vals):
            if v is None:
                raise ValueError(f"reward {cfg.rewards[d]} returned None for a {d!r} row")
            b.task_reward[i] = float(v)
    b.task_reward_raw = b.task_reward
    if cfg.loss.outcome == "group":   # over the samples of each prompt (loss.outcome)
        keys = {}
        group_B = torch.tensor([keys.setdefault((p.domain, p.index), len(keys)) for p in b.rows])
        b.task_reward = L.group_normalized(b.task_reward, group_B)
