"""`--dry-run` of every command (issue 41, item 3), in-process through `mopd`'s main:
every shipped command recipe names each missing input in one line, no traceback, in a
fresh folder; with tiny checkpoints placed where the recipe expects them, it passes. A
broken recipe (a misspelt key, a missing teacher, a bad accelerate config) names every
problem at once; the real runs refuse the same before any model loads."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from core.config import load_config
from pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "recipes"
NOT_COMMANDS = ("accelerate", "harnesses")   # read by the commands, checked through them below


def command_of(path: Path) -> str:
    """The `mopd` command a shipped recipe is the --config of."""
    parts = path.relative_to(RECIPES).parts
    if parts[0] == "base":
        return "base"
    if parts[0] == "baselines":   # mopd baseline <kind>: recipes/baselines/<kind>.yaml
        return "baseline"
    if "mopd" in parts or parts[-1] == "mopd.yaml":
        return "distill"
    if "experts" in parts or (parts[0] == "opt_in" and parts[-1] in ("sft.yaml", "rl.yaml")):
        return "expert"   # recipes/opt_in/<domain>/: a domain runs over "every domain" leave out
    if parts[0] == "pipeline" or parts[-1] == "pipeline.yaml":
        return "pipeline"
    raise AssertionError(f"{path}: which command reads it? (add it to command_of)")


COMMAND_RECIPES = sorted(p for p in RECIPES.rglob("*.yaml") if not set(p.relative_to(RECIPES).parts) & set(NOT_COMMANDS)
                         and command_of(p) != "base")   # `mopd base` trains from nothing: no inputs to check
IDS = [str(p.relative_to(RECIPES)) for p in COMMAND_RECIPES]


def inputs(recipe: Path) -> dict[str, str]:
    """The recipe's input paths: dotted key -> path (what the dry run must find or name)."""
    cmd = command_of(recipe)
    if cmd == "baseline":   # its MOPD recipe's inputs and the MOPD run it is matched to
        from pipeline.baseline import BaselineConfig

        c = load_config(BaselineConfig, recipe)
        return {**inputs(REPO / c.mopd), **({"mopd_run": c.mopd_run} if c.mopd_run else {})}
    if cmd == "distill":
        from mopd.distill.config import DistillConfig

        c = load_config(DistillConfig, recipe)
        out = {"model.path": c.model.path, **{f"teachers.{k}.path": t.path for k, t in c.teachers.items()}}
        out.update({f"data.datasets[{i}].path": d.path for i, d in enumerate(c.data.datasets)})
        return out
    if cmd == "expert":
        from experts.run import ExpertConfig

        c = load_config(ExpertConfig, recipe)
        out = {"model.path": c.model.path, "model.base": c.model.base}
        return {k: v for k, v in out.items() if v}
    from pipeline.config import PipelineConfig

    c = load_config(PipelineConfig, recipe)
    return {"base.path": c.base.path} if c.base.path else {}


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli_main([str(a) for a in argv])
    got = capsys.readouterr()
    return rc, got.out, got.err


def dry_run(recipe: Path, out: Path, capsys, *overrides) -> tuple[int, str, str]:
    cmd = command_of(recipe)
    kind = [recipe.stem.replace("_", "-")] if cmd == "baseline" else []
    return run(capsys, cmd, *kind, "--config", recipe, "--out", out, "--dry-run", *overrides)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A fresh clone's working directory: the recipes, nothing under runs/."""
    (tmp_path / "recipes").symlink_to(RECIPES)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("recipe", COMMAND_RECIPES, ids=IDS)
def test_a_fresh_clone_names_each_missing_input_in_one_line(recipe, fresh, capsys, no_model_loads):
    rc, out, err = dry_run(recipe, fresh / "run", capsys)
    missing = {k: v for k, v in inputs(recipe).items() if not Path(v).exists()}
    assert "Traceback" not in out + err
    if not missing:
        assert rc == 0, err
        return
    assert rc == 2, out + err
    for key, path in missing.items():   # every one, each on a line that names its key and path
        assert any(path in line and (key in line or command_of(recipe) == "pipeline") for line in err.splitlines()), \
            f"{key}={path} not named:\n{err}"


def place(root: Path, recipe: Path, student: Path, teacher: Path) -> list[str]:
    """Put tiny checkpoints (and empty data folders) where the recipe's inputs are; an
    absolute path (/models/...) becomes an override to a folder under `root`."""
    overrides = []
    for key, path in inputs(recipe).items():
        if os.path.isabs(path):
            target = root / "abs" / path.strip("/")
            overrides.append(f"{key}={target}")
        else:
            target = root / path
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if key == "mopd_run":   # a finished MOPD run: its history
            target.mkdir()
            (target / "history.json").write_text('[{"tokens": 64}, {"tokens": 64}]')
        elif key.startswith("data."):
            target.mkdir()
        else:
            target.symlink_to(teacher if key.startswith("teachers.") else student)
    return overrides


def with_positions(src: Path, dst: Path, n: int) -> Path:
    """A copy of the checkpoint `src` whose config.json says n positions (what the recipe's
    context asks for: the pipeline's agent base, Qwen3-8B's 40,960); the weights are linked."""
    import json

    dst.mkdir(parents=True)
    for f in Path(src).iterdir():
        (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": n}))
    return dst


@pytest.fixture(scope="module")
def long_models(tmp_path_factory, tiny_student_dir, tiny_teacher_dir, standins) -> dict[str, tuple[Path, Path]]:
    """(student, teacher) for the tiny recipes and for the real-model (Qwen3) ones."""
    root = tmp_path_factory.mktemp("long")
    return {"tiny": (with_positions(tiny_student_dir, root / "s", 2048), with_positions(tiny_teacher_dir, root / "t", 2048)),
            "real": (with_positions(standins["qwen3"], root / "qs", 40960),
                     with_positions(standins["qwen3-teacher"], root / "qt", 40960)),
            "vl": (standins["qwen2.5-vl"], standins["qwen2.5-vl-teacher"])}   # recipes/opt_in/frontend_loop/vl/


@pytest.mark.parametrize("recipe", COMMAND_RECIPES, ids=IDS)
def test_with_its_inputs_in_place_every_recipe_passes(recipe, fresh, capsys, no_model_loads, long_models):
    parts = recipe.relative_to(RECIPES).parts
    student, teacher = long_models["real" if "real" in parts else "vl" if "vl" in parts else "tiny"]
    overrides = place(fresh, recipe, student, teacher)
    if "group_size: 128" in recipe.read_text():   # Qwen3-8B's group; the stand-in's layers are 64 wide
        overrides.append("quant.group_size=32")
    rc, out, err = dry_run(recipe, fresh / "run", capsys, *overrides)
    assert rc == 0, out + err
    assert "Traceback" not in out + err


# ------------------------------------------------------------------ broken recipes
@pytest.fixture
def toy_tree(fresh, tiny_student_dir, tiny_teacher_dir):
    """recipes/mopd/toy.yaml's inputs in place (the tiny student and teacher)."""
    place(fresh, RECIPES / "mopd" / "toy.yaml", tiny_student_dir, tiny_teacher_dir)
    return fresh


def test_toy_recipe_passes_and_shows_what_would_run(toy_tree, capsys, no_model_loads):
    rc, out, err = run(capsys, "distill", "--config", "recipes/mopd/toy.yaml", "--dry-run", "--out", toy_tree / "r",
                       "--accelerate-config", "recipes/accelerate/cpu_ddp2.yaml", "train.max_steps=7")
    assert rc == 0, err
    assert "runs/toy/base  [float32, quant off, sampler vllm]" in out
    assert "teacher reverse" in out and "(hf, fits)" in out
    assert "2 (MULTI_GPU" in out and "7 (train.max_steps)" in out
    assert not (toy_tree / "r").exists()   # nothing written


def test_every_problem_at_once_one_line_each(toy_tree, capsys, tmp_path, no_model_loads):
    """A missing teacher, a mistyped accelerate config and an indivisible batch: all three named."""
    acc = tmp_path / "acc.yaml"
    acc.write_text("distributed_type: MULTI_GPU\nnum_procesess: 2\nnum_processes: 3\n")
    rc, out, err = run(capsys, "distill", "--config", "recipes/mopd/toy.yaml", "--dry-run",
                       "--accelerate-config", acc, "teachers.rotate.path=runs/toy/teachers/rotat")
    assert rc == 2
    lines = err.splitlines()
    assert lines[0].startswith("3 problem(s)")
    assert "teachers.rotate.path: 'runs/toy/teachers/rotat' does not exist (a teacher checkpoint)" in err
    assert "unknown key 'num_procesess' (did you mean 'num_processes'?)" in err
    assert "train.prompts_per_step=128 is not divisible by the 3 processes" in err
    assert "Traceback" not in err


def test_a_misspelt_key_is_one_line_naming_key_and_file(toy_tree, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((RECIPES / "mopd" / "toy.yaml").read_text().replace("max_steps:", "max_step:", 1))
    rc, out, err = run(capsys, "distill", "--config", bad, "--dry-run", "--accelerate-config", tmp_path / "none.yaml")
    assert rc == 2
    assert f"{bad}: train: unknown key 'max_step'" in err and "max_steps" in err
    assert f"accelerate config {tmp_path / 'none.yaml'} does not exist" in err
    assert "Traceback" not in err


def test_a_teacher_with_another_tokenizer_is_named(toy_tree, capsys, standins, no_model_loads):
    rc, out, err = run(capsys, "distill", "--config", "recipes/mopd/toy.yaml", "--dry-run",
                       f"teachers.rotate.path={standins['llama3']}")
    assert rc == 2
    assert "teacher for 'rotate'" in err and "does not fit the student" in err
    assert len([ln for ln in err.splitlines() if ln.startswith("  ")]) == 1


@pytest.mark.parametrize("drop, says", [("config.json", "no config.json"), ("tokenizer.json", "has no tokenizer")])
def test_a_checkpoint_folder_without_its_files_is_named(toy_tree, capsys, tiny_student_dir, drop, says,
                                                        no_model_loads):
    d = toy_tree / "broken"
    shutil.copytree(tiny_student_dir, d)
    (d / drop).unlink()
    rc, out, err = run(capsys, "distill", "--config", "recipes/mopd/toy.yaml", "--dry-run", f"model.path={d}",
                       f"teachers.reverse.path={d}")
    assert rc == 2 and says in err and f"model.path: {d}" in err
    if drop == "config.json":   # the teacher's own line too
        assert "teacher for 'reverse'" in err


def test_teachers_validate_is_the_same_check(fresh, capsys):
    """Was: a 72-line transformers traceback on a fresh clone ('Repo id must be in the form ...')."""
    rc, out, err = run(capsys, "teachers", "validate", "--config", "recipes/mopd/pipeline.yaml")
    assert rc == 2 and "Traceback" not in err and "Repo id" not in err
    assert "model.path: 'runs/pipeline/base/model' does not exist" in err
    assert "teachers.math/low.path: 'runs/pipeline/experts/math-low/rl/model' does not exist" in err


def test_the_real_distill_refuses_what_the_dry_run_names(toy_tree, capsys, no_model_loads):
    rc, out, err = run(capsys, "distill", "--config", "recipes/mopd/toy.yaml", "--out", toy_tree / "r",
                       "teachers.rotate.path=runs/x", "teachers.reverse.path=runs/y")
    assert rc == 2
    assert "teachers.rotate.path: 'runs/x' does not exist" in err and "teachers.reverse.path: 'runs/y'" in err


# ------------------------------------------------------------------ expert and eval
def test_expert_dry_run_names_every_problem(fresh, capsys, tiny_student_dir, no_model_loads):
    rc, out, err = run(capsys, "expert", "--config", "recipes/experts/math/rl-low.yaml", "--out", fresh / "e",
                       "--dry-run", f"model.base={tiny_student_dir}", "effort=medium", "rl.num_generations=1")
    assert rc == 2, err
    assert "model.path='runs/experts/math-low/sft/model' is not an HF checkpoint directory" in err
    assert "set effort to one of them (got 'medium')" in err
    assert "rl.num_generations must be >= 2" in err
    rc, out, err = run(capsys, "expert", "--config", "recipes/experts/math/sft-low.yaml", "--out", fresh / "e",
                       "--dry-run", f"model.path={tiny_student_dir}")
    assert rc == 0, err
    assert "math/low sft" in out and f"{tiny_student_dir}  [float32" in out
    assert not (fresh / "e").exists()


def test_eval_dry_run_names_every_model_and_domain(fresh, capsys, tiny_student_dir, no_model_loads):
    rc, out, err = run(capsys, "eval", "--models", f"a={tiny_student_dir},b=runs/missing,c={fresh}", "--domains",
                       "math,nosuch", "--out", fresh / "ev", "--dry-run")
    assert rc == 2
    assert "--models b: checkpoint 'runs/missing' does not exist" in err
    assert f"--models c: checkpoint {str(fresh)!r} has no config.json" in err
    assert "--domains: ['nosuch'] have no recipes" in err
    assert "math/low (200 rows)" in out   # the known domain still checked
    rc, out, err = run(capsys, "eval", "--models", f"a={tiny_student_dir}", "--domains", "math", "--out",
                       fresh / "ev", "--dry-run", "--n", "5")
    assert rc == 0, err
    assert "math/low (5 rows)" in out and not (fresh / "ev").exists()


# ------------------------------------------------------------------ accelerate configs
@pytest.mark.parametrize("acc", sorted((RECIPES / "accelerate").glob("*.yaml"))
                         + sorted(RECIPES.glob("real/*/accelerate/*.yaml")), ids=lambda p: p.name)
def test_every_shipped_accelerate_config_is_sane(acc):
    from core.dryrun import DryRun, check_accelerate_config

    dry = DryRun("t")
    n = check_accelerate_config(acc, dry)
    assert dry.problems == [] and n == yaml.safe_load(acc.read_text()).get("num_processes", 1)


def test_the_accelerate_keys_are_accelerates_own():
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig

    from core.dryrun import ACCELERATE_KEYS

    assert ACCELERATE_KEYS == {f.name for f in dataclasses.fields(ClusterConfig)}


def test_the_vllm_architecture_table_read_from_source_is_vllms():
    from vllm.model_executor.models import ModelRegistry

    from core.hf_dirs import _vllm_text_generation_archs

    archs = _vllm_text_generation_archs()
    assert "Qwen2ForCausalLM" in archs and archs <= set(ModelRegistry.get_supported_archs())


def test_the_module_entry_under_a_launcher_refuses_them_too(toy_tree, no_model_loads):
    """`accelerate launch -m mopd.distill` (mopd/distill/loop.py main): the same preflight."""
    from core.config import ConfigError
    from mopd.distill.loop import main

    with pytest.raises(ConfigError) as e:
        main(["--config", "recipes/mopd/toy.yaml", "--out", str(toy_tree / "r"), "teachers.rotate.path=runs/x",
              "model.path=runs/y"])
    assert "2 problems before anything loads" in str(e.value) and "'runs/x'" in str(e.value)
    assert not (toy_tree / "r").exists()


def test_expert_looks_up_a_models_uri_in_its_own_store(fresh, capsys, no_model_loads):
    rc, out, err = run(capsys, "expert", "--config", "recipes/experts/math/sft-low.yaml", "--out", fresh / "e",
                       "--dry-run", "model.path=models:/nosuch@teacher")
    assert rc == 2
    assert f"there is no MLflow store at sqlite:///{fresh / 'e'}/mlflow.db" in err


def test_under_a_launcher_its_process_count_is_checked(toy_tree, capsys, monkeypatch, no_model_loads):
    monkeypatch.setenv("WORLD_SIZE", "3")
    rc, out, err = run(capsys, "distill", "--config", "recipes/mopd/toy.yaml", "--dry-run")
    assert rc == 2 and "3 (WORLD_SIZE of this launch)" in out
    assert "train.prompts_per_step=128 is not divisible by the 3 processes" in err


def test_a_models_uri_student_is_named_as_the_real_run_names_it(toy_tree, capsys, no_model_loads):
    rc, out, err = run(capsys, "distill", "--config", "recipes/mopd/toy.yaml", "--dry-run",
                       "model.path=models:/student@latest")
    assert rc == 2 and "model.path: 'models:/student@latest' is an MLflow reference" in err


def test_pipeline_dry_run_names_every_problem_at_once(fresh, capsys, no_model_loads):
    """`mopd pipeline --dry-run` (issue 41 item 3): a bad base override, a bad expert override
    (each math recipe it reaches) and a bad MOPD override, all named, one line each, exit 2;
    before, the first one stopped it."""
    rc, out, err = run(capsys, "pipeline", "--config", "recipes/pipeline/tiny.yaml", "--out", fresh / "p", "--dry-run",
                       "domains=[math]", "base.overrides=[train.bogus=1]", "experts.rl=[train.max_step=3]",
                       "mopd.overrides=[rollout.max_tokens=3]")
    assert rc == 2, out + err
    assert "Traceback" not in out + err
    lines = [x.strip() for x in err.splitlines()]
    assert sum("unknown key 'bogus'" in x for x in lines) == 1
    assert sum("unknown key 'max_step'" in x and "rl-" in x for x in lines) == 2   # math/rl-low, math/rl-high
    assert sum("unknown key 'max_tokens'" in x for x in lines) == 1
    assert "4 problem(s)" in err


def test_baseline_dry_run_names_its_own_problems_with_the_mopd_recipes(toy_tree, capsys, tmp_path, no_model_loads):
    """`mopd baseline mix-rl --dry-run`: a MOPD run without its history, a global batch that does not
    split over the launch's processes, a reward that does not import, a missing teacher: all at once."""
    rc, out, err = run(capsys, "baseline", "mix-rl", "--config", "recipes/baselines/mix_rl.yaml", "--out", tmp_path / "r",
                       "--dry-run", "--accelerate-config", RECIPES / "accelerate" / "cpu_ddp2.yaml",
                       "mix_rl.batch_size=3", "mix_rl.num_generations=3", "rewards.rotate=nowhere:reward",
                       f"mopd_run={tmp_path / 'no_run'}", f"mopd_overrides=[teachers.reverse.path={tmp_path / 'gone'}]")
    assert rc == 2 and "Traceback" not in out + err
    problems = [x.strip() for x in err.splitlines()[1:]]
    assert len(problems) == 4, err
    assert any("mopd_run" in p and "no_run" in p for p in problems)
    assert any("batch_size x num_generations = 9 does not split over 2 processes" in p for p in problems)
    assert any("nowhere:reward" in p for p in problems)
    assert any("teachers.reverse.path" in p and "gone" in p for p in problems)
