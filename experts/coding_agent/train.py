"""The coding_agent expert's own training stages (experts/run.py calls these instead of
TRL's trainers, as for `agent`): a thin copy of experts/agent/train.py's two entry points
with this domain's environment and oracle; the GRPO loop (group advantages, the clipped
policy step, partial rollouts, logging) is the shared one in mopd/agent/grpo.py.

    sft: supervised on the oracle's episodes (run the tests, read, replace, run the tests,
         submit), each through a harness sampled per episode; loss on assistant tokens.
    rl:  multi-turn GRPO on the expert's own episodes, every episode in its own sandboxed
         workspace (rewards/workspace.py), removed when the turn loop is over.

Why a copy and not experts/agent/train.py itself: that file binds the agent domain's
make_env and oracle_messages at import.
"""
from __future__ import annotations

import json

from experts.coding_agent.data import oracle_messages
from mopd.agent.grpo import rl_loop
from mopd.agent.harness import Harness, load_harnesses
from mopd.agent.sft import oracle_transcripts, train_sft_stage
from rewards.coding_agent import TOOLS, make_env


def sft_transcripts(cfg, tokenizer, train_ds) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, completion_ids, loss_mask) of every training task's oracle episode,
    each through a harness drawn from the mix (seeded); `agent.perturb` of them carry a
    wrong call and its error before the oracle's call (data.oracle_messages)."""
    def episode(task, hc, rng):
        harness = Harness(hc, dict(TOOLS))
        # no draw when perturb is off: the episodes' harness draws stay those of the measured recipe
        perturb = cfg.agent.perturb > 0 and rng.random() < cfg.agent.perturb
        return ([{"role": "system", "content": harness.system_prompt()}]
                + oracle_messages(task, hc, perturb=perturb, rng=rng), harness.apply_context)
    return oracle_transcripts(cfg, tokenizer, train_ds, episode, "coding_agent")


def train_sft(cfg, model, tok, train_ds, out):
    """Cross-entropy on the assistant tokens of oracle episodes; returns the model."""
    return train_sft_stage(cfg, model, tok, sft_transcripts(cfg, tok, train_ds))


def train_rl(cfg, domain, model, tok, train_ds, out):
    """Multi-turn GRPO on the model's own episodes (`agent.partial`: partial rollouts,
    mopd/agent/grpo.py); returns the model. Each episode's workspace is removed when it
    ends, or, still in flight at the end, when it is dropped."""
    mix = load_harnesses(cfg.agent.harnesses)
    # rl.reward_kwargs.partial_credit: the episodes' reward is the share of hidden assertions passed
    credit = cfg.rl.reward_kwargs.get("partial_credit", False)
    return rl_loop(cfg, model, tok, [json.loads(t) for t in train_ds["task"]],
                   lambda t, rng: make_env(mix.sample(rng), partial_credit=credit), "coding_agent")
