"""`mopd distill` with a vision-language student and teacher (the Qwen2.5-VL stand-ins of
core/standins.py) on frontend_loop with screenshots: the loop's loaders take the VL class,
the student's processor reaches the episodes, the in-process teacher scores the student's
tokens with the same images in context, and the final model loads back as a VL model
with its image processor. Bad combinations are refused before any model loads: a
text-only teacher, a vLLM or server teacher for an image domain, the vLLM sampler for a
VL student."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from core.agent.transcript import image_observation_ids, prompt_ids
from core.rollout import Sample
from core.vision import Vision, load_model, load_processor
from rewards import frontend_loop as FL
from rewards.browser import SCREENSHOT_CLIP
from tests.conftest import mopd_in_process


def _recipe(root: Path, student, teacher, *, env: str = "make_screenshot_env", extra: str = "") -> Path:
    """root/run.yaml: 2 MOPD steps of frontend_loop (2 episodes a step, 2 turns of 12 tokens)."""
    from experts.frontend_loop.data import make_dataset

    rows = root / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": r["prompt"], "domain": r["domain"], "task": r["task"]})
                              for r in make_dataset("train", 4, seed=0)))
    cfg = root / "run.yaml"
    cfg.write_text(f"""
model: {{path: {student}}}
data: {{datasets: [{{path: {rows}}}], max_prompt_tokens: 256}}
teachers:
  frontend_loop: {{path: {teacher}, backend: hf}}
agents:
  frontend_loop:
    env: rewards.frontend_loop:{env}
    harnesses: recipes/harnesses/frontend_loop.yaml
    max_turns: 2
    max_context_tokens: 2048
    max_new_tokens: 12
rollout: {{backend: hf, temperature: 1.0, max_model_len: 2048}}
train: {{max_steps: 2, prompts_per_step: 2, lr: 1.0e-3}}
mlflow: {{experiment: vl}}
{extra}
""")
    return cfg


def _text_only_copy(src: Path, dst: Path) -> Path:
    """The checkpoint folder with its config.json's vision tower removed: what the checks see
    of a text-only teacher that shares the student's tokenizer (no model is loaded)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("vision_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.ci
def test_mopd_distill_trains_a_vl_student_from_a_vl_teacher_on_screenshots(standins, tmp_path, monkeypatch):
    """Two steps of `mopd distill` (the CLI, in process): the loss ran; images reached the
    student's sampler, the student's loss forward (with gradient) and the teacher's scoring
    (another model: the teacher stand-in is wider); no image pad and no observation token is
    in the mask the step weighed its loss with; the final model loads back as a VL model."""
    import core.vision as V
    import mopd.distill.trainer as T

    student, teacher = standins["qwen2.5-vl"], standins["qwen2.5-vl-teacher"]
    forwards = []   # (the model's text width, grad on, images) of every forward given images
    real_kwargs = V.forward_kwargs

    def spy(model, input_ids, vision):
        m = getattr(model, "module", model)
        forwards.append((m.config.text_config.hidden_size, torch.is_grad_enabled(), vision.n_images if vision else 0))
        return real_kwargs(model, input_ids, vision)
    monkeypatch.setattr(V, "forward_kwargs", spy)
    steps = []
    real_step = T.train_step

    def record(*a, **kw):
        res = real_step(*a, **kw)
        steps.append((kw["samples"], res))
        return res
    monkeypatch.setattr(T, "train_step", record)

    out = tmp_path / "run"
    r = mopd_in_process(["distill", "--config", str(_recipe(tmp_path, student, teacher)), "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    hist = json.loads((out / "history.json").read_text())
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    assert hist[0]["agent/env_errors/frontend_loop"] == 0.0

    s_width = json.loads((Path(student) / "config.json").read_text())["text_config"]["hidden_size"]
    t_width = json.loads((Path(teacher) / "config.json").read_text())["text_config"]["hidden_size"]
    assert s_width != t_width
    assert any(w == s_width and not g and n for w, g, n in forwards), "the sampler saw no image"
    assert any(w == s_width and g and n for w, g, n in forwards), "the student's loss forward saw no image"
    assert any(w == t_width and n for w, g, n in forwards), "the teacher scored without the images"

    img = load_processor(student).image_token_id
    n_images = 0
    for samples, res in steps:
        for j, s in enumerate(samples):
            mask = res.mask_BT[j, :len(s.completion_ids)].tolist()
            assert all(m == 0 for t, m in zip(s.completion_ids, mask) if t == img)
            # 1 exactly on the tokens the student wrote: observations (reports, images) at 0
            assert mask == [float(t >= 0) for t in s.turn_ids]
            n_images += sum(t == img for t in s.completion_ids)
    assert n_images > 0   # the transcripts held screenshots

    final = out / "final"
    assert type(load_model(final)).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert load_processor(final) is not None


def _image_sample(proc, tmp_path, color: str) -> Sample:
    """A transcript segment: system + user prompt, then an image observation, then 4 student tokens."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SCREENSHOT_CLIP["width"], SCREENSHOT_CLIP["height"]), "white")
    ImageDraw.Draw(im).rectangle((40, 40, 300, 120), fill=color)
    im.save(tmp_path / f"{color}.png")
    tok = proc.tokenizer
    prompt = prompt_ids(tok, [{"role": "user", "content": "Write a page."}])
    obs, vision = image_observation_ids(tok, proc, "user", [{"type": "image", "image": str(tmp_path / f"{color}.png")},
                                                            {"type": "text", "text": "The page."}])
    said = tok.encode("<div>", add_special_tokens=False)[:4]
    comp = said + obs + said
    return Sample(prompt_ids=prompt, completion_ids=comp, sampler_logprobs=[0.0] * len(comp), finished=False,
                  loss_mask=[1] * len(said) + [0] * len(obs) + [1] * len(said), vision=vision)


def test_the_teacher_router_scores_a_transcript_with_its_images(standins, tmp_path):
    """The in-process teacher (TeacherRouter over HFTeacher, as the loop loads it) scores the
    student's tokens with the row's images: other pixels under the same tokens give other
    log-probs (sampled tokens and whole distributions); a teacher that takes no images is
    refused for such rows, naming the fix."""
    from types import SimpleNamespace

    from teachers.routing import TeacherRouter
    from teachers.scoring import HFTeacher

    path = standins["qwen2.5-vl-teacher"]
    proc = load_processor(path)
    router = TeacherRouter({"t": HFTeacher(str(path), device="cpu")})
    s = _image_sample(proc, tmp_path, "teal")
    blank = Sample(**{**s.__dict__, "vision": Vision(torch.zeros_like(s.vision.pixel_values), s.vision.image_grid_thw)})
    rows = [SimpleNamespace(ids=s.prompt_ids, teacher_key="t")] * 2
    lp, full = [None, None], [None, None]
    router.score(rows, [s, blank], [0, 1], False, lp, full)
    assert len(lp[0]) == len(s.completion_ids)
    assert (torch.tensor(lp[0]) - torch.tensor(lp[1])).abs().max() > 1e-4
    router.score(rows, [s, blank], [0, 1], True, lp, full)
    assert full[0].shape[0] == len(s.completion_ids) and (full[0] - full[1]).abs().max() > 1e-4

    class TokensOnly:   # a vLLM or server teacher: token ids in, log-probs out
        path = "server"

        def score(self, prompts, completions):
            return [torch.zeros(len(c)) for c in completions]
    with pytest.raises(ValueError, match="cannot take images.*backend hf"):
        TeacherRouter({"t": TokensOnly()}).score(rows[:1], [s], [0], False, [None], [None])


@pytest.mark.usefixtures("no_model_loads")
def test_a_text_only_teacher_and_the_vllm_sampler_are_refused_before_any_model_loads(standins, tmp_path):
    """A text-only teacher for the screenshots and the vLLM sampler for the VL student are both
    named (the fix with each) by `mopd distill` before any model loads; with the render report
    (no images) the text-only teacher is fine (and the run's own test passes the VL pair)."""
    student = standins["qwen2.5-vl"]
    text_teacher = _text_only_copy(standins["qwen2.5-vl-teacher"], tmp_path / "text_teacher")
    cfg = _recipe(tmp_path, student, text_teacher, extra="")
    cfg.write_text(cfg.read_text().replace("rollout: {backend: hf,", "rollout: {backend: vllm,"))
    r = mopd_in_process(["distill", "--config", str(cfg), "--out", str(tmp_path / "run")])
    assert r.returncode != 0
    err = r.stderr
    assert "teachers.frontend_loop" in err and "text-only model" in err and "vision-language teacher" in err, err
    assert "rollout.backend=vllm" in err and "is a vision-language model" in err and "rollout.backend=hf" in err
    cfg = _recipe(tmp_path, student, text_teacher, env="make_env")
    r = mopd_in_process(["distill", "--dry-run", "--config", str(cfg), "--out", str(tmp_path / "report")])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.usefixtures("no_model_loads")
def test_a_vllm_teacher_for_screenshots_is_refused_naming_the_in_process_one(standins, tmp_path):
    cfg = _recipe(tmp_path, standins["qwen2.5-vl"], standins["qwen2.5-vl-teacher"])
    cfg.write_text(cfg.read_text().replace("backend: hf}", "backend: vllm}"))
    r = mopd_in_process(["distill", "--dry-run", "--config", str(cfg), "--out", str(tmp_path / "run")])
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "takes token ids only" in out and "teachers.frontend_loop.backend=hf" in out, out[-2000:]
    assert "rollout.backend" not in out and "text-only" not in out   # the VL pair and the HF sampler pass


def test_a_lora_qat_vl_student_samples_and_scores_with_images(standins, tmp_path):
    """The loop's student loader (build_student) with LoRA and QAT on the VL stand-in: the
    HF sampler's 3D positions and the loss forward reach the model inside peft's wrapper,
    and the loss forward reads the pixels."""
    from core.models import build_student, collate, completion_logprobs
    from core.quant import QuantConfig
    from core.rollout import HFRollout
    from mopd.distill.config import LoraConfig

    path = standins["qwen2.5-vl"]
    proc = load_processor(path)
    model = build_student(str(path), lora=LoraConfig(enabled=True, r=4, alpha=8),
                          quant=QuantConfig(enabled=True, group_size=32))
    s = _image_sample(proc, tmp_path, "teal")
    smp = HFRollout(model, proc.tokenizer).generate([s.prompt_ids + s.completion_ids], max_new_tokens=3,
                                                    seeds=[0], vision=[s.vision])[0]
    assert len(smp.completion_ids) >= 1
    blank = Vision(torch.zeros_like(s.vision.pixel_values), s.vision.image_grid_thw)
    with torch.no_grad():
        lp = [completion_logprobs(model, collate([s.prompt_ids], [s.completion_ids], 0, {}, vision=[v]))[0]
              for v in (s.vision, blank)]
    assert torch.isfinite(lp[0]).all() and (lp[0] - lp[1]).abs().max() > 1e-4


def test_export_of_a_vl_model_carries_its_image_processor_or_refuses(standins, tmp_path):
    """`core.export.export_model` (the expert stages' and the loop's final export): a VL model
    gets its image processor from the folder it was loaded from (or `source=`), so the
    export loads back with `load_processor`; without one anywhere, a clear error and no
    checkpoint, not a model that cannot read its images."""
    from core.export import export_model

    path = standins["qwen2.5-vl"]
    model, tok = load_model(path), load_processor(path).tokenizer
    export_model(model, tok, tmp_path / "out")
    assert load_processor(tmp_path / "out").image_processor is not None
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    (bare / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match="no image processor.*pass source="):
        export_model(load_model(bare), tok, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    export_model(load_model(bare), tok, tmp_path / "out3", source=path)
    assert (tmp_path / "out3" / "preprocessor_config.json").exists()
