"""The `unitconv` domain: convert a quantity between units ("Convert 7 km to m." ->
"7000"), checked numerically. One object, DOMAIN, registered in pyproject.toml's
`mopd.domains` entry points; mopd finds its data, reward, eval and recipes through it."""
from __future__ import annotations

from pathlib import Path

from core.domain import Domain

HERE = Path(__file__).resolve().parent

DOMAIN = Domain(
    name="unitconv",
    data="mopd_unitconv.data",
    reward="mopd_unitconv.reward:reward",
    eval="mopd_unitconv.evaluate:evaluate",
    recipes=str(HERE / "recipes"),
    mix_weight=1.0,
    description="unit conversion (km->m, kg->g, h->min, ...), the answer checked numerically",
)
