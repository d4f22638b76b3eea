"""The frontend_loop vision arm on the Qwen2.5-VL stand-in (core/standins.py): screenshots
are image observations, and no image token and no observation token is ever in the loss
mask, through the code users run: the episode runner with the student's processor, then
mopd.distill.agents.segment_rows, then train_step (whose mask weighs the loss); the
teacher scores the student's tokens with the same images in context. Bad input (a
screenshot over the student's image budget, screenshots for a text student) is refused
by the MOPD loop's agent checks before any episode or model load.

Two environments: one whose observation is a PNG drawn here (no browser), and the real one
(Chromium screenshots); the episodes are the second tier's (minutes on two busy cores)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from core.agent.episode import run_episodes
from core.agent.transcript import image_observation_ids, observation_ids
from core.models import collate, completion_logprobs, pad_id_of
from core.rollout import HFRollout, eos_ids
from core.vision import Vision, load_model, load_processor
from rewards import frontend_loop as FL
from rewards.browser import SCREENSHOT_CLIP

RECIPE = "recipes/opt_in/frontend_loop/mopd.yaml"


@pytest.fixture(scope="module")
def vl(standins):
    path = standins["qwen2.5-vl"]
    return path, load_processor(path), load_model(path)


class DrawnPageEnv:
    """Answers every turn with one PNG of the screenshot's size (drawn, no browser), as the
    screenshot environment does; the episode ends after `max_turns`."""

    def __init__(self, png, max_turns=3):
        self.png, self.max_turns = png, max_turns
        self.harness = FL.PageHarness(FL.harness_config("page_plain"))

    def reset(self, task):
        self.turn = 0
        self.messages = [{"role": "system", "content": self.harness.system_prompt()},
                         {"role": "user", "content": task["user"]}]
        return task["user"]

    def step(self, text):
        self.turn += 1
        if self.turn >= self.max_turns:
            return "", True, {"reward": 0.0, "obs_role": "user"}
        return [{"type": "image", "image": self.png}, {"type": "text", "text": "The rendered page."}], False, \
            {"obs_role": "user"}


def _png(tmp_path):
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SCREENSHOT_CLIP["width"], SCREENSHOT_CLIP["height"]), "white")
    ImageDraw.Draw(im).rectangle((40, 40, 300, 120), fill="teal")
    p = tmp_path / "page.png"
    im.save(p)
    return str(p)


def _play(model, proc, envs, tasks, max_new_tokens=12):
    torch.manual_seed(0)
    return run_episodes(HFRollout(model, proc.tokenizer, batch_size=4), proc.tokenizer, envs, tasks,
                        seeds=list(range(1, len(tasks) + 1)), temperature=1.0, top_p=1.0, max_turns=3,
                        max_context_tokens=2048, max_new_tokens=max_new_tokens, eos_ids=eos_ids(proc.tokenizer),
                        processor=proc)


def _check_no_image_or_observation_token_in_the_loss(model, proc, eps, teacher=None):
    """segment_rows -> train_step: the mask that weighs the loss is 0 on every image pad and
    on each observation's tokens, 1 on exactly the student's; the sampler's log-probs are the
    trainer's (same images, same 3D positions); the teacher's scoring reads the images."""
    from types import SimpleNamespace

    from mopd.distill.agents import segment_rows
    from mopd.distill.data import Prompt
    from mopd.distill.config import LossConfig
    from mopd.distill.step import SingleProcess, train_step

    tok, img = proc.tokenizer, proc.image_token_id
    rows = [Prompt(i, FL.DOMAIN, FL.DOMAIN, [], [0], {}) for i in range(len(eps))]
    _r, _s, _o, samples, ep_of = segment_rows(rows, [0] * len(eps), [False] * len(eps), [None] * len(eps),
                                              list(range(len(eps))), eps)
    pad, B = pad_id_of(tok), len(samples)
    teacher = teacher or model
    with torch.no_grad():
        batches = [collate([s.prompt_ids], [s.completion_ids], pad, {}, token_mask=[s.loss_mask], vision=[s.vision])
                   for s in samples]
        teacher_lp = [completion_logprobs(teacher, b)[0].tolist() for b in batches]
        own_lp = [completion_logprobs(model, b)[0] for b in batches]
    n_images = 0
    for j, s in enumerate(samples):
        n = len(s.completion_ids)
        student = [k for k in range(n) if s.loss_mask[k]]
        assert sum(s.loss_mask) == sum(1 for t in s.turn_ids if t >= 0)
        assert max(abs(float(own_lp[j][k]) - s.sampler_logprobs[k]) for k in student) < 1e-4
        pads = [k for k in range(n) if s.completion_ids[k] == img]
        assert not any(s.loss_mask[k] for k in pads)
        # a page that hung the renderer on the first turn leaves an episode without images
        assert len(pads) == (int(s.vision.image_grid_thw.prod(-1).sum()) // proc.merge_size ** 2 if s.vision else 0)
        n_images += s.vision.n_images if s.vision else 0
        for m in eps[ep_of[j]].messages[2:]:   # every observation's tokens, at masked positions
            if m["role"] == "assistant":
                continue
            obs = observation_ids(tok, m["role"], m["content"]) if isinstance(m["content"], str) else \
                image_observation_ids(tok, proc, m["role"], m["content"])[0]
            at = [k for k in range(n - len(obs) + 1) if s.completion_ids[k:k + len(obs)] == obs]
            assert at and not any(s.loss_mask[k] for k in range(at[0], at[0] + len(obs)))
    # other pixels under the same tokens change the teacher's scores: the images are in its context
    with torch.no_grad():
        j, s = next((j, s) for j, s in enumerate(samples) if s.vision is not None)
        blank = Vision(torch.zeros_like(s.vision.pixel_values), s.vision.image_grid_thw)
        other = collate([s.prompt_ids], [s.completion_ids], pad, {}, token_mask=[s.loss_mask], vision=[blank])
        assert (completion_logprobs(teacher, other)[0] - torch.tensor(teacher_lp[j])).abs().max() > 1e-4
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    res = train_step(SingleProcess(), model, opt, SimpleNamespace(step=lambda: None), loss_cfg=LossConfig(),
                     grad_clip=0.0, prompt_ids=[s.prompt_ids for s in samples], samples=samples,
                     teacher_lp=teacher_lp, teacher_full=[None] * B, off_B=torch.zeros(B, dtype=torch.bool),
                     task_reward_B=torch.zeros(B), domain_ids_B=torch.zeros(B, dtype=torch.long), n_domains=1,
                     pad_id=pad)
    assert torch.isfinite(res.loss)
    for j, s in enumerate(samples):   # the mask the step weighed its loss with
        assert res.mask_BT[j, :len(s.completion_ids)].tolist() == [float(k) for k in s.loss_mask]
    return n_images


def test_vl_standin_carries_image_tokens_and_its_image_budget(vl):
    path, proc, model = vl
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    tok = proc.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image", "image": "x.png"},
                                                                 {"type": "text", "text": "hi"}]}], tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>hi" in text
    assert FL.image_budget(proc) >= SCREENSHOT_CLIP["width"] * SCREENSHOT_CLIP["height"]
    assert model.config.image_token_id == proc.image_token_id
    FL.check_observation("screenshot", tok, proc)


# minutes on two busy cores (a forward over ~700 image tokens per turn): the second tier
@pytest.mark.ci
def test_no_image_token_and_no_observation_token_is_in_the_loss(vl, tmp_path):
    _path, proc, model = vl
    tasks = [{"id": f"t{i}", "user": "Make a page with a teal box."} for i in range(2)]
    eps = _play(model, proc, [DrawnPageEnv(_png(tmp_path)) for _ in tasks], tasks)
    assert all(e.turns == 3 and e.env_error is None for e in eps)
    assert _check_no_image_or_observation_token_in_the_loss(model, proc, eps) == 4   # 2 episodes x 2 screenshots


def test_an_image_observation_for_a_text_student_fails_its_episode_with_the_fix(tiny_tokenizer, student_hf, tmp_path):
    env = DrawnPageEnv(_png(tmp_path))
    ep = run_episodes(HFRollout(student_hf, tiny_tokenizer), tiny_tokenizer, [env], [{"id": "t", "user": "page"}],
                      seeds=[0], temperature=1.0, top_p=1.0, max_turns=3, max_context_tokens=1024, max_new_tokens=4,
                      eos_ids=eos_ids(tiny_tokenizer))[0]
    assert "text-only" in ep.env_error and "make_env" in ep.env_error


def test_the_mopd_loop_refuses_a_screenshot_over_the_students_image_budget(standins, tmp_path, no_model_loads):
    from core.config import ConfigError, load_config
    from mopd.distill.agents import load_agents
    from mopd.distill.config import DistillConfig

    small = tmp_path / "vl-small-budget"
    shutil.copytree(standins["qwen2.5-vl"], small)
    pre = json.loads((small / "preprocessor_config.json").read_text())
    pre["size"]["longest_edge"] = 100_000
    (small / "preprocessor_config.json").write_text(json.dumps(pre))
    env = "agents.frontend_loop.env=rewards.frontend_loop:make_screenshot_env"
    for path, ok in ((standins["qwen2.5-vl"], True), (small, False)):
        cfg = load_config(DistillConfig, RECIPE, [env, f"model.path={path}"])
        tok = load_processor(path).tokenizer
        if ok:
            assert load_agents(cfg, tok)["frontend_loop"].factory is FL.make_screenshot_env
            continue
        with pytest.raises(ConfigError, match=r"agents.frontend_loop: .*256000 pixels, over the student's image "
                                              r"budget of 100000 .*size.longest_edge.*raise it to at least 256000"):
            load_agents(cfg, tok)


@pytest.mark.ci
def test_screenshot_episodes_put_no_image_token_in_the_loss_and_the_teacher_sees_the_pages(vl, standins, tmp_path):
    from experts.frontend_loop.data import make_tasks

    _path, proc, model = vl
    teacher = load_model(standins["qwen2.5-vl-teacher"]).eval()
    tasks = make_tasks("test", 2, seed=0)
    # the screenshots kept (shot_dir): the check re-encodes each observation after the episodes closed
    envs = [FL.make_screenshot_env(FL.harness_config("page_plain"), max_turns=3, timeout_s=30,
                                   shot_dir=str(tmp_path / f"e{i}")) for i in range(len(tasks))]
    eps = _play(model, proc, envs, tasks, max_new_tokens=16)
    assert all(e.env_error is None for e in eps)
    assert all(len(env.scores) == e.turns for env, e in zip(envs, eps))
    assert _check_no_image_or_observation_token_in_the_loss(model, proc, eps, teacher) >= 2
