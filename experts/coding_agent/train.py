"""The coding_agent expert's own training stages (experts/run.py calls these instead of
TRL's trainers, as for `agent`): a thin copy of experts/agent/train.py's two entry points
with this domain's environment and oracle; the GRPO loop (group advantages, the clipped
policy step, partial rollouts, logging) is the shared one in mopd/agent/grpo.py.

    sft: supervised on the oracle's episodes (run the tests, read, replace, run the tests,
         submit), each through a harness sampled per episode; loss on assistant tokens.
    rl:  multi-turn GRPO on the expert's own episodes, every episode in its own sandboxed
         workspace (rewards/workspace.py), removed when the turn loop is over.

Why a copy and not experts/agent/train.py itself: that file binds the agent domain's
make_env and oracle_messages at import, and the domain's `agent.perturb` (a wrong call
and its recovery) has no counterpart here.
"""
from __future__ import annotations

import json
import random

from experts.coding_agent.data import oracle_messages
from mopd.agent.grpo import log_metrics, rl_loop
from mopd.agent.harness import Harness, load_harnesses
from mopd.agent.sft import train_on_transcripts
from mopd.agent.transcript import encode_segments
from rewards.coding_agent import TOOLS, make_env


def sft_transcripts(cfg, tokenizer, train_ds) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, completion_ids, loss_mask) of every training task's oracle episode,
    each through a harness drawn from the mix (seeded)."""
    mix = load_harnesses(cfg.agent.harnesses)
    rng = random.Random(cfg.data.seed)
    out, cut = [], 0
    for row in train_ds:
        task = json.loads(row["task"])
        hc = mix.sample(rng)
        harness = Harness(hc, dict(TOOLS))
        msgs = [{"role": "system", "content": harness.system_prompt()}] + oracle_messages(task, hc)
        rows = encode_segments(tokenizer, msgs, harness.apply_context)
        if any(len(p) + len(c) > cfg.train.max_length for p, c, _ in rows):
            cut += 1
            continue
        out += rows
    if cut:
        print(f"[expert] coding_agent sft: {cut} of {len(train_ds)} oracle episodes are longer than "
              f"train.max_length={cfg.train.max_length} tokens and were left out", flush=True)
    if not out:
        raise ValueError("coding_agent sft: no oracle episode fits train.max_length; raise it")
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
    mopd/agent/grpo.py); returns the model. Each episode's workspace is removed when it
    ends, or, still in flight at the end, when it is dropped."""
    mix = load_harnesses(cfg.agent.harnesses)
    # rl.reward_kwargs.partial_credit: the episodes' reward is the share of hidden assertions passed
    credit = cfg.rl.reward_kwargs.get("partial_credit", False)
    return rl_loop(cfg, model, tok, [json.loads(t) for t in train_ds["task"]],
                   lambda t, rng: make_env(mix.sample(rng), partial_credit=credit), "coding_agent")
