"""The agent expert's own training stages (experts/run.py calls these for the `agent`
domain instead of TRL's trainers):

    sft: supervised on the oracle's episodes, rendered through a harness sampled per
         episode from the recipe's mix; loss on the assistant tokens only. With
         agent.perturb > 0 that share of episodes carries a wrong call, its error
         observation and the oracle's recovery, so the expert has seen a way back.
    rl:  multi-turn GRPO on the expert's own episodes: a group of episodes per task
         (harness sampled per episode), the episode's reward normalized within the
         group is the advantage of every token the model wrote in it; observation
         tokens carry no loss. The episodes are sampled by mopd/agent/episode.py, the
         same runner MOPD uses, with the policy's own (fake-quantized) forward. With
         agent.partial.enabled a step stops waiting once a share of its groups ended
         and carries the rest over (partial rollouts, mopd/agent/grpo.py).

Why not TRL's GRPOTrainer(environment_factory=...): it takes tool calls in the chat
template's own tool format (one call syntax, the template's), while the point of the
harness is that syntax, tool names and prompt vary per episode; and it re-renders the
conversation with the template each turn, where MOPD and these stages extend the exact
sampled token sequence. The environment is the same class either way (rewards/agent.py).
"""
from __future__ import annotations

import json

from mopd.agent.grpo import group_advantages, rl_loop
from mopd.agent.harness import load_harnesses
from mopd.agent.sft import oracle_transcripts, train_sft_stage
from rewards.agent import make_env

from experts.agent.data import oracle_messages

__all__ = ["group_advantages", "sft_transcripts", "train_rl", "train_sft"]


def sft_transcripts(cfg, tokenizer, train_ds) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, completion_ids, loss_mask) of every training task's oracle episode,
    each through a harness drawn from the mix (seeded), a share perturbed."""
    def episode(task, hc, rng):
        env = make_env(hc, toolset=task.get("toolset", "procedural"))   # BFCL tasks use BFCL's tool docs
        env.reset(task)
        system = [m for m in env.messages if m["role"] == "system"]
        return (system + oracle_messages(task, hc, perturb=rng.random() < cfg.agent.perturb, rng=rng),
                env.harness.apply_context)
    return oracle_transcripts(cfg, tokenizer, train_ds, episode, "agent")


def train_sft(cfg, model, tok, train_ds, out):
    """Cross-entropy on the assistant tokens of oracle episodes; returns the model."""
    return train_sft_stage(cfg, model, tok, sft_transcripts(cfg, tok, train_ds))


def train_rl(cfg, domain, model, tok, train_ds, out):
    """Multi-turn GRPO on the model's own episodes (`agent.partial`: partial rollouts,
    mopd/agent/grpo.py); returns the model."""
    mix = load_harnesses(cfg.agent.harnesses)
    # BFCL tasks use BFCL's tool docs
    return rl_loop(cfg, model, tok, [json.loads(t) for t in train_ds["task"]],
                   lambda t, rng: make_env(mix.sample(rng), toolset=t.get("toolset", "procedural")), "agent")
