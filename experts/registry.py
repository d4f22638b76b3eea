"""The one domain registry: which domains exist, where each comes from, and their pieces
(data, reward, efforts, teacher keys, expert recipes, agent trainer).

A domain is a `core.domain.Domain` object, found in the `mopd.domains` entry-point group
(importlib.metadata): this project registers its built-in domains there (pyproject.toml ->
experts/domains.py) exactly as a team's package registers its own (docs/experts.md).
The project's own entry points are also read from its pyproject.toml, so the built-ins are
found before the editable install is redone (`pip install --no-deps -e .`). A recipe may
also name a domain by a 'module:attribute' path; `get` loads it and knows it by its name
from then on, in this process (`ref_of` gives the path to hand to another process).

A domain that fails to load is kept aside with its package and error (`broken()`, shown by
`mopd domains list`): it breaks only what asks for it. A missing piece is a ValueError
naming the domain, its package and the module, never a bare ModuleNotFoundError.

(The held-out suite, the domain's `eval`, is imported by evals/run.py, a layer above.)
"""
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata as md
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from core.domain import Domain, is_ref, load_ref

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes" / "experts"
GROUP = "mopd.domains"
PROJECT = "mopd"


@dataclass(frozen=True)
class Broken:
    """A registered domain that did not load: its name, package and error."""
    name: str
    package: str
    value: str
    error: str


@dataclass
class _Table:
    domains: dict[str, Domain]
    packages: dict[str, str]
    broken: dict[str, Broken]
    refs: dict[str, str]           # name -> 'module:attribute' of domains loaded from a recipe's path


def project_entry_points(pyproject: Path = REPO / "pyproject.toml") -> list[md.EntryPoint]:
    """This project's own `mopd.domains` entry points, read from its pyproject.toml."""
    if not pyproject.exists():   # an installed copy without its source tree: the metadata has them
        return []
    table = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    eps = table.get("project", {}).get("entry-points", {}).get(GROUP, {})
    return [md.EntryPoint(name=n, value=v, group=GROUP) for n, v in eps.items()]


def _package(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else PROJECT


def _discover() -> _Table:
    """Every entry point of the group, loaded one by one: the project's first, then the
    installed ones by package name. The same (name, value) twice (the project's pyproject
    and its installed metadata) is one domain; a second package claiming a taken name is
    broken, not a silent replacement."""
    t = _Table({}, {}, {}, {})
    seen: dict[str, str] = {}      # name -> value
    installed = sorted(md.entry_points(group=GROUP), key=lambda ep: (_package(ep) != PROJECT, _package(ep), ep.name))
    for ep in [*project_entry_points(), *installed]:
        pkg = _package(ep)
        if ep.name in seen:
            if seen[ep.name] != ep.value:
                first = t.packages.get(ep.name) or t.broken[ep.name].package
                t.broken.setdefault(f"{ep.name} ({pkg})", Broken(ep.name, pkg, ep.value,
                                    f"the name {ep.name!r} is already registered by {first} ({seen[ep.name]})"))
            continue
        seen[ep.name] = ep.value
        try:
            dom = ep.load()
            if not isinstance(dom, Domain):
                raise TypeError(f"{ep.value} is a {type(dom).__name__}, not a core.domain.Domain")
            if dom.name != ep.name:
                raise ValueError(f"entry point {ep.name!r} names a Domain called {dom.name!r}")
        except Exception as e:  # noqa: BLE001 - any failure of a team's package: shown, never fatal to the others
            t.broken[ep.name] = Broken(ep.name, pkg, ep.value, f"{type(e).__name__}: {e}")
            continue
        t.domains[ep.name], t.packages[ep.name] = dom, pkg
    return t


@functools.lru_cache(maxsize=1)
def _table() -> _Table:
    return _discover()


def reload():
    """Forget what was discovered (a package installed since, in tests)."""
    _table.cache_clear()


def names() -> list[str]:
    """Every domain that loaded (built-in, installed or named by path so far), sorted."""
    return sorted(_table().domains)


def broken() -> list[Broken]:
    return sorted(_table().broken.values(), key=lambda b: (b.name, b.package))


def package_of(name: str) -> str:
    return _table().packages.get(get(name).name, "?")


def ref_of(name: str) -> str:
    """How another process finds the domain: its 'module:attribute' path when a recipe
    named it so, else its name."""
    return _table().refs.get(name, name)


def get(ref: str) -> Domain:
    """The domain called `ref`, or loaded from `ref` = 'module:attribute'."""
    t = _table()
    if is_ref(ref):
        dom = load_ref(ref, f"domain {ref!r}")
        if not isinstance(dom, Domain):
            raise ValueError(f"domain {ref!r} is a {type(dom).__name__}, not a core.domain.Domain")
        have = t.domains.get(dom.name)
        if have is not None and have != dom:
            raise ValueError(f"domain {ref!r} is called {dom.name!r}, already registered by {t.packages[dom.name]}")
        if have is None:
            t.domains[dom.name], t.packages[dom.name], t.refs[dom.name] = dom, ref.partition(":")[0], ref
        return dom
    if ref in t.domains:
        return t.domains[ref]
    if ref in t.broken:
        b = t.broken[ref]
        raise ValueError(f"domain {ref!r} (package {b.package}, {b.value}) failed to load: {b.error}")
    raise ValueError(f"no domain {ref!r}: registered are {sorted(t.domains)} (a team's domain: install its "
                     f"package, which registers it in the {GROUP!r} entry points, or name it as 'module:attribute')")


def all_domains(recipes_dir: str | Path = RECIPES) -> list[str]:
    """Domains with a recipe folder under `recipes_dir` (default recipes/experts/: the
    built-ins), sorted: the default selection of runs over "every domain". A team's domain
    joins a run when the run names it (its recipes are in its own package)."""
    root = Path(recipes_dir)
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


def _where(domain: str) -> str:
    return f"domain {domain!r} ({_table().packages.get(domain, '?')})"


def data_module(domain: str) -> ModuleType:
    """The domain's data module, checked to define make_dataset."""
    d = get(domain)
    try:
        data = importlib.import_module(d.data)
    except ModuleNotFoundError as e:
        if e.name and (d.data == e.name or d.data.startswith(e.name + ".")):
            raise ValueError(f"{_where(d.name)}: its data module {d.data} is missing") from None
        raise
    if not hasattr(data, "make_dataset"):
        raise ValueError(f"{_where(d.name)}: {d.data} defines no `make_dataset`")
    return data


def reward_function(domain: str) -> Callable:
    """The domain's reward (TRL's signature)."""
    d = get(domain)
    fn = load_ref(d.reward, f"{_where(d.name)}: reward")
    if not callable(fn):
        raise ValueError(f"{_where(d.name)}: reward {d.reward} is not callable")
    return fn


def reward_ref(domain: str) -> str:
    """The reward's 'module:function' (stages that import it by name, e.g. Mix-RL)."""
    return get(domain).reward


def environment_ref(domain: str) -> str:
    """An agent domain's environment factory, 'module:function'."""
    d = get(domain)
    if not d.environment:
        raise ValueError(f"{_where(d.name)} is played as episodes but names no environment")
    return d.environment


def is_agent_domain(domain: str) -> bool:
    """A domain played as multi-turn episodes (it names an environment, or its data module
    says MULTI_TURN = True)."""
    return bool(get(domain).environment) or bool(getattr(data_module(domain), "MULTI_TURN", False))


def domain_trainer(domain: str):
    """The domain's own trainer (its `trainer` reference, else its data module's `TRAINER`:
    an experts.agent_expert.AgentExpert, or anything with `train_sft` and `train_rl`) when
    the domain trains with its own loop (agent episodes), else None (TRL's SFT and GRPO
    trainers in experts/run.py)."""
    d = get(domain)
    trainer = load_ref(d.trainer, f"{_where(d.name)}: trainer") if d.trainer else \
        getattr(data_module(domain), "TRAINER", None)
    if trainer is None:
        return None
    for fn in ("train_sft", "train_rl"):
        if not callable(getattr(trainer, fn, None)):
            raise ValueError(f"{_where(d.name)}: its trainer has no `{fn}`")
    return trainer


@dataclass
class LoadedDomain:
    """A domain with its data module and reward function imported."""
    name: str
    data: ModuleType
    reward: Callable
    spec: Domain | None = None


def load_domain(name: str) -> LoadedDomain:
    """The domain's data module and reward function, or a clear error naming what is missing."""
    d = get(name)
    return LoadedDomain(d.name, data_module(d.name), reward_function(d.name), d)


def domain_efforts(domain: str) -> tuple[str, ...]:
    """The domain's reasoning efforts ("low", "high"), or () for a domain without any."""
    return tuple(getattr(data_module(domain), "EFFORTS", ()) or ())


def teacher_keys(domain: str) -> list[tuple[str, str | None]]:
    """[(key, effort)]: ("math/low", "low"), ("math/high", "high") or [("code", None)]."""
    efforts = domain_efforts(domain)
    return [(f"{domain}/{e}", e) for e in efforts] if efforts else [(domain, None)]


def expert_recipe(recipes_dir: str | Path, domain: str, effort: str | None, stage: str) -> Path:
    """<recipes_dir>/<domain>/<stage>[-<effort>].yaml when that folder has the domain,
    else the same file in the domain's own recipes folder (a team's package ships its own)."""
    name = f"{stage}-{effort}.yaml" if effort else f"{stage}.yaml"
    here = Path(recipes_dir) / domain
    folder = here if here.is_dir() else get(domain).recipes_dir
    p = folder / name
    if not p.exists():
        raise ValueError(f"domain {domain!r}: no recipe {p} (a domain's recipes folder needs sft.yaml and "
                         f"rl.yaml, or sft-<effort>.yaml and rl-<effort>.yaml)")
    return p


# ----------------------------------------------------------------------------- mopd domains list
def data_sources(data: ModuleType) -> list[str]:
    """Where an expert's rows can come from: its generator, its named datasets, files."""
    return ["procedural", *sorted(getattr(data, "DATASETS", {}) or {}), "files"]


def describe(name: str) -> dict:
    """One row of `mopd domains list`: package, reward, data sources, agent, recipes; the
    data module is imported (its DATASETS), a failure is the row's error."""
    d = get(name)
    row = {"domain": name, "package": _table().packages.get(name, "?"), "reward": d.reward, "eval": d.eval,
           "recipes": d.recipes, "environment": d.environment, "harnesses": d.harnesses, "agent": None, "data": [],
           "error": ""}
    try:
        data = data_module(name)
        row["data"] = data_sources(data)
        row["agent"] = is_agent_domain(name)
        row["efforts"] = list(domain_efforts(name))
        reward_function(name)
    except Exception as e:  # noqa: BLE001 - one domain's broken piece is its own row's error
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def list_domains(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    rows = [describe(n) for n in names()]
    bad = [{"domain": b.name, "package": b.package, "reward": "", "eval": "", "recipes": "", "agent": None,
            "data": [], "error": f"{b.value}: {b.error}"} for b in broken()]
    if args.json:
        print(json.dumps(rows + bad, indent=1))
        return 1 if bad or any(r["error"] for r in rows) else 0
    t = Table(title=f"domains ({GROUP} entry points)")
    for c in ("domain", "package", "reward", "data sources", "agent"):
        t.add_column(c)
    for r in rows + bad:
        agent = "-" if r["agent"] is None else ("yes" if r["agent"] else "no")
        t.add_row(r["domain"], r["package"], r["reward"] or "-", ", ".join(r["data"]) or "-", agent)
    console = Console()
    console.width = max(console.width, 150)   # piped output is 80 wide: the references would be cut
    console.print(t)
    for r in rows + bad:
        if r["error"]:
            print(f"domain {r['domain']!r} ({r['package']}) failed to load: {r['error']}", file=sys.stderr)
    return 1 if bad or any(r["error"] for r in rows) else 0


def add_domains_parser(sub) -> argparse.ArgumentParser:
    """`mopd domains list`."""
    p = sub.add_parser("domains", help="the registered domains (built-in and installed packages)")
    dsub = p.add_subparsers(dest="dcmd", required=True)
    v = dsub.add_parser("list", help="each domain, its package, reward, data sources and whether it is an agent "
                        "domain; a domain that fails to load is named with its package and error (exit 1)")
    v.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    v.set_defaults(fn=list_domains)
    return p
