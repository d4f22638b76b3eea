"""The frontend_loop expert stages for a vision-language model (`agent.env:
rewards.frontend_loop:make_screenshot_env` in the expert recipe,
recipes/opt_in/frontend_loop/vl/sft.yaml): the SFT's scripted episodes are played in the
screenshot environment (real Chromium), their rows carry the images, and the SFT step
(core.agent.sft.train_on_transcripts, what the stage runs) forwards them; image tokens and
observations never in the loss. Bad input (screenshots for a text-only model, agent.env
for a domain or stage that cannot take it) is refused before any model loads or page
renders."""
from __future__ import annotations

import pytest
import torch

from core.agent.sft import train_on_transcripts
from core.agent.transcript import assistant_ids
from core.config import load_config
from core.vision import load_model, load_processor
from experts.frontend_loop import data as FLD
from experts.run import ExpertConfig
from tests.conftest import mopd_in_process

RECIPE = "recipes/opt_in/frontend_loop/vl/sft.yaml"
TEXT_RECIPE = "recipes/opt_in/frontend_loop/sft.yaml"


def _cfg(model, *over):
    return load_config(ExpertConfig, RECIPE, [f"model.path={model}", "data.n_train=3", "agent.perturb=1.0",
                                              "train.num_threads=1", *over])


@pytest.fixture(scope="module")
def vl_rows(standins):
    """The SFT rows of 3 perturbed scripted episodes through the screenshot env, and the same
    episodes' rows through the render report (same model, same draws): (rows, text_rows, cfg)."""
    path = standins["qwen2.5-vl"]
    cfg = _cfg(path)
    tok = load_processor(path).tokenizer
    train_ds = FLD.make_dataset("train", 3, seed=0)
    rows = FLD.TRAINER.sft_transcripts(cfg, tok, train_ds)
    text_rows = FLD.TRAINER.sft_transcripts(_cfg(path, "agent.env="), tok, train_ds)
    return rows, text_rows, cfg, tok


@pytest.mark.ci   # Chromium renders both kinds of episode (~40 s on two busy cores)
def test_vl_sft_rows_mask_every_image_and_observation_token(vl_rows):
    """(prompt, completion, mask, Vision) rows: every image pad at mask 0, mask 1 exactly on
    the tokens of the assistant's target turns (the same as the text rows', whose targets
    are the same scripted pages), pads = the images' merged patches."""
    rows, text_rows, cfg, tok = vl_rows
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert len(rows) == len(text_rows) and all(len(r) == 4 for r in rows)
    n_images = 0
    for (p, c, m, v), (tp, tc, tm) in zip(rows, text_rows):
        ids = p + c
        full_mask = [0] * len(p) + m
        n_pad = sum(t == pad for t in ids)
        if v is None:
            assert n_pad == 0
            continue
        n_images += v.n_images
        assert n_pad == int(v.image_grid_thw.prod(-1).sum()) // 4 > 0   # merge 2 x 2
        assert v.pixel_values.shape[0] == int(v.image_grid_thw.prod(-1).sum())
        assert all(mk == 0 for t, mk in zip(ids, full_mask) if t == pad)
        # the tokens under mask 1: the target turns, as in the text rows (observations differ)
        target = [t for t, mk in zip(c, m) if mk]
        assert target == [t for t, mk in zip(tc, tm) if mk] and target
        # the last target is a whole assistant turn (its EOS)
        eos = assistant_ids(tok, "")[-1]
        assert target[-1] == eos
    assert n_images >= 3   # every perturbed episode saw at least one screenshot


@pytest.mark.ci
def test_the_sft_step_reads_the_pixels(vl_rows, standins):
    """train_on_transcripts (the stage's step) on the same tokens with other pixels gives
    another loss: the images reach the forward."""
    rows, _, _, tok = vl_rows
    rows = [r for r in rows if r[3] is not None][:2]
    model = load_model(standins["qwen2.5-vl"])

    def loss(rs):
        return train_on_transcripts(model, rs, pad_id=tok.pad_token_id, steps=1, lr=0.0, batch_size=len(rs),
                                    grad_clip=0.0)[0]
    a = loss(rows)
    assert loss(rows) == pytest.approx(a, abs=1e-6)   # lr 0: the model did not change
    other = []
    for p, c, m, v in rows:
        v2 = type(v)(torch.flip(v.pixel_values, dims=[0]) * -1.0, v.image_grid_thw)
        other.append((p, c, m, v2))
    assert abs(loss(other) - a) > 1e-5


def test_screenshots_for_a_text_only_model_are_refused_before_anything_runs(tmp_path, tiny_student_dir,
                                                                          no_model_loads, monkeypatch):
    """`mopd expert` with agent.env screenshots and a text-only model: one error naming the
    fix, before any model load or page render."""
    import rewards.browser as browser

    def no_render(*a, **kw):
        raise AssertionError("a page was rendered before the input checks ended")
    monkeypatch.setattr(browser, "get_pool", no_render)
    r = mopd_in_process(["expert", "--config", RECIPE, "--out", str(tmp_path / "x"),
                         f"model.path={tiny_student_dir}"])
    assert r.returncode != 0, r.stdout + r.stderr
    err = r.stderr
    assert "agent.env='rewards.frontend_loop:make_screenshot_env'" in err and "text-only" in err, err
    assert "rewards.frontend_loop:make_env" in err and "leave agent.env empty" in err and "AssertionError" not in err


@pytest.mark.parametrize("case", ["other domain", "rl stage"])
def test_agent_env_is_refused_where_a_stage_cannot_take_it(tmp_path, standins, no_model_loads, case):
    """agent.env for a domain whose stages build their own environment, and screenshots for
    the rl stage (its episodes pass no images): refused with the reason, before any model."""
    if case == "other domain":
        argv = ["expert", "--config", "recipes/experts/frontend/sft.yaml", f"model.path={standins['qwen2.5-vl']}",
                "agent.env=rewards.frontend_loop:make_screenshot_env"]
        want = "cannot take another"
    else:
        argv = ["expert", "--config", RECIPE, "stage=rl", f"model.path={standins['qwen2.5-vl']}"]
        want = "rl stage's episodes"
    r = mopd_in_process([argv[0], *argv[1:3], "--out", str(tmp_path / "x"), *argv[3:]])
    assert r.returncode != 0 and want in r.stderr, r.stdout + r.stderr


def test_the_held_out_eval_plays_in_the_recipes_environment_with_the_processor(standins, tiny_student_dir,
                                                                              monkeypatch):
    """The expert stage's eval (evals.frontend_loop.evaluate with the recipe's agent.env, as
    pipeline/expert.py passes it): screenshot environments and the model's processor reach
    the episode runner; a text-only model is refused before it loads."""
    from evals import agent as agent_eval
    from evals import frontend_loop as ev

    seen = {}

    def spy(model, tok, tasks, harness_cfgs, *, make_env, processor=None, **kw):
        env = make_env(harness_cfgs[0])
        seen.update(observation=env.observation, processor=processor)
        return []
    monkeypatch.setattr(agent_eval, "run_tasks", spy)
    ev.evaluate(str(standins["qwen2.5-vl"]), n=1, env="rewards.frontend_loop:make_screenshot_env")
    assert seen["observation"] == "screenshot" and seen["processor"] is not None
    assert seen["processor"].image_processor is not None
    ev.evaluate(str(standins["qwen2.5-vl"]), n=1)
    assert seen["observation"] == "report" and seen["processor"] is None
    with pytest.raises(ValueError, match="text-only"):
        ev.evaluate(str(tiny_student_dir), n=1, env="rewards.frontend_loop:make_screenshot_env")
