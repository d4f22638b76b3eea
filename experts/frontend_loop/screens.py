"""The frontend_loop expert's environment setting (`agent.env` of an expert recipe, as a
MOPD recipe's `agents.frontend_loop.env`) and the SFT rows it gives.

Empty, the stages play the render report (rewards.frontend_loop:make_env), as before.
`rewards.frontend_loop:make_screenshot_env` makes every stage a vision-language model's:
the SFT's scripted episodes are played in it (each page rendered in Chromium, the
observation the viewport PNG as an image message) and encoded with the model's processor
as the episode runner encodes them (each `<|image_pad|>` repeated once per merged patch,
masked like any observation), each row carrying its images' pixel values (core.vision.Vision)
for the training forward; the held-out eval plays its episodes there with the processor
(evals/frontend_loop.py). The RL stage refuses it (experts/run.py: its episodes carry no
images yet); a text-only model is refused before any episode (the factory's preflight).
"""
from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

from rewards.frontend_loop import make_env


def env_factory(cfg):
    """The environment factory `agent.env` names (experts/run.py checked it), else the render
    report's."""
    ref = getattr(getattr(cfg, "agent", None), "env", "") or ""
    if not ref:
        return make_env
    from mopd.distill.agents import _import_factory

    return _import_factory(ref, "agent.env")


def sft_rows(trainer, cfg, tokenizer, train_ds, prerendered, timeout_s: float) -> list[tuple]:
    """The SFT rows of `trainer` (a LoopExpert) in the recipe's environment, every page
    rendered concurrently first (`prerendered`). Screenshots: each episode keeps its pages in
    a folder of its own, numbered alike in the dry and the real pass (the cache's key), and
    the rows carry the images, read while the folders exist."""
    from experts.agent_expert import AgentExpert

    factory = env_factory(cfg)
    if not getattr(factory, "observes_images", False):   # the text rows, exactly as before
        with prerendered(lambda: AgentExpert.sft_transcripts(trainer, cfg, tokenizer, train_ds), timeout_s=timeout_s):
            return AgentExpert.sft_transcripts(trainer, cfg, tokenizer, train_ds)
    processor = vision_processor(cfg)
    with tempfile.TemporaryDirectory(prefix="mopd-frontend-loop-sft-") as tmp:
        def rows():
            n = itertools.count()

            def oracle(task, hc, *, perturb, rng):
                return trainer.oracle_messages(task, hc, perturb=perturb, rng=rng, factory=factory,
                                               shot_dir=str(Path(tmp) / str(next(n))))
            return AgentExpert.sft_transcripts(trainer, cfg, tokenizer, train_ds, oracle=oracle, processor=processor)
        with prerendered(rows, timeout_s=timeout_s):
            return rows()


def vision_processor(cfg):
    """The model's core.vision.VisionProcessor (model.path's; the preflight made sure it has one)."""
    from core.vision import load_processor
    from experts.run import resolve_model

    proc = load_processor(resolve_model(cfg.model.path))
    if proc is None:
        raise ValueError(f"agent.env={cfg.agent.env!r}: model.path {cfg.model.path} has no image processor "
                         f"(preprocessor_config.json) or image token; screenshots need a vision-language model")
    return proc
