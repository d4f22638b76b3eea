"""Held-out eval of the `frontend_loop` domain: episodes on held-out page tasks (the
frontend domain's test split), run by the episode runner MOPD samples with, in the
environment of rewards/frontend_loop.py (render report observations).

Reported: `score` = mean final page score (the reward), `first_score` = mean score of the
first page each episode wrote, `gain` = their difference (what revising bought), turns per
episode, the share that said DONE, and the share ended by a page that hung the renderer.
"""
from __future__ import annotations

from pathlib import Path

from evals import agent as agent_eval
from evals.agent import model_and_tokenizer
from experts.frontend_loop.data import DOMAIN, make_tasks
from core.agent.harness import load_harnesses
from rewards.frontend_loop import HARNESSES, MAX_TURNS, TIMEOUT_S, check_observation, make_env, says_done


def loop_stats(episodes, envs) -> dict:
    """Final and first-turn scores (per episode and means), turns, done and hung shares."""
    n = max(1, len(episodes))
    final = [float(e.reward) for e in episodes]
    first = [float(env.scores[0]) if getattr(env, "scores", None) else 0.0 for env in envs]
    done = [any(m["role"] == "assistant" and says_done(m["content"]) for m in e.messages) for e in episodes]
    return {"n": len(episodes), "score": sum(final) / n, "first_score": sum(first) / n,
            "gain": (sum(final) - sum(first)) / n, "turns": sum(e.turns for e in episodes) / n,
            "cut": sum(e.cut is not None for e in episodes) / n, "done": sum(done) / n,
            "hung": sum(bool(getattr(env, "hung", None)) for env in envs) / n,
            "per_episode": {"final": final, "first": first, "turns": [e.turns for e in episodes],
                            "done": done}}


def run_loop(model, tokenizer, tasks: list[dict], harness_cfgs: list, *, max_turns: int = MAX_TURNS,
             max_new_tokens: int = 160, max_context_tokens: int = 1024, batch_size: int = 32,
             temperature: float = 0.0, seeds: list[int] | None = None,
             timeout_s: float = TIMEOUT_S, factory=make_env, processor=None) -> tuple[list, list]:
    """(episodes, their environments) of one episode per task (evals.agent.run_tasks);
    `timeout_s`: each page's render deadline (a page past it hung: its episode scores 0);
    `factory`: the environment (screenshots need the model's `processor`)."""
    envs: list = []

    def env_of(h):
        envs.append(factory(h, max_turns=max_turns, timeout_s=timeout_s))
        return envs[-1]
    eps = agent_eval.run_tasks(model, tokenizer, tasks, harness_cfgs, max_new_tokens=max_new_tokens,
                               max_turns=max_turns, max_context_tokens=max_context_tokens, batch_size=batch_size,
                               temperature=temperature, seeds=seeds, make_env=env_of, processor=processor)
    return eps, envs


def _environment(env: str, model):
    """(factory, processor) of an `env` reference ("": the render report); a screenshot
    environment gets the model's processor (a checkpoint path), a text-only one is refused."""
    if not env:
        return make_env, None
    from mopd.distill.agents import _import_factory

    factory = _import_factory(env, f"evals.{DOMAIN}: env")
    if not getattr(factory, "observes_images", False):
        return factory, None
    from core.vision import load_processor

    # a loaded model: the folder it came from
    path = model if isinstance(model, (str, Path)) else getattr(getattr(model, "config", None), "_name_or_path", "")
    proc = load_processor(path) if path else None
    check_observation("screenshot", getattr(proc, "tokenizer", None), proc, where=f"evals.{DOMAIN}: env {env}",
                      student=str(path or type(model).__name__))
    return factory, proc


def evaluate(model, *, n: int | None = 100, seed: int = 0, difficulty: int = 1, effort: str | None = None,
             dataset: str = "procedural", max_new_tokens: int | None = None, batch_size: int = 32, tokenizer=None,
             harnesses: str = str(HARNESSES), max_turns: int | None = None, max_context_tokens: int = 1024,
             temperature: float = 0.0, env: str = "", **reward_kwargs) -> dict:
    """Held-out episodes of `model` (module doc), each harness drawn (seeded) from the mix's
    train harnesses, in the environment `env` names ('module:function', an expert recipe's
    agent.env; "": the render report; screenshots need `model` as a vision-language
    checkpoint path). Returns {"domain", "effort", "dataset", "n", "score", "first_score",
    "gain", "train_harness": {stats}}."""
    import random

    agent_eval.refuse_settings(DOMAIN, effort, dataset, reward_kwargs)
    factory, processor = _environment(env, model)   # before the model loads
    model, tokenizer = model_and_tokenizer(model, tokenizer)
    tasks = make_tasks("test", 100 if n is None else n, seed, difficulty)
    mix, rng = load_harnesses(harnesses), random.Random(seed)
    eps, envs = run_loop(model, tokenizer, tasks, [mix.sample(rng) for _ in tasks], max_turns=max_turns or MAX_TURNS,
                         max_new_tokens=max_new_tokens or 160, max_context_tokens=max_context_tokens,
                         batch_size=batch_size, temperature=temperature,
                         seeds=[seed * 100_003 + i for i in range(len(tasks))], factory=factory, processor=processor)
    stats = loop_stats(eps, envs)
    return {"domain": DOMAIN, "effort": None, "dataset": dataset, "n": len(tasks), "score": stats["score"],
            "first_score": stats["first_score"], "gain": stats["gain"], "held_out": None,
            "train_harness": {k: v for k, v in stats.items() if k != "per_episode"}}
