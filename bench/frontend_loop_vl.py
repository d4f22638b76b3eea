"""The frontend_loop vision arm: a vision-language stand-in student sees each rendered page as
a screenshot, and `mopd distill` trains it from a vision-language teacher that scores the
student's tokens with the same screenshots in its context.

    python -m bench.frontend_loop_vl --out runs/fl_vl --steps 4 --n-train 4 --n-eval 4 --seeds 0 1 2

Builds (core.standins) a Qwen2.5-VL student (`qwen2.5-vl`, seed 0) and teacher
(`qwen2.5-vl-teacher`, seed 1), random init, unless --student/--teacher name checkpoints
(e.g. a teacher SFT'd by `mopd expert --config recipes/opt_in/frontend_loop/sft.yaml
model.path=<VL checkpoint>`). Then, with the HF sampler (core.rollout.HFRollout with the
images' 3D positions):

  eval   held-out page tasks (the frontend test split), one episode per task and seed, in
         the screenshot environment (rewards.frontend_loop:make_screenshot_env): first-turn
         score, final score, gain, turns used, for the teacher and the student before and
         after;
  MOPD   `--steps` steps of `mopd distill`'s loop (mopd.distill.loop.run) on
         recipes/opt_in/frontend_loop/vl/mopd.yaml with the student and teacher given, on
         `--n-train` train page tasks, `--prompts-per-step` episodes a step; the run's
         history (reverse KL by turn, transcript tokens, mismatch) lands in OUT/run;
  grid   OUT/grid.png: one row an episode, one column a turn: --scripted scripted revise
         episodes (the expert SFT's: an imperfect page, then the reference) on top, then the
         first --grid episodes of the student's eval after MOPD.

Writes OUT/vl.json; retention = student after / teacher (final score).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

MAX_TURNS, MAX_CTX = 4, 4096   # the recipe's agents.frontend_loop settings
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "opt_in" / "frontend_loop" / "vl" / "mopd.yaml"


def _episodes(model, proc, tasks, seeds, *, temperature, max_new_tokens, shot_dir=None, timeout_s=30.0):
    from core.agent.episode import run_episodes
    from core.rollout import HFRollout, eos_ids
    from rewards import frontend_loop as FL

    envs = [FL.make_screenshot_env(FL.harness_config("page_plain"), max_turns=MAX_TURNS, timeout_s=timeout_s,
                                   shot_dir=shot_dir and str(Path(shot_dir) / f"s{s}")) for s in seeds]
    eps = run_episodes(HFRollout(model, proc.tokenizer, batch_size=8), proc.tokenizer, envs, tasks, seeds=seeds,
                       temperature=temperature, top_p=1.0, max_turns=MAX_TURNS, max_context_tokens=MAX_CTX,
                       max_new_tokens=max_new_tokens, eos_ids=eos_ids(proc.tokenizer), processor=proc)
    return eps, envs


def evaluate(model, proc, n: int, seeds: list[int], shot_dir=None, *, temperature: float = 1.0,
             max_new_tokens: int = 48) -> dict:
    """First-turn and final score, gain and turns over n held-out tasks x seeds (sampled: a
    random model's greedy turn repeats itself)."""
    from experts.frontend_loop.data import make_tasks

    tasks = make_tasks("test", n, seed=0)
    rows = []
    for s in seeds:
        torch.manual_seed(s)
        eps, envs = _episodes(model, proc, tasks, [1000 * s + i for i in range(n)], temperature=temperature,
                              max_new_tokens=max_new_tokens, shot_dir=shot_dir and str(Path(shot_dir) / f"seed{s}"))
        for t, e, env in zip(tasks, eps, envs):
            sc = env.scores or [0.0]
            rows.append({"seed": s, "task": t["id"], "first": sc[0], "final": float(e.reward), "turns": e.turns,
                         "pages": len(env.scores), "scores": list(env.scores), "shots": list(env.shots), "error": e.env_error, "hung": env.hung})
    mean = lambda k: sum(r[k] for r in rows) / max(1, len(rows))   # noqa: E731
    return {"first_score": mean("first"), "score": mean("final"), "gain": mean("final") - mean("first"),
            "turns": mean("turns"), "episodes": rows}


def distill(student, teacher, out: Path, a) -> dict:
    """`--steps` steps of `mopd distill`'s loop on RECIPE with this student and teacher; the
    run's last step's frontend_loop metrics."""
    from core.config import load_config
    from experts.frontend_loop.data import make_dataset
    from mopd.distill.config import DistillConfig
    from mopd.distill.loop import run

    rows = out / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": r["prompt"], "domain": r["domain"], "task": r["task"]})
                              for r in make_dataset("train", a.n_train, seed=0)))
    cfg = load_config(DistillConfig, RECIPE, [f"model.path={student}", f"teachers.frontend_loop.path={teacher}",
                                              f"data.datasets=[{{path: {rows}}}]", f"train.max_steps={a.steps}",
                                              f"train.prompts_per_step={a.prompts_per_step}", f"train.lr={a.lr}",
                                              f"agents.frontend_loop.max_new_tokens={a.max_new_tokens}",
                                              *a.overrides])
    t0 = time.time()
    hist = run(cfg, out / "run", progress=False)["history"]
    keep = ("loss", "reverse_kl/frontend_loop", "agent/turns/frontend_loop", "agent/tokens_per_episode/frontend_loop",
            "agent/transcript_tokens/frontend_loop", "agent/env_errors/frontend_loop", "agent/reward/frontend_loop")
    return {"steps": len(hist), "wall_s": time.time() - t0,
            "history": [{k: v for k, v in h.items() if k in keep or "turn_" in k or "mismatch" in k} for h in hist]}


def scripted_rows(n: int, shot_dir: Path) -> list[dict]:
    """The expert SFT's scripted revise episodes (an imperfect page, then the reference, then
    DONE) played in the screenshot environment: what the grid shows for pages that improve."""
    import random

    from experts.frontend_loop.data import imperfect_page, make_tasks
    from rewards import frontend_loop as FL

    out = []
    for t in make_tasks("test", n, seed=0):
        env = FL.make_screenshot_env(FL.harness_config("page_plain"), timeout_s=30, shot_dir=str(shot_dir))
        env.reset(t)
        info = {}
        for text in (imperfect_page(t, random.Random(0)) or t["reference"], t["reference"], FL.DONE):
            _obs, done, info = env.step(text)
            if done:
                break
        out.append({"task": "scripted " + t["id"], "first": env.scores[0], "final": info.get("reward", 0.0),
                    "turns": env.turn, "scores": list(env.scores), "shots": list(env.shots)})
    return out


def picture_grid(rows: list[dict], out: Path, *, cell=(240, 96), n: int = 4) -> Path:
    """The screenshots of the first `n` episodes, one row an episode, one column a turn, each
    labelled with its page's score (the pages sit top left: the top-left 480x192 is shown)."""
    from PIL import Image, ImageDraw

    rows = [r for r in rows if r["shots"]][:n]
    cols = max(len(r["shots"]) for r in rows)
    W, H, lab = cell[0], cell[1], 14
    grid = Image.new("RGB", (cols * (W + 4) + 4, len(rows) * (H + lab + 4) + 4), "#888")
    d = ImageDraw.Draw(grid)
    for i, r in enumerate(rows):
        for j, p in enumerate(r["shots"]):
            x, y = 4 + j * (W + 4), 4 + i * (H + lab + 4)
            grid.paste(Image.open(p).convert("RGB").crop((0, 0, 2 * W, 2 * H)).resize((W, H)), (x, y + lab))
            score = f" score {r['scores'][j]:.2f}" if j < len(r.get("scores", [])) else ""
            d.text((x + 2, y), f"{r['task'][:22]} turn {j + 1}{score}", fill="white")
    grid.save(out, optimize=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.frontend_loop_vl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--student", help="a vision-language checkpoint (default: build the qwen2.5-vl stand-in)")
    ap.add_argument("--teacher", help="default: build the qwen2.5-vl-teacher stand-in (seed 1)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--n-train", type=int, default=16, help="train page tasks (rows of the MOPD run)")
    ap.add_argument("--prompts-per-step", type=int, default=4, help="episodes per MOPD step")
    ap.add_argument("--n-eval", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--grid", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-new-tokens", type=int, default=48, help="per turn, in the evals and the MOPD episodes")
    ap.add_argument("--temperature", type=float, default=1.0, help="the evals' sampling temperature")
    ap.add_argument("overrides", nargs="*", help="more recipe overrides (key=value)")
    ap.add_argument("--scripted", type=int, default=2, help="scripted revise episodes atop the grid")
    a = ap.parse_args(argv)
    from core.standins import build_standin
    from core.vision import load_model, load_processor
    from rewards import frontend_loop as FL

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    student_path = a.student or build_standin("qwen2.5-vl", out / "student", seed=0)
    teacher_path = a.teacher or build_standin("qwen2.5-vl-teacher", out / "teacher", seed=1)
    proc = load_processor(student_path)
    FL.check_observation("screenshot", proc.tokenizer, proc)   # before any episode
    student, teacher = load_model(student_path).eval(), load_model(teacher_path).eval()
    t0 = time.time()
    res = {"student": str(student_path), "teacher": str(teacher_path), "max_turns": MAX_TURNS,
           "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "seeds": a.seeds, "n_eval": a.n_eval}
    ev = {"temperature": a.temperature, "max_new_tokens": a.max_new_tokens}
    save = lambda: (out / "vl.json").write_text(json.dumps(res, indent=1))   # noqa: E731 (after each phase)
    res["teacher_eval"] = evaluate(teacher, proc, a.n_eval, a.seeds, **ev)
    save()
    res["student_before"] = evaluate(student, proc, a.n_eval, a.seeds, **ev)
    save()
    del student, teacher   # the loop loads its own
    res["mopd"] = distill(student_path, teacher_path, out, a)
    save()
    student = load_model(out / "run" / "final")
    student.eval()
    res["student_after"] = evaluate(student, proc, a.n_eval, a.seeds, shot_dir=out / "shots", **ev)
    t = res["teacher_eval"]["score"]
    res["retention"] = res["student_after"]["score"] / t if t > 0 else None
    res["scripted"] = scripted_rows(a.scripted, out / "shots" / "scripted") if a.scripted else []
    res["grid"] = str(picture_grid(res["scripted"] + res["student_after"]["episodes"][:a.grid], out / "grid.png",
                                   n=a.scripted + a.grid))
    res["wall_s"] = time.time() - t0
    save()
    summary = {k: {m: res[k][m] for m in ("first_score", "score", "gain", "turns")}
               for k in ("teacher_eval", "student_before", "student_after")}
    print(json.dumps({**summary, "retention": res["retention"], "wall_s": res["wall_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
