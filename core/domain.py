"""What a domain is: one object naming its data, reward, eval, recipes and, for agent
domains, its environment, harness mix and trainer.

A team's package exposes one `Domain` and registers it in the `mopd.domains` entry-point
group (its pyproject.toml: `[project.entry-points."mopd.domains"] units = "pkg:DOMAIN"`),
or a recipe names it as a `module:attribute` path; the built-in domains are registered the
same way (experts/domains.py). experts/registry.py finds them all.

The pieces are `module:attribute` references, imported only by whoever uses them: the
experts import the data and the reward, evals/run.py the eval, the MOPD loop the
environment. So this type sits at the bottom layer, a domain's object imports nothing
heavy, and no layer imports one above it to reach a piece (the built-in math eval lives in
evals/, a layer above the registry in experts/, which never imports it).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Domain:
    """One domain. `name` is the one string that names it everywhere (recipes, the rows'
    `domain` column, MLflow tags, metric keys)."""
    name: str
    # module with make_dataset(split, n, seed, difficulty[, effort]) -> rows (prompt, completion, domain and
    # the reward's columns); optional: EFFORTS, DATASETS {name: loader}, pretrain_rows(n, seed), corrupt(row,
    # reference, rng) for `mopd rewards check`, MULTI_TURN, TRAINER
    data: str
    reward: str            # "module:function", TRL's signature: reward(prompts, completions, **columns)
    eval: str              # "module:function": evaluate(model, *, n, seed, difficulty, max_new_tokens, ...)
    recipes: str           # folder with sft.yaml and rl.yaml (or sft-<effort>.yaml, rl-<effort>.yaml)
    environment: str | None = None   # agent domains: "module:function" make_env(harness_cfg, memory)
    harnesses: str | None = None     # agent domains: the harness-mix YAML its recipes' agent.harnesses name
    trainer: str | None = None       # "module:attribute" with train_sft and train_rl (else the data module's
    #                                  TRAINER, else TRL's SFT and GRPO trainers)
    mix_weight: float | None = None  # its weight in the MOPD prompt stream when the recipe's data.mix has none
    description: str = ""

    def __post_init__(self):
        if not self.name or not self.name.replace("_", "").isalnum() or not self.name[0].isalpha():
            raise ValueError(f"Domain name {self.name!r}: letters, digits and _ only, starting with a letter "
                             f"(it names folders, columns and metric keys)")
        if not self.data or ":" in self.data:
            raise ValueError(f"Domain {self.name!r}: data={self.data!r} must be a module path (pkg.data)")
        for field in ("reward", "eval", "environment", "trainer"):
            ref = getattr(self, field)
            if ref is not None and not is_ref(ref):
                raise ValueError(f"Domain {self.name!r}: {field}={ref!r} must be 'package.module:attribute'")
        if self.mix_weight is not None and not self.mix_weight > 0:
            raise ValueError(f"Domain {self.name!r}: mix_weight must be > 0, got {self.mix_weight}")

    @property
    def recipes_dir(self) -> Path:
        return Path(self.recipes)


def is_ref(text: str) -> bool:
    """'package.module:attribute'."""
    mod, sep, attr = text.partition(":")
    return bool(sep and mod and attr) and " " not in text


def load_ref(ref: str, what: str) -> Any:
    """The attribute a 'module:attribute' reference names; a ValueError naming `what` and
    the reference when the module or the attribute is missing (an error inside an existing
    module is raised as it is: it is the module's bug, shown with its traceback)."""
    mod, _, attr = ref.partition(":")
    try:
        m = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name and (mod == e.name or mod.startswith(e.name + ".")):
            raise ValueError(f"{what}: module {mod!r} of {ref!r} is not importable (no module {e.name!r})") from None
        raise
    obj = m
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: {mod} has no attribute {attr!r} (from {ref!r})")
        obj = getattr(obj, part)
    return obj
