"""Agent episodes: the student writes a turn, the environment answers, until it is done.

`run_episodes` drives a batch of episodes at once: each turn is one `rollout.generate`
over the current token sequences of all live episodes, so a turn costs one sampler call
whatever the batch size. Each episode's tokens are one growing sequence

    prompt (system + user, chat template)  turn 0  obs 0  turn 1  obs 1 ...

continued, never re-tokenized: the ids the student sampled stay verbatim, and the
observation tokens are the chat template's text between an assistant turn's EOS and the
next generation prompt (`core.agent.transcript.observation_ids`). The sequence is kept as
a `Sample` whose completion holds every token after the prompt, with `loss_mask` 1 on the
student's tokens and 0 on observations, and `turn_ids` (-1 on observations), so a teacher
scores the whole transcript in one forward pass and only the student's tokens carry loss.

Playing is resumable: `start_episodes` resets the environments into `LiveEpisode`s, and
`play` takes turns until every episode has ended or its `stop_when` says the caller has
waited long enough (partial rollouts in the MOPD loop); the episodes still going keep
their environment, segment and turn count, and a later `play` (with newer weights)
continues them where they stopped. Every token records the weights version that sampled
it (`Episode.versions`, -1 on observations) beside its sampler log-prob, so a trainer can
tell how stale each token is. `run_episodes` is `start_episodes` + one `play` to the end.

A context policy that rewrites earlier turns (last_k) changes the prefix the model sees:
the episode then starts a new segment whose prompt is the re-rendered view, so every
segment is one exact token sequence.

Image observations (a list content with image items: the frontend_loop screenshot) need
a vision-language student: `processor` (core.vision.VisionProcessor) expands each image
into its pad tokens, masked like any observation, and the segment's `vision` holds the
pixel values every later forward over it takes (the sampler's, the loss's, the teacher's).

Bad input never stops the batch: an environment that raises ends that episode as failed
(the error is logged with the task id); a malformed tool call is the environment's error
observation; an episode whose next turn would not fit in `max_context_tokens` is cut
(`cut="max_context_tokens"`) before it is sampled, so no sequence outgrows the budget.
"""
from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from core.agent.transcript import end_of_turn_id, image_observation_ids, observation_ids, prompt_ids, vision_prompt_ids
from core.rollout.base import Sample


@dataclass
class Episode:
    task_id: str
    harness: str
    segments: list[Sample] = field(default_factory=list)   # usually one; empty when reset failed
    messages: list[dict] = field(default_factory=list)     # the chat transcript (system, user, assistant, ...)
    turns: int = 0
    student_tokens: int = 0
    calls: int = 0
    failed_calls: int = 0
    env_error: str | None = None
    success: bool = False
    reward: float = 0.0
    cut: str | None = None                # "max_turns" | "max_context_tokens" | None
    first_failed_turn: int | None = None
    recovered: bool = False               # succeeded after a failed call
    # per segment, per completion token: the weights version that sampled it (-1: not sampled)
    versions: list[list[int]] = field(default_factory=list)


def turn_seed(seed: int, turn: int) -> int:
    """The sampler seed of an episode's turn, derived from the episode's seed."""
    return int(hashlib.sha256(f"{seed}/turn/{turn}".encode()).hexdigest()[:8], 16)


def _decode(tokenizer, ids: list[int]) -> str:
    # No clean-up of spaces: the text must be exactly what the tokens spell.
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class LiveEpisode:
    """An episode being played: its environment, seed, current segment and the index of
    its next turn; `done` once it ended (success, failure or cut), `closed` once its
    environment was released."""
    ep: Episode
    env: object
    seed: int
    seg: Sample | None = None
    done: bool = False
    closed: bool = False
    turn: int = 0

    @property
    def length(self) -> int:
        return len(self.seg.prompt_ids) + len(self.seg.completion_ids)


@dataclass
class Played:
    """What one `play` call did: the episodes that ended and those still going (both in
    input order), and the student tokens it sampled."""
    finished: list[LiveEpisode]
    unfinished: list[LiveEpisode]
    tokens: int


# stop_when(ended, total, tokens): ended episodes of the call, all of them, student tokens sampled so far
StopWhen = Callable[[int, int, int], bool]


def _new_segment(r: LiveEpisode, ids: list[int], vision=None) -> None:
    r.seg = Sample(prompt_ids=ids, completion_ids=[], sampler_logprobs=[], finished=False, loss_mask=[], turn_ids=[],
                   vision=vision)
    r.ep.segments.append(r.seg)
    r.ep.versions.append([])


def _append(r: LiveEpisode, ids: list[int], logprobs: list[float], student: bool, turn: int, version: int) -> None:
    seg = r.seg
    seg.completion_ids += ids
    seg.sampler_logprobs += logprobs
    seg.loss_mask += [int(student)] * len(ids)
    seg.turn_ids += [turn if student else -1] * len(ids)
    r.ep.versions[-1] += [version if student else -1] * len(ids)


def _fail(r: LiveEpisode, error: str) -> None:
    r.ep.env_error, r.ep.success, r.ep.reward, r.done = error, False, 0.0, True
    print(f"[mopd] agent episode {r.ep.task_id!r} (harness {r.ep.harness or '-'}): environment error: {error}; "
          "the episode is marked failed, the run continues", file=sys.stderr)


def _view(r: LiveEpisode) -> list[dict]:
    """What the model sees of the transcript (the harness's context policy)."""
    harness = getattr(r.env, "harness", None)
    return harness.apply_context(r.ep.messages) if harness is not None else list(r.ep.messages)


def _start(r: LiveEpisode, task: dict, tokenizer, max_context_tokens: int, max_new_tokens: int) -> None:
    try:
        first = r.env.reset(task)
    except Exception as e:   # noqa: BLE001 (any environment failure ends this episode only)
        _fail(r, repr(e))
        return
    head = getattr(r.env, "messages", None)   # ToolEnv: [system (the harness's prompt), user]
    r.ep.messages = [dict(m) for m in head] if head else [{"role": "user", "content": first}]
    _new_segment(r, prompt_ids(tokenizer, _view(r)))
    if r.length + max_new_tokens > max_context_tokens:
        r.ep.cut, r.done = "max_context_tokens", True


def _observation(r: LiveEpisode, tokenizer, processor, role: str, obs):
    """(ids, Vision or None) of an observation: text, or a list content with images."""
    if isinstance(obs, str):
        return observation_ids(tokenizer, role, obs), None
    if processor is None:
        raise ValueError("an image observation needs a vision-language student (a processor); this one is "
                         "text-only: use a text observation (frontend_loop: rewards.frontend_loop:make_env)")
    return image_observation_ids(tokenizer, processor, role, obs)


def _extend(r: LiveEpisode, obs_ids: list[int], vision, turn: int, version: int) -> None:
    from core.vision import cat_vision

    _append(r, obs_ids, [0.0] * len(obs_ids), False, turn, version)
    if vision is not None:
        r.seg.vision = cat_vision([r.seg.vision, vision])


def _take_turn(r: LiveEpisode, smp: Sample, turn: int, tokenizer, *, eos_ids: set[int], end_id: int,
               last_turn: bool, max_context_tokens: int, max_new_tokens: int, version: int,
               processor=None) -> None:
    """Record the student's turn, let the environment answer, append the observation."""
    ep, ids = r.ep, list(smp.completion_ids)
    _append(r, ids, list(smp.sampler_logprobs), True, turn, version)
    ep.turns += 1
    ep.student_tokens += len(ids)
    # The turn's text is what the template renders before its end-of-turn token. A turn cut
    # by max_new_tokens (or ended by another EOS id) gets that token appended, masked.
    closed = bool(ids) and ids[-1] == end_id
    text = _decode(tokenizer, ids[:-1] if closed else ids)
    if not closed:
        _append(r, [end_id], [0.0], False, turn, version)
    r.seg.finished = bool(ids) and ids[-1] in eos_ids
    ep.messages.append({"role": "assistant", "content": text})
    try:
        obs, done, info = r.env.step(text)
    except Exception as e:   # noqa: BLE001
        _fail(r, repr(e))
        return
    ep.calls += int(info.get("calls", 0))
    ep.failed_calls += int(info.get("failed_calls", 0))
    if info.get("failed_calls") and ep.first_failed_turn is None:
        ep.first_failed_turn = turn
    if info.get("env_error"):
        _fail(r, str(info["env_error"]))
        return
    if done:
        ep.success = bool(info.get("success", False))
        ep.reward = float(info.get("reward", float(ep.success)))
        ep.recovered = ep.success and ep.failed_calls > 0
        r.done = True
        return
    role = info.get("obs_role", "tool")
    ep.messages.append({"role": role, "content": obs})
    if last_turn:
        ep.cut, r.done = "max_turns", True
        return
    view = _view(r)
    try:
        if view == ep.messages:   # the usual case: extend the exact sampled sequence
            obs_ids, vision = _observation(r, tokenizer, processor, role, obs)
        else:                     # the context policy rewrote earlier turns: a new segment
            new, vision = vision_prompt_ids(tokenizer, processor, view) if processor is not None \
                else (prompt_ids(tokenizer, view), None)
    except (ValueError, OSError) as e:   # an image the student cannot take: this episode fails
        _fail(r, repr(e))
        return
    if view == ep.messages:
        if r.length + len(obs_ids) + max_new_tokens > max_context_tokens:
            ep.cut, r.done = "max_context_tokens", True
            return
        _extend(r, obs_ids, vision, turn, version)
    else:
        if len(new) + max_new_tokens > max_context_tokens:
            ep.cut, r.done = "max_context_tokens", True
            return
        _new_segment(r, new, vision)


def _check_budgets(where: str, max_turns: int, max_new_tokens: int) -> None:
    if max_turns < 1 or max_new_tokens < 1:
        raise ValueError(f"{where}: max_turns ({max_turns}) and max_new_tokens ({max_new_tokens}) must be >= 1")


def start_episodes(tokenizer, envs: list, tasks: list[dict], *, seeds: list[int], max_context_tokens: int,
                   max_new_tokens: int) -> list[LiveEpisode]:
    """Reset one environment per task; an episode whose reset fails (or whose prompt leaves
    no room for a turn) is already done. Episode i samples with seeds derived from seeds[i]."""
    if not len(envs) == len(tasks) == len(seeds):
        raise ValueError(f"run_episodes: {len(envs)} envs, {len(tasks)} tasks, {len(seeds)} seeds (need one each)")
    runs = []
    for i, (env, task, seed) in enumerate(zip(envs, tasks, seeds)):
        harness = getattr(getattr(env, "harness", None), "name", "")
        r = LiveEpisode(Episode(task_id=str(task.get("id", i)), harness=harness), env, int(seed))
        _start(r, task, tokenizer, max_context_tokens, max_new_tokens)
        runs.append(r)
    return runs


def play(rollout, tokenizer, runs: list[LiveEpisode], *, temperature: float, top_p: float, max_turns: int,
         max_context_tokens: int, max_new_tokens: int, eos_ids: set[int], version: int = 0,
         stop_when: StopWhen | None = None, processor=None) -> Played:
    """Take turns for every live episode of `runs`, all batched into one sampler call per
    round (each episode at its own turn index and seed), until none is live or, checked
    after each round, `stop_when(ended, len(runs), tokens sampled)` is true. Tokens
    sampled here record `version`. Ended episodes have their environment closed; the
    others keep it open for a later `play`."""
    _check_budgets("play", max_turns, max_new_tokens)
    end_id = end_of_turn_id(tokenizer)
    tokens = 0
    while True:
        live = [r for r in runs if not r.done]
        for r in live:   # the next turn must fit: cut here rather than outgrow the context
            if r.turn >= max_turns:
                r.ep.cut, r.done = "max_turns", True
            elif r.length + max_new_tokens > max_context_tokens:
                r.ep.cut, r.done = "max_context_tokens", True
        live = [r for r in live if not r.done]
        if not live:
            break
        # images only where an episode has some: a text-only sampler backend never sees the argument
        vision = {"vision": [r.seg.vision for r in live]} if any(r.seg.vision is not None for r in live) else {}
        samples = rollout.generate([r.seg.prompt_ids + r.seg.completion_ids for r in live],
                                   max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   seeds=[turn_seed(r.seed, r.turn) for r in live], **vision)
        for r, smp in zip(live, samples):
            turn, r.turn = r.turn, r.turn + 1
            tokens += len(smp.completion_ids)
            _take_turn(r, smp, turn, tokenizer, eos_ids=eos_ids, end_id=end_id, last_turn=turn == max_turns - 1,
                       max_context_tokens=max_context_tokens, max_new_tokens=max_new_tokens, version=version,
                       processor=processor)
            if r.done:
                _close(r)
        if stop_when is not None and stop_when(sum(r.done for r in runs), len(runs), tokens):
            break
    for r in runs:   # ended at reset or cut before a turn
        if r.done:
            _close(r)
    return Played([r for r in runs if r.done], [r for r in runs if not r.done], tokens)


def run_episodes(rollout, tokenizer, envs: list, tasks: list[dict], *, seeds: list[int], temperature: float,
                 top_p: float, max_turns: int, max_context_tokens: int, max_new_tokens: int,
                 eos_ids: set[int], processor=None) -> list[Episode]:
    """Play one episode per (env, task) to its end, all turns batched; episode i samples
    with seeds derived from seeds[i] (`turn_seed`). Returns the episodes in input order.
    `processor`: a vision-language student's (core.vision.VisionProcessor), for image
    observations."""
    if not len(envs) == len(tasks) == len(seeds):
        raise ValueError(f"run_episodes: {len(envs)} envs, {len(tasks)} tasks, {len(seeds)} seeds (need one each)")
    _check_budgets("run_episodes", max_turns, max_new_tokens)
    runs = start_episodes(tokenizer, envs, tasks, seeds=seeds, max_context_tokens=max_context_tokens,
                          max_new_tokens=max_new_tokens)
    play(rollout, tokenizer, runs, temperature=temperature, top_p=top_p, max_turns=max_turns,
         max_context_tokens=max_context_tokens, max_new_tokens=max_new_tokens, eos_ids=eos_ids, processor=processor)
    return [r.ep for r in runs]


def abandon(r: LiveEpisode) -> None:
    """Give up an unfinished episode (a checkpoint or the run's end while it is in flight):
    its environment is released; the episode is not trained on."""
    _close(r)


def _close(r: LiveEpisode) -> None:
    """Release what the environment holds (a coding workspace, its sandbox) as soon as its
    episode ends, not at garbage collection; an env without `close` holds nothing. Twice is
    harmless: closing is idempotent."""
    close = getattr(r.env, "close", None)
    if r.closed or not callable(close):
        return
    r.closed = True
    try:
        close()
    except Exception as e:   # noqa: BLE001 (the episode is over; its result stands)
        print(f"[mopd] agent episode {r.ep.task_id!r}: closing its environment failed: {e!r}", file=sys.stderr)
