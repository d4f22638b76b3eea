"""What a run checks and opens before any model loads: the resume settings, the data,
teachers, rewards and agent domains (`check_inputs`, returning `Inputs`), the sampler
backend (`rollout_kind`, `open_rollout`: chosen in one place) and the MLflow run."""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import mlflow
from accelerate import Accelerator
from transformers import AutoTokenizer

from core.config import ConfigError, dump_yaml, flatten, to_dict
from mopd.distill import agents as A
from mopd.distill.checkpoints import latest_checkpoint, read_state, settings_diff, training_settings
from mopd.distill.config import DistillConfig, PartialRollouts
from mopd.distill.data import Prompt, load_prompts, load_reward_fn
from mopd.distill.preflight import check_checkpoint_dir, check_context, check_paths, check_quant_shapes, check_tokenizer
from core.models import torch_dtype
from core.rollout import make_rollout
from core.tracking import StoreUnreachable, check_store, end_run, resolve_uri, start_run
from teachers.registry import lineage
from teachers.routing import resolve_teachers


@dataclass
class Inputs:
    """What `check_inputs` found: everything the run needs that is not a model."""
    tokenizer: object
    by_domain: dict[str, list[Prompt]]
    teacher_paths: dict
    reward_fns: dict
    agents: dict[str, A.AgentDomain]
    ckpt: Path | None                   # the checkpoint to resume from
    settings: dict                      # the run's training settings (recorded in its checkpoints)
    changed: dict[str, tuple]           # accepted changes from the checkpoint's settings
    rollout: object | None = None       # the sampler, when it needs no model (rollout.backend=server)
    lineage: dict = dataclasses.field(default_factory=dict)   # teacher.<key> -> the version or path it used

    @property
    def domains(self) -> list[str]:
        return sorted(self.by_domain)

    @property
    def old_run_id(self) -> str | None:
        """The MLflow run of the checkpoint resumed from."""
        return read_state(self.ckpt).get("mlflow_run_id") if self.ckpt is not None else None


def check_inputs(cfg: DistillConfig, out: Path, accelerator: Accelerator) -> Inputs:
    """Everything that can fail without a model, before one is loaded: the resume
    settings (refused before anything is written), the batch split, the data rows and their
    routing, the teachers' tokenizers, the reward functions, the agent domains' environments
    and harnesses, a sampler server, and an --out that already holds a run."""
    uri = resolve_uri(cfg.mlflow.tracking_uri, out)
    check_store(uri)   # a tracking server that does not answer: named in seconds, not after MLflow's retries
    ckpt = latest_checkpoint(out) if cfg.train.resume else None
    settings, changed = resume_settings(cfg, ckpt)
    world = accelerator.num_processes
    if cfg.train.prompts_per_step % world:
        raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} is not divisible by the "
                          f"{world} processes")
    if accelerator.is_main_process:
        print(f"[mopd] {world} process(es), {accelerator.distributed_type.value}, {cfg.train.prompts_per_step} "
              f"prompts per step ({cfg.train.prompts_per_step // world} per rank)", file=sys.stderr)
    check_paths(cfg)   # every missing path at once, then the student's folder
    check_quant_shapes(cfg)   # QAT's block divides every quantized Linear (config.json only)
    check_checkpoint_dir(out)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    check_tokenizer(tokenizer, cfg.model.path)
    by_domain = load_prompts(cfg, tokenizer)
    used_keys = sorted({p.teacher_key for ps in by_domain.values() for p in ps})
    teacher_paths = resolve_teachers(cfg.teachers, used_keys, tokenizer, cfg.model.path, tracking_uri=uri)
    # the versions the aliases name now: the student's lineage when it is registered
    teacher_versions = lineage({k: cfg.teachers[k] for k in used_keys}, uri)
    # prompt + completion within every model's positions and the engines' max_model_len
    check_context(cfg, sorted(by_domain), {"the student (model.path)": cfg.model.path,
                                           **{f"teacher {k}": p for k, p in teacher_paths.items() if p is not None}})
    reward_fns = {d: load_reward_fn(r, cfg.reward_kwargs.get(d)) for d, r in cfg.rewards.items()}
    agents = A.load_agents(cfg, tokenizer)
    A.check_vision(cfg, teacher_paths)   # images: the HF sampler, in-process vision-language teachers
    # a sampler server is opened (reachable, the token route on, raw log-probs) before any model loads
    rollout = open_rollout(cfg, accelerator) if rollout_kind(cfg.rollout) == "server" else None
    try:
        _claim_out(cfg, out, accelerator)
    except BaseException:
        if rollout is not None:
            rollout.close()
        raise
    return Inputs(tokenizer, by_domain, teacher_paths, reward_fns, agents, ckpt, settings, changed, rollout,
                  teacher_versions)


def _claim_out(cfg: DistillConfig, out: Path, accelerator: Accelerator) -> None:
    """--out holds no other run's checkpoints (unless resuming); its config.yaml is this run's."""
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if not cfg.train.resume and latest_checkpoint(out) is not None:
            raise ConfigError(f"{out} already holds checkpoints; pass train.resume=true to continue "
                              "that run, or choose a new --out")
        (out / "config.yaml").write_text(dump_yaml(cfg))
    accelerator.wait_for_everyone()


def rollout_kind(r) -> str:
    """The sampler backend of `rollout` settings r: vLLM in this process, a vLLM server,
    or the trainer's own module (HF); asynchronous steps sample from a copy of it, since
    the trainer's module changes during the update the sampler runs beside."""
    if r.backend in ("vllm", "server"):
        return r.backend
    return "hf_copy" if r.async_steps else "hf"


def open_rollout(cfg: DistillConfig, accelerator: Accelerator, *, model=None, tokenizer=None):
    """The run's sampler, of kind `rollout_kind(cfg.rollout)`. The server one (another
    process or node; the trainer pushes its weights to it) needs no model and is probed as
    it opens; the HF one samples from `model`, the trainer's own module."""
    r, kind = cfg.rollout, rollout_kind(cfg.rollout)
    if kind == "server":
        rs = r.server
        if not rs.urls:
            raise ConfigError("rollout.backend=server needs rollout.server.urls: start the sampler server with "
                              "`mopd teachers serve --config RECIPE --out DIR` and pass the overrides it writes")
        return make_rollout("server", urls=rs.urls, transfer=rs.transfer, group_host=rs.group_host,
                            group_port=rs.group_port, timeout_s=rs.timeout_s, max_retries=rs.max_retries,
                            concurrency=rs.concurrency, rank=accelerator.process_index,
                            world_size=accelerator.num_processes)
    if kind == "vllm":
        return make_rollout("vllm", model_path=cfg.model.path, dtype=cfg.model.dtype, seed=cfg.train.seed,
                            max_model_len=r.max_model_len, kv_cache_gb=r.kv_cache_gb,
                            gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager)
    if kind == "hf_copy":
        return make_rollout("hf_copy", model_path=cfg.model.path, tokenizer=tokenizer,
                            dtype=torch_dtype(cfg.model.dtype), device=accelerator.device)
    return make_rollout("hf", model=model, tokenizer=tokenizer)


def resume_settings(cfg: DistillConfig, ckpt: Path | None) -> tuple[dict, dict[str, tuple]]:
    """The run's training settings, and how they differ from those `ckpt` was written
    with; a difference is refused (before anything is loaded or written) unless
    train.accept_config_change=true."""
    settings = training_settings(flatten(to_dict(cfg)))
    if ckpt is None:
        return settings, {}
    old = read_state(ckpt).get("settings")
    if old is None:     # written before checkpoints recorded their settings
        return settings, {}
    diff = {k: v for k, v in settings_diff(old, settings).items() if not _new_default(k, v)}
    if diff and not cfg.train.accept_config_change:
        lines = "\n".join(f"  {k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in diff.items())
        raise ConfigError(f"train.resume=true from {ckpt}, but the training settings differ from the "
                          f"checkpoint's:\n{lines}\nresume with the checkpoint's settings, or pass "
                          f"train.accept_config_change=true to continue with the new ones (they apply "
                          f"from step {read_state(ckpt).get('step')} on)")
    return settings, diff


_PARTIAL_DEFAULTS = dataclasses.asdict(PartialRollouts())


def _new_default(key: str, change: tuple) -> bool:
    """A setting added after the checkpoint was written, at its default: agent domains'
    `partial` (off) changes nothing a checkpoint from before it computed."""
    parts = key.split(".")
    if key in ("rollout.async_steps", "model.dropout"):   # added later; off is what every older checkpoint did
        return change[0] == "<unset>" and change[1] is False
    return (change[0] == "<unset>" and len(parts) == 4 and parts[0] == "agents" and parts[2] == "partial"
            and _PARTIAL_DEFAULTS.get(parts[3], object()) == change[1])


def start_mlflow(cfg: DistillConfig, out: Path, run_id: str | None, domains: list[str], *, fresh: bool,
                  changed: dict | None = None, ckpt: Path | None = None) -> str:
    """The run's MLflow run: the checkpoint's one on resume (a new one tagged
    mopd.resumed_from_run_id when that run is gone from the store); a new run logs the
    config, a resume with accepted setting changes tags them. A store that cannot be
    opened is an error naming its URI, raised before any model is loaded."""
    uri = resolve_uri(cfg.mlflow.tracking_uri, out)
    try:
        run = start_run(experiment=cfg.mlflow.experiment, uri=uri, run_name=cfg.mlflow.run_name or out.name,
                        run_id=run_id, tags={**cfg.mlflow.tags, "stage": "mopd", "domains": ",".join(domains)},
                        parent_run_id=cfg.mlflow.parent_run_id)
    except Exception as e:  # noqa: BLE001 - MLflow and the database driver raise many types
        raise StoreUnreachable(f"cannot open the MLflow store at {uri}: {type(e).__name__}: {e}") from None
    new_run = fresh or run.info.run_id != run_id
    try:
        if new_run:
            flat = {k: (json.dumps(v) if isinstance(v, (list, dict)) else v)
                    for k, v in flatten(to_dict(cfg)).items()}
            mlflow.log_params({k: str(v)[:6000] for k, v in flat.items()})
            mlflow.log_artifact(str(out / "config.yaml"))
        if changed:
            step = read_state(ckpt).get("step") if ckpt is not None else None
            print(f"[mopd] resuming with changed settings from step {step}: "
                  + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()), file=sys.stderr)
            mlflow.set_tags({f"mopd.config_change.step_{step}": json.dumps(
                {k: [a, b] for k, (a, b) in changed.items()}, default=str)[:5000]})
            if not new_run:
                mlflow.log_artifact(str(out / "config.yaml"), f"config_step_{step}")
    except Exception:
        end_run("FAILED")
        raise
    return run.info.run_id
