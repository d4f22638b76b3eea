"""Reward for the `frontend` domain: render the completion's HTML in a real headless
browser and check it against the task's page specification; score = fraction of checks met.

A row's `checks` column is a JSON list of checks on elements found by id (the spec names
every id and value; experts/frontend/data.py writes them):

    {"type": "text", "id", "tag", "text"}          element shown, its tag, its text (whitespace folded)
    {"type": "exists", "id", "tag"}                element shown, its tag (containers, no text)
    {"type": "style", "id", "prop", "value"}       getComputedStyle(e)[prop] == value ("rgb(255, 0, 0)")
    {"type": "width"|"height", "id", "op", "px"}   bounding box: "eq" within 1 px, "ge" at least px
    {"type": "centered", "id"}                     horizontal centre within 2 px of the viewport's
    {"type": "row", "ids"}                         left to right in this order, side by side
    {"type": "above", "a", "b"}                    a's bottom edge at or above b's top edge
    {"type": "inside", "inner", "outer"}           inner is a descendant of outer and within its box

"Shown" means a box of non-zero size that is not hidden (display, visibility, opacity): a
missing element fails every check that names it.

How a page is judged (rewards/browser.py renders it; see there for the machinery):
  - The HTML is the completion's first ```html fenced block, else the whole completion.
    Empty, over MAX_HTML_CHARS or NUL-containing output scores 0 without rendering.
  - The page is set into a fresh browser context (800x600 viewport, JavaScript on). Every
    request it makes is aborted, every window it opens is closed; the checks run once the
    `load` event fired, in an isolated JS world (the page's scripts cannot fake styles or
    boxes), within one wall-clock deadline per page (`timeout_s`).
  - Score 0: the page does not load in time (an endless script, a blocked `load`), the
    renderer crashes, the page requested the network or opened a window. Else the
    fraction of the row's checks met.
  - Pages render concurrently (`max_pages`) in one long-lived browser per process; a hung
    or crashed page costs its own deadline and nothing else.

`screenshot` (optional column): a PNG path per row; the page's viewport is saved there
(evals/frontend.py uses it; training rows have no such column).

Scores are None for rows whose `domain` column is another domain. The reward never
raises on model output; it raises ValueError for rows without `checks`, and
BrowserUnavailable (with how to install one) when no Chromium is found: a missing browser
stops the run instead of scoring 0.0. `reward.preflight` raises the same before any model
loads.
"""
from __future__ import annotations

import json
import re

from core.completions import completion_text
from rewards.browser import BrowserUnavailable, PageJob, check_playwright, find_chromium, get_pool
from rewards.columns import column

DOMAIN = "frontend"
MAX_HTML_CHARS = 20_000
TIMEOUT_S = 10.0
MAX_PAGES = 4

# The palette the tasks use -> computed-style value (CSS named colors).
COLORS: dict[str, str] = {
    "red": "rgb(255, 0, 0)", "blue": "rgb(0, 0, 255)", "green": "rgb(0, 128, 0)", "black": "rgb(0, 0, 0)",
    "white": "rgb(255, 255, 255)", "gray": "rgb(128, 128, 128)", "orange": "rgb(255, 165, 0)",
    "purple": "rgb(128, 0, 128)", "yellow": "rgb(255, 255, 0)", "pink": "rgb(255, 192, 203)",
    "navy": "rgb(0, 0, 128)", "teal": "rgb(0, 128, 128)", "brown": "rgb(165, 42, 42)",
}
CHECK_TYPES = ("text", "exists", "style", "width", "height", "centered", "row", "above", "inside")

# Evaluated in the isolated world: CHECKS is replaced by the row's list; returns one
# boolean per check. Any exception in a check fails that check only.
CHECK_JS = r"""
((checks) => {
  const vw = document.documentElement.clientWidth;
  const el = (id) => document.getElementById(id);
  const box = (e) => e.getBoundingClientRect();
  const shown = (e) => {
    if (!e) return false;
    const r = box(e), s = getComputedStyle(e);
    return r.width > 0 && r.height > 0 && s.visibility !== "hidden" && s.display !== "none" && parseFloat(s.opacity) > 0;
  };
  const get = (id) => { const e = el(id); return shown(e) ? e : null; };
  const txt = (e) => (e.innerText || "").replace(/\s+/g, " ").trim();
  const one = (c) => {
    switch (c.type) {
      case "text": { const e = get(c.id); return !!e && e.tagName.toLowerCase() === c.tag && txt(e) === c.text; }
      case "exists": { const e = get(c.id); return !!e && e.tagName.toLowerCase() === c.tag; }
      case "style": { const e = get(c.id); return !!e && getComputedStyle(e)[c.prop] === c.value; }
      case "width": case "height": {
        const e = get(c.id); if (!e) return false;
        const v = box(e)[c.type];
        return c.op === "ge" ? v >= c.px - 0.5 : Math.abs(v - c.px) <= 1;
      }
      case "centered": { const e = get(c.id); if (!e) return false; const r = box(e);
        return Math.abs((r.left + r.right) / 2 - vw / 2) <= 2; }
      case "row": {
        const es = c.ids.map(get); if (es.some((e) => !e)) return false;
        for (let i = 1; i < es.length; i++) {
          const a = box(es[i - 1]), b = box(es[i]);
          if (a.right > b.left + 1 || a.bottom <= b.top || b.bottom <= a.top) return false;
        }
        return true;
      }
      case "above": { const a = get(c.a), b = get(c.b); return !!a && !!b && box(a).bottom <= box(b).top + 1; }
      case "inside": {
        const i = get(c.inner), o = get(c.outer); if (!i || !o || i === o || !o.contains(i)) return false;
        const a = box(i), b = box(o);
        return a.left >= b.left - 1 && a.right <= b.right + 1 && a.top >= b.top - 1 && a.bottom <= b.bottom + 1;
      }
    }
    return false;
  };
  return checks.map((c) => { try { return one(c) === true; } catch (e) { return false; } });
})(CHECKS)
"""

_FENCE = re.compile(r"```[ \t]*(?:html)?[ \t]*\r?\n(.*?)(?:```|\Z)", re.S | re.I)


def html_of(completion) -> str:
    """The page a completion writes: its first ```html block, else the whole text."""
    text = completion_text(completion)
    if "```" in text:
        m = _FENCE.search(text)
        if m:
            return m.group(1)
    return text


def parse_checks(value, where: str) -> list[dict]:
    """A row's checks (JSON text or a list), validated: a bad row is a ValueError naming it."""
    try:
        checks = json.loads(value) if isinstance(value, str) else list(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"rewards.frontend: {where}: `checks` is not a JSON list ({e})") from None
    if not isinstance(checks, list) or not checks:
        raise ValueError(f"rewards.frontend: {where}: `checks` must be a non-empty list")
    for c in checks:
        if not isinstance(c, dict) or c.get("type") not in CHECK_TYPES:
            raise ValueError(f"rewards.frontend: {where}: unknown check {c!r} (types: {CHECK_TYPES})")
    return checks


def check_script(checks: list[dict]) -> str:
    return CHECK_JS.replace("CHECKS", json.dumps(checks))


def _column(columns: dict, name: str, n: int):
    return column(columns, name, n, "rewards.frontend")


def score_result(res, n_checks: int) -> float:
    """The score of one rendered page (module doc)."""
    if not res.loaded or res.error or res.requests or res.popups:
        return 0.0
    v = res.value
    if not isinstance(v, list) or len(v) != n_checks:
        return 0.0
    return sum(1 for x in v if x is True) / n_checks


def render_pages(htmls: list[str], checks: list[list[dict]], *, screenshots: list[str | None] | None = None,
                 timeout_s: float = TIMEOUT_S, max_pages: int = MAX_PAGES, executable: str | None = None):
    """The PageResult of each page (rewards.browser), rendered in the process's pool."""
    shots = screenshots or [None] * len(htmls)
    jobs = [PageJob(h, check_script(c), s) for h, c, s in zip(htmls, checks, shots)]
    return get_pool(executable, int(max_pages)).render(jobs, timeout_s=float(timeout_s))


def reward(prompts, completions, *, timeout_s: float = TIMEOUT_S, max_pages: int = MAX_PAGES,
           executable: str | None = None, **columns) -> list[float | None]:
    """Fraction of the row's `checks` the rendered page meets; 0.0 for a page that does not
    load, requests the network or opens a window; None for rows of another domain (see the
    module docstring). `executable`: the browser (default $MOPD_CHROMIUM, else chromium on
    PATH); `timeout_s`: wall-clock deadline per page; `max_pages`: pages rendered at once."""
    completions = list(completions)
    n = len(completions)
    domains = _column(columns, "domain", n) or [None] * n
    checks_col = _column(columns, "checks", n)
    shots = _column(columns, "screenshot", n)

    out: list[float | None] = [None] * n
    idx, htmls, checks, paths = [], [], [], []
    for i in range(n):
        if domains[i] is not None and domains[i] != DOMAIN:
            continue
        if checks_col is None or not checks_col[i]:
            raise ValueError(f"rewards.frontend: row {i} has no `checks` (frontend rows need them)")
        cs = parse_checks(checks_col[i], f"row {i}")
        html = html_of(completions[i])
        if not html.strip() or len(html) > MAX_HTML_CHARS or "\x00" in html:
            out[i] = 0.0
            continue
        idx.append(i)
        htmls.append(html)
        checks.append(cs)
        paths.append(shots[i] if shots is not None else None)
    if not idx:
        return out
    results = render_pages(htmls, checks, screenshots=paths, timeout_s=timeout_s, max_pages=max_pages,
                           executable=executable)
    for i, cs, res in zip(idx, checks, results):
        out[i] = score_result(res, len(cs))
    return out


def _preflight(*, executable: str | None = None, **_kwargs) -> None:
    """Before any model loads (mopd.distill.data.load_reward_fn calls it): no browser or
    no playwright is an error now, not at the first frontend batch."""
    check_playwright()
    find_chromium(executable)


reward.preflight = _preflight

__all__ = ["reward", "render_pages", "score_result", "html_of", "parse_checks", "COLORS", "BrowserUnavailable"]
