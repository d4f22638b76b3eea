"""Domains as plugins (experts/registry.py, core/domain.py): the built-in domains come
through the `mopd.domains` entry points as the very pieces they were before, a team's
installed package (examples/domain-plugin/) is found the same way and shown by `mopd
domains list`, a package that fails to load is named with its error without breaking the
others, and a recipe may name a domain by its 'module:attribute' path."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from core.domain import Domain
from experts import registry
from pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]
BUILTIN = ["agent", "chat", "code", "coding_agent", "frontend", "instruction_following", "kernel", "math",
           "search_agent", "tool_use"]
AGENTS = {"agent", "coding_agent", "search_agent"}
OPT_IN = ["frontend_loop"]   # registered built-ins whose recipes sit under recipes/opt_in/


@pytest.fixture
def on_path(monkeypatch):
    """Put folders on sys.path for one test, with the registry rediscovered before and after."""
    added: list[str] = []

    def add(*folders: Path):
        for f in folders:
            monkeypatch.syspath_prepend(str(f))
            added.append(str(f))
        importlib.invalidate_caches()
        registry.reload()
    yield add
    for name in [m for m in sys.modules if m.split(".")[0] in ("mopd_unitconv", "team_broken", "team_ref")]:
        del sys.modules[name]
    monkeypatch.undo()
    registry.reload()


def test_the_builtin_domains_are_entry_points_with_the_pieces_they_had():
    """One registry, no special path: each built-in is a Domain of the project's entry points
    (read from pyproject.toml until the editable install is redone), and its pieces are the
    very modules the name convention used to find, so no built-in number moves."""
    eps = {ep.name: ep.value for ep in registry.project_entry_points()}
    assert sorted(eps) == sorted(BUILTIN + OPT_IN) and all(v.startswith("experts.domains:") for v in eps.values())
    assert set(BUILTIN) <= set(registry.names()) and registry.broken() == []
    assert registry.all_domains() == BUILTIN   # the default selection: the recipes under recipes/experts/
    for d in BUILTIN:
        dom = registry.get(d)
        assert isinstance(dom, Domain) and dom.name == d and registry.package_of(d) == "mopd"
        assert registry.data_module(d) is importlib.import_module(f"experts.{d}.data")
        assert registry.reward_function(d) is importlib.import_module(f"rewards.{d}").reward
        assert registry.is_agent_domain(d) == (d in AGENTS)
        assert dom.recipes_dir == REPO / "recipes" / "experts" / d
    assert registry.environment_ref("agent") == "rewards.agent:make_env"
    for d in OPT_IN:   # registered, out of the default selection: a run names it to get it
        assert registry.is_agent_domain(d) and registry.get(d).recipes_dir == REPO / "recipes" / "opt_in" / d
    from evals.run import load_evaluate

    assert load_evaluate("math") is importlib.import_module("evals.math").evaluate


ORDER = ["bench", "pipeline", "evals", "experts", "mopd", "teachers", "rewards", "core"]   # pyproject's layers


def test_the_builtin_pieces_sit_at_or_below_the_layer_that_imports_them():
    """A Domain names its pieces as strings, which import-linter cannot see: each must sit
    at or below the layer that imports it (data, reward, trainer: experts.registry; eval:
    evals.run; environment: the MOPD loop), so the registry never reaches upward."""
    def layer(ref: str) -> int:
        return ORDER.index(ref.split(".")[0].split(":")[0])
    for d in BUILTIN:
        dom = registry.get(d)
        assert layer(dom.data) >= layer("experts") and layer(dom.reward) >= layer("experts"), d
        assert layer(dom.eval) >= layer("evals"), d
        assert dom.environment is None or layer(dom.environment) >= layer("mopd"), d
        assert dom.trainer is None or layer(dom.trainer) >= layer("experts"), d


def test_an_unknown_domain_is_named_with_what_is_registered():
    with pytest.raises(ValueError, match=r"no domain 'nosuch': registered are \[.*'math'"):
        registry.get("nosuch")


def test_the_installed_example_plugin_is_found_and_listed(domain_plugin_site, on_path, capsys):
    on_path(domain_plugin_site)
    dom = registry.get("unitconv")
    assert registry.package_of("unitconv") == "mopd-unitconv"
    assert (dom.recipes_dir / "sft.yaml").exists() and (dom.recipes_dir / "rl.yaml").exists()
    d = registry.load_domain("unitconv")
    rows = d.data.make_dataset("test", 4)
    assert d.reward(rows["prompt"], [c[-1]["content"] for c in rows["completion"]], answer=rows["answer"]) == [1.0] * 4
    assert d.reward(["p"] * 3, ["7,000", "Answer: 7000.0 m", "700"], answer=["7000"] * 3) == [1.0, 1.0, 0.0]
    assert cli_main(["domains", "list", "--json"]) == 0
    listed = {r["domain"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(BUILTIN) | {"unitconv"} <= set(listed)
    u = listed["unitconv"]
    assert (u["package"], u["reward"], u["agent"], u["data"], u["error"]) == \
        ("mopd-unitconv", "mopd_unitconv.reward:reward", False, ["procedural", "files"], "")
    assert listed["agent"]["agent"] is True and "bfcl_multi_turn" in listed["agent"]["data"]


def _fake_dist(site: Path, name: str, entry_points: str, modules: dict[str, str]) -> Path:
    """A minimal installed distribution: dist-info with entry_points.txt, and its modules."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    for mod, text in modules.items():
        (site / f"{mod}.py").write_text(text)
    return site


def test_a_domain_that_fails_to_import_is_named_and_the_others_work(tmp_path, on_path, capsys):
    site = _fake_dist(tmp_path / "site", "team-broken",
                      "[mopd.domains]\nbroken = team_broken:DOMAIN\nmath = team_broken:DOMAIN\n",
                      {"team_broken": "import no_such_dependency_here\n"})
    on_path(site)
    bad = {(b.name, b.package) for b in registry.broken()}
    # its own name fails to import; the name it tries to take from the project stays the project's
    assert bad == {("broken", "team-broken"), ("math", "team-broken")}
    assert registry.package_of("math") == "mopd" and registry.load_domain("math").name == "math"
    with pytest.raises(ValueError, match=r"domain 'broken' \(package team-broken.*no_such_dependency_here"):
        registry.get("broken")
    assert cli_main(["domains", "list"]) == 1
    out = capsys.readouterr()
    assert "math" in out.out and "broken" in out.out
    assert "domain 'broken' (team-broken) failed to load" in out.err and "no_such_dependency_here" in out.err
    assert "already registered by mopd" in out.err


def test_a_recipe_may_name_a_domain_by_its_module_path(tmp_path, domain_plugin_site, on_path):
    """'module:attribute' loads a Domain no entry point names, known by its name from then on;
    `ref_of` gives the path another process (an expert stage) is handed."""
    site = tmp_path / "ref"
    site.mkdir()
    (site / "team_ref.py").write_text(
        "from core.domain import Domain\n"
        "DOMAIN = Domain(name='mathcopy', data='experts.math.data', reward='rewards.math:reward', "
        "eval='evals.math:evaluate', recipes='nowhere')\n"
        "NOT_A_DOMAIN = 3\n")
    on_path(site)
    assert registry.get("team_ref:DOMAIN").name == "mathcopy"
    assert registry.get("mathcopy").data == "experts.math.data" and registry.ref_of("mathcopy") == "team_ref:DOMAIN"
    assert registry.ref_of("math") == "math"
    with pytest.raises(ValueError, match="not a core.domain.Domain"):
        registry.get("team_ref:NOT_A_DOMAIN")
    with pytest.raises(ValueError, match="no attribute 'NOPE'"):
        registry.get("team_ref:NOPE")
    with pytest.raises(ValueError, match=r"data='pkg:x' must be a module path"):
        Domain(name="x", data="pkg:x", reward="a:b", eval="a:b", recipes=".")


def test_the_pipeline_plans_the_example_domain_beside_math(tmp_path, domain_plugin_site, on_path):
    """`domains=[math, unitconv]`: the plugin's recipes, its data file (beside its recipe),
    its reward (Mix-RL), its MOPD weight (the Domain's) and its eval column, planned
    before any work; the math stages are the one-domain run's."""
    from pipeline.config import PipelineConfig
    from pipeline.plan import build_plan

    on_path(domain_plugin_site)
    tiny = REPO / "recipes" / "pipeline" / "tiny.yaml"
    smoke = ["train.max_steps=2", "eval.n=8", "mopd.n_prompts=64"]
    plan = build_plan(load_config(PipelineConfig, tiny, ["domains=[math,unitconv]", "baselines.mix_rl.enabled=true",
                                                         *smoke]), tmp_path / "run")   # Mix-RL: off in tiny.yaml
    st = {s.name: s for s in plan.stages}
    assert {"expert/unitconv/sft", "expert/unitconv/rl", "eval/teacher/unitconv"} <= set(st)
    sft = st["expert/unitconv/sft"].settings
    assert sft["domain"] == "unitconv" and Path(sft["data"]["files"]["train"]).is_file()
    assert sft["data"]["files"]["train"].endswith("mopd_unitconv/files/train.jsonl")
    assert plan.mopd_cfg.data.mix["unitconv"] == 1.0 and "unitconv" in plan.mopd_cfg.teachers
    assert [c.name for c in plan.columns] == ["math/low", "math/high", "unitconv"]
    assert "unitconv" in st["baseline/mix_rl"].settings["domains"]
    # the math experts are configured as in the run without the plugin's domain (their
    # hashes differ through the base, which pretrains on both domains' rows)
    alone = {s.name: s for s in build_plan(load_config(PipelineConfig, tiny, ["domains=[math]", *smoke]),
                                           tmp_path / "run").stages}
    assert all(st[s].settings == alone[s].settings for s in alone if s.startswith("expert/math"))
    assert st["base"].settings["data"]["domains"] == ["math", "unitconv"]


PACKAGES = ("mopd", "experts", "rewards", "evals", "teachers", "pipeline")


def test_no_project_package_names_the_example_domain():
    """The example domain is a team's package: nothing of the project's names it (a
    plugin that needed an edit here would not be a plugin)."""
    found = subprocess.run(["grep", "-rlIiE", "unitconv|domain-plugin|domain_plugin", *PACKAGES], cwd=REPO,
                           capture_output=True, text=True)
    assert found.returncode == 1 and found.stdout == "", f"named in: {found.stdout}"
