"""Partial rollouts against waiting for every episode, on a long-tail agent environment.

    python -m bench.partial_rollouts --out runs/bench/partial [--seeds 0 1 2] [--steps 30]

The environment (`make_env`, below): a task asks for `turns` answers, one per user
message; `--long-every` (default 4: one task in four) tasks ask for `--long-turns`
(default 10) answers, the others for one, so those episodes take ten times the turns
and the tokens of the rest. Every answer is scored against a fixed phrase (the share of
its words in place) and the episode's reward is the mean over its answers: a learnable
score that does not change how long a turn is (the phrase is about as long as a turn).

The models are built here in a minute: one tiny random base; the teacher is it after
`--teacher-sft` steps of SFT on the phrase (an expert-like checkpoint),
the student after `--student-sft` steps (partly there). Each seed then runs the real
MOPD loop (`mopd.distill.loop.run`, `--prompts-per-step` 4, `--kl` sampled) twice,
interleaved (the arm that goes first alternates by seed, so drift of a shared machine
hits both):

  - wait:    every episode of a step is played to its end before the update;
  - partial: `agents.longtail.partial: {enabled: true, min_finished: 0.5}`: a step stops
             once half of its episodes (carried over + new) ended; the others carry over.
             (0.5, not 0.75: carried long episodes plus the new long ones are often a
             quarter of the batch or more, and 0.75 would then wait for them again.)
             loss.max_staleness is 4 (`--max-staleness`): a long episode advances about
             one turn a step, and at 2 most of its turns were masked as stale.

Step wall time is the time between the ends of consecutive steps (step 1 is left out:
it includes loading the models and starting the engine), taken by a step callback; the
saving comes from generating fewer rounds of tokens per step, nothing sleeps. The score
is each final student's mean episode reward on `--n-eval` held-out tasks, sampled at
`--eval-temperature` with fixed seeds (greedy is reported too), the same long-tail share;
the last steps' reverse KL to the teacher is reported beside it.

The sampler is vLLM (`--backend vllm`, the default): it batches continuously and caches
the prefixes of carried-over episodes, so a straggler's turn costs a decode step that the
other sequences share, as on an accelerator. With `--backend hf` every turn re-reads its
whole (left-padded) context and a straggler's turns alone cost one short sequence, so
waiting is cheap and carrying long contexts into every batch is not: on CPU that sampler
shows no saving (docs/results/2026-12-02-partial-rollouts-bench.md).

Writes OUT/partial_rollouts.json (after every run) and OUT/partial_rollouts.md. A
benchmark, not a test: ~1-2 minutes per run at the defaults on two CPU cores. With 8
prompts a step and one task in eight long the tiny model's update outweighs its sampling
and the saving vanishes (the results page, run A).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

DOMAIN = "longtail"
PHRASE = "alpha beta gamma delta epsilon zeta eta theta".split()
HARNESSES = ("harnesses:\n  - {name: json_terse, syntax: json, system_prompt: \"Tools:\\n{tools}\\n{syntax}\", "
             "max_description_chars: 0}\n")


def _say(msg: str):
    print(f"[partial_rollouts] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- environment
def phrase_score(text: str) -> float:
    """Share of the phrase's words the answer has in their place (0..1)."""
    words = text.split()
    return sum(i < len(words) and words[i] == w for i, w in enumerate(PHRASE)) / len(PHRASE)


class LongTailBackend:
    """A task of `turns` answers: each answer without a tool call is scored and, until the
    last, answered by the next user message."""

    def tools(self):
        from core.agent.harness import ToolSpec

        return {"note": ToolSpec("note", "Write a note.", {"type": "object", "properties": {}})}

    def reset(self, task: dict) -> str:
        self.turns, self.scores = int(task["turns"]), []
        return f"Task {task['id']}: answer {self.turns} times."

    def call(self, call) -> str:
        return "noted"

    def end_turn(self, final_text: str) -> str | None:
        self.scores.append(phrase_score(final_text))
        n = len(self.scores)
        return f"Again ({n} of {self.turns} done)." if n < self.turns else None

    def finish(self, final_text: str) -> dict:
        r = statistics.fmean(self.scores) if self.scores else 0.0
        return {"success": r == 1.0, "reward": r}


def make_env(harness_cfg, memory=None):
    from core.agent.env import ToolEnv

    return ToolEnv(LongTailBackend(), harness_cfg, memory)


def tasks(n: int, start: int, long_every: int, long_turns: int) -> list[dict]:
    """Tasks start..start+n; every `long_every`-th (counted from the first) is long."""
    return [{"id": f"t{i}", "turns": long_turns if (i - start) % long_every == long_every - 1 else 1}
            for i in range(start, start + n)]


# ----------------------------------------------------------------------------- models
def sft_rows(tok, harness_path: Path, n: int) -> list:
    """The phrase-answering transcripts of `n` tasks of one to three turns (teacher data)."""
    from core.agent.harness import load_harnesses
    from core.agent.transcript import encode_segments

    hc = load_harnesses(harness_path).harnesses[0]
    rows = []
    for i in range(n):
        env = make_env(hc)
        env.reset({"id": f"s{i}", "turns": 1 + i % 3})
        done = False
        while not done:
            _, done, _ = env.step(" ".join(PHRASE))
        rows += encode_segments(tok, env.messages, env.harness.apply_context)
    return rows


def build_models(out: Path, harness_path: Path, teacher_steps: int, student_steps: int) -> tuple[Path, Path]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.agent.sft import train_on_transcripts
    from core.tiny import build_tiny_model

    paths = out / "models" / "teacher", out / "models" / "student"
    if all((p / "config.json").exists() for p in paths):
        return paths
    base = build_tiny_model(out / "models" / "base", seed=0)
    tok = AutoTokenizer.from_pretrained(str(base))
    rows = sft_rows(tok, harness_path, 48)
    for path, steps in zip(paths, (teacher_steps, student_steps)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        train_on_transcripts(model, rows, pad_id=tok.pad_token_id, steps=steps, lr=3e-3, batch_size=8, seed=0,
                             label=f"bench {path.name} sft")
        model.save_pretrained(str(path))
        tok.save_pretrained(str(path))
        _say(f"built {path.name} ({steps} SFT steps)")
    return paths


def evaluate(path: Path, harness_path: Path, eval_tasks: list[dict], a: dict, temperature: float = 0.0) -> float:
    """Mean episode reward of `path` on `eval_tasks` (greedy at temperature 0; else
    sampled with fixed seeds, the same for every model)."""
    import random

    from core.agent.episode import run_episodes
    from core.agent.harness import load_harnesses
    from core.evaluate import load_model
    from core.rollout import HFRollout, eos_ids

    model, tok = load_model(path)
    hc = load_harnesses(harness_path).harnesses[0]
    rng = random.Random(1)
    eps = run_episodes(HFRollout(model, tok, batch_size=len(eval_tasks)), tok, [make_env(hc) for _ in eval_tasks],
                       eval_tasks, seeds=[rng.randrange(2**31) for _ in eval_tasks], temperature=temperature, top_p=1.0,
                       max_turns=a["max_turns"], max_context_tokens=a["max_context_tokens"],
                       max_new_tokens=a["max_new_tokens"], eos_ids=eos_ids(tok, model.generation_config))
    return statistics.fmean(e.reward for e in eps)


# ----------------------------------------------------------------------------- runs
def agent_settings(args) -> dict:
    return {"env": f"{__name__}:make_env", "max_turns": args.long_turns + 2,
            "max_context_tokens": 512,   # the tiny models' max_position_embeddings
            "max_new_tokens": args.max_new_tokens}


def run_arm(args, arm: str, seed: int, teacher: Path, student: Path, data: Path, harness_path: Path) -> dict:
    import os

    import yaml

    from core.config import load_config
    from mopd.distill import DistillConfig
    from mopd.distill.loop import run as distill

    out = Path(args.out) / f"seed{seed}" / arm
    a = {**agent_settings(args), "harnesses": str(harness_path),
         "partial": {"enabled": arm == "partial", "min_finished": args.min_finished}}
    cfg = {"model": {"path": str(student)},
           "data": {"datasets": [{"path": str(data)}], "max_prompt_tokens": 96},
           "teachers": {DOMAIN: {"path": str(teacher), "backend": "hf"}},
           "agents": {DOMAIN: a},
           "rollout": {"backend": args.backend, "temperature": 1.0, "max_new_tokens": args.max_new_tokens,
                       "max_model_len": 512, "enforce_eager": True},
           "loss": {"kl": args.kl, "max_staleness": args.max_staleness},
           "train": {"max_steps": args.steps, "prompts_per_step": args.prompts_per_step, "lr": args.lr,
                     "warmup_steps": 0, "seed": seed, "save_every": 0},
           "mlflow": {"experiment": "bench-partial-rollouts", "log_model": False,
                      "tracking_uri": f"sqlite:///{(Path(args.out) / 'mlflow.db').resolve()}"}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    ends: list[float] = []
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.perf_counter()
    res = distill(load_config(DistillConfig, out / "config.yaml"), out / "run", progress=False,
                  callbacks=[lambda step, m: ends.append(time.perf_counter())])
    total = time.perf_counter() - t0
    hist = res["history"]
    wall = [b - a_ for a_, b in zip(ends, ends[1:])]   # step 2 onwards: step 1 includes loading the models
    d = DOMAIN

    def mean_of(key: str) -> float | None:   # step 1 left out of times, as of the wall time
        vals = [h[key] for h in (hist[1:] if key.startswith("time/") else hist) if key in h]
        return statistics.fmean(vals) if vals else None

    age = {k: mean_of(f"agent/token_age/{d}/age_{k}") for k in ("0", "1", "2", "3plus")}
    return {"arm": arm, "seed": seed, "steps": len(hist), "run_s": round(total, 1),
            "step_s": wall, "step_s_mean": statistics.fmean(wall), "step_s_median": statistics.median(wall),
            "sample_s_mean": mean_of("time/sample_s"), "teacher_s_mean": mean_of("time/teacher_s"),
            "update_s_mean": mean_of("time/update_s"), "tokens_trained": sum(h.get("tokens", 0.0) for h in hist),
            "train_reward_last5": statistics.fmean([h[f"agent/reward/{d}"] for h in hist[-5:]
                                                    if f"agent/reward/{d}" in h] or [float("nan")]),
            "carried_over_mean": mean_of(f"agent/carried_over/{d}"),
            "carried_over_max": max((h.get(f"agent/carried_over/{d}", 0.0) for h in hist), default=0.0),
            "token_age_mean": mean_of(f"agent/token_age_mean/{d}"), "token_age": age,
            "stale_masked_share": mean_of(f"agent/stale_masked_share/{d}"),
            "final_reverse_kl": statistics.fmean([h[f"reverse_kl/{d}"] for h in hist[-5:] if f"reverse_kl/{d}" in h]),
            "score": evaluate(Path(res["final"]), harness_path, args.eval_tasks, a, args.eval_temperature),
            "score_greedy": evaluate(Path(res["final"]), harness_path, args.eval_tasks, a)}


def summarize(runs: list[dict]) -> dict:
    by = {arm: [r for r in runs if r["arm"] == arm] for arm in ("wait", "partial")}
    out: dict = {}
    for arm, rs in by.items():
        if not rs:
            continue
        steps = [s for r in rs for s in r["step_s"]]
        out[arm] = {"seeds": [r["seed"] for r in rs], "step_s_mean": statistics.fmean(steps),
                    "step_s_median": statistics.median(steps),
                    "score_mean": statistics.fmean(r["score"] for r in rs), "scores": [r["score"] for r in rs],
                    "score_greedy_mean": statistics.fmean(r["score_greedy"] for r in rs),
                    "final_reverse_kl_mean": statistics.fmean(r["final_reverse_kl"] for r in rs)}
    if "wait" in out and "partial" in out:
        w, p = out["wait"], out["partial"]
        out["step_time_ratio_mean"] = p["step_s_mean"] / w["step_s_mean"]
        out["step_time_ratio_median"] = p["step_s_median"] / w["step_s_median"]
        out["step_time_cut_mean"] = 1 - out["step_time_ratio_mean"]
        paired = [(p_["score"] - w_["score"]) for w_ in by["wait"] for p_ in by["partial"] if p_["seed"] == w_["seed"]]
        out["score_diff_per_seed"] = paired
    return out


def write_report(out: Path, runs: list[dict], summary: dict, extra: dict):
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = ["| seed | arm | step s (mean) | step s (median) | sample / teacher / update s (means) | tokens trained | "
             "score (held-out reward, sampled) | greedy | reverse KL (last 5 steps) | carried over (mean / max) | "
             "token age mean | age 0 / 1 / 2 / 3+ | stale masked |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ag = r["token_age"]
        lines.append(f"| {r['seed']} | {r['arm']} | {f(r['step_s_mean'], 2)} | {f(r['step_s_median'], 2)} | "
                     f"{f(r['sample_s_mean'], 2)} / {f(r['teacher_s_mean'], 2)} / {f(r['update_s_mean'], 2)} | "
                     f"{f(r['tokens_trained'], 0)} | {f(r['score'])} | {f(r['score_greedy'])} | "
                     f"{f(r['final_reverse_kl'])} | {f(r['carried_over_mean'], 1)} / "
                     f"{f(r['carried_over_max'], 0)} | {f(r['token_age_mean'], 2)} | "
                     f"{' / '.join(f(ag[k], 2) for k in ('0', '1', '2', '3plus'))} | {f(r['stale_masked_share'])} |")
    if "step_time_ratio_mean" in summary:
        w, p = summary["wait"], summary["partial"]
        lines += ["", f"wait: step {w['step_s_mean']:.2f} s mean, {w['step_s_median']:.2f} s median, score "
                      f"{w['score_mean']:.3f} (greedy {w['score_greedy_mean']:.3f}, reverse KL "
                      f"{w['final_reverse_kl_mean']:.3f}); partial: step {p['step_s_mean']:.2f} s mean, "
                      f"{p['step_s_median']:.2f} s median, score {p['score_mean']:.3f} (greedy "
                      f"{p['score_greedy_mean']:.3f}, reverse KL {p['final_reverse_kl_mean']:.3f}). "
                      f"Step time partial / wait: "
                      f"{summary['step_time_ratio_mean']:.3f} (mean), {summary['step_time_ratio_median']:.3f} "
                      f"(median). Score partial - wait per seed: "
                      f"{', '.join(f'{x:+.3f}' for x in summary['score_diff_per_seed'])}.",
                  f"Held-out reward (sampled / greedy): start student {extra['start_score']:.3f} / "
                  f"{extra['start_score_greedy']:.3f}, teacher {extra['teacher_score']:.3f} / "
                  f"{extra['teacher_score_greedy']:.3f}."]
    (out / "partial_rollouts.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.partial_rollouts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30, help="MOPD steps per run")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--long-every", type=int, default=4, help="one task in this many is long")
    ap.add_argument("--long-turns", type=int, default=10, help="turns of a long task (a short one has 1)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="tokens per turn (the phrase is 10)")
    ap.add_argument("--backend", choices=["hf", "vllm"], default="vllm",
                    help="the student's sampler (rollout.backend); see the module doc for why vllm")
    ap.add_argument("--kl", choices=["sampled", "full"], default="sampled", help="MOPD's loss.kl")
    ap.add_argument("--min-finished", type=float, default=0.5)
    ap.add_argument("--max-staleness", type=int, default=4, help="loss.max_staleness")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--teacher-sft", type=int, default=120)
    ap.add_argument("--student-sft", type=int, default=12)
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--eval-temperature", type=float, default=0.5,
                    help="the score's sampling temperature (greedy is reported too: its reward jumps between a "
                         "few values, too coarse to compare arms)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: leave a core to others)")
    args = ap.parse_args(argv)
    for k in ("steps", "prompts_per_step", "long_every", "long_turns", "max_new_tokens", "n_eval", "threads"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if args.steps < 3:
        ap.error("--steps must be >= 3 (step 1 is not timed; a ratio needs more)")
    if not 0 < args.min_finished <= 1:
        ap.error("--min-finished must be in (0, 1]")

    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    harness_path = out / "harnesses.yaml"
    harness_path.write_text(HARNESSES)
    data = out / "train.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Task {t['id']}"}], "domain": DOMAIN, "task": json.dumps(t)}
            for t in tasks(512, 0, args.long_every, args.long_turns)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args.eval_tasks = tasks(args.n_eval, 100_000, args.long_every, args.long_turns)
    teacher, student = build_models(out, harness_path, args.teacher_sft, args.student_sft)
    a = agent_settings(args)
    extra = {"start_score": evaluate(student, harness_path, args.eval_tasks, a, args.eval_temperature),
             "start_score_greedy": evaluate(student, harness_path, args.eval_tasks, a),
             "teacher_score": evaluate(teacher, harness_path, args.eval_tasks, a, args.eval_temperature),
             "teacher_score_greedy": evaluate(teacher, harness_path, args.eval_tasks, a)}
    _say(f"held-out reward (sampled): start student {extra['start_score']:.3f}, teacher {extra['teacher_score']:.3f}")
    runs: list[dict] = []
    settings = {k: v for k, v in vars(args).items() if k != "eval_tasks"}
    for i, seed in enumerate(args.seeds):
        for arm in (("wait", "partial") if i % 2 == 0 else ("partial", "wait")):
            _say(f"seed {seed}: {arm} ...")
            r = run_arm(args, arm, seed, teacher, student, data, harness_path)
            runs.append(r)
            _say(f"seed {seed} {arm}: step {r['step_s_mean']:.2f} s mean, score {r['score']:.3f}, "
                 f"carried {r['carried_over_mean']}")
            summary = summarize(runs)
            (out / "partial_rollouts.json").write_text(json.dumps({"settings": settings, **extra, "runs": runs,
                                                                   "summary": summary}, indent=1))
            write_report(out, runs, summary, extra)
    print((out / "partial_rollouts.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
