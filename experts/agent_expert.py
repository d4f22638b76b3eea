"""The agent experts' own training stages, one loop for every agent domain: a domain passes
in what differs (its environment, its oracle, its name) and experts/run.py calls the
result's `train_sft` and `train_rl` instead of TRL's trainers (the registry finds it as the
domain data module's `TRAINER`).

    sft: supervised on the oracle's episodes, rendered through a harness sampled per
         episode from the recipe's mix; loss on the assistant tokens only. With
         agent.perturb > 0 that share of episodes carries a wrong call, its error
         observation and the oracle's recovery, so the expert has seen a way back.
    rl:  multi-turn GRPO on the expert's own episodes: a group of episodes per task
         (harness sampled per episode), the episode's reward normalized within the
         group is the advantage of every token the model wrote in it; observation
         tokens carry no loss. The episodes are sampled by core/agent/episode.py, the
         same runner MOPD uses, with the policy's own (fake-quantized) forward. With
         agent.partial.enabled a step stops waiting once a share of its groups ended
         and carries the rest over (partial rollouts, core/agent/grpo.py).

Why not TRL's GRPOTrainer(environment_factory=...): it takes tool calls in the chat
template's own tool format (one call syntax, the template's), while the point of the
harness is that syntax, tool names and prompt vary per episode; and it re-renders the
conversation with the template each turn, where MOPD and these stages extend the exact
sampled token sequence. The environment is the same class either way (rewards/<domain>.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AgentExpert:
    """An agent domain's SFT and RL stages.

    make_env(harness_cfg, task, cfg) -> ToolEnv: the domain's environment for one episode
        of `task` (cfg: the ExpertConfig, for settings such as rl.reward_kwargs).
    oracle_messages(task, harness_cfg, perturb=, rng=) -> messages: the oracle's episode
        after the system prompt (data.py).
    label: the domain, in logs and errors.
    draw_always: draw the perturb coin for every SFT episode even with agent.perturb = 0
        (agent and search_agent did, coding_agent did not; kept so that each domain's
        harness draws, and so its measured runs, stay as they were)."""
    make_env: Callable
    oracle_messages: Callable
    label: str
    draw_always: bool = False

    def sft_transcripts(self, cfg, tokenizer, train_ds, *, oracle: Callable | None = None,
                        processor=None) -> list[tuple]:
        """(prompt_ids, completion_ids, loss_mask) of every training task's oracle episode,
        each through a harness drawn from the mix (seeded); `agent.perturb` of them carry a
        wrong call and its error before the oracle's (data.oracle_messages, or `oracle` with
        its signature). `processor` (a vision-language model's): image observations become
        image tokens, and each row gets its images as a fourth item (core.agent.sft)."""
        from core.agent.sft import oracle_transcripts   # torch and mlflow: not at the data module's import

        oracle = oracle or self.oracle_messages

        def episode(task, hc, rng):
            # the system prompt the episode would start with, without setting the task up
            harness = self.make_env(hc, task, cfg).harness_for(task)
            draw = self.draw_always or cfg.agent.perturb > 0
            perturb = draw and rng.random() < cfg.agent.perturb
            return ([{"role": "system", "content": harness.system_prompt()}]
                    + oracle(task, hc, perturb=perturb, rng=rng), harness.apply_context)
        return oracle_transcripts(cfg, tokenizer, train_ds, episode, self.label, processor)

    def train_sft(self, cfg, model, tok, train_ds, out):
        """Cross-entropy on the assistant tokens of oracle episodes; returns the model."""
        from core.agent.sft import train_sft_stage

        return train_sft_stage(cfg, model, tok, self.sft_transcripts(cfg, tok, train_ds))

    def train_rl(self, cfg, domain, model, tok, train_ds, out):
        """Multi-turn GRPO on the model's own episodes (`agent.partial`: partial rollouts,
        core/agent/grpo.py); returns the model. An environment that holds resources (a
        coding_agent workspace) frees them when its episode ends."""
        from core.agent.grpo import rl_loop
        from core.agent.harness import load_harnesses

        mix = load_harnesses(cfg.agent.harnesses)
        return rl_loop(cfg, model, tok, [json.loads(t) for t in train_ds["task"]],
                       lambda t, rng: self.make_env(mix.sample(rng), t, cfg), self.label)
