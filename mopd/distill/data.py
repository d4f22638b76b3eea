"""Prompts for the loop: every dataset row checked and tokenized before any model is
loaded, grouped by domain and routed to a teacher key; the seeded sampler that draws
each step's batch by the domain mix (its position is saved in checkpoints)."""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from core.config import ConfigError
from mopd.distill.config import DatasetSpec, DistillConfig, RolloutConfig
from core.sft import encode_example


@dataclass
class Prompt:
    index: int                    # position in the pooled prompt table
    domain: str
    teacher_key: str
    messages: list[dict]
    ids: list[int]
    columns: dict[str, Any]
    reference_ids: list[int] | None = None   # the dataset completion + EOS (rollout.on_policy_fraction < 1)


def _check_json_file(p: Path) -> None:
    """A .jsonl (one JSON object a line) or .json file read before `datasets` parses it:
    a decode error, a junk line or no rows at all is reported with the file and line
    (datasets' own errors omit the file, or come as a long chained traceback)."""
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = p.read_bytes()[:e.start].count(b"\n") + 1
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}, line {line})") from None
    if p.suffix == ".json" and text.lstrip()[:1] in ("[", "{") and not text.lstrip().startswith("{\""):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, list) or (isinstance(obj, dict) and obj):
            rows = obj if isinstance(obj, list) else next(iter(obj.values()), [])
            if not rows:
                raise ConfigError(f"{p}: has no rows")
            return
    n = 0
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} line {i}: not valid JSON ({e.msg}); a .jsonl file holds one JSON object "
                              "a line") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{p} line {i}: a row must be a JSON object, got {type(row).__name__}")
        n += 1
    if n == 0:
        raise ConfigError(f"{p}: has no rows (an empty file)")


def _load_rows(spec: DatasetSpec):
    p = Path(spec.path)
    if not p.exists():
        raise ConfigError(f"data.datasets: {spec.path!r} does not exist")
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except (FileNotFoundError, ValueError, OSError) as e:
            raise ConfigError(f"data.datasets: {spec.path} is a folder but not a dataset saved with "
                              f"save_to_disk ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        if isinstance(ds, datasets.DatasetDict):
            if spec.split not in ds:
                raise ConfigError(f"{spec.path}: no split {spec.split!r} (has {list(ds)})")
            ds = ds[spec.split]
        if len(ds) == 0:
            raise ConfigError(f"{spec.path}: has no rows")
        return ds
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(p.suffix)
    if kind is None:
        raise ConfigError(f"{spec.path}: unsupported data file type {p.suffix!r}")
    if kind == "json":
        _check_json_file(p)
    try:
        ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the file is what matters
        cause = e.__cause__ or e.__context__ or e
        raise ConfigError(f"{spec.path}: cannot be read as {kind} ({type(cause).__name__}: "
                          f"{str(cause).splitlines()[0][:200] if str(cause) else ''})") from None
    if len(ds) == 0:
        raise ConfigError(f"{spec.path}: has no rows")
    return ds


def teacher_key_for(domain: str, effort: str | None, teachers: dict) -> str | None:
    if effort and f"{domain}/{effort}" in teachers:
        return f"{domain}/{effort}"
    return domain if domain in teachers else None


def load_prompts(cfg: DistillConfig, tokenizer) -> dict[str, list[Prompt]]:
    """All prompts grouped by domain, tokenized with the student's chat template.
    Every problem with the rows is reported here, before any model is loaded."""
    by_domain: dict[str, list[Prompt]] = {}
    rollout_for: dict[str, RolloutConfig] = {}   # each domain's settings, resolved once
    too_long = 0
    idx = 0
    for spec in cfg.data.datasets:
        ds = _load_rows(spec)
        cols = ds.column_names
        for needed in (cfg.data.prompt_column, "domain"):
            if needed not in cols:
                raise ConfigError(f"{spec.path}: rows have no {needed!r} column (columns: {cols}); "
                                  "every prompt row needs a 'domain' to route it to its teacher")
        for i, row in enumerate(ds):
            domain, effort = row["domain"], row.get("effort")
            if not domain or not isinstance(domain, str):
                raise ConfigError(f"{spec.path} row {i}: empty or non-string 'domain' ({domain!r})")
            msgs = _row_messages(row[cfg.data.prompt_column], f"{spec.path} row {i}", cfg.data.prompt_column)
            key = teacher_key_for(domain, effort, cfg.teachers)
            if key is None:
                want = f"{domain!r}" + (f" (or {domain}/{effort})" if effort else "")
                raise ConfigError(f"{spec.path} row {i}: no teacher for domain {want}; "
                                  f"teachers has {sorted(cfg.teachers)}")
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            if len(ids) > cfg.data.max_prompt_tokens:
                too_long += 1
                continue
            if domain in cfg.agents:
                _check_task(row.get("task"), f"{spec.path} row {i}", domain)
            extra = {k: v for k, v in row.items() if k not in (cfg.data.prompt_column,)}
            ref = None
            if domain not in rollout_for:
                rollout_for[domain] = cfg.rollout.for_domain(domain)
            rdom = rollout_for[domain]
            if rdom.uses_references:
                if not row.get("completion"):
                    raise ConfigError(f"{spec.path} row {i}: rollout.on_policy_fraction="
                                      f"{rdom.on_policy_fraction} (ramp {rdom.on_policy_ramp_steps} steps) for "
                                      f"domain {domain!r} needs a non-empty 'completion' column "
                                      f"(columns: {cols})")
                ref = encode_example(tokenizer, msgs, row["completion"])[1][:cfg.rollout.max_new_tokens]
            by_domain.setdefault(domain, []).append(Prompt(idx, domain, key, msgs, ids, extra, ref))
            idx += 1
    if too_long:
        print(f"[mopd] skipped {too_long} prompts longer than data.max_prompt_tokens="
              f"{cfg.data.max_prompt_tokens}", file=sys.stderr)
    if not by_domain:
        raise ConfigError("no usable prompts in data.datasets")
    _check_domains(cfg, by_domain)
    return by_domain


def _row_messages(msgs, where: str, column: str) -> list[dict]:
    """A row's prompt as chat messages: a string is one user message; a list must hold
    {role, content} messages with string values."""
    if isinstance(msgs, str):
        msgs = [{"role": "user", "content": msgs}]
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m
                                                  and "content" in m for m in msgs)):
        raise ConfigError(f"{where}: {column!r} must be a string "
                          "or a list of {role, content} messages")
    for j, m in enumerate(msgs):
        for k in ("role", "content"):
            if not isinstance(m[k], str):
                raise ConfigError(f"{where}: message {j} of {column!r} has a "
                                  f"{type(m[k]).__name__} {k} ({str(m[k])[:80]!r}); role and content "
                                  "must be strings")
    return msgs


def _check_domains(cfg: DistillConfig, by_domain: dict[str, list[Prompt]]) -> None:
    """Every domain the config names (data.mix, rewards, reward_kwargs, agents,
    rollout.by_domain) has rows, every domain with rows has a data.mix weight, and
    task rewards have a reward function for every domain that trains."""
    mix = cfg.data.mix or {d: 1.0 for d in by_domain}
    for d in mix:
        if d not in by_domain:
            raise ConfigError(f"data.mix names domain {d!r}, which no dataset row has "
                              f"(domains in data: {sorted(by_domain)})")
    for d in by_domain:
        if d not in mix:
            raise ConfigError(f"domain {d!r} is in the data but not in data.mix; give it a weight "
                              "(0 to leave it out)")
    for d in cfg.rewards:
        if d not in by_domain:
            raise ConfigError(f"rewards names domain {d!r}, which no dataset row has")
    for d in cfg.reward_kwargs:
        if d not in cfg.rewards:
            raise ConfigError(f"reward_kwargs names domain {d!r}, which has no reward under rewards")
    for d in cfg.agents:
        if d not in by_domain:
            raise ConfigError(f"agents names domain {d!r}, which no dataset row has "
                              f"(domains in data: {sorted(by_domain)})")
    for d in cfg.rollout.by_domain:
        if d not in by_domain:
            raise ConfigError(f"rollout.by_domain names domain {d!r}, which no dataset row has "
                              f"(domains in data: {sorted(by_domain)})")
    if cfg.loss.task_reward_alpha > 0:   # an agent domain's reward is its episodes' own
        missing = [d for d in by_domain if mix[d] > 0 and d not in cfg.rewards and d not in cfg.agents]
        if missing:
            raise ConfigError(f"loss.task_reward_alpha > 0 but no reward function for domains "
                              f"{missing}: add them under rewards (domain: module:function)")


def _check_task(task, where: str, domain: str) -> None:
    """An agent row's `task`: a JSON object (string) the domain's environment resets to."""
    if task is None:
        raise ConfigError(f"{where}: domain {domain!r} is an agent domain (agents.{domain}) but the row has no "
                          "'task' column (a JSON object the environment resets to)")
    try:
        obj = json.loads(task) if isinstance(task, str) else task
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: 'task' is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: 'task' must be a JSON object, got {type(obj).__name__}")


class PromptSampler:
    """Draws each step's global batch by the domain mix, without replacement within an
    epoch of each domain; its state (cursors, epochs) is the data position saved in
    checkpoints."""

    def __init__(self, by_domain: dict[str, list[Prompt]], mix: dict[str, float], seed: int):
        self.domains = sorted(d for d in by_domain if mix.get(d, 1.0) > 0)
        w = np.array([mix.get(d, 1.0) for d in self.domains], dtype=np.float64)
        self.weights = w / w.sum()
        self.by_domain, self.seed = by_domain, seed
        self.cursor = {d: 0 for d in self.domains}
        self.epoch = {d: 0 for d in self.domains}

    def _perm(self, d: str) -> np.ndarray:
        h = int(hashlib.sha256(f"{self.seed}/{d}/{self.epoch[d]}".encode()).hexdigest()[:8], 16)
        return np.random.default_rng(h).permutation(len(self.by_domain[d]))

    def next_batch(self, step: int, n: int) -> list[Prompt]:
        rng = np.random.default_rng([self.seed, step])
        picks = rng.choice(len(self.domains), size=n, p=self.weights)
        out = []
        for k in picks:
            d = self.domains[k]
            if self.cursor[d] >= len(self.by_domain[d]):
                self.cursor[d], self.epoch[d] = 0, self.epoch[d] + 1
            out.append(self.by_domain[d][int(self._perm(d)[self.cursor[d]])])
            self.cursor[d] += 1
        return out

    def state_dict(self):
        return {"cursor": dict(self.cursor), "epoch": dict(self.epoch)}

    def load_state_dict(self, s):
        self.cursor.update(s["cursor"])
        self.epoch.update(s["epoch"])


def load_reward_fn(ref: str, kwargs: dict | None = None):
    """The reward function named 'module:function', with the recipe's keyword arguments bound."""
    mod, _, fn = ref.partition(":")
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rewards: cannot import {ref!r} ({e}); use 'package.module:function'") from None
    # A reward may check what it needs (a working sandbox, a model file) before any
    # model loads: `f.preflight(**kwargs)` raises what the first batch would have.
    check = getattr(f, "preflight", None)
    if callable(check):
        check(**(kwargs or {}))
    return functools.partial(f, **kwargs) if kwargs else f
