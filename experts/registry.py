"""The one domain registry: which domains exist, their reasoning efforts, their teacher
keys, their expert recipes, and their data and reward modules.

A domain exists when it has a recipe folder `recipes/experts/<domain>/`; its pieces are
found by name (see experts/README.md):

    experts/<domain>/data.py   make_dataset(split, n, seed, difficulty, effort), EFFORTS, ...
                               (agent domains: MULTI_TURN, TRAINER)
    rewards/<domain>.py        reward(prompts, completions, **columns)

(The held-out suite `evals/<domain>.py` sits a layer above and is found by evals/run.py.)
A missing piece is a ValueError naming the file, never a bare ModuleNotFoundError.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes" / "experts"
PIECES = "every domain needs experts/<d>/data.py, rewards/<d>.py and evals/<d>.py"


def all_domains(recipes_dir: str | Path = RECIPES) -> list[str]:
    """Domains with a recipe folder under `recipes_dir` (default recipes/experts/), sorted."""
    root = Path(recipes_dir)
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


def import_piece(domain: str, module: str, file: str) -> ModuleType:
    """`module` of `domain`, or a ValueError naming `file` when it does not exist (an
    import error inside an existing file is raised as is)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise ValueError(f"domain {domain!r}: {file} is missing ({PIECES})") from None
        raise


def data_module(domain: str) -> ModuleType:
    """experts.<domain>.data, checked to define make_dataset."""
    data = import_piece(domain, f"experts.{domain}.data", f"experts/{domain}/data.py")
    if not hasattr(data, "make_dataset"):
        raise ValueError(f"domain {domain!r}: experts/{domain}/data.py defines no `make_dataset`")
    return data


def reward_function(domain: str) -> Callable:
    """rewards.<domain>.reward (TRL's signature)."""
    mod = import_piece(domain, f"rewards.{domain}", f"rewards/{domain}.py")
    if not hasattr(mod, "reward"):
        raise ValueError(f"domain {domain!r}: rewards/{domain}.py defines no `reward` function")
    return mod.reward


def is_agent_domain(domain: str) -> bool:
    """A domain played as multi-turn episodes (its data module says MULTI_TURN = True)."""
    return bool(getattr(data_module(domain), "MULTI_TURN", False))


def domain_trainer(domain: str):
    """The data module's `TRAINER` (an experts.agent_expert.AgentExpert, or anything with
    `train_sft` and `train_rl`) when the domain trains with its own loop (agent episodes),
    else None (TRL's SFT and GRPO trainers in experts/run.py)."""
    trainer = getattr(data_module(domain), "TRAINER", None)
    if trainer is None:
        return None
    for fn in ("train_sft", "train_rl"):
        if not callable(getattr(trainer, fn, None)):
            raise ValueError(f"domain {domain!r}: experts/{domain}/data.py's TRAINER has no `{fn}`")
    return trainer


@dataclass
class Domain:
    name: str
    data: ModuleType               # experts.<domain>.data
    reward: Callable               # rewards.<domain>.reward


def load_domain(name: str) -> Domain:
    """The domain's data module and reward function, or a clear error naming what is missing."""
    return Domain(name, data_module(name), reward_function(name))


def domain_efforts(domain: str) -> tuple[str, ...]:
    """The domain's reasoning efforts ("low", "high"), or () for a domain without any."""
    return tuple(getattr(data_module(domain), "EFFORTS", ()) or ())


def teacher_keys(domain: str) -> list[tuple[str, str | None]]:
    """[(key, effort)]: ("math/low", "low"), ("math/high", "high") or [("code", None)]."""
    efforts = domain_efforts(domain)
    return [(f"{domain}/{e}", e) for e in efforts] if efforts else [(domain, None)]


def expert_recipe(recipes_dir: str | Path, domain: str, effort: str | None, stage: str) -> Path:
    """recipes/experts/<domain>/<stage>.yaml, or <stage>-<effort>.yaml for a domain with efforts."""
    name = f"{stage}-{effort}.yaml" if effort else f"{stage}.yaml"
    p = Path(recipes_dir) / domain / name
    if not p.exists():
        raise ValueError(f"domain {domain!r}: no recipe {p} (recipes/experts/<domain>/ needs "
                         f"sft.yaml and rl.yaml, or sft-<effort>.yaml and rl-<effort>.yaml)")
    return p
