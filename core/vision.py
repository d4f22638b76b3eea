"""Images in a transcript, for vision-language students and teachers (Qwen2.5-VL's layout).

An image observation is a message whose content is a list of items
(`{"type": "image", "image": path}`, `{"type": "text", "text": ...}`). The chat template
renders an image item as `<|vision_start|><|image_pad|><|vision_end|>`; the processor
repeats `<|image_pad|>` once per merged patch of that image (grid t*h*w / merge**2) and
makes its pixel values. So an image is tokens of the transcript like any observation
(masked: never in the loss), plus `Vision` (pixel values and grid) the forward needs.

A row's `Vision` holds its images in the order their pad tokens appear; a batch's is the
rows' concatenated in row order, which is the order a Qwen-VL forward scatters image
features into the pad positions (row-major). Every forward that reads a transcript with
images (the sampler's, the student's in the loss, the teacher's scoring) gets the same
`Vision` and the 3D (mrope) positions the model computes from the pad tokens and grids.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Vision:
    pixel_values: torch.Tensor     # [patches, C*T*P*P], all images of the row, in order
    image_grid_thw: torch.Tensor   # [images, 3]

    @property
    def n_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def cat_vision(parts) -> Vision | None:
    """The images of several rows (or observations) as one Vision, in order; None if none."""
    parts = [p for p in parts if p is not None and p.n_images]
    if not parts:
        return None
    return Vision(torch.cat([p.pixel_values for p in parts]), torch.cat([p.image_grid_thw for p in parts]))


@dataclass
class VisionProcessor:
    """What a transcript needs of a vision-language checkpoint: its tokenizer, its image
    processor and its image pad token. Made by `load_processor`."""
    tokenizer: object
    image_processor: object
    image_token: str = "<|image_pad|>"

    @property
    def image_token_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(self.image_token))

    @property
    def merge_size(self) -> int:
        return int(getattr(self.image_processor, "merge_size", 2))

    def images(self, paths: list) -> Vision:
        from PIL import Image

        imgs = [Image.open(p).convert("RGB") if isinstance(p, (str, Path)) else p for p in paths]
        out = self.image_processor(images=imgs, return_tensors="pt")
        return Vision(out["pixel_values"], out["image_grid_thw"].long())

    def expand(self, text: str, vision: Vision | None) -> str:
        """`text` with its i-th image pad repeated once per merged patch of image i."""
        if vision is None:
            return text
        parts = text.split(self.image_token)
        if len(parts) - 1 != vision.n_images:
            raise ValueError(f"{len(parts) - 1} image pad tokens in the text but {vision.n_images} images")
        m2 = self.merge_size ** 2
        out = parts[0]
        for g, rest in zip(vision.image_grid_thw.tolist(), parts[1:]):
            out += self.image_token * (g[0] * g[1] * g[2] // m2) + rest
        return out


def load_processor(path) -> VisionProcessor | None:
    """The checkpoint's VisionProcessor, or None for a text-only one (no preprocessor_config.json
    or no image pad token in its tokenizer)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    p = Path(str(path))
    if not (p / "preprocessor_config.json").exists():
        return None
    tok = AutoTokenizer.from_pretrained(str(p))
    proc = VisionProcessor(tok, AutoImageProcessor.from_pretrained(str(p)))
    if proc.tokenizer.convert_tokens_to_ids(proc.image_token) in (None, tok.unk_token_id):
        return None
    return proc


def image_paths(content) -> list:
    """The images of a message's content (a string has none)."""
    if isinstance(content, str):
        return []
    return [it.get("image") for it in content if isinstance(it, dict) and (it.get("type") == "image" or "image" in it)]


def _hf_model(model):
    """The transformers model inside DDP's and peft's wrappers (a LoRA student)."""
    m = getattr(model, "module", model)
    return m.get_base_model() if hasattr(m, "get_base_model") else m


def is_vision_model(model) -> bool:
    cfg = getattr(_hf_model(model), "config", None)
    return getattr(cfg, "vision_config", None) is not None


def model_class(config):
    """The transformers auto class of a config: the vision-language one when it has a vision
    tower, else the causal LM (AutoModelForCausalLM does not map Qwen-VL configs)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def is_vision_checkpoint(path) -> bool:
    """Whether the checkpoint folder at `path` is a vision-language model (its config.json
    has a vision tower), read from the file: no model, no transformers import."""
    import json

    f = Path(str(path)) / "config.json"
    try:
        return json.loads(f.read_text()).get("vision_config") is not None
    except (OSError, ValueError, AttributeError):
        return False


def load_model(path, dtype: torch.dtype = torch.float32):
    """A checkpoint's model, of its `model_class`."""
    from transformers import AutoConfig

    return model_class(AutoConfig.from_pretrained(str(path))).from_pretrained(str(path), dtype=dtype)


def copy_image_processor(src, dst) -> bool:
    """A vision-language checkpoint's image processor (preprocessor_config.json) from the
    folder `src` into `dst`, so a model saved there loads back with `load_processor`; False
    (nothing copied) for a text-only one."""
    import shutil

    f = Path(str(src)) / "preprocessor_config.json"
    if not f.exists():
        return False
    Path(str(dst)).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(f, Path(str(dst)) / f.name)
    return True


def forward_kwargs(model, input_ids: torch.Tensor, vision: Vision | None) -> dict:
    """The image inputs of a forward over `input_ids` (a batch whose rows' images are
    `vision`, concatenated in row order): pixel values, grids, and the token types the
    model derives its 3D positions from. Empty without images."""
    if vision is None:
        return {}
    m = _hf_model(model)
    image_id = int(m.config.image_token_id)
    n_pad = int((input_ids == image_id).sum())
    want = int(vision.image_grid_thw.prod(-1).sum()) // (int(m.config.vision_config.spatial_merge_size) ** 2)
    if n_pad != want:
        raise ValueError(f"the batch has {n_pad} image pad tokens but its images make {want} image features")
    dev = input_ids.device
    return {"pixel_values": vision.pixel_values.to(dev), "image_grid_thw": vision.image_grid_thw.to(dev),
            "mm_token_type_ids": (input_ids == image_id).int()}


def rope_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: Vision) -> torch.Tensor:
    """The 3D (mrope) positions [3, B, L] of a batch with images, as the model computes them."""
    m = _hf_model(model)
    kw = forward_kwargs(m, input_ids, vision)
    pos, _ = m.model.get_rope_index(input_ids, kw["mm_token_type_ids"], image_grid_thw=kw["image_grid_thw"],
                                    attention_mask=attention_mask)
    return pos
