"""What every stage builder shares: the run folder's layout, the MLflow store and
experiment, the selected teacher keys, and the helpers a stage uses to log its own runs."""
from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow

from core import ranks
from core.config import ConfigError, parse_override, to_dict
from core.hf_dirs import TOKENIZER_FILES
from core.tracking import start_run
from pipeline.config import PipelineConfig
from pipeline.runner import StageContext, normalize

REPO = Path(__file__).resolve().parents[2]


def key_dir(key: str) -> str:
    """A teacher key ("math/low") as one folder name ("math-low")."""
    return key.replace("/", "-")


def seeded_name(name: str, seed: int | None) -> str:
    """A stage's or a model's name in a seeded copy: "mopd/seed1", "student/seed1"."""
    return name if seed is None else f"{name}/seed{seed}"


def find(path: str) -> Path:
    """A recipe path as given, else under the repository root."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p.resolve()
    q = REPO / p
    return q if q.exists() else p.resolve()


@dataclass(frozen=True)
class Key:
    key: str                       # "math/low" or "code"
    domain: str
    effort: str | None


@dataclass(frozen=True)
class Layout:
    """Where each stage writes inside the run folder DIR."""
    root: Path

    @property
    def base_model(self) -> Path:
        return self.root / "base" / "model"

    def data(self, key: str) -> Path:
        return self.root / "data" / key_dir(key)

    def expert(self, key: str, stage: str | None = None) -> Path:
        d = self.root / "experts" / key_dir(key)
        return d / stage if stage else d

    def expert_model(self, key: str, stage: str) -> Path:
        return self.expert(key, stage) / "model"

    @property
    def chat_rm(self) -> Path:
        return self.root / "chat_rm"

    def baseline(self, name: str) -> Path:
        return self.root / "baselines" / name

    def eval(self, name: str) -> Path:
        return self.root / "evals" / key_dir(name)

    def seeded(self, seed: int | None) -> Path:
        """Where a seeded copy of a stage writes (DIR/seeds/seed<N>), or DIR for the plain run."""
        return self.root if seed is None else self.root / "seeds" / f"seed{seed}"

    def hashed(self, settings: Any) -> Any:
        """Settings as hashed: paths inside DIR written as $OUT."""
        return normalize(settings, self.root)


@dataclass(frozen=True)
class Tracking:
    """The MLflow store and experiment every stage logs to."""
    uri: str
    experiment: str

    def section(self, mlflow_section, **more):
        """A stage config's mlflow section pointed at this store and experiment."""
        return dataclasses.replace(mlflow_section, experiment=self.experiment, tracking_uri=self.uri, **more)

    def stage_run(self, ctx: StageContext, run_name: str, domain: str = "all"):
        """A run for a stage this process runs itself, nested under the pipeline's parent run;
        under a launcher only rank 0 logs (the others get a context of None)."""
        if not ranks.is_main():
            return contextlib.nullcontext()
        return start_run(experiment=self.experiment, uri=self.uri, run_name=run_name,
                         tags={"stage": ctx.name, "domain": domain, "stage_hash": ctx.hash},
                         parent_run_id=ctx.parent_run_id)


@dataclass(frozen=True)
class Scope:
    """What the stage builders are given: the pipeline config, the selected domains and
    teacher keys, where the stages write and where they log. `base_checkpoint`: the local
    folder of `base.path` (resolved at plan time), "" when the pipeline trains its base;
    `student_checkpoint`: the local folder of `mopd.student`, "" for the base."""
    cfg: PipelineConfig
    domains: list[str]
    keys: list[Key]
    layout: Layout
    tracking: Tracking
    base_checkpoint: str = ""
    student_checkpoint: str = ""

    @property
    def base_model(self) -> Path:
        """The checkpoint every expert starts from (and the student, unless mopd.student)."""
        return Path(self.base_checkpoint) if self.base_checkpoint else self.layout.base_model

    @property
    def student_model(self) -> Path:
        """The checkpoint the MOPD student (and the seq-KD and Mix-RL baselines) start from."""
        return Path(self.student_checkpoint) if self.student_checkpoint else self.base_model

    @property
    def cap(self) -> int:
        return self.cfg.train.max_steps

    @property
    def chat(self) -> bool:
        return "chat" in self.domains

    @property
    def rm_from_sft(self) -> bool:
        """The chat RM starts from the chat SFT checkpoint: it runs between chat SFT and chat
        RL, and chat SFT cannot score itself with it."""
        return self.chat and self.cfg.experts.chat_rm.init == "sft"


def resolve_checkpoint(ref: str, key: str, tracking_uri: str) -> str:
    """The local folder of the checkpoint `ref` that setting `key` names (a local HF folder
    or a models:/ reference), checked by `check_checkpoint` at plan time."""
    if ref.startswith(("models:/", "runs:/")):
        from teachers.resolve import TeacherError, resolve_ref
        try:
            path = resolve_ref(ref, tracking_uri=tracking_uri)
        except TeacherError as e:
            raise ConfigError(f"pipeline: {key}: {e}") from None
    else:
        path = Path(ref).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"pipeline: {key}: {ref!r} " + ("has no config.json: not a Hugging Face model folder"
                              if path.is_dir() else "does not exist") + "; give a local HF causal-LM folder (as "
                              "save_pretrained writes it) or a models:/<name>@<alias> reference")
    check_checkpoint(path, key)
    return str(Path(path).resolve())


# files a checkpoint's tokenizer can come in (one of them must be there)
def check_checkpoint(path: str | Path, key: str):
    """A causal LM the experts can train and the student can learn from: its config names a
    *ForCausalLM architecture, and its tokenizer (with a chat template: every domain's rows
    are chats) is in the folder."""
    p = Path(path)
    try:
        c = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"pipeline: {key}: {p / 'config.json'} is not a readable JSON config ({e})") from None
    archs = c.get("architectures") or []
    if not any(str(a).endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"pipeline: {key}: {p} is not a causal LM (config.json architectures {archs}); "
                          f"give a *ForCausalLM checkpoint")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"pipeline: {key}: {p} has no tokenizer (none of {list(TOKENIZER_FILES)}); save it "
                          f"beside the weights: AutoTokenizer.from_pretrained(...).save_pretrained({str(p)!r})")
    tc = p / "tokenizer_config.json"
    template = (p / "chat_template.jinja").is_file() or (p / "chat_template.json").is_file()
    if not template and tc.is_file():
        try:
            template = bool(json.loads(tc.read_text(encoding="utf-8")).get("chat_template"))
        except ValueError as e:
            raise ConfigError(f"pipeline: {key}: {tc} is not readable JSON ({e})") from None
    if not template:
        raise ConfigError(f"pipeline: {key}: {p}'s tokenizer has no chat template (every domain's rows are "
                          f"chats); use the instruct model's tokenizer, or set tokenizer.chat_template and save it")


def overridden(overrides: list[str]) -> dict[str, object]:
    """{dotted key: value} of what `key=value` overrides set; a mapping value counts each of
    its leaves (`model={path: x}` sets model.path)."""
    out: dict[str, object] = {}

    def walk(key: str, v):
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(f"{key}.{k}", x)
        else:
            out[key] = v
    for ov in overrides:
        path, value = parse_override(ov)
        walk(".".join(path), value)
    return out


def names(overrides: dict[str, object], key: str) -> list[str]:
    """The overridden keys at or under `key` ("quant" matches quant.enabled and quant)."""
    return [k for k in overrides if k == key or k.startswith(key + ".")]


def refuse(overrides: dict[str, object], owned: dict[str, str], where: str):
    """A ConfigError for the first override of a key the pipeline sets itself (`owned`:
    key -> why and what to set instead), which would otherwise be dropped without a word."""
    for key, why in owned.items():
        for k in names(overrides, key):
            raise ConfigError(f"pipeline: {where}: {k}={overrides[k]!r} would not reach its stage: {why}")


# settings of every stage's mlflow section the pipeline owns (one store, one experiment,
# runs nested under the pipeline's parent run)
MLFLOW_OWNED = {
    "mlflow.experiment": "every stage logs to the pipeline's experiment: set the top-level mlflow.experiment",
    "mlflow.tracking_uri": "every stage logs to the pipeline's store: set the top-level mlflow.tracking_uri",
    "mlflow.parent_run_id": "the pipeline nests every stage's run under its own parent run"}


def with_parent(cfg, parent_run_id: str | None):
    """`cfg` (any entry config with an mlflow section) nested under `parent_run_id`."""
    return dataclasses.replace(cfg, mlflow=dataclasses.replace(cfg.mlflow, parent_run_id=parent_run_id))


def settings(cfg) -> dict:
    """A stage config as hashed: without its mlflow section (where runs are logged does
    not change what a stage computes; a new tracking store must not retrain everything)."""
    d = to_dict(cfg)
    d.pop("mlflow", None)
    return d


def log_params(d: dict):
    if mlflow.active_run():
        mlflow.log_params({k: str(v)[:500] for k, v in d.items()})


def log_metrics(d: dict, step: int | None = None):
    if mlflow.active_run():
        mlflow.log_metrics({k: float(v) for k, v in d.items() if v is not None}, step=step)


def log_model(checkpoint: str | Path) -> str | None:
    """A stage's final checkpoint as an MLflow transformers model of its run (`model`:
    mlflow.transformers.load_model("runs:/<id>/model") opens it); None without a run."""
    if mlflow.active_run() is None:
        return None
    from core.tracking import log_hf_model

    return log_hf_model(checkpoint)


def log_artifact(path: Path):
    if mlflow.active_run() and Path(path).exists():
        mlflow.log_artifact(str(path))
