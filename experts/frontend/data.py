"""Data of the `frontend` domain: a page specification in, one HTML document with inline
CSS out, judged by what the page looks like in a real browser (rewards/frontend.py).

    user: Write one HTML page (inline CSS): a row #r with a button #a "Save" (background
          red) and a button #b "Quit" (background blue), left to right.
    ->    <div id="r" style="display:flex"><button id="a" style="background:red">Save</button><button id="b" style="background:blue">Quit</button></div>

Task families (the `family` column):
  box     one component with its text, background, text color, exact width and height
  row     a flex row #r of 2+ components, left to right
  stack   2+ components one above the other (document order)
  center  a box centered horizontally, at least N px wide
  card    a box #c (background, width) with a button inside it

The spec names every id, text, color and size the page must have, and the reference is
one fixed template per family (components in spec order, style properties always in the
order display, margin, width, height, background, color), so the page follows from the
spec: a tiny model can learn it by SFT. References are 25-110 tokens of the project's
tokenizer at difficulty 1 (the tokenizer splits HTML finely), up to ~190 at difficulty 3.

The `checks` column (JSON) lists what the reward verifies (text and tag of every
component, its colors and sizes, and the layout relations: in a row, above, centered,
inside, at least N px wide); score = fraction met. A reference meets all of them by
construction (tests render them). `difficulty` d: rows and stacks have min(d + 1, 4)
components, and from d = 2 on components get a text color as well.

`corrupt` applies every corruption kind of CORRUPTIONS at once (wrong colors, wrong texts,
a broken layout, a missing element), so that a corrupted page scores ~0 (0.2 at most);
`corrupt_kind` applies one kind, for measuring how much each costs.

Splits: a prompt belongs to `train` or `test` by a stable hash of its text; rows are
deterministic for (split, n, seed, difficulty).
"""
from __future__ import annotations

import json
import random
import re
from typing import Callable

import datasets

from core.splits import split_of
from rewards.frontend import COLORS

DOMAIN = "frontend"
EFFORTS: tuple[str, ...] = ()
TEST_FRACTION = 0.1
DATASETS: dict[str, Callable[[], datasets.Dataset]] = {}   # no real datasets ship in a PyPI package
FAMILIES = ("box", "row", "stack", "center", "card")
CORRUPTIONS = ("color", "text", "layout", "missing")
ASK = "Write one HTML page (inline CSS): "

# kind named in the spec -> tag
KINDS = {"button": "button", "box": "div", "title": "h1", "text": "p"}
PALETTE = tuple(COLORS)
WORDS = ("Save", "Quit", "Home", "Menu", "Login", "Hello", "Next", "Back", "Buy", "Help", "Send", "Open",
         "Close", "Start", "Stop", "News", "Shop", "About", "Blog", "Search", "Cart", "Play", "Mail", "Sign up",
         "Welcome", "Contact", "Profile", "Settings", "Music", "Photos")
IDS = ("a", "b", "c", "d")


# ------------------------------------------------------------------------ components
def _comp(cid: str, kind: str, text: str | None, **props) -> dict:
    """A component: id, kind, text, and props (display, margin, width, min_width, height,
    background, color, centered) in the spec's fixed order."""
    return {"id": cid, "kind": kind, "text": text, "props": props, "children": []}


def _style(c: dict) -> str:
    p = c["props"]
    parts = []
    if p.get("display"):
        parts.append(f"display:{p['display']}")
    if p.get("centered"):
        parts.append("margin:auto")
    w = p.get("width") or p.get("min_width")
    if w:
        parts.append(f"width:{w}px")
    if p.get("height"):
        parts.append(f"height:{p['height']}px")
    if p.get("background"):
        parts.append(f"background:{p['background']}")
    if p.get("color"):
        parts.append(f"color:{p['color']}")
    return ";".join(parts)


def _html(c: dict) -> str:
    tag = KINDS[c["kind"]]
    style = _style(c)
    inner = "".join(_html(k) for k in c["children"]) if c["children"] else (c["text"] or "")
    return f'<{tag} id="{c["id"]}"' + (f' style="{style}"' if style else "") + f">{inner}</{tag}>"


def _describe(c: dict) -> str:
    """`a button #a "Save" (background red, text white, 120px wide)`."""
    p = c["props"]
    bits = []
    if p.get("background"):
        bits.append(f"background {p['background']}")
    if p.get("color"):
        bits.append(f"text {p['color']}")
    if p.get("width"):
        bits.append(f"{p['width']}px wide")
    if p.get("min_width"):
        bits.append(f"at least {p['min_width']}px wide")
    if p.get("height"):
        bits.append(f"{p['height']}px tall")
    if p.get("centered"):
        bits.append("centered")
    text = f' "{c["text"]}"' if c["text"] else ""
    return f"a {c['kind']} #{c['id']}{text}" + (f" ({', '.join(bits)})" if bits else "")


def _checks_of(c: dict) -> list[dict]:
    tag, p, out = KINDS[c["kind"]], c["props"], []
    if c["text"] is not None:
        out.append({"type": "text", "id": c["id"], "tag": tag, "text": c["text"]})
    else:
        out.append({"type": "exists", "id": c["id"], "tag": tag})
    if p.get("background"):
        out.append({"type": "style", "id": c["id"], "prop": "backgroundColor", "value": COLORS[p["background"]]})
    if p.get("color"):
        out.append({"type": "style", "id": c["id"], "prop": "color", "value": COLORS[p["color"]]})
    if p.get("width"):
        out.append({"type": "width", "id": c["id"], "op": "eq", "px": p["width"]})
    if p.get("min_width"):
        out.append({"type": "width", "id": c["id"], "op": "ge", "px": p["min_width"]})
    if p.get("height"):
        out.append({"type": "height", "id": c["id"], "op": "eq", "px": p["height"]})
    if p.get("centered"):
        out.append({"type": "centered", "id": c["id"]})
    for k in c["children"]:
        out += _checks_of(k)
    return out


def _list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# ------------------------------------------------------------------------ problems
def _config(difficulty) -> int:
    if not isinstance(difficulty, int) or isinstance(difficulty, bool) or difficulty < 1:
        raise ValueError(f"frontend: difficulty must be an int >= 1, got {difficulty!r}")
    return difficulty


def _colors(rng: random.Random, k: int) -> list[str]:
    return rng.sample(PALETTE, k)


def _problem(rng: random.Random, difficulty: int) -> tuple[str, str, str, list[dict]]:
    """(family, prompt, reference page, checks)."""
    d = _config(difficulty)
    family = rng.choice(FAMILIES)
    n = min(d + 1, 4)
    words = rng.sample(WORDS, 4)
    if family == "box":
        bg, fg = _colors(rng, 2)
        c = _comp("a", rng.choice(("button", "box")), words[0], width=rng.randrange(60, 310, 10),
                  height=rng.randrange(20, 90, 10), background=bg, color=fg)
        page, checks, spec = _html(c), _checks_of(c), _describe(c) + "."
    elif family == "row":
        kind = rng.choice(("button", "box"))
        cols = _colors(rng, 2 * n)
        items = [_comp(IDS[i], kind, words[i], background=cols[i], **({"color": cols[n + i]} if d >= 2 else {}))
                 for i in range(n)]
        row = _comp("r", "box", None, display="flex")
        row["children"] = items
        page = _html(row)
        checks = [{"type": "exists", "id": "r", "tag": "div"}] + [x for it in items for x in _checks_of(it)]
        checks.append({"type": "row", "ids": [it["id"] for it in items]})
        spec = f"a row #r with {_list([_describe(it) for it in items])}, left to right."
    elif family == "stack":
        cols = _colors(rng, 2 * n)
        kinds = ["title"] + [rng.choice(("text", "box")) for _ in range(n - 1)]   # blocks: buttons sit side by side
        items = [_comp(IDS[i], kinds[i], words[i], color=cols[i],
                       **({"background": cols[n + i]} if d >= 2 else {})) for i in range(n)]
        page = "".join(_html(it) for it in items)
        checks = [x for it in items for x in _checks_of(it)]
        checks += [{"type": "above", "a": items[i]["id"], "b": items[i + 1]["id"]} for i in range(n - 1)]
        spec = f"{_list([_describe(it) for it in items])}, each above the next."
    elif family == "center":
        bg, fg = _colors(rng, 2)
        c = _comp("a", "box", words[0], centered=True, min_width=rng.randrange(100, 410, 10), background=bg,
                  **({"color": fg} if d >= 2 else {}))
        page, checks, spec = _html(c), _checks_of(c), _describe(c) + "."
    else:  # card
        bg, inner_bg, fg = _colors(rng, 3)
        card = _comp("c", "box", None, width=rng.randrange(150, 410, 10), background=bg)
        btn = _comp("a", "button", words[0], background=inner_bg, **({"color": fg} if d >= 2 else {}))
        card["children"] = [btn]
        page = _html(card)
        checks = _checks_of(card) + [{"type": "inside", "inner": "a", "outer": "c"}]
        spec = f"{_describe(card)} with {_describe(btn)} inside it."
    return family, ASK + spec, page, checks


def _split_of(key: str) -> str:
    return split_of(key, TEST_FRACTION)


def _check_args(split: str, n: int, effort) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"frontend: unknown split {split!r}; expected 'train' or 'test'")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"frontend: n must be an int >= 0, got {n!r}")
    if effort is not None:
        raise ValueError(f"frontend has no reasoning efforts; got effort={effort!r}")


def _problems(split: str, n: int, seed: int, difficulty: int, stream: str = "tasks") -> list[tuple]:
    _config(difficulty)
    rng = random.Random(f"mopd/{DOMAIN}/{stream}/{split}/{seed}/{difficulty}")  # str seeds are stable
    out, seen = [], set()
    while len(out) < n:
        p = _problem(rng, difficulty)
        if _split_of(p[1]) != split or p[1] in seen:
            continue   # the space of prompts is huge: unseen ones are always found quickly
        seen.add(p[1])
        out.append(p)
    return out


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 1,
                 effort: str | None = None) -> datasets.Dataset:
    """Procedural page tasks. Columns: prompt (one user message), completion (the
    reference page), domain, family, checks (JSON string)."""
    _check_args(split, n, effort)
    rows = _problems(split, n, seed, difficulty)
    return datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": p}] for _, p, _, _ in rows],
        "completion": [[{"role": "assistant", "content": r}] for _, _, r, _ in rows],
        "domain": [DOMAIN] * len(rows),
        "family": [f for f, _, _, _ in rows],
        "checks": [json.dumps(c) for _, _, _, c in rows],
    })


# ------------------------------------------------------------------- corrupt / pretrain
_LEAF = re.compile(r'<(\w+) id="(\w+)"[^>]*>[^<]*</\1>')


def _text_of(reference) -> str:
    if isinstance(reference, str):
        return reference
    if isinstance(reference, list) and reference and isinstance(reference[-1], dict):
        return str(reference[-1].get("content", ""))
    return str(reference)


def _other(rng: random.Random, pool, value):
    return rng.choice([x for x in pool if x != value])


def corrupt_kind(reference, kind: str, rng: random.Random) -> str:
    """The reference page with one kind of mistake (CORRUPTIONS):
      color    every background and text color replaced by another one
      text     every component's text replaced by another word
      layout   sizes halved, the row's flex turned into a grid (a column), centering
               dropped, a stack's order reversed, a card's button moved out of it
      missing  one component removed."""
    page = _text_of(reference)
    if kind == "color":
        return re.sub(r"(background|color):(\w+)", lambda m: f"{m.group(1)}:{_other(rng, PALETTE, m.group(2))}", page)
    if kind == "text":
        return re.sub(r'(<(\w+) id="\w+"[^>]*>)([^<]+)(</\2>)',
                      lambda m: m.group(1) + _other(rng, WORDS, m.group(3)) + m.group(4), page)
    if kind == "layout":
        out = re.sub(r"(width|height):(\d+)px", lambda m: f"{m.group(1)}:{int(m.group(2)) // 2}px", page)
        out = out.replace("display:flex", "display:grid").replace("margin:auto", "margin:0")
        card = re.fullmatch(r'(<div id="c"[^>]*>)(.*)(</div>)', out)
        if card:   # the card's button outside the card
            return card.group(1) + card.group(3) + card.group(2)
        leaves = _LEAF.findall(out)
        if len(leaves) > 1 and "".join(m.group(0) for m in _LEAF.finditer(out)) == out:   # a stack
            return "".join(m.group(0) for m in reversed(list(_LEAF.finditer(out))))
        return out
    if kind == "missing":
        leaves = list(_LEAF.finditer(page))
        if not leaves:
            return ""
        m = rng.choice(leaves)
        return page[:m.start()] + page[m.end():]
    raise ValueError(f"frontend: unknown corruption {kind!r}; expected one of {CORRUPTIONS}")


def corrupt(row: dict, reference, rng: random.Random) -> str:
    """A plausible but wrong page made from the reference: every corruption kind at once
    (wrong colors and texts, a broken layout, one component missing), so it scores ~0."""
    page = _text_of(reference)
    for kind in CORRUPTIONS:
        page = corrupt_kind(page, kind, rng)
    return page


def pretrain_rows(n: int, seed: int = 0) -> datasets.Dataset:
    """Rows in the domain's format that do not solve it (domain="pretrain"), for the shared
    tiny base: task prompts (train split) answered with corrupted pages (the right
    template, wrong values), and "a page that says X" answered with a bare paragraph."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"frontend: n must be an int >= 0, got {n!r}")
    rng = random.Random(f"mopd/{DOMAIN}/pretrain/{seed}")
    problems = _problems("train", n, seed, 1, stream="pretrain")
    prompts, completions = [], []
    for _, prompt, page, _ in problems:
        if rng.random() < 0.3:
            word = rng.choice(WORDS)
            prompts.append([{"role": "user", "content": f"Write one HTML page that says {word}."}])
            completions.append([{"role": "assistant", "content": f"<p>{word}</p>"}])
        else:
            prompts.append([{"role": "user", "content": prompt}])
            completions.append([{"role": "assistant", "content": corrupt({}, page, rng)}])
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions,
                                       "domain": ["pretrain"] * len(prompts)})
