"""The coding_agent expert's own training stages (experts/run.py calls these instead of
TRL's trainers, as for `agent`): a thin copy of experts/agent/train.py's two entry points
with this domain's environment and oracle; the GRPO pieces (group advantages, the clipped
policy step, logging) are the shared ones in mopd/agent/grpo.py.

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
import time

import torch

from experts.coding_agent.data import oracle_messages
from mopd.agent.episode import run_episodes
from mopd.agent.grpo import group_advantages, log_metrics, policy_step
from mopd.agent.harness import Harness, load_harnesses
from mopd.agent.sft import lr_lambda, train_on_transcripts
from mopd.agent.transcript import encode_segments
from mopd.rollout import HFRollout, eos_ids
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
    """Multi-turn GRPO on the model's own episodes; returns the model."""
    r, a = cfg.rl, cfg.agent
    mix = load_harnesses(a.harnesses)
    rng = random.Random(cfg.train.seed)
    tasks = [json.loads(t) for t in train_ds["task"]]
    tr = cfg.train
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tr.lr, weight_decay=tr.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tr.max_steps, tr.warmup_steps, tr.lr_schedule))
    rollout = HFRollout(model, tok, batch_size=max(1, cfg.train.batch_size * r.num_generations))
    eos = eos_ids(tok, getattr(model, "generation_config", None))
    G, t0 = r.num_generations, time.perf_counter()
    for step in range(1, cfg.train.max_steps + 1):
        batch_tasks = [tasks[rng.randrange(len(tasks))] for _ in range(cfg.train.batch_size)]
        ep_tasks = [t for t in batch_tasks for _ in range(G)]
        envs = [make_env(mix.sample(rng)) for _ in ep_tasks]
        seeds = [rng.randrange(2**31) for _ in ep_tasks]
        try:
            episodes = run_episodes(rollout, tok, envs, ep_tasks, seeds=seeds, temperature=r.temperature, top_p=1.0,
                                    max_turns=a.max_turns, max_context_tokens=a.max_context_tokens,
                                    max_new_tokens=a.max_new_tokens, eos_ids=eos)
        finally:
            for e in envs:   # episodes cut by max_turns / context still hold a workspace
                e.close()
        rewards = [e.reward for e in episodes]
        adv = group_advantages(rewards, G, r.scale_rewards)
        rows = [(seg, adv[i]) for i, e in enumerate(episodes) for seg in e.segments if adv[i] != 0.0]
        m = {"reward": sum(rewards) / len(rewards), "success": sum(e.success for e in episodes) / len(episodes),
             "turns": sum(e.turns for e in episodes) / len(episodes),
             "failed_calls": sum(e.failed_calls for e in episodes) / len(episodes),
             "env_errors": sum(e.env_error is not None for e in episodes) / len(episodes)}
        if rows:
            m.update(policy_step(model, opt, tok, rows, epsilon=cfg.rl.epsilon, grad_clip=cfg.train.grad_clip))
            sched.step()
        if step % cfg.train.logging_steps == 0 or step == cfg.train.max_steps:
            print(f"[expert] coding_agent rl step {step}/{cfg.train.max_steps} reward {m['reward']:.3f} "
                  f"turns {m['turns']:.1f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        log_metrics(step, m)
    return model
