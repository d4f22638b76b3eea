"""What revising buys on `frontend_loop`: a model's first-turn page score against its final
page score on held-out page tasks, over seeds, with the 95% CI of the gain.

    python -m bench.frontend_loop_gain --model runs/experts/frontend_loop/sft/model --out runs/fl_gain \
        --seeds 0 1 2 --n 30 --temperature 0.7

For each seed: `--n` held-out tasks (the frontend domain's test split, evals/frontend_loop.py),
one episode each through a train harness drawn per episode, sampled at `--temperature`
with that seed (greedy at 0). Per episode: the first page's score, the final page's score
(the reward), turns. The gain's CI is a paired bootstrap over the episodes of all seeds
(10,000 resamples, percentile interval); the per-seed means are listed beside it.

Writes OUT/gain.json; a benchmark, not a test (each page is rendered in Chromium).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from bench.stats import bootstrap_ci


def measure(model, tokenizer, *, seeds: list[int], n: int, difficulty: int, temperature: float, max_turns: int,
            max_new_tokens: int, batch_size: int, timeout_s: float = 10.0) -> dict:
    from core.agent.harness import load_harnesses
    from evals.frontend_loop import loop_stats, run_loop
    from experts.frontend_loop.data import make_tasks
    from rewards.frontend_loop import HARNESSES

    tasks = make_tasks("test", n, 0, difficulty)   # the same held-out tasks for every seed
    mix = load_harnesses(str(HARNESSES))
    per_seed, first, final, turns, done = {}, [], [], [], []
    for s in seeds:
        rng = random.Random(s)
        eps, envs = run_loop(model, tokenizer, tasks, [mix.sample(rng) for _ in tasks], max_turns=max_turns,
                             max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
                             seeds=[s * 100_003 + i for i in range(len(tasks))], timeout_s=timeout_s)
        st = loop_stats(eps, envs)
        per_seed[s] = {k: v for k, v in st.items() if k != "per_episode"}
        first += st["per_episode"]["first"]
        final += st["per_episode"]["final"]
        turns += st["per_episode"]["turns"]
        done += st["per_episode"]["done"]
        per_seed[s]["per_episode"] = st["per_episode"]
        print(f"[bench.frontend_loop_gain] seed {s}: first {st['first_score']:.3f} final {st['score']:.3f} "
              f"turns {st['turns']:.2f} done {st['done']:.2f}", file=sys.stderr)
    diffs = [b - a for a, b in zip(first, final)]
    lo, hi = bootstrap_ci(diffs)
    k = max(1, len(diffs))
    return {"seeds": seeds, "n_tasks": n, "episodes": len(diffs), "temperature": temperature,
            "first_score": sum(first) / k, "final_score": sum(final) / k, "gain": sum(diffs) / k,
            "gain_ci95": [lo, hi], "turns": sum(turns) / k, "done": sum(done) / k,
            "revised_up": sum(d > 0 for d in diffs), "revised_down": sum(d < 0 for d in diffs),
            "per_seed": per_seed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.frontend_loop_gain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (HF)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n", type=int, default=30, help="held-out tasks per seed")
    ap.add_argument("--difficulty", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=10.0,
                    help="render deadline per page (a busy machine needs more: past it a page counts as hung)")
    a = ap.parse_args(argv)
    from core.evaluate import load_model

    model, tok = load_model(a.model)
    res = measure(model, tok, seeds=a.seeds, n=a.n, difficulty=a.difficulty, temperature=a.temperature,
                  max_turns=a.max_turns, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, timeout_s=a.timeout_s)
    res["model"] = a.model
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gain.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "per_seed"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
