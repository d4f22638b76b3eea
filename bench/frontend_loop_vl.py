"""The frontend_loop vision arm: a vision-language stand-in student sees each rendered page as
a screenshot, and MOPD from a vision-language teacher that scores the student's tokens with
the same screenshots in its context.

    python -m bench.frontend_loop_vl --out runs/fl_vl --steps 4 --n-train 4 --n-eval 4 --seeds 0 1 2

Builds (core.standins) a Qwen2.5-VL student (`qwen2.5-vl`, seed 0) and teacher
(`qwen2.5-vl-teacher`, seed 1), random init, unless --student/--teacher name checkpoints.
Then, with the HF sampler (core.rollout.HFRollout with the images' 3D positions):

  eval   held-out page tasks (the frontend test split), one episode per task and seed, in
         the screenshot environment (rewards.frontend_loop:make_screenshot_env): first-turn
         score, final score, gain, turns used, for the teacher and the student before and
         after;
  MOPD   `--steps` updates of the student (mopd.distill.step.train_step, the loop's step):
         episodes on train tasks (core.agent.episode.run_episodes with the student's
         processor), rows per segment (mopd.distill.agents.segment_rows), the teacher's
         log-probs of every completion token from one forward over the transcript with the
         segment's images, the step's token mask (core.models.collate) with every image and
         report token at 0 (asserted each step);
  grid   OUT/grid.png: one row an episode, one column a turn: --scripted scripted revise
         episodes (the expert SFT's: an imperfect page, then the reference) on top, then the
         first --grid episodes of the student's eval after MOPD.

Writes OUT/vl.json. This is the MOPD step path, not `mopd distill`'s loop: the loop's
student and teacher loaders (core.models.build_student, teachers/) load causal LMs only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

MAX_TURNS, MAX_NEW, MAX_CTX = 4, 48, 4096


def _episodes(model, proc, tasks, seeds, *, temperature, shot_dir=None, timeout_s=30.0):
    from core.agent.episode import run_episodes
    from core.rollout import HFRollout, eos_ids
    from rewards import frontend_loop as FL

    envs = [FL.make_screenshot_env(FL.harness_config("page_plain"), max_turns=MAX_TURNS, timeout_s=timeout_s,
                                   shot_dir=shot_dir and str(Path(shot_dir) / f"s{s}")) for s in seeds]
    eps = run_episodes(HFRollout(model, proc.tokenizer, batch_size=8), proc.tokenizer, envs, tasks, seeds=seeds,
                       temperature=temperature, top_p=1.0, max_turns=MAX_TURNS, max_context_tokens=MAX_CTX,
                       max_new_tokens=MAX_NEW, eos_ids=eos_ids(proc.tokenizer), processor=proc)
    return eps, envs


def evaluate(model, proc, n: int, seeds: list[int], shot_dir=None) -> dict:
    """First-turn and final score, gain and turns over n held-out tasks x seeds (sampled at 1.0:
    a random model's greedy turn repeats itself)."""
    from experts.frontend_loop.data import make_tasks

    tasks = make_tasks("test", n, seed=0)
    rows = []
    for s in seeds:
        torch.manual_seed(s)
        eps, envs = _episodes(model, proc, tasks, [1000 * s + i for i in range(n)], temperature=1.0,
                              shot_dir=shot_dir and str(Path(shot_dir) / f"seed{s}"))
        for t, e, env in zip(tasks, eps, envs):
            sc = env.scores or [0.0]
            rows.append({"seed": s, "task": t["id"], "first": sc[0], "final": float(e.reward), "turns": e.turns,
                         "pages": len(env.scores), "scores": list(env.scores), "shots": list(env.shots), "error": e.env_error, "hung": env.hung})
    mean = lambda k: sum(r[k] for r in rows) / max(1, len(rows))   # noqa: E731
    return {"first_score": mean("first"), "score": mean("final"), "gain": mean("final") - mean("first"),
            "turns": mean("turns"), "episodes": rows}


def mopd_step(student, teacher, proc, opt, tasks, seeds, loss_cfg) -> dict:
    """One MOPD update on frontend_loop episodes with screenshots (module doc)."""
    from core.models import collate, completion_logprobs, pad_id_of
    from mopd.distill.agents import segment_rows
    from mopd.distill.data import Prompt
    from mopd.distill.step import SingleProcess, train_step

    tok = proc.tokenizer
    eps, _envs = _episodes(student, proc, tasks, seeds, temperature=1.0)
    rows = [Prompt(i, "frontend_loop", "frontend_loop", [], [0], {}) for i in range(len(eps))]
    _r, _s, _o, samples, _ep_of = segment_rows(rows, seeds, [False] * len(eps), [None] * len(eps),
                                               list(range(len(eps))), eps)
    samples = [s for s in samples if s.completion_ids]
    pad = pad_id_of(tok)
    img = proc.image_token_id
    for s in samples:   # what the loss weighs: the student's tokens only, never an image pad
        assert all(k == 0 for t, k in zip(s.completion_ids, s.loss_mask) if t == img)
        assert sum(s.loss_mask) == sum(1 for t in s.turn_ids if t >= 0)
    with torch.no_grad():   # the teacher scores the student's tokens with the same images in context
        teacher_lp = [completion_logprobs(teacher, collate([s.prompt_ids], [s.completion_ids], pad, {},
                                                           token_mask=[s.loss_mask], vision=[s.vision]))[0]
                      [:len(s.completion_ids)].tolist() for s in samples]
    B = len(samples)
    res = train_step(SingleProcess(), student, opt, SimpleNamespace(step=lambda: None), loss_cfg=loss_cfg,
                     grad_clip=1.0, prompt_ids=[s.prompt_ids for s in samples], samples=samples,
                     teacher_lp=teacher_lp, teacher_full=[None] * B, off_B=torch.zeros(B, dtype=torch.bool),
                     task_reward_B=torch.tensor([float(e.reward) for e in eps][:B]),
                     domain_ids_B=torch.zeros(B, dtype=torch.long), n_domains=1, pad_id=pad)
    m = res.mask_BT
    n_img = sum(sum(1 for t in s.completion_ids if t == img) for s in samples)
    return {"reverse_kl": float((res.kl_log_BT * m).sum() / m.sum()), "loss": float(res.loss),
            "student_tokens": int(m.sum()), "image_tokens": n_img,
            "transcript_tokens": sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples),
            "mismatch": float(((res.trainer_lp_BT - res.sampler_lp_BT).abs() * m).sum() / m.sum()),
            "reward": sum(e.reward for e in eps) / len(eps)}


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
    ap.add_argument("--n-train", type=int, default=4, help="episodes per MOPD step")
    ap.add_argument("--n-eval", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--grid", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--scripted", type=int, default=2, help="scripted revise episodes atop the grid")
    a = ap.parse_args(argv)
    from core.standins import build_standin
    from core.vision import load_model, load_processor
    from experts.frontend_loop.data import make_tasks
    from mopd.distill.config import LossConfig
    from rewards import frontend_loop as FL

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    student_path = a.student or build_standin("qwen2.5-vl", out / "student", seed=0)
    teacher_path = a.teacher or build_standin("qwen2.5-vl-teacher", out / "teacher", seed=1)
    proc = load_processor(student_path)
    FL.check_observation("screenshot", proc.tokenizer, proc)   # before any episode
    student, teacher = load_model(student_path), load_model(teacher_path).eval()
    t0 = time.time()
    res = {"student": str(student_path), "teacher": str(teacher_path), "max_turns": MAX_TURNS,
           "max_new_tokens": MAX_NEW, "seeds": a.seeds, "n_eval": a.n_eval}
    save = lambda: (out / "vl.json").write_text(json.dumps(res, indent=1))   # noqa: E731 (after each phase)
    res["teacher_eval"] = evaluate(teacher, proc, a.n_eval, a.seeds)
    save()
    res["student_before"] = evaluate(student, proc, a.n_eval, a.seeds)
    save()
    opt = torch.optim.AdamW(student.parameters(), lr=a.lr)
    loss_cfg = LossConfig()
    res["steps"] = []
    for k in range(a.steps):
        tasks = make_tasks("train", a.n_train, seed=100 + k)
        torch.manual_seed(k)
        res["steps"].append(mopd_step(student, teacher, proc, opt, tasks, [10_000 + 100 * k + i for i in
                                                                          range(a.n_train)], loss_cfg))
        print(json.dumps({"step": k, **res["steps"][-1]}), flush=True)
        save()
    student.eval()
    res["student_after"] = evaluate(student, proc, a.n_eval, a.seeds, shot_dir=out / "shots")
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
