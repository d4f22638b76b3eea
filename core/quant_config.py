"""The `quant:` section of a recipe and the INT4 grids and FP4 formats it names, apart from core/quant.py
(which imports torch) so that a config loads, and its errors show, before torch does."""
from __future__ import annotations

from dataclasses import dataclass, field

# convention -> (divisor of max|w| per group, lowest code, highest code)
CONVENTIONS: dict[str, tuple[float, float, float]] = {
    "llm-compressor": (7.5, -8.0, 7.0),
    "kimi": (7.0, -7.0, 7.0),
}
# FP4 format -> the one block size (weights per scale) it has (core/fp4.py)
FP4_BLOCK: dict[str, int] = {"nvfp4": 16, "mxfp4": 32}
FORMATS = ("int4", *FP4_BLOCK)


@dataclass
class QuantConfig:
    """`quant:` section of a recipe. `ignore` holds module-name patterns: an exact name,
    a dotted suffix (``lm_head`` matches ``base_model.model.lm_head``) or ``re:<regex>``
    (``re.match``, as in compressed-tensors)."""

    enabled: bool = field(default=False, metadata={
        "help": "train with fake-quantized Linear layers (quant.format: INT4, NVFP4 or MXFP4 weights) and a "
                "straight-through gradient"})
    bits: int = field(default=4, metadata={"help": "weight bits (4 only)"})
    format: str = field(default="int4", metadata={
        "help": "int4 (group-wise symmetric, its grid in `convention`), nvfp4 (E2M1, an FP8 scale per "
                "16 and an FP32 one per tensor; group_size: 16) or mxfp4 (E2M1, a power-of-two "
                "scale per 32; group_size: 32); weights only (A16)"})
    group_size: int = field(default=128, metadata={"help": "weights per quantization group (scale per group)"})
    convention: str = field(default="llm-compressor", metadata={
        "help": "the int4 grid: llm-compressor (scale max|w|/7.5, codes [-8, 7]) or kimi (max|w|/7, codes [-7, 7])"})
    ignore: list[str] = field(default_factory=lambda: ["lm_head"], metadata={
        "help": "modules left unquantized: an exact name, a dotted suffix, or re:<regex>"})

    @property
    def grid(self) -> str:
        """What core.quant's functions take as `convention`: the int4 convention, or the FP4
        format's name."""
        return self.convention if self.format == "int4" else self.format

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.bits != 4:
            raise ValueError(f"quant.bits={self.bits!r}: only 4-bit (W4A16) is supported")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or self.group_size <= 0:
            raise ValueError(f"quant.group_size={self.group_size!r}: must be a positive int "
                             "(32 and 128 are the usual choices)")
        if self.format not in FORMATS:
            raise ValueError(f"quant.format={self.format!r}: expected one of {list(FORMATS)}")
        if self.format in FP4_BLOCK:
            block = FP4_BLOCK[self.format]
            if self.group_size != block:
                raise ValueError(f"quant.group_size={self.group_size}: {self.format} has one scale per "
                                 f"{block} weights; set quant.group_size: {block} (or quant.format: int4)")
            if self.convention != "llm-compressor":
                raise ValueError(f"quant.convention={self.convention!r} is an int4 grid; remove it with "
                                 f"quant.format: {self.format}")
        if self.convention not in CONVENTIONS:
            raise ValueError(f"quant.convention={self.convention!r}: expected one of "
                             f"{sorted(CONVENTIONS)}")
        if isinstance(self.ignore, str) or not all(isinstance(p, str) for p in self.ignore):
            raise ValueError(f"quant.ignore={self.ignore!r}: expected a list of name patterns")
