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

from experts.search_agent.data import oracle_messages
from mopd.agent.grpo import group_advantages, rl_loop
from mopd.agent.harness import load_harnesses
from mopd.agent.sft import oracle_transcripts, train_sft_stage
from rewards.search_agent import make_env

__all__ = ["group_advantages", "sft_transcripts", "train_rl", "train_sft"]


def sft_transcripts(cfg, tokenizer, train_ds) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, completion_ids, loss_mask) of every training task's oracle episode,
    each through a harness drawn from the mix (seeded), a share perturbed."""
    def episode(task, hc, rng):
        env = make_env(hc)
        env.reset(task)
        system = [m for m in env.messages if m["role"] == "system"]
        return (system + oracle_messages(task, hc, perturb=rng.random() < cfg.agent.perturb, rng=rng),
                env.harness.apply_context)
    return oracle_transcripts(cfg, tokenizer, train_ds, episode, "search_agent")


def train_sft(cfg, model, tok, train_ds, out):
    """Cross-entropy on the assistant tokens of oracle episodes; returns the model."""
    return train_sft_stage(cfg, model, tok, sft_transcripts(cfg, tok, train_ds))


def train_rl(cfg, domain, model, tok, train_ds, out):
    """Multi-turn GRPO on the model's own episodes (`agent.partial`: partial rollouts,
    mopd/agent/grpo.py); returns the model."""
    mix = load_harnesses(cfg.agent.harnesses)
    return rl_loop(cfg, model, tok, [json.loads(t) for t in train_ds["task"]],
                   lambda t, rng: make_env(mix.sample(rng)), "search_agent")
