"""Data of the `tool_use` domain: pick the right tool and fill in its arguments, as JSON.

    system: Reply with JSON tool calls. Tools: [{"name": "get_weather", "parameters":
            {"city": "string", "unit": "string?"}}, {"name": "set_timer", "parameters":
            {"minutes": "integer"}}]
    user:   What's the weather in Oslo?
    ->      {"name": "get_weather", "arguments": {"city": "Oslo"}}

rewards/tool_use.py scores the call the way BFCL's AST checker does, against a
BFCL-style answer ({func: {param: [allowed values]}}, "" = may be left out) and the
BFCL-style schemas of the tools offered, both stored as JSON strings in the `functions`
and `ground_truth` columns, so procedural rows and BFCL rows go through one checker.

Procedural tasks: ten tools (weather, currency, alarm, timer, flights, message, stock
price, translation, music, restaurant booking), each with request templates and value
pools whose words tokenize compactly. The prompt lists the tools offered in a compact
JSON form ("?" marks an optional parameter); the `functions` column holds the full
schemas. `difficulty` (DIFFICULTY below) sets how many tools are offered, how often an
optional argument is asked for (and must then be passed), whether minutes may have a
leading zero ("7:05" -> 5), and how often a request asks for two calls. At difficulty 1
two tools are offered, only required arguments are asked for and there is one call:
prompts are 100-145 tokens of the tiny tokenizer (mean ~118) and calls 21-43 (mean ~31).
The task is copying plus a 10-way template -> tool mapping, meant to be learnable by
SFT of a tiny model in a few hundred steps (not measured yet).

BFCL (DATASETS["bfcl"], needs the `bfcl-eval` package): the single-turn categories
with a possible answer (simple python/java/javascript, multiple, parallel,
parallel_multiple, and their live_* versions; 2501 records), with the reference
completion built from the first allowed value of each argument. All references pass the
reward except four records whose BFCL answer nothing can satisfy (BFCL_UNSATISFIABLE).

Splits: a request belongs to `train` or `test` by a stable hash of the user message,
so the splits are disjoint whatever tools are offered beside it; rows are deterministic
for (split, n, seed, difficulty).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import random
from pathlib import Path
from typing import Callable

import datasets

from experts.procedural import check_split_n_effort
from core.splits import split_of
from rewards.tool_use import format_calls, parse_calls, score_completion

DOMAIN = "tool_use"
EFFORTS: tuple[str, ...] = ()
TEST_FRACTION = 0.1

# Short on purpose: at difficulty 1 the whole prompt stays under ~150 tokens of the tiny
# tokenizer; the call format itself is learned from the references.
SYSTEM_PROMPT = "Reply with JSON tool calls. Tools: "

# difficulty -> tools offered, share of requests that ask for an optional argument,
# minutes may have a leading zero, share of requests that need two calls.
DIFFICULTY: dict[int, dict] = {
    1: {"tools": 2, "optional": 0.0, "leading_zero": False, "parallel": 0.0},
    2: {"tools": 3, "optional": 0.5, "leading_zero": True, "parallel": 0.0},
    3: {"tools": 4, "optional": 0.5, "leading_zero": True, "parallel": 0.3},
    4: {"tools": 6, "optional": 0.5, "leading_zero": True, "parallel": 0.5},
}

# ------------------------------------------------------------------------ value pools

CITIES = ("Paris London Tokyo Berlin Rome Madrid Cairo Lima Oslo Dublin Vienna Prague Lisbon "
          "Athens Boston Chicago Denver Seattle Miami Austin Toronto Sydney Delhi Seoul Nairobi "
          "Quito Bogota Havana Warsaw Zurich").split()
CURRENCIES = "USD EUR GBP JPY CHF CAD AUD CNY INR MXN".split()
SYMBOLS = "AAPL MSFT GOOG AMZN TSLA NVDA META IBM INTC ORCL NFLX ADBE CSCO SONY UBER SHOP SNAP PYPL QCOM AMD".split()
ARTISTS = ("Adele Drake Queen Coldplay Shakira Beyonce Muse Abba Blur Oasis Eminem Rihanna Madonna "
           "Prince Nirvana Metallica Sting Bjork Moby Usher").split()
CONTACTS = "Ana Ben Cal Dora Eli Fay Gus Ivy Jon Kim Leo Mia Ned Ola Pam Raj Sam Tom Uma Zoe".split()
LANGUAGES = "French Spanish German Italian Japanese Dutch Greek Polish Swedish Korean".split()
RESTAURANTS = "Nobu Zuma Roka Sakura Lotus Olive Ember Basil Saffron Juniper".split()
PHRASES = ("hello", "good morning", "thank you", "see you soon", "running late", "call me",
           "on my way", "good night", "happy birthday", "where are you")
LABELS = ("work", "gym", "school", "meds", "meeting", "flight")
MONTHS = "January February March April May June July August September October November December".split()


# ------------------------------------------------------------------------------ tools
# Each tool: BFCL-style schema (properties in call order) and a request maker
# rng, opt(param) -> (request text, arguments of the reference call, possible answer).
# `opt(p)` says whether this request asks for the optional parameter p; a parameter
# not asked for gets "" among its allowed values (BFCL's "may be left out").

def _schema(name: str, description: str, params: list[tuple[str, str, bool, str]], enums: dict | None = None) -> dict:
    props = {}
    for p, t, _req, desc in params:
        props[p] = {"type": t, "description": desc}
        if enums and p in enums:
            props[p]["enum"] = list(enums[p])
    return {"name": name, "description": description,
            "parameters": {"type": "dict", "properties": props, "required": [p for p, _t, r, _d in params if r]}}


SCHEMAS: dict[str, dict] = {s["name"]: s for s in [
    _schema("get_weather", "Current weather in a city.",
            [("city", "string", True, "City name."), ("unit", "string", False, "celsius or fahrenheit.")],
            {"unit": ("celsius", "fahrenheit")}),
    _schema("convert_currency", "Convert an amount between currencies.",
            [("amount", "float", True, "Amount to convert."), ("from", "string", True, "Currency code to convert from."),
             ("to", "string", True, "Currency code to convert to.")]),
    _schema("set_alarm", "Set an alarm.",
            [("hour", "integer", True, "Hour, 0-23."), ("minute", "integer", True, "Minute, 0-59."),
             ("label", "string", False, "Name of the alarm.")]),
    _schema("set_timer", "Start a countdown timer.", [("minutes", "integer", True, "Length in minutes.")]),
    _schema("search_flights", "Search flights between two cities.",
            [("origin", "string", True, "Departure city."), ("destination", "string", True, "Arrival city."),
             ("date", "string", False, "Travel date, e.g. May 12."),
             ("passengers", "integer", False, "Number of travellers.")]),
    _schema("send_message", "Send a text message to a contact.",
            [("contact", "string", True, "Who to send it to."), ("text", "string", True, "The message.")]),
    _schema("get_stock_price", "Latest price of a stock.", [("symbol", "string", True, "Ticker symbol.")]),
    _schema("translate", "Translate text into another language.",
            [("text", "string", True, "Text to translate."), ("language", "string", True, "Target language.")]),
    _schema("play_music", "Play music by an artist.",
            [("artist", "string", True, "Artist name."), ("volume", "integer", False, "Volume, 1-10.")]),
    _schema("book_table", "Book a restaurant table.",
            [("restaurant", "string", True, "Restaurant name."), ("people", "integer", True, "Number of guests."),
             ("time", "string", False, "Time, e.g. 7pm.")]),
]}
TOOL_NAMES = tuple(SCHEMAS)


def _answer(args: dict, schema: dict, asked_optional: set[str]) -> dict:
    """BFCL possible answer for a reference call: each passed argument's value (a float
    parameter's as a float), optional parameters not asked for marked with ""."""
    out = {}
    for p in schema["parameters"]["properties"]:
        if p in args:
            v = args[p]
            out[p] = [float(v)] if schema["parameters"]["properties"][p]["type"] == "float" else [v]
        elif p not in schema["parameters"]["required"] and p not in asked_optional:
            out[p] = [""]
    return out


def _minute_text(minute: int) -> str:
    return f"{minute:02d}"


def _req_weather(rng, cfg, opt):
    city = rng.choice(CITIES)
    text = rng.choice(("What's the weather in {c}?", "How warm is it in {c}?", "Weather for {c}, please.",
                       "Is it cold in {c} today?")).format(c=city)
    args = {"city": city}
    if opt("unit"):
        args["unit"] = rng.choice(("celsius", "fahrenheit"))
        text = text[:-1] + f" in {args['unit']}?" if text.endswith("?") else text[:-1] + f", in {args['unit']}."
    return text, args


def _req_currency(rng, cfg, opt):
    a, b = rng.sample(CURRENCIES, 2)
    amount = rng.randint(1, 999) if rng.random() < 0.7 else rng.randint(1, 999) + rng.choice((0.5, 0.25, 0.75))
    text = rng.choice(("Convert {x} {a} to {b}.", "How much is {x} {a} in {b}?",
                       "Change {x} {a} into {b}.")).format(x=amount, a=a, b=b)
    return text, {"amount": amount, "from": a, "to": b}


def _req_alarm(rng, cfg, opt):
    hour = rng.randint(1, 23)
    minute = rng.randint(0, 59) if cfg["leading_zero"] else rng.randint(10, 59)
    text = rng.choice(("Set an alarm for {h}:{m}.", "Wake me up at {h}:{m}.",
                       "Alarm at {h}:{m} please.")).format(h=hour, m=_minute_text(minute))
    args = {"hour": hour, "minute": minute}
    if opt("label"):
        args["label"] = rng.choice(LABELS)
        text = text[:-1] + f" called {args['label']}."
    return text, args


def _req_timer(rng, cfg, opt):
    m = rng.randint(1, 120)
    text = rng.choice(("Set a timer for {m} minutes.", "Start a {m} minute timer.",
                       "Timer for {m} minutes, please.")).format(m=m)
    return text, {"minutes": m}


def _req_flights(rng, cfg, opt):
    a, b = rng.sample(CITIES, 2)
    text = rng.choice(("Find flights from {a} to {b}.", "Any flights from {a} to {b}?",
                       "Search flights {a} to {b}.")).format(a=a, b=b)
    args = {"origin": a, "destination": b}
    extra = ""
    if opt("date"):
        args["date"] = f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"
        extra += f" on {args['date']}"
    if opt("passengers"):
        args["passengers"] = rng.randint(2, 9)
        extra += f" for {args['passengers']} people"
    if extra:
        text = text[:-1] + extra + text[-1]
    return text, args


def _req_message(rng, cfg, opt):
    who, what = rng.choice(CONTACTS), rng.choice(PHRASES)
    text = rng.choice(('Text {c}: "{t}".', 'Send {c} the message "{t}".', 'Tell {c} "{t}".')).format(c=who, t=what)
    return text, {"contact": who, "text": what}


def _req_stock(rng, cfg, opt):
    s = rng.choice(SYMBOLS)
    text = rng.choice(("What is {s} trading at?", "Get the stock price of {s}.", "Price of {s} stock?")).format(s=s)
    return text, {"symbol": s}


def _req_translate(rng, cfg, opt):
    what, lang = rng.choice(PHRASES), rng.choice(LANGUAGES)
    text = rng.choice(('Translate "{t}" into {l}.', 'How do you say "{t}" in {l}?',
                       'Say "{t}" in {l}.')).format(t=what, l=lang)
    return text, {"text": what, "language": lang}


def _req_music(rng, cfg, opt):
    artist = rng.choice(ARTISTS)
    text = rng.choice(("Play some {a}.", "Put on {a}.", "I want to hear {a}.")).format(a=artist)
    args = {"artist": artist}
    if opt("volume"):
        args["volume"] = rng.randint(1, 10)
        text = text[:-1] + f" at volume {args['volume']}."
    return text, args


def _req_table(rng, cfg, opt):
    r, k = rng.choice(RESTAURANTS), rng.randint(2, 12)
    text = rng.choice(("Book a table for {k} at {r}.", "Reserve {r} for {k} people.",
                       "Table at {r} for {k}, please.")).format(k=k, r=r)
    args = {"restaurant": r, "people": k}
    if opt("time"):
        args["time"] = f"{rng.randint(5, 10)}pm"
        text = text[:-1] + f" at {args['time']}."
    return text, args


REQUESTS: dict[str, Callable] = {
    "get_weather": _req_weather, "convert_currency": _req_currency, "set_alarm": _req_alarm,
    "set_timer": _req_timer, "search_flights": _req_flights, "send_message": _req_message,
    "get_stock_price": _req_stock, "translate": _req_translate, "play_music": _req_music,
    "book_table": _req_table,
}
assert set(REQUESTS) == set(SCHEMAS)


def prompt_tools(schemas: list[dict]) -> str:
    """The compact JSON tool list shown in the prompt: name and parameter types, "?"
    after the type of an optional parameter."""
    out = []
    for s in schemas:
        req = set(s["parameters"]["required"])
        out.append({"name": s["name"], "parameters": {
            p: d["type"] + ("" if p in req else "?") for p, d in s["parameters"]["properties"].items()}})
    return json.dumps(out)


# ------------------------------------------------------------------------ problems

def _split_of(key: str) -> str:
    return split_of(key, TEST_FRACTION)


def _config(difficulty: int) -> dict:
    if not isinstance(difficulty, int) or isinstance(difficulty, bool) or difficulty < 1:
        raise ValueError(f"tool_use: difficulty must be an int >= 1, got {difficulty!r}")
    return DIFFICULTY[min(difficulty, max(DIFFICULTY))]


def _request(rng: random.Random, cfg: dict, tool: str) -> tuple[str, dict, dict]:
    """(request text, reference arguments, possible answer {param: [allowed]})."""
    schema = SCHEMAS[tool]
    asked: set[str] = set()

    def opt(p: str) -> bool:
        if rng.random() < cfg["optional"]:
            asked.add(p)
            return True
        return False

    text, args = REQUESTS[tool](rng, cfg, opt)
    return text, args, _answer(args, schema, asked)


def _problem(rng: random.Random, cfg: dict) -> dict:
    """One task: request text, offered tool names, reference calls, possible answers."""
    if rng.random() < cfg["parallel"]:
        tools = [rng.choice(TOOL_NAMES), rng.choice(TOOL_NAMES)]
        parts = [_request(rng, cfg, t) for t in tools]
        if parts[0][0] == parts[1][0]:
            parts = parts[:1]
            tools = tools[:1]
    else:
        tools = [rng.choice(TOOL_NAMES)]
        parts = [_request(rng, cfg, tools[0])]
    if len(parts) == 2:
        text = f"{parts[0][0]} Also: {parts[1][0][0].lower()}{parts[1][0][1:]}"
        category = "parallel" if tools[0] == tools[1] else "parallel_multiple"
    else:
        text = parts[0][0]
        category = "multiple"
    needed = list(dict.fromkeys(tools))
    others = [t for t in TOOL_NAMES if t not in needed]
    offered = needed + rng.sample(others, max(0, min(cfg["tools"], len(TOOL_NAMES)) - len(needed)))
    rng.shuffle(offered)
    return {
        "request": text,
        "offered": offered,
        "calls": [(t, p[1]) for t, p in zip(tools, parts)],
        "answers": [{t: p[2]} for t, p in zip(tools, parts)],
        "category": category,
    }


def _row(problem: dict) -> dict:
    schemas = [SCHEMAS[t] for t in problem["offered"]]
    return {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT + prompt_tools(schemas)},
                   {"role": "user", "content": problem["request"]}],
        "completion": [{"role": "assistant", "content": format_calls(problem["calls"])}],
        "domain": DOMAIN,
        "functions": json.dumps(schemas),
        "ground_truth": json.dumps(problem["answers"]),
        "test_category": problem["category"],
    }


def _problems(split: str, n: int, seed: int, difficulty: int, stream: str = "tasks") -> list[dict]:
    cfg = _config(difficulty)
    rng = random.Random(f"mopd/{DOMAIN}/{stream}/{split}/{seed}/{difficulty}")  # str seeds are stable
    out: list[dict] = []
    seen: set[str] = set()
    for _ in range(n):
        fallback = None  # prefer unseen requests; a split with fewer than n repeats some
        for _attempt in range(200):
            p = _problem(rng, cfg)
            if _split_of(p["request"]) != split:
                continue
            fallback = p
            if p["request"] not in seen:
                break
        else:
            if fallback is None:
                raise RuntimeError(f"tool_use: could not draw a {split} problem")
            p = fallback
        seen.add(p["request"])
        out.append(p)
    return out


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 1,
                 effort: str | None = None) -> datasets.Dataset:
    """Procedural tool-call tasks. Columns: prompt (system: instructions + tools, user:
    request), completion (the reference call), domain, functions and ground_truth
    (JSON strings, BFCL format), test_category ("multiple", or "parallel" /
    "parallel_multiple" for two-call requests)."""
    check_split_n_effort(DOMAIN, split, n, effort)
    rows = [_row(p) for p in _problems(split, n, seed, difficulty)]
    cols = ("prompt", "completion", "domain", "functions", "ground_truth", "test_category")
    return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in cols})


# --------------------------------------------------------------------------- BFCL

BFCL_CATEGORIES = (
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
    "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
)
BFCL_SYSTEM_PROMPT = (
    "You are given a question and a set of possible functions. Based on the question, make one or more "
    "function calls to achieve the purpose. Reply with JSON only: "
    '{"name": "func_name", "arguments": {"param": value}} for one call, or a JSON list of such objects '
    "for several calls.\nFunctions:\n"
)
_OMIT = object()


def bfcl_data_dir() -> Path:
    """The data folder of the installed `bfcl-eval` package (found without importing
    it: its top-level import needs dependencies this project does not install)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("tool_use: the BFCL dataset needs the `bfcl-eval` package "
                           "(pip install --no-deps bfcl-eval)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _first_allowed(allowed):
    """The first allowed value other than "" (BFCL's "optional"), or _OMIT."""
    if not isinstance(allowed, list):
        return allowed
    for v in allowed:
        if v != "":
            return v
    return _OMIT


def _concrete_dict(spec: dict) -> dict:
    """A dict argument from a possible-answer dict {key: [allowed...]}."""
    out = {}
    for k, allowed in spec.items():
        v = _first_allowed(allowed)
        if v is not _OMIT:
            out[k] = v
    return out


def reference_arguments(description: dict, possible: dict) -> dict:
    """Arguments of a ground-truth call: the first allowed value of each parameter;
    a parameter whose only allowed value is "" is left out (kept as "" when required);
    dict-typed values are possible answers themselves and are made concrete too."""
    params = description.get("parameters", {}) if description else {}
    props = params.get("properties", {}) or {}
    required = set(params.get("required", []) or [])
    args = {}
    for p, allowed in possible.items():
        v = _first_allowed(allowed)
        if props and p not in props and isinstance(allowed, list) and "" in allowed:
            continue  # an answer that allows a parameter the schema lacks: leave it out
        if v is _OMIT:
            if p in required:
                args[p] = ""
            continue
        d = props.get(p, {}) if isinstance(props.get(p), dict) else {}
        item_type = (d.get("items") or {}).get("type") if isinstance(d.get("items"), dict) else None
        if isinstance(v, dict) and d.get("type") in ("dict", "HashMap", "object"):
            v = _concrete_dict(v)
        elif isinstance(v, list) and item_type == "dict" and all(isinstance(x, dict) for x in v):
            v = [_concrete_dict(x) for x in v]
        args[p] = v
    return args


def _bfcl_rows(category: str, data_dir: Path) -> list[dict]:
    name = f"BFCL_v4_{category}.json"
    questions = [json.loads(line) for line in (data_dir / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    answers = {a["id"]: a["ground_truth"] for a in
               (json.loads(line) for line in (data_dir / "possible_answer" / name).read_text(encoding="utf-8").splitlines()
                if line.strip())}
    rows = []
    for q in questions:
        if q["id"] not in answers or len(q["question"]) != 1:
            continue
        functions, truth = q["function"], answers[q["id"]]
        calls = []
        for ans in truth:
            (fname, possible), = ans.items()
            desc = next((f for f in functions if f.get("name") == fname), None)
            calls.append((fname, reference_arguments(desc, possible)))
        messages = [dict(m) for m in q["question"][0]]
        system = BFCL_SYSTEM_PROMPT + json.dumps(functions, ensure_ascii=False)
        if messages and messages[0].get("role") == "system":  # one system message, tools first
            system = system + "\n\n" + messages.pop(0)["content"]
        rows.append({
            "prompt": [{"role": "system", "content": system}]
                      + [{"role": m["role"], "content": m["content"]} for m in messages],
            "completion": [{"role": "assistant", "content": format_calls(calls, as_list="parallel" in category)}],
            "domain": DOMAIN,
            "functions": json.dumps(functions, ensure_ascii=False),
            "ground_truth": json.dumps(truth, ensure_ascii=False),
            "test_category": category,
            "id": q["id"],
        })
    return rows


# BFCL records whose possible answer no call can satisfy, kept (BFCL scores them as
# misses too): an allowed-value list that is empty, a parameter the answer requires but
# the schema lacks, a required parameter the answer leaves out. Their references score 0.
BFCL_UNSATISFIABLE = ("live_simple_106-63-0", "live_simple_112-68-0", "live_multiple_862-181-3",
                      "live_multiple_964-207-0")


def load_bfcl(categories: tuple[str, ...] | list[str] | None = None) -> datasets.Dataset:
    """BFCL's single-turn categories that have a possible answer (all of
    BFCL_CATEGORIES by default, 2501 records), joined with their answers. Same columns
    as make_dataset, plus `id`; test_category is BFCL's category name, which picks the
    checker (parallel: order-insensitive) and the language (java/javascript). The
    reference of every record passes the reward except BFCL_UNSATISFIABLE's four."""
    data_dir = bfcl_data_dir()
    cats = tuple(categories) if categories is not None else BFCL_CATEGORIES
    unknown = [c for c in cats if c not in BFCL_CATEGORIES]
    if unknown:
        raise ValueError(f"tool_use: unknown BFCL categories {unknown}; expected some of {BFCL_CATEGORIES}")
    rows = [r for c in cats for r in _bfcl_rows(c, data_dir)]
    cols = ("prompt", "completion", "domain", "functions", "ground_truth", "test_category", "id")
    return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in cols})


DATASETS: dict[str, Callable[[], datasets.Dataset]] = {"bfcl": load_bfcl}


# ------------------------------------------------------------------- corrupt / pretrain

def _text_of(reference) -> str:
    if isinstance(reference, str):
        return reference
    if isinstance(reference, list) and reference and isinstance(reference[-1], dict):
        return str(reference[-1].get("content", ""))
    return str(reference)


def _wrong_value(v, rng: random.Random):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + rng.randint(1, 9)
    if isinstance(v, float):
        return v + rng.choice((1.5, 2.0, 10.0))
    if isinstance(v, str):
        pool = [x for x in CITIES + CONTACTS + ARTISTS if x.lower() != v.lower()]
        return rng.choice(pool)
    if isinstance(v, list):
        return v[:-1] if len(v) > 1 else v + v + ["extra"]
    if isinstance(v, dict):
        return {**v, "unexpected_key": 1}
    return "wrong"


def corrupt(row: dict, reference, rng: random.Random) -> str:
    """A plausible but wrong completion made from the reference: another function's
    name, a changed or missing argument value, or malformed JSON. Every candidate is
    checked against the row's answer, so the result scores 0 (malformed JSON when no
    other corruption does)."""
    text = _text_of(reference)
    calls = parse_calls(text)
    broken = text.rstrip()[:-1] if text.strip() else "{"
    if not calls:
        return broken
    try:
        functions = json.loads(row["functions"]) if isinstance(row.get("functions"), str) else row.get("functions")
        answers = json.loads(row["ground_truth"]) if isinstance(row.get("ground_truth"), str) else row.get("ground_truth")
        category = row.get("test_category")
    except (KeyError, ValueError, TypeError):
        return broken
    kinds = ["name", "value", "missing", "malformed"]
    rng.shuffle(kinds)
    for kind in kinds:
        for _attempt in range(4):
            new = copy.deepcopy([{"name": n, "arguments": a} for c in calls for n, a in c.items()])
            i = rng.randrange(len(new))
            call = new[i]
            if kind == "malformed":
                return broken
            if kind == "name":
                names = [f.get("name") for f in functions or [] if isinstance(f, dict) and f.get("name") != call["name"]]
                call["name"] = rng.choice(names) if names else call["name"] + "_v2"
            elif kind == "value":
                if not call["arguments"]:
                    break
                p = rng.choice(sorted(call["arguments"]))
                call["arguments"][p] = _wrong_value(call["arguments"][p], rng)
            else:  # missing
                if not call["arguments"]:
                    break
                p = rng.choice(sorted(call["arguments"]))
                del call["arguments"][p]
            out = format_calls([(c["name"], c["arguments"]) for c in new])
            if score_completion(out, functions, answers, category) == 0.0:
                return out
    return broken


def pretrain_rows(n: int, seed: int = 0) -> datasets.Dataset:
    """Rows in the domain's format that do not solve it (domain="pretrain"), for the
    shared tiny base: "Echo this JSON" (copy a call), and tool prompts answered with a
    well-formed call that is wrong: another offered tool with its own arguments, or the
    right tool with a changed value. The base learns the JSON shape, the tool names and
    to copy values, never to pick the right call."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"tool_use: n must be an int >= 0, got {n!r}")
    rng = random.Random(f"mopd/{DOMAIN}/pretrain/{seed}")
    problems = _problems("train", n, seed, 1, stream="pretrain")
    prompts, completions = [], []
    for p in problems:
        row = _row(p)
        (name, args), = p["calls"]
        kind = rng.random()
        if kind < 0.3:
            prompts.append([{"role": "user", "content": "Echo this JSON: " + format_calls([(name, args)])}])
            completions.append([{"role": "assistant", "content": format_calls([(name, args)])}])
            continue
        if kind < 0.65:  # another offered tool, with arguments of a request for it
            other = rng.choice([t for t in p["offered"] if t != name])
            _t, other_args, _a = _request(rng, _config(1), other)
            wrong = format_calls([(other, other_args)])
        else:  # right tool, one value changed
            for _ in range(10):
                bad = dict(args)
                k = rng.choice(sorted(bad))
                bad[k] = _wrong_value(bad[k], rng)
                wrong = format_calls([(name, bad)])
                if score_completion(wrong, json.loads(row["functions"]), json.loads(row["ground_truth"])) == 0.0:
                    break
        prompts.append(row["prompt"])
        completions.append([{"role": "assistant", "content": wrong}])
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions, "domain": ["pretrain"] * n})
