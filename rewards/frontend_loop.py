"""Environment and reward of the `frontend_loop` agent domain: the student writes a page,
sees what the browser made of it, and revises it (the frontend domain's tasks and checks,
played as an episode).

A turn is the student's HTML (its first ```html block, else the whole text, as the
frontend reward reads it). The environment renders it in the frontend reward's browser
pool (rewards/browser.py: the same Chromium, isolation and per-page deadline) and answers
with an observation, as the next user message:

    report      (text students) a render report: which checks' elements are missing or
                misplaced (the kind of check and the ids it names, never its expected
                text, color, tag or size), the measured box of every named element,
                console errors, and overflow of the viewport. Nothing in it says what a
                check wants, so it cannot be copied into a perfect page: it tells the
                student where to look, the prompt says what to write.
    screenshot  (vision-language students) the viewport's PNG (SCREENSHOT_CLIP of
                rewards/browser.py) as an image message. A text-only student, or a PNG
                over the model's image budget, is an error before any episode
                (`check_observation`; the MOPD loop calls the factory's `preflight`).

The episode ends when the student writes the done marker (`DONE` alone on the turn's last
line; a page in the same turn is rendered first and is the final page), when it has used
`max_turns` turns, or when a page hangs the renderer (does not load within the deadline,
crashes it): that episode ends at once with score 0 and nothing else.

Reward: the final page's score under the frontend checks (the share met; 0 when it
requested the network or opened a window, as in rewards/frontend.py). The first turn's
score is kept beside it (`info["first_score"]`, `env.scores`), so the benefit of revising
is visible. `reward(prompts, completions, task, ...)` (TRL's signature) replays a
completion's assistant turns through a fresh environment.

Task dicts (the `task` column, JSON): {"id", "family", "user": the page request,
"checks": the frontend checks (list)}; experts/frontend_loop/data.py makes them from the
frontend domain's tasks.
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

from core.agent.harness import Harness, HarnessConfig, MemoryStore
from core.completions import completion_text
from rewards.browser import SCREENSHOT_CLIP, PageJob, PageResult, get_pool
from rewards.frontend import MAX_HTML_CHARS, MAX_PAGES, TIMEOUT_S, check_script, html_of, parse_checks, score_result

DOMAIN = "frontend_loop"
REPO = Path(__file__).resolve().parents[1]
HARNESSES = REPO / "recipes" / "harnesses" / "frontend_loop.yaml"
DONE = "DONE"
MAX_TURNS = 4
OBSERVATIONS = ("report", "screenshot")
SYNTAX_HELP = (f"Write the whole page in one ```html block. You then see a report of how it rendered; "
               f"write the page again to fix it, or {DONE} alone on the last line when it is right.")
ALL_MET = "All checks pass."
HUNG = ("timeout", "crashed", "browser")

# Runs in the isolated world after the checks: the measured state of the page, nothing of
# what the checks want. IDS is replaced by the ids the checks name.
REPORT_JS = r"""
((ids) => {
  const de = document.documentElement;
  const out = {els: {}, overflow: [Math.max(0, de.scrollWidth - de.clientWidth), Math.max(0, de.scrollHeight - de.clientHeight)]};
  for (const id of ids) {
    const e = document.getElementById(id);
    if (!e) { out.els[id] = null; continue; }
    const r = e.getBoundingClientRect(), s = getComputedStyle(e);
    const shown = r.width > 0 && r.height > 0 && s.visibility !== "hidden" && s.display !== "none" && parseFloat(s.opacity) > 0;
    out.els[id] = {shown, x: Math.round(r.left), y: Math.round(r.top), w: Math.round(r.width), h: Math.round(r.height)};
  }
  return out;
})(IDS)
"""


def check_ids(check: dict) -> list[str]:
    """The element ids one check names."""
    if "ids" in check:
        return [str(i) for i in check["ids"]]
    return [str(check[k]) for k in ("id", "a", "b", "inner", "outer") if k in check]


def page_script(checks: list[dict]) -> str:
    """One expression for the isolated world: {"checks": [bool...], "state": measured state}."""
    ids = list(dict.fromkeys(i for c in checks for i in check_ids(c)))
    return ("({checks: " + check_script(checks).strip() + ", state: " +
            REPORT_JS.replace("IDS", json.dumps(ids)).strip() + "})")


# What a failed check says, by its type: the kind of property, never the value wanted.
_FAILED = {"text": "is not the element or text asked for", "exists": "is not the element asked for",
           "width": "has the wrong width", "height": "has the wrong height", "centered": "is not centered",
           "row": "are not side by side in the order asked", "above": "are not one above the other as asked",
           "inside": "is not inside the element asked for"}


def _failed_line(c: dict, state: dict) -> str:
    ids = check_ids(c)
    missing = [i for i in ids if not (state.get("els", {}).get(i) or {}).get("shown")]
    names = ", ".join(f"#{i}" for i in ids)
    if missing:
        return f"{', '.join('#' + i for i in missing)} missing or not shown"
    if c["type"] == "style":
        return f"#{c['id']} has the wrong {'background' if 'background' in str(c.get('prop')) else 'text color'}"
    return f"{names} {_FAILED.get(c['type'], 'is not as asked')}"


def render_report(checks: list[dict], res) -> str:
    """The text observation of one rendered page (module doc). `res`: a PageResult whose
    value is `page_script`'s."""
    if not res.loaded or res.error:
        return f"The page did not render ({res.error or 'not loaded'})."
    v = res.value if isinstance(res.value, dict) else {}
    met, state = v.get("checks") or [], v.get("state") or {}
    lines = []
    if res.requests or res.popups:
        lines.append("The page tried to load something or open a window: it scores 0. Use inline CSS only.")
    failed = list(dict.fromkeys(_failed_line(c, state) for c, ok in zip(checks, met) if ok is not True))
    if failed:
        lines.append(f"{len(met) - sum(1 for x in met if x is True)} of {len(met)} checks fail:")
        lines += [f"- {f}" for f in failed]
    elif not lines:
        lines.append(ALL_MET)
    boxes = []
    for i, b in (state.get("els") or {}).items():
        boxes.append(f"#{i}: " + ("absent" if b is None else "hidden" if not b["shown"] else
                                 f"x={b['x']} y={b['y']} w={b['w']} h={b['h']}"))
    if boxes:
        lines.append("Boxes: " + "; ".join(boxes))
    over = state.get("overflow") or [0, 0]
    if over[0] > 0:
        lines.append(f"The page is {over[0]} wider than the viewport.")
    if res.console:
        lines.append("Console errors: " + " | ".join(e[:120] for e in res.console[:3]))
    return "\n".join(lines)


def page_score(checks: list[dict], res) -> float:
    """score_result on page_script's value (its `checks` part)."""
    if isinstance(res.value, dict):
        res = type(res)(**{**res.__dict__, "value": res.value.get("checks")})
    return score_result(res, len(checks))


# ------------------------------------------------------------------------ observation checks

def image_budget(processor) -> int | None:
    """The most pixels one image may have for `processor` (a transformers processor or image
    processor, or core.vision.VisionProcessor): its max_pixels, else size's "max_pixels" or
    "longest_edge" (Qwen-VL's image processors keep the pixel budget there: a dict, or a
    SizeDict in transformers 5); None when it states none."""
    ip = getattr(processor, "image_processor", processor)
    if getattr(ip, "max_pixels", None):
        return int(ip.max_pixels)
    size = getattr(ip, "size", None) or {}
    get = size.get if isinstance(size, dict) else (lambda k: getattr(size, k, None))
    for key in ("max_pixels", "longest_edge"):
        if get(key):
            return int(get(key))
    return None


def check_observation(observation: str, tokenizer=None, processor=None, *, where: str = DOMAIN,
                      student: str | None = None) -> None:
    """Before any episode: the observation kind suits the student. A screenshot needs a
    vision-language model (a processor with an image processor and a chat template with
    image tokens) whose image budget holds the screenshot; a ValueError naming the fix
    otherwise."""
    if observation not in OBSERVATIONS:
        raise ValueError(f"{where}: unknown observation {observation!r}; expected one of {OBSERVATIONS}")
    if observation == "report":
        return
    ip = getattr(processor, "image_processor", None) if processor is not None else None
    image_token = getattr(processor, "image_token", None) or getattr(tokenizer, "image_token", None)
    if ip is None or not image_token:
        name = student or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"{where}: observation 'screenshot' puts images in the conversation, but the student "
                         f"({name}) is text-only (no image processor or image token); use observation 'report' "
                         f"(the env rewards.frontend_loop:make_env, in a MOPD recipe agents.{DOMAIN}.env, in an "
                         f"expert recipe agent.env) or a "
                         f"vision-language student (a checkpoint with preprocessor_config.json and image tokens, "
                         f"e.g. python -m core.standins --family qwen2.5-vl)")
    px = SCREENSHOT_CLIP["width"] * SCREENSHOT_CLIP["height"]
    budget = image_budget(processor)
    if budget is not None and px > budget:
        raise ValueError(f"{where}: the screenshot is {SCREENSHOT_CLIP['width']}x{SCREENSHOT_CLIP['height']} = "
                         f"{px} pixels, over the student's image budget of {budget} pixels (its image "
                         f"processor's max_pixels: size.longest_edge in preprocessor_config.json); raise it to at "
                         f"least {px} or use observation 'report' (rewards.frontend_loop:make_env)")


# ------------------------------------------------------------------------ the environment

class PageHarness:
    """What the episode runner reads of a harness (name, system prompt, context policy) for
    an environment without tools: the prompt's {syntax} is the done-marker rule."""

    def __init__(self, cfg: HarnessConfig):
        self.cfg, self.name = cfg, cfg.name
        self._h = Harness(cfg, {}, None)     # its context policy; it has no tools to offer

    def system_prompt(self) -> str:
        skills = ("\nTips:\n" + "\n".join(f"- {s}" for s in self.cfg.skills)) if self.cfg.skills else ""
        return self.cfg.system_prompt.format(tools="", syntax=SYNTAX_HELP, skills=skills, memory="").strip()

    def apply_context(self, messages: list[dict]) -> list[dict]:
        return self._h.apply_context(messages)


def says_done(text: str) -> bool:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return bool(lines) and lines[-1] == DONE


def _page_of(text: str) -> str:
    """The page in a turn (the done marker is not part of it)."""
    body = str(text).strip()
    if says_done(body):
        body = body[: body.rstrip().rfind(DONE)]
    return html_of(body).strip() if body.strip() else ""


class FrontendLoopEnv:
    """`reset(task) -> user message`, `step(text) -> (observation, done, info)` (module doc).
    `scores`: each rendered page's score in order; `shots`: screenshot paths."""
    tools: dict = {}

    def __init__(self, harness_cfg: HarnessConfig, memory: MemoryStore | None = None, *, observation: str = "report",
                 max_turns: int = MAX_TURNS, timeout_s: float = TIMEOUT_S, max_pages: int = MAX_PAGES,
                 executable: str | None = None, shot_dir: str | None = None):
        if observation not in OBSERVATIONS:
            raise ValueError(f"{DOMAIN}: unknown observation {observation!r}; expected one of {OBSERVATIONS}")
        self.harness = self.full_harness = PageHarness(harness_cfg)
        self.observation, self.max_turns = observation, int(max_turns)
        self.timeout_s, self.max_pages, self.executable = float(timeout_s), int(max_pages), executable
        self.done, self.messages, self._tmp = True, [], None
        self.shot_dir = shot_dir   # keep the screenshots there (a picture grid), else a temp dir removed at close
        self.calls = self.failed_calls = 0

    def harness_for(self, task: dict) -> PageHarness:
        return self.harness

    def reset(self, task: dict) -> str:
        self.task = task
        self.checks = parse_checks(task["checks"], f"task {task.get('id', '?')}")
        self.scores: list[float] = []
        self.shots: list[str] = []
        self.reports: list[str] = []
        self.turn, self.done, self.hung = 0, False, None
        self.messages = [{"role": "system", "content": self.harness.system_prompt()},
                         {"role": "user", "content": task["user"]}]
        return task["user"]

    def render(self, html: str):
        script = page_script(self.checks)
        shot = None
        if self.observation == "screenshot":
            if self.shot_dir:
                Path(self.shot_dir).mkdir(parents=True, exist_ok=True)
                shot = str(Path(self.shot_dir) / f"{self.task.get('id', 'task')}_turn{self.turn}.png")
            else:
                if self._tmp is None:
                    self._tmp = tempfile.TemporaryDirectory(prefix="mopd-frontend-loop-")
                shot = str(Path(self._tmp.name) / f"turn{self.turn}.png")
        # a screenshot is cached only where it stays (shot_dir): a temp dir's path is not the page's
        if _CACHE.get("on") and (self.observation == "report" or self.shot_dir):
            key = (html, script, shot)
            if _CACHE.get("recording"):   # a dry pass: note the page, answer as if nothing were met
                _CACHE["jobs"].setdefault(key, PageJob(html, script, shot))
                return PageResult(loaded=True, value={"checks": [False] * len(self.checks), "state": {}})
            if key in _CACHE["results"]:
                return _CACHE["results"][key]
        job = PageJob(html, script, shot)
        return get_pool(self.executable, self.max_pages).render([job], timeout_s=self.timeout_s)[0]

    def step(self, assistant_text: str):
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset(task) first")
        self.turn += 1
        self.messages.append({"role": "assistant", "content": assistant_text})
        info: dict = {"calls": 0, "failed_calls": 0, "env_error": None, "obs_role": "user"}
        html = _page_of(assistant_text)
        obs = ""
        if html and (len(html) > MAX_HTML_CHARS or "\x00" in html):
            self.scores.append(0.0)
            obs = f"The page is over {MAX_HTML_CHARS} characters or has a NUL byte: it scores 0."
        elif html:
            res = self.render(html)
            if res.error in HUNG or not res.loaded:   # a page that hangs the renderer: 0, nothing else
                self.scores.append(0.0)
                return self._end(info, 0.0, hung=res.error or "not loaded")
            self.scores.append(page_score(self.checks, res))
            if res.screenshot:
                self.shots.append(res.screenshot)
            obs = render_report(self.checks, res)
        elif not says_done(assistant_text):
            obs = f"No page found. {SYNTAX_HELP}"
        self.reports.append(obs)
        if says_done(assistant_text) or self.turn >= self.max_turns:
            return self._end(info, self.scores[-1] if self.scores else 0.0)
        if self.observation == "screenshot" and self.shots and html:
            obs = [{"type": "image", "image": self.shots[-1]}, {"type": "text", "text": "The rendered page."}]
        self.messages.append({"role": "user", "content": obs})
        return obs, False, info

    def _end(self, info: dict, score: float, hung: str | None = None):
        self.done, self.hung = True, hung
        first = self.scores[0] if self.scores else 0.0
        info.update(reward=float(score), success=score >= 1.0, first_score=float(first), hung=hung,
                    pages=len(self.scores))
        return "", True, info

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


# Scripted episodes (the expert's SFT data) render one page at a time; `prerendered` plays
# them twice: a dry pass notes every page (renders are the only thing it skips: the
# episodes draw the same random numbers), the pages are rendered MAX_PAGES at once, and
# the real pass reads them back.
_CACHE: dict = {}


@contextlib.contextmanager
def prerendered(dry_pass, *, timeout_s: float = TIMEOUT_S, executable: str | None = None):
    """Run `dry_pass()` noting pages, render them all concurrently, then yield: renders inside
    the block read the results (pages not seen render as usual). A screenshot environment's
    pages are cached with their screenshot's path, so only one with a `shot_dir` (the same
    path in both passes) reads them back."""
    _CACHE.clear()
    _CACHE.update(on=True, recording=True, jobs={}, results={})
    try:
        dry_pass()
        keys = list(_CACHE["jobs"])
        res = get_pool(executable, MAX_PAGES).render([_CACHE["jobs"][k] for k in keys], timeout_s=timeout_s)
        _CACHE.update(recording=False, results=dict(zip(keys, res)))
        yield
    finally:
        _CACHE.clear()


def make_env(harness_cfg: HarnessConfig, memory: MemoryStore | None = None, **kw) -> FrontendLoopEnv:
    """The frontend_loop environment with the render report (text students)."""
    return FrontendLoopEnv(harness_cfg, memory, observation="report", **kw)


def make_screenshot_env(harness_cfg: HarnessConfig, memory: MemoryStore | None = None, **kw) -> FrontendLoopEnv:
    """The frontend_loop environment with screenshots (vision-language students)."""
    return FrontendLoopEnv(harness_cfg, memory, observation="screenshot", **kw)


def _processor(model_path):
    """The student's image processor and tokenizer (core.vision.load_processor), or None for a
    text-only student."""
    if not model_path:
        return None
    from core.vision import load_processor

    try:
        return load_processor(model_path)
    except (OSError, ValueError, KeyError):
        return None


def _report_preflight(*, tokenizer=None, model_path=None, processor=None) -> None:
    check_observation("report", tokenizer, processor)


def _screenshot_preflight(*, tokenizer=None, model_path=None, processor=None) -> None:
    check_observation("screenshot", tokenizer, processor or _processor(model_path),
                      student=None if model_path is None else str(model_path))


make_env.preflight = _report_preflight
make_screenshot_env.preflight = _screenshot_preflight
# its transcripts hold images: the MOPD loop's teacher must see them (mopd.distill.agents.check_vision)
make_screenshot_env.observes_images = True


# ------------------------------------------------------------------------ replay and reward

def harness_config(name: str | None = None, harnesses: str | Path | None = None) -> HarnessConfig:
    import core.agent.harness as agent_harness

    return agent_harness.harness_config(name, harnesses or HARNESSES)


def replay(task: dict, completion, harness_cfg: HarnessConfig, **env_kw) -> dict:
    """The info of the step that ended a replay of the completion's assistant turns (a
    transcript that never ends: its last page's score, as if the turns ran out)."""
    env = make_env(harness_cfg, max_turns=env_kw.pop("max_turns", MAX_TURNS), **env_kw)
    env.reset(task)
    msgs = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion or [])
    try:
        for m in msgs:
            if isinstance(m, dict) and m.get("role") == "assistant":
                _obs, done, info = env.step(completion_text(m.get("content") or ""))
                if done:
                    return info
        return env._end({}, env.scores[-1] if env.scores else 0.0)
    finally:
        env.close()


def reward(prompts, completions, task=None, harness=None, domain=None, harnesses: str | None = None,
           timeout_s: float = TIMEOUT_S, **kwargs) -> list[float | None]:
    """TRL-style reward: the final page's score of the episode in each completion, replayed
    (module doc); None for rows of another domain."""
    from core.agent.env import reward_columns

    completions, tasks, names, mine = reward_columns("reward_frontend_loop", DOMAIN, completions, task, harness, domain)
    out: list[float | None] = []
    for i, c in enumerate(completions):
        if not mine[i]:
            out.append(None)
            continue
        t = json.loads(tasks[i]) if isinstance(tasks[i], str) else tasks[i]
        out.append(float(replay(t, c, harness_config(names[i], harnesses), timeout_s=float(timeout_s))["reward"]))
    return out


reward.__name__ = "reward_frontend_loop"
