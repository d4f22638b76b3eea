"""The built-in domains as `core.domain.Domain` objects, registered in the `mopd.domains`
entry-point group by this project's pyproject.toml, exactly as a team's package registers
its own (docs/experts.md). Only references: importing this module imports none of
the pieces (the evals live a layer above, in evals/)."""
from __future__ import annotations

from pathlib import Path

from core.domain import Domain

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def builtin(name: str, *, agent: bool = False) -> Domain:
    """experts/<name>/data.py, rewards/<name>.py, evals/<name>.py, recipes/experts/<name>/ and,
    for an agent domain, rewards/<name>.py:make_env with recipes/harnesses/<name>.yaml."""
    return Domain(name=name, data=f"experts.{name}.data", reward=f"rewards.{name}:reward",
                  eval=f"evals.{name}:evaluate", recipes=str(RECIPES / "experts" / name),
                  environment=f"rewards.{name}:make_env" if agent else None,
                  harnesses=str(RECIPES / "harnesses" / f"{name}.yaml") if agent else None)


AGENT = builtin("agent", agent=True)
CHAT = builtin("chat")
CODE = builtin("code")
CODING_AGENT = builtin("coding_agent", agent=True)
FRONTEND = builtin("frontend")
INSTRUCTION_FOLLOWING = builtin("instruction_following")
KERNEL = builtin("kernel")
MATH = builtin("math")
SEARCH_AGENT = builtin("search_agent", agent=True)
TOOL_USE = builtin("tool_use")
# Opt-in (its recipes sit outside recipes/experts/, so runs over "every domain" leave it out
# until one names it): the frontend tasks as write / see the render / revise episodes.
FRONTEND_LOOP = Domain(name="frontend_loop", data="experts.frontend_loop.data", reward="rewards.frontend_loop:reward",
                       eval="evals.frontend_loop:evaluate", recipes=str(RECIPES / "opt_in" / "frontend_loop"),
                       environment="rewards.frontend_loop:make_env",
                       harnesses=str(RECIPES / "harnesses" / "frontend_loop.yaml"))
