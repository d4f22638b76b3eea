"""The search_agent expert's own training stages (experts/run.py calls these for the
domain instead of TRL's trainers): the agent domain's loop (experts/agent/train.py) on this
domain's environment and oracle.

    sft: supervised on the oracle's episodes, each rendered through a harness sampled
         from the recipe's mix; loss on the assistant tokens only. With agent.perturb > 0
         that share of episodes carries a wrong call (an unknown document id, a search
         without its query), its error observation and the oracle's recovery.
    rl:  multi-turn GRPO on the expert's own episodes (a group per task, harness sampled
         per episode, the group-normalized exact-match reward as every student token's
         advantage, PPO's clip), sampled by mopd/agent/episode.py as MOPD samples.

The pieces that do not depend on the domain (the GRPO loop with its group advantages,
clipped policy step, partial rollouts and MLflow logging) are mopd/agent/grpo.py's, shared
by every agent domain; what names the environment and the oracle is copied from
experts/agent/train.py, since that module binds the agent domain's.
"""
from __future__ import annotations

import json
import random

from experts.search_agent.data import oracle_messages
from mopd.agent.grpo import group_advantages, log_metrics, rl_loop
from mopd.agent.harness import load_harnesses
from mopd.agent.sft import train_on_transcripts
from mopd.agent.transcript import encode_segments
from rewards.search_agent import make_env

__all__ = ["group_advantages", "sft_transcripts", "train_rl", "train_sft"]


def sft_transcripts(cfg, tokenizer, train_ds) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, completion_ids, loss_mask) of every training task's oracle episode,
    each through a harness drawn from the mix (seeded), a share perturbed."""
    mix = load_harnesses(cfg.agent.harnesses)
    rng = random.Random(cfg.data.seed)
    out, cut = [], 0
    for row in train_ds:
        task = json.loads(row["task"])
        hc = mix.sample(rng)
        env = make_env(hc)
        env.reset(task)
        system = [m for m in env.messages if m["role"] == "system"]
        msgs = system + oracle_messages(task, hc, perturb=rng.random() < cfg.agent.perturb, rng=rng)
        rows = encode_segments(tokenizer, msgs, env.harness.apply_context)
        if any(len(p) + len(c) > cfg.train.max_length for p, c, _ in rows):
            cut += 1
            continue
        out += rows
    if cut:
        print(f"[expert] search_agent sft: {cut} of {len(train_ds)} oracle episodes are longer than "
              f"train.max_length={cfg.train.max_length} tokens and were left out", flush=True)
    if not out:
        raise ValueError("search_agent sft: no oracle episode fits train.max_length; raise it")
    return out


def train_sft(cfg, model, tok, train_ds, out):
    """Cross-entropy on the assistant tokens of oracle episodes; returns the model."""
    t = cfg.train
    train_on_transcripts(model, sft_transcripts(cfg, tok, train_ds), pad_id=tok.pad_token_id, steps=t.max_steps,
                         lr=t.lr, batch_size=t.batch_size, grad_accum=t.grad_accum, warmup=t.warmup_steps,
                         schedule=t.lr_schedule, weight_decay=t.weight_decay, grad_clip=t.grad_clip, seed=t.seed,
                         log=log_metrics, log_every=t.logging_steps)
    return model


def train_rl(cfg, domain, model, tok, train_ds, out):
    """Multi-turn GRPO on the model's own episodes (`agent.partial`: partial rollouts,
    mopd/agent/grpo.py); returns the model."""
    mix = load_harnesses(cfg.agent.harnesses)
    return rl_loop(cfg, model, tok, [json.loads(t) for t in train_ds["task"]],
                   lambda t, rng: make_env(mix.sample(rng)), "search_agent")
