"""Environments for multi-turn agents.

`Environment` is what the episode runner, the evals and the expert's RL drive:
`reset(task) -> first user message`, `step(assistant_text) -> (observation, done, info)`.
A domain does not write one: it writes a `ToolBackend` (its tools, their effects, the
success check) and `ToolEnv` puts a harness in front of it, so one backend serves every
harness (call syntax, tool names, prompt, context, memory) a run samples.

What `ToolEnv.step` does with the assistant's text:

    malformed call      -> observation "error: <what was wrong>", a failed call, not done
    no call             -> backend.end_turn(text): the next user message (obs_role "user"),
                           or, when it returns None, done with backend.finish(text)'s verdict
    calls               -> each one run (memory tools by the harness, the rest by the backend);
                           ToolError -> "error: <msg>" as that call's result, a failed call
    any other exception -> done, info["env_error"] = repr(e), success False: the episode
                           failed, the run goes on

`info` always has `calls` and `failed_calls` (this step's counts; the episode totals are
`ToolEnv.calls` / `ToolEnv.failed_calls`), `env_error` and `obs_role`; at done also
`success` and `reward`.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from core.agent.harness import CallSyntaxError, Harness, HarnessConfig, MemoryStore, ToolCall, ToolSpec


class ToolError(Exception):
    """A tool call that failed in a way the model should see (and may recover from)."""


@runtime_checkable
class Environment(Protocol):
    tools: dict[str, ToolSpec]

    def reset(self, task: dict) -> str:
        """Start an episode; returns the first user message's text."""
        ...

    def step(self, assistant_text: str) -> tuple[str, bool, dict]:
        """The assistant's turn; returns (observation text, done, info)."""
        ...


@runtime_checkable
class ToolBackend(Protocol):
    """A domain's tools and their state (one instance per environment, reset per task)."""

    def tools(self) -> dict[str, ToolSpec]: ...

    def reset(self, task: dict) -> str:
        """Set up the task's state; returns the user message text."""
        ...

    def call(self, call: ToolCall) -> str:
        """Run one call (canonical names, arguments checked against the schema); returns the
        result text, or raises ToolError for a failed call."""
        ...

    def end_turn(self, final_text: str) -> str | None:
        """The assistant answered without a call: the next user message, or None when the task is over."""
        ...

    def finish(self, final_text: str) -> dict:
        """The verdict at the end of the episode: {"success": bool, "reward": float, ...}."""
        ...

    # Optional: `task_tools(task) -> list[str] | None`, the canonical names a task needs; ToolEnv
    # then offers only those (a shorter system prompt for a task involving one API of several).


class ToolEnv:
    """An Environment over a ToolBackend, through a harness."""

    def __init__(self, backend: ToolBackend, harness_cfg: HarnessConfig, memory: MemoryStore | None = None,
                 family_key: str = "family"):
        self.backend = backend
        self.tools: dict[str, ToolSpec] = dict(backend.tools())
        self.full_harness = Harness(harness_cfg, self.tools, memory)   # ConfigError: a harness the tools don't fit
        self.harness = self.full_harness
        self.family_key = family_key
        self.family = "default"
        self.messages: list[dict] = []
        self.calls = 0
        self.failed_calls = 0
        self.done = True

    def reset(self, task: dict) -> str:
        """The first user message; the backend's exceptions propagate (a task it cannot set up
        is bad data, not a failed episode)."""
        self.family = str(task.get(self.family_key) or "default")
        user = self.backend.reset(task)
        self.harness = self.harness_for(task)
        self.messages = [{"role": "system", "content": self.harness.system_prompt()},
                         {"role": "user", "content": user}]
        self.calls = self.failed_calls = 0
        self.done = False
        return user

    def harness_for(self, task: dict) -> Harness:
        """The harness an episode of `task` runs through (only the tools the task offers),
        without setting the task up: what an oracle transcript's system prompt needs."""
        narrow = getattr(self.backend, "task_tools", None)
        return self.full_harness.restricted(narrow(task) if callable(narrow) else None)

    def step(self, assistant_text: str) -> tuple[str, bool, dict]:
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset(task) first")
        self.messages.append({"role": "assistant", "content": assistant_text})
        info: dict = {"calls": 0, "failed_calls": 0, "env_error": None, "obs_role": "tool"}
        try:
            obs, done = self._step(assistant_text, info)
        except Exception as e:   # the backend broke: this episode failed, the run goes on
            obs, done = "", True
            info.update(env_error=repr(e), success=False, reward=0.0)
        self.calls += info["calls"]
        self.failed_calls += info["failed_calls"]
        if done:
            info.setdefault("success", False)
            info.setdefault("reward", float(bool(info["success"])))
            self.done = True
        else:
            self.messages.append({"role": info["obs_role"], "content": obs})
        return obs, done, info

    def _step(self, text: str, info: dict) -> tuple[str, bool]:
        try:
            calls = self.harness.parse(text)
        except CallSyntaxError as e:
            info.update(calls=1, failed_calls=1)
            return f"error: {e}", False
        if not calls:
            user = self.backend.end_turn(text)
            if user is None:
                info.update(self.backend.finish(text))
                return "", True
            info["obs_role"] = "user"
            return user, False
        results = []
        for call in calls:
            info["calls"] += 1
            result = self.harness.builtin(call, self.family)
            if result is None:
                try:
                    result = self.backend.call(call)
                except ToolError as e:
                    info["failed_calls"] += 1
                    result = f"error: {e}"
            results.append(str(result))
        return self.harness.format_observation(results), False


def reward_columns(reward_name: str, domain_name: str, completions, task=None, harness=None,
                   domain=None) -> tuple[list, list, list, list[bool]]:
    """The columns an agent domain's reward (TRL's signature) reads, checked: returns
    (completions, tasks, harness names, mine) with one entry per completion; `mine[i]` is
    False for rows of another domain (their score is None). A missing `task` column or a
    column of the wrong length is a ValueError naming the reward and the column."""
    completions = list(completions)
    n = len(completions)
    domains = list(domain) if domain is not None else [None] * n
    mine = [d is None or d == domain_name for d in domains]
    if any(mine) and task is None:
        raise ValueError(f"{reward_name} needs the `task` column (the task as JSON)")
    tasks = list(task) if task is not None else [None] * n
    names = list(harness) if harness is not None and not isinstance(harness, str) else [harness] * n
    for col, vals in (("task", tasks), ("harness", names), ("domain", domains)):
        if len(vals) != n:
            raise ValueError(f"{reward_name}: {n} completions but {len(vals)} values of {col!r}")
    return completions, tasks, names, mine
